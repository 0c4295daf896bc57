"""Flash attention of a prefill chunk over a KV cache (Pallas, Triton backend): no score matrix in memory.

Layout: the G = NH / NKV query heads that read one key/value head are interleaved as rows, row r = t * G + g, so one
program runs `block_m` rows ([block_m / G] positions x G heads) against its head's keys, and a key tile loaded once
serves the whole group. Grid (B, NKV, rows / block_m). Each program walks its key tiles in order, keeping the running
max m, normaliser l and the unnormalised output (the online softmax, README.md): first the tiles every row of the
block sees whole (no mask), then the tiles that cross a row's position (masked). Tiles past the block's last position
are never read, so a chunk at position p costs p + chunk keys, not the cache's length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

F32 = jnp.float32


def dot_f32(a, b, *, trans_b=False, exact):
    """a @ b (or a @ b^T) with fp32 accumulation; `exact`: fp32 operands at full precision (CPU interpret, fp32)."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    prec = lax.Precision.HIGHEST if exact and a.dtype == F32 else None
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=F32)


def _flash_kernel(start_ref, q_ref, k_ref, v_ref, o_ref, *, group, block_m, block_k, seq_len, scale, exact):
    start = start_ref[pl.program_id(0)]  # position of this batch row's query row 0
    first = pl.program_id(2) * block_m  # the block's first row
    q = q_ref[...]  # [BM, D]
    pos = start + (first + lax.broadcasted_iota(jnp.int32, (block_m,), 0)) // group  # [BM] each row's position
    lo, hi = start + first // group, start + (first + block_m - 1) // group  # first and last position in the block
    n_tiles = jnp.minimum((hi + block_k) // block_k, pl.cdiv(seq_len, block_k))  # tiles holding a visible key
    n_whole = jnp.minimum((lo + 1) // block_k, n_tiles)  # tiles every row sees whole

    def tile(j, carry, masked: bool):
        m, l, acc = carry
        keys = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)  # [BK] slots
        rows = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        if masked:  # the cache's last tile may be partial: read zeros past it
            inside = jnp.broadcast_to((keys < seq_len)[:, None], (block_k, q.shape[1]))
            k = plt.load(k_ref.at[rows, :], mask=inside, other=0.0)
            v = plt.load(v_ref.at[rows, :], mask=inside, other=0.0)
        else:
            k, v = k_ref[rows, :], v_ref[rows, :]
        s = dot_f32(q, k, trans_b=True, exact=exact) * scale  # [BM, BK] fp32
        if masked:
            s = jnp.where((keys[None, :] <= pos[:, None]) & (keys[None, :] < seq_len), s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # finite: every row sees slot 0 in the first tile
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + dot_f32(p.astype(v.dtype), v, exact=exact)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    d = q.shape[1]
    carry = (jnp.full((block_m,), -jnp.inf, F32), jnp.zeros((block_m,), F32), jnp.zeros((block_m, d), F32))
    carry = lax.fori_loop(0, n_whole, functools.partial(tile, masked=False), carry)
    _, l, acc = lax.fori_loop(n_whole, n_tiles, functools.partial(tile, masked=True), carry)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def flash_attention(q, k, v, start, *, scale, block_m=64, block_k=64, num_warps=4, num_stages=2, interpret=False):
    """q [B, T, NH, hd] at positions start [B] + t; k, v [B, S, NKV, hd]; returns [B, T, NH, hd] in q.dtype.

    hd must be a power of two >= 16 (the caller pads). T * G rows are padded to whole blocks of block_m rows."""
    B, T, NH, D = q.shape
    S, NKV = k.shape[1], k.shape[2]
    group = NH // NKV
    rows = T * group
    padded = pl.cdiv(rows, block_m) * block_m
    qr = q.reshape(B, T, NKV, group, D).transpose(0, 2, 1, 3, 4).reshape(B, NKV, rows, D)  # row = t * G + g
    if padded != rows:
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
    kernel = functools.partial(_flash_kernel, group=group, block_m=block_m, block_k=block_k, seq_len=S, scale=scale,
                               exact=interpret or q.dtype == F32)
    out = pl.pallas_call(
        kernel,
        grid=(B, NKV, padded // block_m),
        in_specs=[
            pl.BlockSpec((B,), lambda b, h, i: (0,)),
            pl.BlockSpec((None, None, block_m, D), lambda b, h, i: (b, h, i, 0)),
            pl.BlockSpec((None, S, None, D), lambda b, h, i: (b, 0, h, 0)),
            pl.BlockSpec((None, S, None, D), lambda b, h, i: (b, 0, h, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, block_m, D), lambda b, h, i: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((B, NKV, padded, D), q.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="flash_prefill_attention",
    )(start.astype(jnp.int32), qr, k.astype(q.dtype), v.astype(q.dtype))
    out = out[:, :, :rows].reshape(B, NKV, T, group, D).transpose(0, 2, 1, 3, 4)
    return out.reshape(B, T, NH, D)
