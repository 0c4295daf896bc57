"""Decode-block ops as Pallas (Triton backend) kernels: the reference's math (reference.py) in few launches.

`block_linear`: grid over blocks of output columns; every program norms the whole (few-row) input itself, so the
norm, the product and the epilogue (SwiGLU, residual) are one launch. `cached_attention`: one program per
(batch row, query head): head norms, RoPE, the cache write of the new keys / values, attention over the cache
(online softmax over blocks of slots) and over the new rows (from registers), and the sigmoid gate. Every value
in a kernel has power-of-two dimensions (Triton): rows are padded by the caller to a power of two >= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .reference import rotate_half_matrix

F32 = jnp.float32
NEG = -1e30  # finite "minus infinity": a fully masked block must not give inf - inf
PRELOAD_BYTES = 64 * 1024  # a program's tiles up to this size are all loaded before its arithmetic
MIN_PROGRAMS = 32  # output blocks are narrowed (down to 16 columns) until the grid has this many programs


def _dot(a, b, *, trans_b=False):
    precision = lax.Precision.HIGHEST if a.dtype == F32 else None
    return lax.dot_general(a, b, (((1,), (1 if trans_b else 0,)), ((), ())), precision=precision,
                           preferred_element_type=F32)


def _norm0(x32, w, eps):
    return x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * (1.0 + w.astype(F32))


def _linear_kernel(*refs, n_norms, eps, epilogue, has_residual, want_normed, block_k):
    x_ref, refs = refs[0], refs[1:]
    w_refs, refs = (refs[:2], refs[2:]) if epilogue == "silu_mul" else (refs[:1], refs[1:])
    norm_refs, refs = refs[:n_norms], refs[n_norms:]
    res_ref, refs = (refs[0], refs[1:]) if has_residual else (None, refs)
    y_ref = refs[0]
    normed_ref = refs[1] if want_normed else None
    m, din = x_ref.shape
    seg = din // max(n_norms, 1)
    starts = range(0, din, block_k)
    # Every load is issued before the arithmetic where the tiles fit in registers (a few-row product is all latency:
    # the weights' load must not wait behind the norm's reduction).
    itemsize = jnp.dtype(x_ref.dtype).itemsize
    held = len(w_refs) * w_refs[0].shape[0] * din * itemsize <= PRELOAD_BYTES
    w_tiles = {(i, k0): w_ref[:, pl.ds(k0, block_k)] for i, w_ref in enumerate(w_refs) for k0 in starts} if held else {}
    x_tiles = {k0: x_ref[:, pl.ds(k0, block_k)] for k0 in starts} if m * din * itemsize <= PRELOAD_BYTES else {}
    residual = res_ref[...] if res_ref is not None else None
    x_tile = lambda k0: x_tiles[k0] if k0 in x_tiles else x_ref[:, pl.ds(k0, block_k)]
    scales = []  # per segment: 1 / rms [M, 1] float32
    for s in range(n_norms):
        ss = 0.0
        for k0 in range(s * seg, (s + 1) * seg, block_k):
            xb = x_tile(k0).astype(F32)
            ss = ss + jnp.sum(xb * xb, axis=1, keepdims=True)
        scales.append(lax.rsqrt(ss / seg + eps))
    accs = [0.0 for _ in w_refs]
    for k0 in starts:
        a = x_tile(k0)
        if n_norms:
            s = k0 // seg
            nw = norm_refs[s][pl.ds(k0 - s * seg, block_k)].astype(F32)
            a = (a.astype(F32) * scales[s] * (1.0 + nw)[None, :]).astype(x_ref.dtype)
            if want_normed:
                normed_ref[:, pl.ds(k0, block_k)] = a
        for i, w_ref in enumerate(w_refs):
            w = w_tiles[i, k0] if held else w_ref[:, pl.ds(k0, block_k)]
            accs[i] = accs[i] + _dot(a, w.astype(a.dtype), trans_b=True)
    y = accs[0]
    if epilogue == "silu_mul":
        y = jax.nn.silu(y) * accs[1]
    if residual is not None:
        y = y + residual.astype(F32)
    y_ref[...] = y.astype(y_ref.dtype)


def pow2_block(n: int, most: int) -> int:
    """The largest power of two <= most dividing n (0 when below 16: Triton's smallest product operand)."""
    b = most
    while b >= 16 and n % b:
        b //= 2
    return b if b >= 16 else 0


def block_linear(x, w, *, norms=(), eps=1e-6, residual=None, epilogue="none", want_normed=False, out_dtype=None,
                 block_n=64, block_k=256, num_warps=4, interpret=False):
    """reference.block_linear as one launch; x [M, Din] with M a power of two >= 16; Din (per norm segment) and
    Dout need a power-of-two divisor >= 16 (`pow2_block`)."""
    m, din = x.shape
    dout = w.shape[0] // (2 if epilogue == "silu_mul" else 1)
    while block_n > 16 and dout // block_n < MIN_PROGRAMS:  # few-row products are latency-bound: more programs
        block_n //= 2  # issue more loads at once
    block_n, block_k = pow2_block(dout, block_n), pow2_block(din // max(len(norms), 1), block_k)
    if not (block_n and block_k):
        raise ValueError(f"block_linear: [{m}, {din}] x [{dout}, {din}] has no power-of-two blocks >= 16")
    nb = dout // block_n
    row = lambda j: (j, 0)
    in_specs = [pl.BlockSpec((m, din), lambda j: (0, 0)), pl.BlockSpec((block_n, din), row)]
    args = [x, w]
    if epilogue == "silu_mul":
        in_specs.append(pl.BlockSpec((block_n, din), lambda j: (j + nb, 0)))
        args.append(w)
    for nw in norms:
        in_specs.append(pl.BlockSpec(nw.shape, lambda j: (0,)))
        args.append(nw)
    if residual is not None:
        in_specs.append(pl.BlockSpec((m, block_n), lambda j: (0, j)))
        args.append(residual)
    out_specs = [pl.BlockSpec((m, block_n), lambda j: (0, j))]
    out_shape = [jax.ShapeDtypeStruct((m, dout), out_dtype or x.dtype)]
    if want_normed:  # every program writes the same normed input (no program-dependent branch)
        out_specs.append(pl.BlockSpec((m, din), lambda j: (0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((m, din), x.dtype))
    outs = pl.pallas_call(
        functools.partial(_linear_kernel, n_norms=len(norms), eps=eps, epilogue=epilogue,
                          has_residual=residual is not None, want_normed=want_normed, block_k=block_k),
        grid=(nb,), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="block_linear",
    )(*args)
    return (outs[0], outs[1]) if want_normed else outs[0]


def _attention_kernel(start_ref, qkv_ref, kc_ref, vc_ref, qn_ref, kn_ref, freq_ref, o_ref, kc_out, vc_out, *, n_heads,
                      n_kv, n_new, eps, mscale, block_s, half):
    b, h = pl.program_id(0), pl.program_id(1)
    tp, hd = o_ref.shape
    group = n_heads // n_kv
    start = start_ref[b]
    dtype = qkv_ref.dtype
    n_blocks = kc_ref.shape[0] // block_s

    def kv_block(s):  # cache slots [s * block_s, (s + 1) * block_s)
        return kc_ref[pl.ds(s * block_s, block_s), :], vc_ref[pl.ds(s * block_s, block_s), :]

    # Loads first (the first cache block included): the arithmetic before the loop hides their latency.
    kv0 = kv_block(0)
    q_raw, gate = qkv_ref[:, pl.ds(h * 2 * hd, hd)], qkv_ref[:, pl.ds(h * 2 * hd + hd, hd)].astype(F32)
    k_raw = qkv_ref[:, pl.ds((2 * n_heads + 0) * hd + (h // group) * hd, hd)]
    v_new = qkv_ref[:, pl.ds((2 * n_heads + n_kv) * hd + (h // group) * hd, hd)]
    rows = lax.broadcasted_iota(jnp.int32, (tp, 1), 0)
    angle = (start + rows).astype(F32) * freq_ref[...][None, :]  # [Tp, hd]
    cos, sin = jnp.cos(angle) * mscale, jnp.sin(angle) * mscale
    rotate = rotate_half_matrix(hd, half, dtype)  # built from iotas (no constant); the product is exact

    def head(x, w):  # head norm, then RoPE: [Tp, hd] in dtype
        xn = _norm0(x.astype(F32), w, eps).astype(dtype)
        rot = _dot(xn, rotate)
        return (xn.astype(F32) * cos + rot * sin).astype(dtype)

    q, k_new = head(q_raw, qn_ref[...]), head(k_raw, kn_ref[...])
    scale = hd ** -0.5

    def update(m, l, acc, sc, values):  # online softmax: fold scores sc [Tp, N] over values [N, hd] in
        m_new = jnp.maximum(m, jnp.max(sc, axis=1, keepdims=True))
        p = jnp.exp(sc - m_new)
        corr = jnp.exp(m - m_new)
        return m_new, l * corr + jnp.sum(p, axis=1, keepdims=True), acc * corr + _dot(p.astype(dtype), values)

    sc = _dot(q, k_new, trans_b=True) * scale  # [Tp, Tp]: the new rows, causal
    col = lax.broadcasted_iota(jnp.int32, (1, tp), 1)
    sc = jnp.where((col <= rows) & (col < n_new), sc, NEG)
    carry = update(jnp.full((tp, 1), NEG, F32), jnp.zeros((tp, 1), F32), jnp.zeros((tp, hd), F32), sc, v_new)

    def block(s, carry):  # the cached slots of block s, visible where < start; the next block's load issued first
        m, l, acc, (kb, vb) = carry
        nxt = kv_block(jnp.minimum(s + 1, n_blocks - 1))
        sc = _dot(q, kb.astype(dtype), trans_b=True) * scale  # [Tp, BS]
        slot = s * block_s + lax.broadcasted_iota(jnp.int32, (1, block_s), 1)
        return (*update(m, l, acc, jnp.where(slot < start, sc, NEG), vb.astype(dtype)), nxt)

    m, l, acc, _ = lax.fori_loop(0, (start + block_s - 1) // block_s, block, (*carry, kv0))
    o_ref[...] = (acc / l * jax.nn.sigmoid(gate)).astype(o_ref.dtype)
    # The new keys and values into the cache, as one masked block from slot start (the caller leaves Tp slots past
    # every start; `cached_attention`), by one program per key head; slots >= start were never read.
    keep = (rows < n_new) & (h % group == 0)
    plt.store(kc_out.at[pl.ds(start, tp), :], k_new.astype(kc_out.dtype), mask=keep)
    plt.store(vc_out.at[pl.ds(start, tp), :], v_new.astype(vc_out.dtype), mask=keep)


def cached_attention(qkv, start, k_cache, v_cache, q_norm, k_norm, freqs, *, n_heads, n_new, eps=1e-6,
                     mscale=1.0, block_s=64, num_warps=4, interpret=False):
    """reference.cached_attention as one launch; the caches are updated in place (aliased).

    qkv [B, Tp, ...] with Tp a power of two >= 16; the cache length S a multiple of block_s (a block read past S would
    be out of bounds), with Tp slots from every start (the new rows are stored as one block of Tp rows, masked; on the
    CPU, interpret mode would clamp a block running past S onto the wrong slots)."""
    if k_cache.shape[1] % block_s:
        raise ValueError(f"cached_attention: cache length {k_cache.shape[1]} is not a multiple of block_s={block_s}")
    b, tp, width = qkv.shape
    _, s_len, n_kv, hd = k_cache.shape
    group = n_heads // n_kv
    starts = start.astype(jnp.int32)  # [B] padded to a power of two (a block's length must be one)
    if b & (b - 1):
        starts = jnp.pad(starts, (0, (1 << (b - 1).bit_length()) - b))
    cache_spec = pl.BlockSpec((None, s_len, None, hd), lambda i, h: (i, 0, h // group, 0))
    vec = lambda n: pl.BlockSpec((n,), lambda i, h: (0,))
    in_specs = [vec(starts.shape[0]), pl.BlockSpec((None, tp, width), lambda i, h: (i, 0, 0)), cache_spec,
                cache_spec, vec(hd), vec(hd), vec(hd)]
    out_specs = [pl.BlockSpec((None, tp, hd), lambda i, h: (i, 0, h)), cache_spec, cache_spec]
    out_shape = [jax.ShapeDtypeStruct((b, tp, n_heads * hd), qkv.dtype),
                 jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    out, k_cache, v_cache = pl.pallas_call(
        functools.partial(_attention_kernel, n_heads=n_heads, n_kv=n_kv, n_new=n_new, eps=eps, mscale=mscale,
                          block_s=block_s, half=int(np.count_nonzero(np.asarray(freqs))) // 2),
        grid=(b, n_heads), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases={2: 1, 3: 2},  # read below start, written from start: one buffer, no overlap
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="cached_attention",
    )(starts, qkv, k_cache, v_cache, q_norm, k_norm, jnp.asarray(freqs, F32))
    return out, k_cache, v_cache
