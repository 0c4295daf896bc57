"""Pure-jnp references of the decode-block ops (the math the Pallas kernels compute; README.md).

Rows are the flattened (batch, position) pairs of a few-token forward, zero-padded by the caller. Norms are
Qwen3.5's zero-centred RMSNorm (x_hat * (1 + w)) in float32, cast to the activation dtype before a product;
products accumulate in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = jnp.float32
EPILOGUES = ("none", "silu_mul")
NEG = -1e30  # finite "minus infinity" (a log-sum-exp over no slots): a fully masked split must not give inf - inf


class Gathered(NamedTuple):
    """A product's input rows, gathered by the kernel instead of materialized by a launch before it: padded row
    b * rows_per + t (t < ids.shape[1]) is [table[ids[b, t]] ; rest[b, t]]; the other rows are zero. The MTP head's fc
    input (the next token's embedding beside a hidden state). rest [B, Tr, Dr] with Tr >= T: a previous op's output
    may be passed with its padding rows."""
    table: jax.Array  # [V, De]
    ids: jax.Array  # [B, T] int32
    rest: jax.Array  # [B, Tr, Dr]
    rows_per: int  # padded rows per batch row (a power of two >= T)


class Partials(NamedTuple):
    """An attention not yet combined across the splits of its cache (`cached_attention(splits=P)`), the input of a
    product that combines it: out [P, M, NH * hd] each split's normalized, gated output; lse [P, M, NH] float32 the
    log-sum-exp of its scores (NEG where it saw no slot). The combination: sum_p out_p w_p / sum_p w_p with
    w_p = exp(lse_p - max_p lse_p), per row and head."""
    out: jax.Array
    lse: jax.Array


class HeadSum(NamedTuple):
    """A product's input as the residual stream plus an attention's per-head output projections
    (`cached_attention(out_proj=...)`), summed by the product as it loads them: x = residual + sum_h parts[h], the sum
    in float32, cast to residual's dtype. parts [NH, Mp, D] float32, residual [Mp, D] (Mp <= the operand's rows: rows
    past it repeat row Mp - 1)."""
    parts: jax.Array
    residual: jax.Array


def operand_rows(batch: int, rows_per: int) -> int:
    """Rows of a product's operand for batch x rows_per positions: a power of two (Triton)."""
    return 1 << (batch * rows_per - 1).bit_length()


def gathered_rows(g: Gathered) -> jax.Array:
    """The [operand_rows, De + Dr] input a `Gathered` stands for."""
    B, T = g.ids.shape
    rows = operand_rows(B, g.rows_per)
    x = jnp.concatenate([g.table[g.ids].astype(g.rest.dtype), g.rest[:, :T]], axis=-1)
    x = jnp.pad(x, ((0, 0), (0, g.rows_per - T), (0, 0))).reshape(B * g.rows_per, -1)
    return jnp.pad(x, ((0, rows - B * g.rows_per), (0, 0)))


def head_sum(x: HeadSum) -> jax.Array:
    """The [operand_rows, D] input a `HeadSum` stands for."""
    y = x.residual.astype(F32) + jnp.sum(x.parts, axis=0)
    rows = operand_rows(1, y.shape[0])
    return jnp.concatenate([y, jnp.broadcast_to(y[-1:], (rows - y.shape[0], y.shape[1]))]).astype(x.residual.dtype)


def combine(parts: Partials) -> jax.Array:
    """The attention output [M, NH * hd] (in out's dtype) a `Partials` stands for."""
    hd = parts.out.shape[-1] // parts.lse.shape[2]
    lse = jnp.repeat(parts.lse, hd, axis=-1)  # [P, M, NH * hd]
    w = jnp.exp(lse - jnp.max(lse, axis=0, keepdims=True))
    x = jnp.sum(parts.out.astype(F32) * w, axis=0) / jnp.sum(w, axis=0)
    rows = operand_rows(1, x.shape[0])  # the product's operand rows (past Mp: row Mp - 1 again, as the kernel reads)
    return jnp.concatenate([x, jnp.broadcast_to(x[-1:], (rows - x.shape[0], x.shape[1]))]).astype(parts.out.dtype)


