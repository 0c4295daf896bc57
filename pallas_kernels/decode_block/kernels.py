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

from .reference import NEG, Gathered, HeadSum, Partials, operand_rows, rotate_half_matrix

F32 = jnp.float32
PRELOAD_BYTES = 64 * 1024  # a program's tiles up to this size are all loaded before its arithmetic
MIN_PROGRAMS = 32  # output blocks are narrowed (down to 16 columns) until the grid has this many programs


def _dot(a, b, *, trans_b=False):
    precision = lax.Precision.HIGHEST if a.dtype == F32 else None
    return lax.dot_general(a, b, (((1,), (1 if trans_b else 0,)), ((), ())), precision=precision,
                           preferred_element_type=F32)


def _norm0(x32, w, eps):
    return x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * (1.0 + w.astype(F32))


def _input_tiles(x_refs, x_kind, m, block_k, meta):
    """x_tile(k0) -> [M, block_k] in the activation dtype, for a dense, `Gathered` or `Partials` input."""
    if x_kind == "dense":
        (x_ref,) = x_refs
        return lambda k0: x_ref[:, pl.ds(k0, block_k)]
    if x_kind == "gathered":  # ids [B * T] int32, table [V, De], rest [B * Tr, Dr]
        ids_ref, table_ref, rest_ref = x_refs
        batch, count, rest_per, rows_per = meta
        rows = lax.broadcasted_iota(jnp.int32, (m,), 0)
        b, t = rows // rows_per, rows % rows_per
        valid = ((t < count) & (b < batch)).reshape(m, 1)
        b, t = jnp.minimum(b, batch - 1), jnp.minimum(t, count - 1)
        ids, src = ids_ref[b * count + t], b * rest_per + t  # [M]: row r's token, and its row of rest
        de = table_ref.shape[1]

        def tile(k0):
            g = table_ref[ids, pl.ds(k0, block_k)] if k0 < de else rest_ref[src, pl.ds(k0 - de, block_k)]
            return jnp.where(valid, g.astype(rest_ref.dtype), 0).astype(rest_ref.dtype)
        return tile
    if x_kind == "headsum":  # parts [NH, Mp, D] float32, residual [Mp, D]
        parts_ref, res_ref = x_refs
        mp = res_ref.shape[0]
        at = slice(None) if mp == m else jnp.minimum(lax.broadcasted_iota(jnp.int32, (m,), 0), mp - 1)

        def tile(k0):
            y = res_ref[at, pl.ds(k0, block_k)].astype(F32)
            for h in range(parts_ref.shape[0]):
                y = y + parts_ref[h, at, pl.ds(k0, block_k)]
            return y.astype(res_ref.dtype)
        return tile
    out_ref, lse_ref = x_refs  # Partials: out [P, Mp, NH * hd], lse [P, Mp, NH] (Mp <= M: rows past it repeat row Mp-1)
    (hd,) = meta  # block_k divides hd: a tile lies in one head
    mp = out_ref.shape[1]
    rows = jnp.minimum(lax.broadcasted_iota(jnp.int32, (m,), 0), mp - 1)

    def tile(k0):
        splits, h = range(out_ref.shape[0]), k0 // hd
        at = slice(None) if mp == m else rows
        outs = [out_ref[p, at, pl.ds(k0, block_k)] for p in splits]
        lse = [lse_ref[p, at, pl.ds(h, 1)] for p in splits]  # [M, 1] each: the split's log-sum-exp for this head
        top = functools.reduce(jnp.maximum, lse)
        ws = [jnp.exp(x - top) for x in lse]
        num = functools.reduce(jnp.add, [o.astype(F32) * w for o, w in zip(outs, ws)])
        return (num / functools.reduce(jnp.add, ws)).astype(out_ref.dtype)
    return tile


