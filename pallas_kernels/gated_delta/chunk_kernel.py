"""Chunked gated delta rule (prefill / verification) as Pallas kernels (Triton backend).

Derivation and measurements: README.md. Chunk C = 64; per value head, per chunk (gamma = cumulative
gate inside the chunk, Gamma_ij = exp(gamma_i - gamma_j) for i >= j):

1. `_wy_kernel`, grid (B*HV, NC), every chunk independent (fills the GPU):
       A = strictly-lower(beta_i (k_i . k_j) Gamma_ij)                    [C, C]
       Tinv = (I + A)^{-1}          (16x16 forward substitution + two block merges, in registers)
       W = Tinv (beta e^gamma K)   [C, K]      U = Tinv (beta V)   [C, V]
2. `_state_pass_kernel`, grid (B*HV, V/BV), the chunk loop carries the [K, BV] state in registers:
       S_c stored (state entering chunk c)
       V_new = U - W S                               (pseudo-values, exactly the per-step u_t)
       S <- e^{gamma_C} S + (K e^{gamma_C - gamma})^T V_new
3. `_output_kernel`, grid (B*HV, NC), parallel again:
       O = scale [(Q e^gamma) S_c + ((Q K^T) * Gamma) V_new]

Only the state dependence is sequential, and the sequential kernel does two matrix products per
chunk. `split_output=False` selects `_state_kernel` instead of 2 + 3 (O formed inside the chunk
loop: one launch and no S_c round trip, but five products per sequential step; measured slower).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ._kernel_utils import F32, L2_EPS, inv_norms, iota2, mm

CHUNK = 64
SUB = 16  # forward-substitution block (rows inside one block are solved sequentially)


WY_SOLVERS = ("substitution", "merge")


def _merge_levels(x: jax.Array, a: jax.Array, first: int, merge_precision) -> jax.Array:
    """Block inverses of size `first` -> the full inverse: at each level the lower-left coupling
    block N of every pair of blocks is folded in with [[L11, 0], [L21, L22]]^{-1} = X - X N X
    (X = the block-diagonal inverse so far; products, never ratios)."""
    c = a.shape[0]
    row, col = iota2(c)
    size = first
    while size < c:
        rb, cb = lax.div(row, size), lax.div(col, size)
        coupling = jnp.where((lax.rem(rb, 2) == 1) & (cb == rb - 1), a, 0.0)
        x = x - mm(mm(x, coupling, merge_precision), x, merge_precision)
        size *= 2
    return x


def unit_lower_inverse(a: jax.Array, merge_precision, solver: str = "substitution") -> jax.Array:
    """(I + a)^{-1} for a strictly lower-triangular a [64, 64] fp32, all in registers.

    solver="substitution": forward substitution solves the four diagonal 16x16 blocks at once (row r
    of every block per step: the blocks occupy disjoint columns, so one masked reduction extracts
    all four rows), then two merges fill the off-diagonal blocks (16 -> 32 -> 64).
    solver="merge": no substitution; six merge levels from 1x1 blocks (the unit diagonal) up,
    12 matrix products and no sequential cross-row reductions. In TF32 its error matched the
    substitution's (1e-4 to 8e-4 of the inverse's largest entry on keys from unrelated to identical,
    README.md), both below bf16 input rounding.
    """
    if solver == "merge":
        return _merge_levels(_eye(a.shape[0]), a, 1, merge_precision)
    if solver != "substitution":
        raise ValueError(f"unit_lower_inverse: solver must be one of {WY_SOLVERS}; got {solver!r}")
    c = a.shape[0]
    row, col = iota2(c)
    rb, cb = lax.div(row, SUB), lax.div(col, SUB)  # block row / column (non-negative: truncation ok)
    r_in = lax.rem(row, SUB)
    same_block = rb == cb
    d = jnp.where(same_block, a, 0.0)

    def substitute(r, x):  # x [C, C]: rows < r of every block are final, the rest still identity
        sel = r_in == r
        a_rows = jnp.sum(jnp.where(sel, d, 0.0), axis=0)  # [C] row r of each block, own columns
        contrib = jnp.sum(a_rows[:, None] * x, axis=0)  # [C] sum_j a_rj x_j, per block
        return jnp.where(sel & same_block, x - contrib[None, :], x)

    x = lax.fori_loop(1, SUB, substitute, _eye(c))
    return _merge_levels(x, a, SUB, merge_precision)


def _eye(c: int) -> jax.Array:
    row, col = iota2(c)
    return jnp.where(row == col, 1.0, 0.0).astype(F32)


def _pair_decay(gam, lo, mask):
    """exp(gamma_i - gamma_j) where mask else 0, [C, C]; gamma = gam + lo (reference.compensated_cumsum)."""
    diff = (gam[:, None] - gam[None, :]) + (lo[:, None] - lo[None, :])
    return jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)


def _to_chunk_end(gam, lo, last):
    """(gamma_C, exp(gamma_C - gamma_j) [C]): the decay over the whole chunk and from each step to its end."""
    g_last = jnp.sum(jnp.where(last, gam, 0.0))
    lo_last = jnp.sum(jnp.where(last, lo, 0.0))
    return g_last + lo_last, jnp.exp((g_last - gam) + (lo_last - lo))


def _wy_kernel(k_ref, v_ref, gam_ref, lo_ref, beta_ref, w_ref, u_ref, *rk_ref, l2norm, prec, merge_prec, solver):
    # Diagonal scalings are applied to the small [C, C] factors, never to the [C, K] tiles: the
    # 16-bit k and v go straight into the matrix products (fewer registers, no extra rounding).
    k = k_ref[...]  # [C, K] input dtype
    gam, lo = gam_ref[...], lo_ref[...]  # [C] cumulative gate inside the chunk, as hi + lo
    beta = beta_ref[...]  # [C]
    row, col = iota2(CHUNK)
    strict = row > col
    kk = mm(k, k, prec, trans_b=True)  # [C, C]
    if l2norm:  # normalised keys: diag(r) K K^T diag(r) with r_i = 1 / |k_i|
        r_k = lax.rsqrt(jnp.sum(jnp.where(row == col, kk, 0.0), axis=1) + L2_EPS)  # [C]
        kk = kk * r_k[:, None] * r_k[None, :]
        rk_ref[0][...] = r_k  # reused by the state pass (the key norms of this value head's chunk)
    else:
        r_k = jnp.ones((CHUNK,), F32)
    decay = _pair_decay(gam, lo, strict)
    tinv = unit_lower_inverse(kk * decay * beta[:, None], merge_prec, solver)  # [C, C]
    cdt = k.dtype
    # W = Tinv diag(beta e^gamma r) K,   U = Tinv diag(beta) V
    w_ref[...] = mm((tinv * (beta * jnp.exp(gam + lo) * r_k)[None, :]).astype(cdt), k, prec).astype(w_ref.dtype)
    u_ref[...] = mm((tinv * beta[None, :]).astype(cdt), v_ref[...].astype(cdt), prec).astype(u_ref.dtype)


def _state_kernel(*refs, n_chunks, scale, has_s0, want_vnew, l2norm, prec, state_dtype):
    """Fused variant: the chunk loop forms O as well (five products per sequential step)."""
    q_ref, k_ref, w_ref, u_ref, gam_ref, lo_ref = refs[:6]
    rest = list(refs[6:])
    s0_ref = rest.pop(0) if has_s0 else None
    o_ref, st_ref = rest[0], rest[1]
    vnew_ref = rest[2] if want_vnew else None
    kdim, bv = st_ref.shape
    sdt = state_dtype  # operand dtype of the products with the state (and with V_new)
    state = s0_ref[...].astype(F32) if has_s0 else jnp.zeros((kdim, bv), F32)
    row, col = iota2(CHUNK)
    causal = row >= col
    last = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0) == CHUNK - 1

    def body(c, state):  # state [K, BV] fp32
        sl = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
        q, k = q_ref[sl, :].astype(sdt), k_ref[sl, :].astype(sdt)  # [C, K]
        gam, lo = gam_ref[sl], lo_ref[sl]  # [C]
        g_last, to_end = _to_chunk_end(gam, lo, last)  # gamma_C: decay over the whole chunk
        if l2norm:  # fold 1/|q_i|, 1/|k_j| into row/column scalings of the small products
            r_q, r_k = inv_norms(q), inv_norms(k)
        else:
            r_q = r_k = jnp.ones((CHUNK,), F32)
        s_op = state.astype(sdt)
        v_new = u_ref[sl, :].astype(F32) - mm(w_ref[sl, :].astype(sdt), s_op, prec)  # [C, BV]
        decay = _pair_decay(gam, lo, causal)
        qk = mm(q, k, prec, trans_b=True) * decay * r_k[None, :]  # [C, C]
        o = (mm(q, s_op, prec) * jnp.exp(gam + lo)[:, None]  # (Q e^gamma) S
             + mm(qk.astype(sdt), v_new.astype(sdt), prec))  # [C, BV]
        o_ref[sl, :] = (o * (scale * r_q)[:, None]).astype(o_ref.dtype)
        if want_vnew:
            vnew_ref[sl, :] = v_new
        v_dec = (v_new * (to_end * r_k)[:, None]).astype(sdt)  # [C, BV]
        return state * jnp.exp(g_last) + mm(k, v_dec, prec, trans_a=True)

    state = lax.fori_loop(0, n_chunks, body, state)
    st_ref[...] = state


def _state_pass_kernel(*refs, n_chunks, has_s0, l2norm, prec, state_dtype):
    """Split variant, sequential part only: V_new = U - W S and the state update (two products)."""
    k_ref, w_ref, u_ref, gam_ref, lo_ref = refs[:5]
    rest = list(refs[5:])
    rk_ref = rest.pop(0) if l2norm else None
    s0_ref = rest.pop(0) if has_s0 else None
    h_ref, vnew_ref, st_ref = rest
    kdim, bv = st_ref.shape
    sdt = state_dtype
    state = s0_ref[...].astype(F32) if has_s0 else jnp.zeros((kdim, bv), F32)
    last = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0) == CHUNK - 1

    def body(c, state):  # state [K, BV] fp32
        sl = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
        h_ref[c, :, :] = state.astype(h_ref.dtype)  # state entering chunk c, for the output kernel
        s_op = state.astype(sdt)
        v_new = u_ref[sl, :].astype(F32) - mm(w_ref[sl, :].astype(sdt), s_op, prec)  # [C, BV]
        vnew_ref[sl, :] = v_new.astype(vnew_ref.dtype)
        g_last, to_end = _to_chunk_end(gam_ref[sl], lo_ref[sl], last)
        row_scale = to_end * rk_ref[sl] if l2norm else to_end  # [C]
        v_dec = (v_new * row_scale[:, None]).astype(sdt)  # [C, BV]
        return state * jnp.exp(g_last) + mm(k_ref[sl, :].astype(sdt), v_dec, prec, trans_a=True)

    state = lax.fori_loop(0, n_chunks, body, state)
    st_ref[...] = state


def _output_kernel(q_ref, k_ref, gam_ref, lo_ref, *refs, scale, l2norm, prec, state_dtype):
    """Split variant, parallel over chunks: O = scale [(Q e^gamma) S_c + ((Q K^T) * Gamma) V_new]."""
    refs = list(refs)
    rk_ref = refs.pop(0) if l2norm else None
    h_ref, vnew_ref, o_ref = refs
    sdt = state_dtype
    q, k = q_ref[...].astype(sdt), k_ref[...].astype(sdt)  # [C, K]
    gam, lo = gam_ref[...], lo_ref[...]  # [C]
    row, col = iota2(CHUNK)
    causal = row >= col
    qk = mm(q, k, prec, trans_b=True) * _pair_decay(gam, lo, causal)  # [C, C]
    if l2norm:
        qk = qk * rk_ref[...][None, :]
    o = (mm(q, h_ref[...].astype(sdt), prec) * jnp.exp(gam + lo)[:, None]
         + mm(qk.astype(sdt), vnew_ref[...].astype(sdt), prec))  # [C, V]
    row_scale = scale * inv_norms(q) if l2norm else jnp.full((CHUNK,), scale, F32)
    o_ref[...] = (o * row_scale[:, None]).astype(o_ref.dtype)


def _specs(b, hv, group, tp, kp, bv):
    """BlockSpecs shared by the kernels (grid axis 0 = batch * value head)."""
    head = lambda i: (i // hv, i % hv)
    key_head = lambda i: (i % hv) // group  # value head j reads key head j // group (never materialised)
    return dict(
        head=head, key_head=key_head,
        gate_chunk=pl.BlockSpec((None, None, CHUNK), lambda i, c: (*head(i), c)),
        key_full=pl.BlockSpec((None, tp, None, kp), lambda i, j: (i // hv, 0, key_head(i), 0)),
        w_full=pl.BlockSpec((None, None, tp, kp), lambda i, j: (*head(i), 0, 0)),
        u_full=pl.BlockSpec((None, None, tp, bv), lambda i, j: (*head(i), 0, j)),
        gate_full=pl.BlockSpec((None, None, tp), lambda i, j: (*head(i), 0)),
        state=pl.BlockSpec((None, None, kp, bv), lambda i, j: (*head(i), 0, j)),
        val_full=pl.BlockSpec((None, tp, None, bv), lambda i, j: (i // hv, 0, i % hv, j)),
    )


def wy_call(k, v, gam, gam_lo, beta, *, hv, l2norm, wu_dtype, prec, merge_prec, interpret, num_warps=4,
            solver="substitution"):
    """Stage 1: per chunk W, U [B, HV, Tp, K|V] (wu_dtype) and, with l2norm, 1/|k_t| [B, HV, Tp] fp32."""
    b, tp, h, kp = k.shape
    vp = v.shape[3]
    sp = _specs(b, hv, hv // h, tp, kp, vp)
    head, key_head, gate_chunk = sp["head"], sp["key_head"], sp["gate_chunk"]
    out_specs = [pl.BlockSpec((None, None, CHUNK, kp), lambda i, c: (*head(i), c, 0)),
                 pl.BlockSpec((None, None, CHUNK, vp), lambda i, c: (*head(i), c, 0))]
    # W and U per head contiguous in T; stored in the input precision (16-bit halves their traffic)
    out_shape = [jax.ShapeDtypeStruct((b, hv, tp, kp), wu_dtype), jax.ShapeDtypeStruct((b, hv, tp, vp), wu_dtype)]
    if l2norm:
        out_specs.append(gate_chunk)
        out_shape.append(jax.ShapeDtypeStruct((b, hv, tp), F32))
    outs = pl.pallas_call(
        functools.partial(_wy_kernel, l2norm=l2norm, prec=prec, merge_prec=merge_prec, solver=solver),
        grid=(b * hv, tp // CHUNK),
        in_specs=[
            pl.BlockSpec((None, CHUNK, None, kp), lambda i, c: (i // hv, c, key_head(i), 0)),
            pl.BlockSpec((None, CHUNK, None, vp), lambda i, c: (i // hv, c, i % hv, 0)),
            gate_chunk,
            gate_chunk,
            gate_chunk,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_chunk_wy",
    )(k, v, gam, gam_lo, beta)
    return outs[0], outs[1], (outs[2] if l2norm else None)


def state_pass_call(k, w, u, gam, gam_lo, r_k, s0, *, vnew_dtype, state_dtype, prec, block_v, interpret, num_warps=4,
                    num_stages=2):
    """Stage 2 (sequential over chunks): states entering every chunk [B, HV, NC, K, V] (state_dtype),
    V_new [B, Tp, HV, V] (vnew_dtype), final state [B, HV, K, V] fp32."""
    b, tp, h, kp = k.shape
    hv, vp = w.shape[1], u.shape[3]
    nc = tp // CHUNK
    bv = min(block_v, vp)
    sp = _specs(b, hv, hv // h, tp, kp, bv)
    head = sp["head"]
    l2norm, has_s0 = r_k is not None, s0 is not None
    in_specs = [sp["key_full"], sp["w_full"], sp["u_full"], sp["gate_full"], sp["gate_full"]]
    args = [k, w, u, gam, gam_lo]
    if l2norm:
        in_specs.append(sp["gate_full"])
        args.append(r_k)
    if has_s0:
        in_specs.append(sp["state"])
        args.append(s0)
    return pl.pallas_call(
        functools.partial(_state_pass_kernel, n_chunks=nc, has_s0=has_s0, l2norm=l2norm, prec=prec,
                          state_dtype=state_dtype),
        grid=(b * hv, vp // bv),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, nc, kp, bv), lambda i, j: (*head(i), 0, 0, j)), sp["val_full"],
                   sp["state"]],
        out_shape=[jax.ShapeDtypeStruct((b, hv, nc, kp, vp), state_dtype),  # state entering each chunk
                   jax.ShapeDtypeStruct((b, tp, hv, vp), vnew_dtype), jax.ShapeDtypeStruct((b, hv, kp, vp), F32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gdn_chunk_state_pass",
    )(*args)


def output_call(q, k, gam, gam_lo, r_k, h_states, v_new, *, out_dtype, scale, state_dtype, prec, interpret, num_warps=4):
    """Stage 3 (parallel over chunks): o [B, Tp, HV, V] (out_dtype)."""
    b, tp, h, kp = q.shape
    hv, vp = v_new.shape[2], v_new.shape[3]
    sp = _specs(b, hv, hv // h, tp, kp, vp)
    head, key_head, gate_chunk = sp["head"], sp["key_head"], sp["gate_chunk"]
    l2norm = r_k is not None
    key_chunk = pl.BlockSpec((None, CHUNK, None, kp), lambda i, c: (i // hv, c, key_head(i), 0))
    val_chunk = pl.BlockSpec((None, CHUNK, None, vp), lambda i, c: (i // hv, c, i % hv, 0))
    in_specs = [key_chunk, key_chunk, gate_chunk, gate_chunk] + ([gate_chunk] if l2norm else []) + [
        pl.BlockSpec((None, None, None, kp, vp), lambda i, c: (*head(i), c, 0, 0)), val_chunk]
    return pl.pallas_call(
        functools.partial(_output_kernel, scale=scale, l2norm=l2norm, prec=prec, state_dtype=state_dtype),
        grid=(b * hv, tp // CHUNK),
        in_specs=in_specs,
        out_specs=val_chunk,
        out_shape=jax.ShapeDtypeStruct((b, tp, hv, vp), out_dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_chunk_output",
    )(q, k, gam, gam_lo, *([r_k] if l2norm else []), h_states, v_new)


def chunk_fwd(q, k, v, gam, gam_lo, beta, s0, *, scale, l2norm, want_vnew, wu_dtype, state_dtype, prec, merge_prec,
              block_v, interpret, split_output=True, wy_warps=4, state_warps=4, state_stages=3, out_warps=4,
              wy_solver="substitution"):
    """Run the kernels on padded inputs.

    q, k [B, Tp, H, Kp]; v [B, Tp, HV, Vp] (Tp multiple of 64, Kp/Vp powers of two);
    gam, gam_lo, beta [B, HV, Tp] fp32 (gam + gam_lo = cumulative gate inside each chunk, as
    reference.compensated_cumsum returns it); s0 [B, HV, Kp, Vp] or None.
    Returns o [B, Tp, HV, Vp] (v.dtype), final state [B, HV, Kp, Vp] fp32, v_new [B, Tp, HV, Vp] fp32 or None.

    split_output=True: wy -> state pass (V_new and the state entering every chunk, two products per
    chunk on the sequential path) -> output kernel parallel over chunks. False: the state kernel also
    forms O inside its chunk loop (one kernel less, five products per sequential step).
    """
    b, tp, h, kp = q.shape
    hv, vp = v.shape[2], v.shape[3]
    w, u, r_k = wy_call(k, v, gam, gam_lo, beta, hv=hv, l2norm=l2norm, wu_dtype=wu_dtype, prec=prec, merge_prec=merge_prec,
                        interpret=interpret, num_warps=wy_warps, solver=wy_solver)
    has_s0 = s0 is not None
    if not split_output:
        bv = min(block_v, vp)
        sp = _specs(b, hv, hv // h, tp, kp, bv)
        in_specs = [sp["key_full"], sp["key_full"], sp["w_full"], sp["u_full"], sp["gate_full"], sp["gate_full"]] + (
            [sp["state"]] if has_s0 else [])
        out_specs = [sp["val_full"], sp["state"]] + ([sp["val_full"]] if want_vnew else [])
        out_shape = [jax.ShapeDtypeStruct((b, tp, hv, vp), v.dtype), jax.ShapeDtypeStruct((b, hv, kp, vp), F32)]
        if want_vnew:
            out_shape.append(jax.ShapeDtypeStruct((b, tp, hv, vp), F32))
        outs = pl.pallas_call(
            functools.partial(_state_kernel, n_chunks=tp // CHUNK, scale=scale, has_s0=has_s0, want_vnew=want_vnew,
                              l2norm=l2norm, prec=prec, state_dtype=state_dtype),
            grid=(b * hv, vp // bv), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
            compiler_params=plt.CompilerParams(num_warps=state_warps, num_stages=state_stages),
            interpret=interpret, name="gdn_chunk_state_fused",
        )(q, k, w, u, gam, gam_lo, *([s0] if has_s0 else []))
        return outs[0], outs[1], (outs[2] if want_vnew else None)

    # V_new is an output anyway when asked for (fp32); otherwise it only feeds the output kernel.
    h_states, v_new, final = state_pass_call(k, w, u, gam, gam_lo, r_k, s0, vnew_dtype=F32 if want_vnew else wu_dtype,
                                             state_dtype=state_dtype, prec=prec, block_v=block_v,
                                             interpret=interpret, num_warps=state_warps, num_stages=state_stages)
    o = output_call(q, k, gam, gam_lo, r_k, h_states, v_new, out_dtype=v.dtype, scale=scale, state_dtype=state_dtype,
                    prec=prec, interpret=interpret, num_warps=out_warps)
    return o, final, (v_new if want_vnew else None)
