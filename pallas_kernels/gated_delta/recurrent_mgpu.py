"""Fused step recurrence for small T on the Mosaic GPU backend (decode / chain verification).

Same math and grid as recurrent_kernel.py (Triton backend): program (head, value block) keeps a
[K, BV] fp32 state block in registers (WGMMA fragment layout, one warpgroup) and walks the T
positions, unrolled. Inputs arrive in shared memory by TMA in their native layouts (strided boxes
of [B, T, H, K] etc.; the gates as a whole [T, HV] row block), outputs leave by TMA.

    S <- e^{g_t} S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T (scale q_t)

Requirements (checked by `supported`): K % 64 == 0, V % block_v == 0, HV % 4 == 0 (16-byte TMA rows
for the gate block). Runs on CPU with `interpret=plgpu.InterpretGPUParams()` (jax >= 0.12).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ._kernel_utils import F32, L2_EPS


def supported(k_dim: int, v_dim: int, n_heads_v: int, block_v: int) -> bool:
    return k_dim % 64 == 0 and v_dim % block_v == 0 and block_v % 8 == 0 and n_heads_v % 4 == 0


def recurrent_fwd_mgpu(q, k, v, g, beta, s0, *, scale, l2norm, want_vnew, block_v, interpret=False):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] fp32; s0 [B, HV, K, V] fp32.

    Returns o [B, T, HV, V] (v.dtype), final state [B, HV, K, V] fp32, u [B, T, HV, V] fp32 or None.
    """
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    group = hv // h
    bv = block_v
    wgmma = plgpu.Layout.WGMMA
    rows, cols_v = wgmma.reduce(1), wgmma.reduce(0)  # vectors over K (state rows) / over BV

    def kernel(q_g, k_g, v_g, g_g, b_g, s0_g, *refs):
        if want_vnew:
            o_g, st_g, u_g, q_s, k_s, v_s, g_s, b_s, s_s, o_s, u_s, bars = refs
        else:
            o_g, st_g, q_s, k_s, v_s, g_s, b_s, s_s, o_s, bars = refs
        i = lax.axis_index("bh")
        bi, hi = i // hv, i % hv
        cols = pl.ds(lax.axis_index("vb") * bv, bv)
        plgpu.copy_gmem_to_smem(q_g.at[bi, :, hi // group, :], q_s, bars.at[0])  # key head: hi // group
        plgpu.copy_gmem_to_smem(k_g.at[bi, :, hi // group, :], k_s, bars.at[1])
        plgpu.copy_gmem_to_smem(v_g.at[bi, :, hi, cols], v_s, bars.at[2])
        plgpu.copy_gmem_to_smem(g_g.at[bi], g_s, bars.at[3])  # [T, HV]
        plgpu.copy_gmem_to_smem(b_g.at[bi], b_s, bars.at[4])
        plgpu.copy_gmem_to_smem(s0_g.at[bi, hi, :, cols], s_s, bars.at[5])
        for n in range(6):
            plgpu.barrier_wait(bars.at[n])
        state = plgpu.load(s_s, layout=wgmma)  # [K, BV] fp32
        for tt in range(t):
            kv = plgpu.load(k_s.at[tt], layout=rows).astype(F32)  # [K]
            qv = plgpu.load(q_s.at[tt], layout=rows).astype(F32)  # [K]
            vv = plgpu.load(v_s.at[tt], layout=cols_v).astype(F32)  # [BV]
            if l2norm:
                kv = kv * lax.rsqrt(jnp.sum(kv * kv) + L2_EPS)
                qv = qv * lax.rsqrt(jnp.sum(qv * qv) + L2_EPS)
            qv = qv * scale
            state = state * jnp.exp(g_s[tt, hi])
            u = b_s[tt, hi] * (vv - jnp.sum(state * kv[:, None], axis=0))  # [BV]
            state = state + kv[:, None] * u[None, :]
            o_s[tt] = jnp.sum(state * qv[:, None], axis=0).astype(o_s.dtype)
            if want_vnew:
                u_s[tt] = u
        s_s[...] = state
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g.at[bi, :, hi, cols])
        plgpu.copy_smem_to_gmem(s_s, st_g.at[bi, hi, :, cols])
        if want_vnew:
            plgpu.copy_smem_to_gmem(u_s, u_g.at[bi, :, hi, cols])
        plgpu.wait_smem_to_gmem(0)

    out_type = [jax.ShapeDtypeStruct((b, t, hv, vd), v.dtype), jax.ShapeDtypeStruct((b, hv, kd, vd), F32)]
    scratch = [plgpu.SMEM((t, kd), q.dtype), plgpu.SMEM((t, kd), k.dtype), plgpu.SMEM((t, bv), v.dtype),
               plgpu.SMEM((t, hv), F32), plgpu.SMEM((t, hv), F32), plgpu.SMEM((kd, bv), F32),
               plgpu.SMEM((t, bv), v.dtype)]
    if want_vnew:
        out_type.append(jax.ShapeDtypeStruct((b, t, hv, vd), F32))
        scratch.append(plgpu.SMEM((t, bv), F32))
    scratch.append(plgpu.Barrier(num_barriers=6))
    extra = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    outs = plgpu.kernel(kernel, out_type=tuple(out_type), grid=(b * hv, vd // bv), grid_names=("bh", "vb"),
                        scratch_types=scratch, **extra)(q, k, v, g.astype(F32), beta.astype(F32), s0)
    return outs[0], outs[1], (outs[2] if want_vnew else None)