def _linear_kernel(*refs, x_kind, x_count, x_meta, n_norms, eps, epilogue, has_residual, want_normed, want_input,
                   block_k):
    x_refs, refs = refs[:x_count], refs[x_count:]
    w_refs, refs = (refs[:2], refs[2:]) if epilogue == "silu_mul" else (refs[:1], refs[1:])
    norm_refs, refs = refs[:n_norms], refs[n_norms:]
    res_ref, refs = (refs[0], refs[1:]) if has_residual else (None, refs)
    y_ref = refs[0]
    normed_ref = refs[1] if want_normed else None
    input_ref = refs[1] if want_input else None
    m, din = y_ref.shape[0], w_refs[0].shape[1]
    seg = din // max(n_norms, 1)
    starts = range(0, din, block_k)
    # Every load is issued before the arithmetic where the tiles fit in registers (a few-row product is all latency:
    # the weights' load must not wait behind the norm's reduction).
    itemsize = jnp.dtype(w_refs[0].dtype).itemsize
    held = len(w_refs) * w_refs[0].shape[0] * din * itemsize <= PRELOAD_BYTES
    w_tiles = {(i, k0): w_ref[:, pl.ds(k0, block_k)] for i, w_ref in enumerate(w_refs) for k0 in starts} if held else {}
    load_x = _input_tiles(x_refs, x_kind, m, block_k, x_meta)
    preload_x = x_kind != "partials" and m * din * itemsize <= PRELOAD_BYTES  # (a combination: per tile, as used)
    x_tiles = {k0: load_x(k0) for k0 in starts} if preload_x else {}
    residual = res_ref[...] if res_ref is not None else None
    x_tile = lambda k0: x_tiles[k0] if k0 in x_tiles else load_x(k0)
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
        if want_input:
            input_ref[:, pl.ds(k0, block_k)] = a
        if n_norms:
            s = k0 // seg
            nw = norm_refs[s][pl.ds(k0 - s * seg, block_k)].astype(F32)
            a = (a.astype(F32) * scales[s] * (1.0 + nw)[None, :]).astype(a.dtype)
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
                 want_input=False, block_n=64, block_k=256, num_warps=4, interpret=False):
    """reference.block_linear as one launch; x [M, Din] with M a power of two >= 16, or a `Gathered` / `Partials`
    (gathered / combined by every program as it loads its input); Din (per norm segment) and Dout need a power-of-two
    divisor >= 16 (`pow2_block`)."""
    din = w.shape[1]
    dout = w.shape[0] // (2 if epilogue == "silu_mul" else 1)
    while block_n > 16 and dout // block_n < MIN_PROGRAMS:  # few-row products are latency-bound: more programs
        block_n //= 2  # issue more loads at once
    block_n, block_k = pow2_block(dout, block_n), pow2_block(din // max(len(norms), 1), block_k)
    whole = lambda a: pl.BlockSpec(a.shape, lambda j: (0,) * a.ndim)
    if isinstance(x, Gathered):
        (batch, count), rest_per = x.ids.shape, x.rest.shape[1]
        m, dtype = operand_rows(batch, x.rows_per), x.rest.dtype
        x_args = [x.ids.reshape(-1), x.table, x.rest.reshape(batch * rest_per, -1)]
        x_kind, x_meta = "gathered", (batch, count, rest_per, x.rows_per)
        block_k = pow2_block(x.table.shape[1], block_k) if block_k else 0  # a tile reads the table or the rest
    elif isinstance(x, Partials):
        m, dtype = operand_rows(1, x.out.shape[1]), x.out.dtype
        hd = x.out.shape[2] // x.lse.shape[2]
        x_args, x_kind, x_meta = [x.out, x.lse], "partials", (hd,)
        block_k = pow2_block(hd, block_k) if block_k else 0  # a tile within one head
    elif isinstance(x, HeadSum):
        m, dtype = operand_rows(1, x.residual.shape[0]), x.residual.dtype
        x_args, x_kind, x_meta = [x.parts, x.residual], "headsum", ()
    else:
        m, dtype = x.shape[0], x.dtype
        x_args, x_kind, x_meta = [x], "dense", ()
    if not (block_n and block_k):
        raise ValueError(f"block_linear: [{m}, {din}] x [{dout}, {din}] has no power-of-two blocks >= 16")
    nb = dout // block_n
    row = lambda j: (j, 0)
    in_specs = [whole(a) for a in x_args] + [pl.BlockSpec((block_n, din), row)]
    args = x_args + [w]
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
    out_shape = [jax.ShapeDtypeStruct((m, dout), out_dtype or dtype)]
    if want_normed or want_input:  # every program writes the same (normed) input (no program-dependent branch)
        out_specs.append(pl.BlockSpec((m, din), lambda j: (0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((m, din), dtype))
    outs = pl.pallas_call(
        functools.partial(_linear_kernel, x_kind=x_kind, x_count=len(x_args), x_meta=x_meta, n_norms=len(norms),
                          eps=eps, epilogue=epilogue, has_residual=residual is not None, want_normed=want_normed,
                          want_input=want_input, block_k=block_k),
        grid=(nb,), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="block_linear",
    )(*args)
    return (outs[0], outs[1]) if want_normed or want_input else outs[0]


def _attention_kernel(start_ref, qkv_ref, kc_ref, vc_ref, qn_ref, kn_ref, freq_ref, *refs, n_heads, n_kv, n_new, eps,
                      mscale, block_s, half, splits, out_proj):
    wo_ref, refs = (refs[0], refs[1:]) if out_proj else (None, refs)
    o_ref, lse_ref, kc_out, vc_out = refs if splits > 1 else (refs[0], None, *refs[1:])
    b, h, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tp, hd = qkv_ref.shape[0], kc_ref.shape[1]
    group = n_heads // n_kv
    start = start_ref[b]
    dtype = qkv_ref.dtype
    n_blocks = kc_ref.shape[0] // block_s
    # This program's cached blocks (reference.split_of_slot): a run of ceil(used / splits) blocks; the last split also
    # takes the new rows.
    used = (start + block_s - 1) // block_s
    per = jnp.maximum((used + splits - 1) // splits, 1)
    lo, hi = part * per, jnp.minimum((part + 1) * per, used)
    takes_new = part == splits - 1

    def kv_block(s):  # cache slots [s * block_s, (s + 1) * block_s)
        return kc_ref[pl.ds(s * block_s, block_s), :], vc_ref[pl.ds(s * block_s, block_s), :]

    # Loads first (the first cache block included): the arithmetic before the loop hides their latency.
    kv0 = kv_block(jnp.minimum(lo, n_blocks - 1))
    wo = wo_ref[:, pl.ds(h * hd, hd)] if out_proj else None  # [D, hd]: this head's columns of the projection
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

    def update(m, l, acc, sc, seen, values):  # online softmax: fold scores sc [Tp, N] (where seen) over values in
        m_new = jnp.maximum(m, jnp.max(jnp.where(seen, sc, NEG), axis=1, keepdims=True))
        p = jnp.where(seen, jnp.exp(sc - m_new), 0.0)  # zero where unseen: a split may see no slot of a row
        corr = jnp.exp(m - m_new)
        return m_new, l * corr + jnp.sum(p, axis=1, keepdims=True), acc * corr + _dot(p.astype(dtype), values)

    sc = _dot(q, k_new, trans_b=True) * scale  # [Tp, Tp]: the new rows, causal
    col = lax.broadcasted_iota(jnp.int32, (1, tp), 1)
    carry = update(jnp.full((tp, 1), NEG, F32), jnp.zeros((tp, 1), F32), jnp.zeros((tp, hd), F32), sc,
                   (col <= rows) & (col < n_new) & takes_new, v_new)

    def block(s, carry):  # the cached slots of block s, visible where < start; the next block's load issued first
        m, l, acc, (kb, vb) = carry
        nxt = kv_block(jnp.minimum(s + 1, n_blocks - 1))
        sc = _dot(q, kb.astype(dtype), trans_b=True) * scale  # [Tp, BS]
        slot = s * block_s + lax.broadcasted_iota(jnp.int32, (1, block_s), 1)
        return (*update(m, l, acc, sc, slot < start, vb.astype(dtype)), nxt)

    m, l, acc, _ = lax.fori_loop(lo, hi, block, (*carry, kv0))
    seen = l > 0.0
    out = (acc / jnp.where(seen, l, 1.0) * jax.nn.sigmoid(gate)).astype(dtype)
    o_ref[...] = _dot(out, wo, trans_b=True) if out_proj else out  # [Tp, D] float32 / [Tp, hd]
    if lse_ref is not None:
        lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG).reshape(tp)
    # The new keys and values into the cache, as one masked block from slot start (the caller leaves Tp slots past
    # every start; `cached_attention`), by one program per key head; slots >= start were never read.
    keep = (rows < n_new) & (h % group == 0) & takes_new
    plt.store(kc_out.at[pl.ds(start, tp), :], k_new.astype(kc_out.dtype), mask=keep)
    plt.store(vc_out.at[pl.ds(start, tp), :], v_new.astype(vc_out.dtype), mask=keep)


def cached_attention(qkv, start, k_cache, v_cache, q_norm, k_norm, freqs, *, n_heads, n_new, eps=1e-6,
                     mscale=1.0, block_s=64, splits=1, out_proj=None, num_warps=4, interpret=False):
    """reference.cached_attention as one launch of (B, NH, splits) programs; the caches are updated in place (aliased).

    qkv [B, Tp, ...] with Tp a power of two >= 16; the cache length S a multiple of block_s (a block read past S would
    be out of bounds), with Tp slots from every start (the new rows are stored as one block of Tp rows, masked; on the
    CPU, interpret mode would clamp a block running past S onto the wrong slots). splits > 1: a `Partials` over
    [splits, B * Tp] instead of the output; out_proj [D, NH * hd] (splits 1): each head's projection [NH, B * Tp, D]."""
    if out_proj is not None and splits > 1:
        raise ValueError("cached_attention: out_proj takes one split")
    if k_cache.shape[1] % block_s:
        raise ValueError(f"cached_attention: cache length {k_cache.shape[1]} is not a multiple of block_s={block_s}")
    b, tp, width = qkv.shape
    _, s_len, n_kv, hd = k_cache.shape
    group = n_heads // n_kv
    starts = start.astype(jnp.int32)  # [B] padded to a power of two (a block's length must be one)
    if b & (b - 1):
        starts = jnp.pad(starts, (0, (1 << (b - 1).bit_length()) - b))
    cache_spec = pl.BlockSpec((None, s_len, None, hd), lambda i, h, p: (i, 0, h // group, 0))
    vec = lambda n: pl.BlockSpec((n,), lambda i, h, p: (0,))
    in_specs = [vec(starts.shape[0]), pl.BlockSpec((None, tp, width), lambda i, h, p: (i, 0, 0)), cache_spec,
                cache_spec, vec(hd), vec(hd), vec(hd)]
    args = [starts, qkv, k_cache, v_cache, q_norm, k_norm, jnp.asarray(freqs, F32)]
    if out_proj is not None:  # [NH, B * Tp, D] float32
        d = out_proj.shape[0]
        in_specs.append(pl.BlockSpec(out_proj.shape, lambda i, h, p: (0, 0)))
        args.append(out_proj.astype(qkv.dtype))
        out_specs = [pl.BlockSpec((None, tp, d), lambda i, h, p: (h, i, 0))]
        out_shape = [jax.ShapeDtypeStruct((n_heads, b * tp, d), F32)]
    elif splits == 1:
        out_specs = [pl.BlockSpec((None, tp, hd), lambda i, h, p: (i, 0, h))]
        out_shape = [jax.ShapeDtypeStruct((b, tp, n_heads * hd), qkv.dtype)]
    else:  # Partials: out [P, B * Tp, NH * hd], lse [P, B * Tp, NH]
        out_specs = [pl.BlockSpec((None, tp, hd), lambda i, h, p: (p, i, h)),
                     pl.BlockSpec((None, tp, None), lambda i, h, p: (p, i, h))]
        out_shape = [jax.ShapeDtypeStruct((splits, b * tp, n_heads * hd), qkv.dtype),
                     jax.ShapeDtypeStruct((splits, b * tp, n_heads), F32)]
    outs = pl.pallas_call(
        functools.partial(_attention_kernel, n_heads=n_heads, n_kv=n_kv, n_new=n_new, eps=eps, mscale=mscale,
                          block_s=block_s, half=int(np.count_nonzero(np.asarray(freqs))) // 2, splits=splits,
                          out_proj=out_proj is not None),
        grid=(b, n_heads, splits), in_specs=in_specs, out_specs=out_specs + [cache_spec, cache_spec],
        out_shape=out_shape + [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                               jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={2: len(out_shape), 3: len(out_shape) + 1},  # read below start, written from start
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="cached_attention",
    )(*args)
    out = outs[0] if splits == 1 else Partials(outs[0], outs[1])
    return out, outs[-2], outs[-1]