def rms_norm0(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm over the last axis, float32 in, float32 out."""
    x32 = x.astype(F32)
    return x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * (1.0 + w.astype(F32))


def _product(a: jax.Array, w: jax.Array) -> jax.Array:
    precision = lax.Precision.HIGHEST if a.dtype == F32 else None
    return lax.dot_general(a, w.astype(a.dtype), (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=F32)


def block_linear(x, w: jax.Array, *, norms: tuple = (), eps: float = 1e-6, residual=None,
                 epilogue: str = "none", want_normed: bool = False, out_dtype=None, want_input: bool = False):
    """y = epilogue(norm(x) @ w^T) (+ residual), in x.dtype.

    x [M, Din]; w [Dout, Din] (epilogue "silu_mul": [2F, Din], gate rows then up rows; y = silu(gate) * up, [M, F]);
    norms: () or one weight per equal segment of Din (each segment normed on its own: the MTP head's fc reads
    [embedding ; hidden], each normed with its weight); residual [M, Dout] or None.
    x may also be a `Gathered` (materialized first) or a `Partials` (combined first).
    Returns y (in out_dtype, default x.dtype), or (y, norm(x)) with want_normed, or (y, x) with want_input.
    """
    if isinstance(x, Gathered):
        x = gathered_rows(x)
    elif isinstance(x, Partials):
        x = combine(x)
    elif isinstance(x, HeadSum):
        x = head_sum(x)
    a = x
    if norms:
        parts = jnp.split(x, len(norms), axis=-1)
        a = jnp.concatenate([rms_norm0(p, nw, eps).astype(x.dtype) for p, nw in zip(parts, norms)], axis=-1)
    y = _product(a, w)
    if epilogue == "silu_mul":
        gate, up = jnp.split(y, 2, axis=-1)
        y = jax.nn.silu(gate) * up
    if residual is not None:
        y = y + residual.astype(F32)
    y = y.astype(out_dtype or x.dtype)
    return (y, a) if want_normed else (y, x) if want_input else y


def rope_frequencies(hd: int, inv_freq) -> np.ndarray:
    """Frequency per head dim [hd] (float32, numpy: a constant) for RoPE on the first 2 * len(inv_freq) dims.

    With f = freqs[d] * position, rope(x) = x * cos(f) + (x @ rotate_half_matrix) * sin(f): the passed-through dims
    have frequency 0 (cos 1, sin 0) and an empty column of the matrix."""
    inv = np.asarray(inv_freq, np.float32)
    return np.concatenate([inv, inv, np.zeros(hd - 2 * len(inv), np.float32)])


def rotate_half_matrix(hd: int, half: int, dtype=F32) -> jax.Array:
    """[hd, hd] with x @ it = (-x[half:2 half], x[:half], 0...): rotate-half on the rotary dims (entries 0 / +-1, so
    the product is exact in any dtype)."""
    e = lax.broadcasted_iota(jnp.int32, (hd, hd), 0)
    d = lax.broadcasted_iota(jnp.int32, (hd, hd), 1)
    return (jnp.where((d < half) & (e == d + half), -1.0, 0.0)
            + jnp.where((d >= half) & (d < 2 * half) & (e == d - half), 1.0, 0.0)).astype(dtype)


def _qk(x, w, positions, freqs, eps, dtype, mscale):
    """Head-normed, rotated [B, T, N, hd] (in dtype) from x [B, T, N, hd]."""
    xn = rms_norm0(x, w, eps).astype(dtype)
    f = positions.astype(F32)[:, :, None, None] * freqs  # [B, T, 1, hd]
    half = int(np.count_nonzero(np.asarray(freqs))) // 2
    rot = jnp.einsum("btnd,de->btne", xn.astype(F32), rotate_half_matrix(x.shape[-1], half),
                     precision=lax.Precision.HIGHEST)
    return (xn.astype(F32) * (jnp.cos(f) * mscale) + rot * (jnp.sin(f) * mscale)).astype(dtype)


def cached_attention(qkv: jax.Array, start: jax.Array, k_cache: jax.Array, v_cache: jax.Array, q_norm: jax.Array,
                     k_norm: jax.Array, freqs: np.ndarray, *, n_heads: int, n_new: int,
                     eps: float = 1e-6, mscale: float = 1.0, splits: int = 1, block_s: int = 64, out_proj=None):
    """Qwen3.5's gated attention for a few new positions continuing a KV cache.

    qkv [B, Tp, 2 * NH * hd + 2 * NKV * hd]: per head (query ; gate), then keys, then values (rows past n_new are
    padding); start [B] int32: the position of row 0 (rows are consecutive). k_cache, v_cache [B, S, NKV, hd].
    Queries and keys: head RMSNorm, then RoPE (`rope_frequencies`, a numpy constant; cos and sin scaled by mscale).
    The n_new new keys / values are written at start..start + n_new - 1; row t attends to cache slots < start and to
    new rows <= t.
    Returns (out [B, Tp, NH * hd] = attention * sigmoid(gate), k_cache, v_cache); with splits > 1, out is a
    `Partials` over [P = splits, B * Tp]: split p reads the cached blocks (of block_s slots) `split_of_slot` gives it,
    the last split also the new rows. out_proj [D, NH * hd] (splits 1): instead of out, each head's output projection
    [NH, B * Tp, D] float32 (sum over heads: out @ out_proj^T), for a `HeadSum`.
    """
    B, Tp, _ = qkv.shape
    NKV, hd = k_cache.shape[2], k_cache.shape[3]
    dtype = qkv.dtype
    qg = qkv[..., : 2 * n_heads * hd].reshape(B, Tp, n_heads, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = qkv[..., 2 * n_heads * hd: (2 * n_heads + NKV) * hd].reshape(B, Tp, NKV, hd)
    v = qkv[..., (2 * n_heads + NKV) * hd:].reshape(B, Tp, NKV, hd)
    positions = start[:, None] + jnp.arange(Tp, dtype=jnp.int32)[None]
    q = _qk(q, q_norm, positions, freqs, eps, dtype, mscale)
    k = _qk(k, k_norm, positions, freqs, eps, dtype, mscale)

    def write(cache, new, s):
        return lax.dynamic_update_slice_in_dim(cache, new[:n_new].astype(cache.dtype), s, axis=0)

    k_cache = jax.vmap(write)(k_cache, k, start)
    v_cache = jax.vmap(write)(v_cache, v, start)
    S = k_cache.shape[1]
    slots = jnp.arange(S)[None, None, :]
    mask = (slots < start[:, None, None]) | ((slots - start[:, None, None] <= jnp.arange(Tp)[None, :, None])
                                             & (slots - start[:, None, None] < n_new))  # [B, Tp, S]
    group = n_heads // NKV
    scores = jnp.einsum("btngd,bsnd->bngts", q.reshape(B, Tp, NKV, group, hd), k_cache.astype(dtype),
                        preferred_element_type=F32) * hd ** -0.5
    sig = jax.nn.sigmoid(gate.reshape(B, Tp, n_heads * hd).astype(F32))
    if splits == 1:
        scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("bngts,bsnd->btngd", probs, v_cache.astype(dtype), preferred_element_type=F32)
        out = (out.reshape(B, Tp, n_heads * hd) * sig).astype(dtype)
        if out_proj is not None:
            per_head = out.reshape(B * Tp, n_heads, hd)
            out = jnp.einsum("mhd,ehd->hme", per_head, out_proj.astype(dtype).reshape(-1, n_heads, hd),
                             preferred_element_type=F32)
        return out, k_cache, v_cache
    split = jnp.where(slots[:, 0] < start[:, None], split_of_slot(start, S, splits, block_s), splits - 1)  # [B, S]
    mask = mask[None] & (split[None, :, None, :] == jnp.arange(splits)[:, None, None, None])  # [P, B, Tp, S]
    scores = jnp.where(mask[:, :, None, None], scores[None], -jnp.inf)  # [P, B, NKV, group, Tp, S]
    lse = jax.nn.logsumexp(scores, axis=-1)
    seen = jnp.isfinite(lse)
    probs = jnp.exp(scores - jnp.where(seen, lse, 0.0)[..., None]).astype(dtype)
    out = jnp.einsum("pbngts,bsnd->pbtngd", probs, v_cache.astype(dtype), preferred_element_type=F32)
    out = (out.reshape(splits, B, Tp, n_heads * hd) * sig).astype(dtype).reshape(splits, B * Tp, n_heads * hd)
    lse = jnp.moveaxis(jnp.where(seen, lse, NEG), 4, 2).reshape(splits, B * Tp, n_heads)
    return Partials(out, lse), k_cache, v_cache


def split_of_slot(start: jax.Array, length: int, splits: int, block_s: int) -> jax.Array:
    """[B, length]: the split that reads each cached slot below start [B]. The n = ceil(start / block_s) blocks of
    block_s slots are dealt in runs of ceil(n / splits) consecutive blocks, the first run to split 0."""
    n_used = (start + block_s - 1) // block_s
    per = jnp.maximum((n_used + splits - 1) // splits, 1)
    return (jnp.arange(length)[None] // block_s) // per[:, None]
