"""Commit without snapshots: the state after the first `a` verified positions (Pallas, Triton backend).

    S_a = e^{gamma_a} S0 + sum_{j < a} e^{gamma_a - gamma_j} k_j u_j^T      (0-based j, a traced)

Grid (B*HV, V/BV); each program reads its [K, BV] block of S0, the T keys, gates and pseudo-values
of its head and writes the committed block: one read and one write of the state, a rank-T update
with weights that are zero past a (masking, so one compiled kernel serves every a).
The decay e^{gamma_a - gamma_j} = exp(sum_{j < i < a} g_i) is an exclusive suffix sum of the kept
gates, formed directly (not as a cumsum difference, which cancels under strong decay).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ._kernel_utils import F32, l2norm_rows, mm


def _commit_kernel(n_ref, s0_ref, k_ref, g_ref, u_ref, out_ref, *, n_heads, l2norm):
    n_acc = n_ref[pl.program_id(0) // n_heads]  # accepted positions of this batch row
    g = g_ref[...].astype(F32)  # [Tp] raw gates (zero padded)
    tp = g.shape[0]
    pos = lax.broadcasted_iota(jnp.int32, (tp,), 0)
    keep = pos < n_acc
    g_kept = jnp.where(keep, g, 0.0)
    row = lax.broadcasted_iota(jnp.int32, (tp, tp), 0)
    col = lax.broadcasted_iota(jnp.int32, (tp, tp), 1)
    after = jnp.sum(jnp.where(row > col, g_kept[:, None], 0.0), axis=0)  # [Tp] sum_{i > j} g_i
    weight = jnp.where(keep, jnp.exp(after), 0.0)  # [Tp]
    gamma_a = jnp.sum(g_kept)
    k = k_ref[...].astype(F32)  # [Tp, K]
    if l2norm:  # normalised in fp32 and kept there (as the verify kernels use it)
        k = l2norm_rows(k)
    kw = k * weight[:, None]  # [Tp, K]
    update = mm(kw, u_ref[...].astype(F32), lax.Precision.HIGHEST, trans_a=True)  # [K, BV]
    out_ref[...] = s0_ref[...].astype(F32) * jnp.exp(gamma_a) + update


def commit_fwd(s0, k, g, u, n_accepted, *, l2norm, block_v, interpret, num_warps=4, num_stages=1):
    """s0 [B, HV, Kp, Vp]; k [B, Tp, H, Kp]; g [B, HV, Tp] fp32; u [B, Tp, HV, Vp]; n_accepted [B] int32.

    Tp is a power of two >= 16 (zero padded past T). Returns the committed state [B, HV, Kp, Vp] fp32.
    """
    b, hv, kp, vp = s0.shape
    tp, h = k.shape[1], k.shape[2]
    group = hv // h
    bv = min(block_v, vp)
    return pl.pallas_call(
        functools.partial(_commit_kernel, n_heads=hv, l2norm=l2norm),
        grid=(b * hv, vp // bv),
        in_specs=[
            pl.BlockSpec((b,), lambda i, j: (0,)),
            pl.BlockSpec((None, None, kp, bv), lambda i, j: (i // hv, i % hv, 0, j)),
            pl.BlockSpec((None, tp, None, kp), lambda i, j: (i // hv, 0, (i % hv) // group, 0)),
            pl.BlockSpec((None, None, tp), lambda i, j: (i // hv, i % hv, 0)),
            pl.BlockSpec((None, tp, None, bv), lambda i, j: (i // hv, 0, i % hv, j)),
        ],
        out_specs=pl.BlockSpec((None, None, kp, bv), lambda i, j: (i // hv, i % hv, 0, j)),
        out_shape=jax.ShapeDtypeStruct((b, hv, kp, vp), F32),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gdn_commit",
    )(n_accepted, s0, k, g, u)
