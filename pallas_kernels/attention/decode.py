"""Attention of a few query rows (decode, verification) over a long KV cache, split over the cache (Pallas, Triton).

Grid (B, NKV, splits): each program runs every query row of one key/value head (the G query heads that read it,
interleaved as rows r = t * G + g, padded to `rows`) against one contiguous span of the cache, and writes its partial
softmax: running max m, normaliser l and unnormalised output a (README.md, the online softmax). The spans are fixed
by the cache length alone, and `combine` merges them in span order, so a row's keys are reduced in the same order
whatever the number of rows. Spans past the last row's position read nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .flash import F32, dot_f32


def _split_kernel(start_ref, q_ref, k_ref, v_ref, a_ref, m_ref, l_ref, *, group, n_rows, block_k, span, seq_len,
                  scale, exact):
    start = start_ref[pl.program_id(0)]
    rows = q_ref.shape[0]
    q = q_ref[...]  # [R, D]
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    pos = start + jnp.where(r < n_rows, r, n_rows - 1) // group  # [R]; padding rows repeat the last position
    first_tile = pl.program_id(2) * (span // block_k)
    last_pos = start + (n_rows - 1) // group
    end = jnp.minimum(jnp.minimum((pl.program_id(2) + 1) * span, last_pos + 1), seq_len)  # slots this span reads
    n_tiles = jnp.maximum(pl.cdiv(end - first_tile * block_k, block_k), 0)

    def tile(j, carry):
        m, l, acc = carry
        keys = (first_tile + j) * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        at = pl.ds(pl.multiple_of((first_tile + j) * block_k, block_k), block_k)
        inside = jnp.broadcast_to((keys < seq_len)[:, None], (block_k, q.shape[1]))
        k = plt.load(k_ref.at[at, :], mask=inside, other=0.0)
        v = plt.load(v_ref.at[at, :], mask=inside, other=0.0)
        s = dot_f32(q, k, trans_b=True, exact=exact) * scale  # [R, BK]
        s = jnp.where((keys[None, :] <= pos[:, None]) & (keys[None, :] < seq_len), s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing seen yet keeps exp(-inf) = 0
        p = jnp.exp(s - safe[:, None])
        alpha = jnp.exp(m - safe)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + dot_f32(p.astype(v.dtype), v, exact=exact)

    d = q.shape[1]
    m, l, acc = lax.fori_loop(0, n_tiles, tile, (jnp.full((rows,), -jnp.inf, F32), jnp.zeros((rows,), F32),
                                                 jnp.zeros((rows, d), F32)))
    a_ref[...], m_ref[...], l_ref[...] = acc, m, l


def combine(a, m, l):
    """Partials a [..., splits, R, D], m and l [..., splits, R] -> the normalised output [..., R, D] (fp32)."""
    top = jnp.max(m, axis=-2, keepdims=True)
    w = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - jnp.where(top == -jnp.inf, 0.0, top)))  # [..., splits, R]
    num = jnp.sum(a * w[..., None], axis=-3)
    return num / jnp.sum(l * w, axis=-2)[..., None]


def split_attention(q, k, v, start, *, scale, span=4096, block_k=64, num_warps=4, num_stages=2, interpret=False):
    """q [B, T, NH, hd] (T * G <= 256 rows) at positions start [B] + t; k, v [B, S, NKV, hd] -> [B, T, NH, hd]."""
    B, T, NH, D = q.shape
    S, NKV = k.shape[1], k.shape[2]
    group = NH // NKV
    n_rows = T * group
    rows = max(16, 1 << (n_rows - 1).bit_length())
    span = max(block_k, min(span, pl.cdiv(S, block_k) * block_k))
    splits = pl.cdiv(S, span)
    qr = q.reshape(B, T, NKV, group, D).transpose(0, 2, 1, 3, 4).reshape(B, NKV, n_rows, D)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows - n_rows), (0, 0)))
    kernel = functools.partial(_split_kernel, group=group, n_rows=n_rows, block_k=block_k, span=span, seq_len=S,
                               scale=scale, exact=interpret or q.dtype == F32)
    part = lambda *tail: pl.BlockSpec((None, None, None) + tail, lambda b, h, i: (b, h, i) + (0,) * len(tail))
    a, m, l = pl.pallas_call(
        kernel,
        grid=(B, NKV, splits),
        in_specs=[
            pl.BlockSpec((B,), lambda b, h, i: (0,)),
            pl.BlockSpec((None, None, rows, D), lambda b, h, i: (b, h, 0, 0)),
            pl.BlockSpec((None, S, None, D), lambda b, h, i: (b, 0, h, 0)),
            pl.BlockSpec((None, S, None, D), lambda b, h, i: (b, 0, h, 0)),
        ],
        out_specs=[part(rows, D), part(rows), part(rows)],
        out_shape=[jax.ShapeDtypeStruct((B, NKV, splits, rows, D), F32),
                   jax.ShapeDtypeStruct((B, NKV, splits, rows), F32),
                   jax.ShapeDtypeStruct((B, NKV, splits, rows), F32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="split_decode_attention",
    )(start.astype(jnp.int32), qr, k.astype(q.dtype), v.astype(q.dtype))
    out = combine(a, m, l)[:, :, :n_rows]  # [B, NKV, T * G, D]
    out = out.reshape(B, NKV, T, group, D).transpose(0, 2, 1, 3, 4).reshape(B, T, NH, D)
    return out.astype(q.dtype)
