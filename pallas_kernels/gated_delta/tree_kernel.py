"""Tree-WY verification of the gated delta rule as one Pallas kernel (Triton backend), N <= 64 nodes.

Math and derivation: tree_wy.py and README.md ("Tree-WY"). Grid (B*HV, V/BV); each program owns one
value head (key head j // (HV/H) through the index map) and a [K, BV] block of S0. N is padded to
Np in {16, 32, 64} (padded nodes: parent -1, g = beta = 0, zero q/k/v: isolated roots that no real
node reaches). In registers, per program:

    R = I + P (P_ij = [parents_i == j]);  R <- min(R R, 1), log2(Np) times   -> ancestor matrix M
    gamma = M g                          (path gammas, row sums)
    E = (M diag(g)) (1 - M)^T            (E_ij = gates on i's path strictly after j: no cancellation)
    Gamma = M ? exp(E) : 0
    A = strict(beta_i (k_i . k_j) Gamma_ij);  Tinv = (I + A)^{-1}   (16x16 substitution + merges)
    V_new = Tinv [diag(beta) (V - diag(e^gamma) K S0)]   (= U - W S0 with U = Tinv diag(beta) V,
                                                           W = Tinv diag(beta e^gamma) K)
    O = scale [(Q S0) e^gamma + ((Q K^T) * Gamma) V_new]

S0 is the same for every node, so V_new is formed by associativity without the [Np, K] factor W.
The [Np, Np] part is recomputed by each V-block program (Np^2 K work, small next to a launch).
Every op is one the chunk kernels already use (masked iota compares, row reductions,
`lax.dot_general` with fp32 accumulation, fori_loop substitution). Registers (lowered Triton IR
compiled locally for sm_90a with Triton 3.8 + ptxas, README.md): no spills for 16-bit inputs at
Np = 64, K = V = 128, BV = 32, 4 warps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ._kernel_utils import F32, L2_EPS, check_block_v, dot_precisions, is_low_precision, mm, next_pow2, pad_axis
from ._kernel_utils import inv_norms, iota2
from .chunk_kernel import SUB
from .reference import GatedDeltaOutput, check_gated_delta_inputs
from .tree_common import MAX_PALLAS_NODES as MAX_NODES
from .tree_common import ancestor_matrix, check_parents, n_squarings, path_gammas

def unit_lower_inverse(a: jax.Array, merge_precision) -> jax.Array:
    """(I + a)^{-1} for a strictly lower-triangular a [C, C] fp32, C in {16, 32, 64}, in registers.

    chunk_kernel.unit_lower_inverse generalised to C < 64: forward substitution solves every
    diagonal 16x16 block at once, then one merge X <- X - X N X per doubling of the block size
    (N = the coupling blocks of that level), 16 -> 32 -> ... -> C.
    """
    c = a.shape[0]
    row, col = iota2(c)
    rb, cb = lax.div(row, SUB), lax.div(col, SUB)
    r_in = lax.rem(row, SUB)
    same_block = rb == cb
    d = jnp.where(same_block, a, 0.0)
    eye = jnp.where(row == col, 1.0, 0.0).astype(F32)

    def substitute(r, x):  # rows < r of every block are final, the rest still identity
        sel = r_in == r
        a_rows = jnp.sum(jnp.where(sel, d, 0.0), axis=0)  # [C] row r of each block, own columns
        contrib = jnp.sum(a_rows[:, None] * x, axis=0)  # [C]
        return jnp.where(sel & same_block, x - contrib[None, :], x)

    x = lax.fori_loop(1, SUB, substitute, eye)
    level = 2 * SUB
    while level <= c:
        half = level // 2
        couple = ((lax.div(row, level) == lax.div(col, level))
                  & (lax.rem(row, level) >= half) & (lax.rem(col, level) < half))
        n_blk = jnp.where(couple, a, 0.0)
        x = x - mm(mm(x, n_blk, merge_precision), x, merge_precision)
        level *= 2
    return x


def _path_exponents(on_path: jax.Array, reach: jax.Array) -> jax.Array:
    """E = (M diag(g)) (1 - M)^T: E_ij = the gates on i's path strictly after j, to fp32 accuracy.

    The right operand is 0/1, so every product is exact; the left one is split into three bf16
    pieces (8 + 8 + 8 significant bits: the whole fp32 significand), giving three bf16 MMAs with
    fp32 accumulation instead of one IEEE fp32 FMA dot (which needs many more registers). TF32 alone
    would round the gates to 1e-3 and exp(E) would inherit it.
    """
    bf16 = jnp.bfloat16
    hi = on_path.astype(bf16)
    rest = on_path - hi.astype(F32)
    mid = rest.astype(bf16)
    lo = (rest - mid.astype(F32)).astype(bf16)
    off_path = (1.0 - reach).astype(bf16)
    expo = mm(lo, off_path, None, trans_b=True) + mm(mid, off_path, None, trans_b=True)
    return expo + mm(hi, off_path, None, trans_b=True)


def _tree_kernel(par_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, vnew_ref, *, scale, l2norm,
                 prec, merge_prec, state_dtype):
    n = g_ref.shape[0]
    row, col = iota2(n)
    diag = row == col
    par = par_ref[...]  # [Np] int32, -1 for roots and padding
    # Ancestor matrix by repeated squaring of I + P. 0/1 operands and counts <= Np are exact in a
    # bf16 MMA with fp32 accumulation (no IEEE fp32 FMA dot: fewer registers).
    reach = jnp.where((par[:, None] == col) | diag, 1.0, 0.0).astype(F32)
    for _ in range(n_squarings(n)):
        r16 = reach.astype(jnp.bfloat16)
        reach = jnp.minimum(mm(r16, r16, None), 1.0)
    g = g_ref[...]  # [Np] raw gates
    beta = beta_ref[...]  # [Np]
    on_path = reach * g[None, :]  # [Np, Np] M diag(g)
    gam = jnp.sum(on_path, axis=1)  # [Np] path gammas
    expo = _path_exponents(on_path, reach)  # [Np, Np]
    anc = reach > 0.5
    decay = jnp.where(anc, jnp.exp(jnp.where(anc, expo, 0.0)), 0.0)  # Gamma, ancestors incl. self

    k = k_ref[...]  # [Np, Kp] input dtype
    sdt = state_dtype  # operand dtype of the products with the state
    kk = mm(k, k, prec, trans_b=True)  # [Np, Np]
    if l2norm:  # normalised keys: diag(r) K K^T diag(r), r_i = 1 / |k_i| off the diagonal of K K^T
        r_k = lax.rsqrt(jnp.sum(jnp.where(diag, kk, 0.0), axis=1) + L2_EPS)
        kk = kk * r_k[:, None] * r_k[None, :]
    else:
        r_k = jnp.ones((n,), F32)
    a = jnp.where(diag, 0.0, kk * decay * beta[:, None])  # strictly lower: ancestors precede
    tinv = unit_lower_inverse(a, merge_prec)  # [Np, Np]
    # V_new = U - W S0 = Tinv [diag(beta) (V - diag(e^gamma / |k|) K S0)]: with S0 fixed for the whole
    # tree the [Np, K] factor W is never formed (it cost a [64, K] fp32 tile of registers).
    s_op = s0_ref[...].astype(sdt)  # [Kp, BV]
    ks = mm(k.astype(sdt), s_op, prec)  # [Np, BV]
    rhs = beta[:, None] * (v_ref[...].astype(F32) - ks * (jnp.exp(gam) * r_k)[:, None])  # [Np, BV]
    v_new = mm(tinv, rhs, merge_prec)  # [Np, BV] pseudo-values (fp32 operands)
    vnew_ref[...] = v_new.astype(vnew_ref.dtype)
    q = q_ref[...].astype(sdt)  # [Np, Kp]
    qk = mm(q, k.astype(sdt), prec, trans_b=True) * decay * r_k[None, :]  # [Np, Np]
    o = mm(q, s_op, prec) * jnp.exp(gam)[:, None] + mm(qk, v_new, merge_prec)
    row_scale = scale * inv_norms(q) if l2norm else jnp.full((n,), scale, F32)
    o_ref[...] = (o * row_scale[:, None]).astype(o_ref.dtype)


def tree_fwd(q, k, v, g, beta, parents, s0, *, scale, l2norm, state_dtype, prec, merge_prec, block_v, interpret,
             num_warps=4, num_stages=1):
    """Run the kernel on padded inputs.

    q, k [B, Np, H, Kp]; v [B, Np, HV, Vp]; g, beta [B, HV, Np] fp32; parents [B, Np] int32 (-1 padded);
    s0 [B, HV, Kp, Vp] fp32. Np in {16, 32, 64}; Kp, Vp powers of two >= 16.
    Returns o [B, Np, HV, Vp] (v.dtype) and v_new [B, Np, HV, Vp] fp32.
    """
    b, np_, h, kp = q.shape
    hv, vp = v.shape[2], v.shape[3]
    group = hv // h
    bv = min(block_v, vp)
    key_spec = pl.BlockSpec((None, np_, None, kp), lambda i, j: (i // hv, 0, (i % hv) // group, 0))
    val_spec = pl.BlockSpec((None, np_, None, bv), lambda i, j: (i // hv, 0, i % hv, j))
    gate_spec = pl.BlockSpec((None, None, np_), lambda i, j: (i // hv, i % hv, 0))
    return pl.pallas_call(
        functools.partial(_tree_kernel, scale=scale, l2norm=l2norm, prec=prec, merge_prec=merge_prec,
                          state_dtype=state_dtype),
        grid=(b * hv, vp // bv),
        in_specs=[
            pl.BlockSpec((None, np_), lambda i, j: (i // hv, 0)),
            key_spec, key_spec, val_spec, gate_spec, gate_spec,
            pl.BlockSpec((None, None, kp, bv), lambda i, j: (i // hv, i % hv, 0, j)),
        ],
        out_specs=[val_spec, val_spec],
        out_shape=[jax.ShapeDtypeStruct((b, np_, hv, vp), v.dtype), jax.ShapeDtypeStruct((b, np_, hv, vp), F32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gdn_tree_wy",
    )(parents, q, k, v, g, beta, s0)


def padded_nodes(n: int) -> int:
    """16, 32 or 64: the node count the kernel runs at."""
    if not 1 <= n <= MAX_NODES:
        raise ValueError(f"tree_wy (pallas): the kernel handles 1 <= N <= {MAX_NODES} nodes; got N={n} "
                         "(use implementation='reference' for larger trees)")
    return next_pow2(n)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "interpret", "block_v", "num_warps"))
def _tree(q, k, v, g, beta, parents, initial_state, *, scale, use_qk_l2norm, interpret, block_v, num_warps):
    b, n, _, hv, k_dim, v_dim = check_gated_delta_inputs(q, k, v, g, beta, initial_state)
    npad, kp, vp = padded_nodes(n), next_pow2(k_dim), next_pow2(v_dim)
    low = is_low_precision(k.dtype)
    prec, merge_prec = dot_precisions(low, interpret)
    q, k = (pad_axis(pad_axis(x, 3, kp), 1, npad) for x in (q, k))
    v = pad_axis(pad_axis(v, 3, vp), 1, npad)
    gates = lambda x: jnp.moveaxis(pad_axis(x.astype(F32), 1, npad), 1, 2)  # [B, HV, Np]
    par = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, n))
    par = jnp.pad(par, ((0, 0), (0, npad - n)), constant_values=-1)  # padded nodes are isolated roots
    s0 = (jnp.zeros((b, hv, kp, vp), F32) if initial_state is None
          else pad_axis(pad_axis(initial_state.astype(F32), 2, kp), 3, vp))
    o, v_new = tree_fwd(q, k, v, gates(g), gates(beta), par, s0, scale=scale, l2norm=use_qk_l2norm,
                        state_dtype=k.dtype if low else F32, prec=prec, merge_prec=merge_prec,
                        block_v=block_v, interpret=interpret, num_warps=num_warps)
    # The returned path gammas: cheap jnp beside the kernel (the kernel forms its own in registers).
    return GatedDeltaOutput(o=o[:, :n, :, :v_dim], final_state=None, v_new=v_new[:, :n, :, :v_dim],
                            g_cumsum=path_gammas(ancestor_matrix(par[:, :n]), g))


def tree_gated_delta_rule_pallas(q, k, v, g, beta, parents, *, initial_state, scale=None, use_qk_l2norm=False,
                                 interpret=False, block_v=32, num_warps=None) -> GatedDeltaOutput:
    """Tree-WY verification, Pallas kernel; signature and outputs as tree_wy.tree_gated_delta_rule_reference.

    N <= 64 (padded to 16/32/64 inside). `block_v`: value columns per program; `num_warps`: Triton
    warps (None: 4 for 16-bit inputs, 8 for fp32, whose IEEE FMA products need more registers).
    """
    b, n = q.shape[:2]
    check_parents(parents, b, n)
    padded_nodes(n)  # raises for N > 64 before anything is traced
    k_dim = q.shape[-1]
    if num_warps is None:
        num_warps = 4 if is_low_precision(k.dtype) else 8
    return _tree(q, k, v, g, beta, parents, initial_state, scale=float(k_dim ** -0.5 if scale is None else scale),
                 use_qk_l2norm=bool(use_qk_l2norm), interpret=bool(interpret), block_v=check_block_v(block_v),
                 num_warps=num_warps)
