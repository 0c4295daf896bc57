"""Shared model pieces: norms, RoPE variants, SwiGLU, linear layers, the attention core.

Weights keep the Hugging Face orientation ([out, in]) so checkpoints load without transposes.
Reductions (norms, softmax) run in float32; matmuls accumulate in float32.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import attention as attention_kernels

from ..sharding import split_groups


MATVEC_MODES = ("auto", "dot", "reduce")
# Float32 products of this many rows or fewer at precision "highest" run as TF32x3 on the GPU (see product_form);
# measured at 2-32 rows (docs/LOG.md, 2026-12-02), so the exact path's 17- and 33-row decode
# shapes (gamma 16, 32) are covered up to 32.
MAX_FEW_ROWS = 32


def matvec_mode() -> str:
    """How a single-row product (batch 1 decode) is computed; SPECDEC_MATVEC overrides.

    "dot": the matrix product (XLA picks a GEMM kernel, tiled for at least 8 rows);
    "reduce": broadcast-multiply and a float32 row reduction, which XLA emits as one
    bandwidth-bound reduction kernel reading the weight once; "auto": on GPU, reduce when the
    contraction length is not a multiple of 128 (where XLA's GEMM tiling measured 14-69% of the
    bandwidth roofline against 55-89% for the reduction), else dot (which measured faster for
    aligned lengths such as 17920); dot elsewhere (docs/LOG.md, 2026-12-01).
    "auto" also runs float32 products of 2..MAX_FEW_ROWS rows at precision "highest" as TF32x3 on
    the GPU (product_form); "dot" and "reduce" keep XLA's IEEE float32 GEMM there.
    """
    mode = os.environ.get("SPECDEC_MATVEC", "auto")
    if mode not in MATVEC_MODES:
        raise ValueError(f"SPECDEC_MATVEC must be one of {MATVEC_MODES}; got {mode!r}")
    return mode


def highest_matmul_precision() -> bool:
    """True under jax_default_matmul_precision "highest" / "float32" (float32 products asked for)."""
    precision = jax.config.jax_default_matmul_precision
    return precision is not None and str(precision).lower() in ("highest", "float32", "f32_f32_f32")


def product_form(rows: int, in_dim: int, dtype) -> str:
    """How `linear` multiplies `rows` rows of `dtype`: "reduce", "tf32x3" or "dot".

    tf32x3 (DotAlgorithmPreset.TF32_TF32_F32_X3: each float32 operand split into a TF32 head and tail,
    three tensor-core products, float32 accumulation): float32 at precision "highest", 2..MAX_FEW_ROWS rows,
    on the GPU under "auto". XLA's IEEE float32 GEMM there reads its weight at 1.5-2.2 TB/s against
    3.1-3.5 at one row, which made a 9-token verification 2.3x a 1-row AR step; TF32x3 reads it at
    2.0-2.8 TB/s, and its error against a float64 product was 2-5e-7 of the largest output, against
    8.8e-7-2.9e-6 for the IEEE GEMM at 8-32 rows (and 1.1-1.4e-7 at one row, where the GEMM stays):
    docs/exactness.md. Every decode forward of an exact
    generation runs at one row count, so AR and verification meet the same algorithm.
    """
    mode = matvec_mode()
    on_gpu = jax.default_backend() == "gpu"
    if rows == 1:
        if mode == "reduce" or (mode == "auto" and on_gpu and in_dim % 128 != 0):
            return "reduce"
        return "dot"
    if (mode == "auto" and on_gpu and rows <= MAX_FEW_ROWS and jnp.dtype(dtype) == jnp.float32
            and highest_matmul_precision()):
        return "tf32x3"
    return "dot"


def linear(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., in] @ w[out, in]^T -> [..., out] in out_dtype (default x.dtype), float32 accumulation."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    form = product_form(math.prod(x.shape[:-1]), x.shape[-1], x.dtype)
    if form == "reduce":
        y = jnp.sum(x.reshape(1, -1).astype(jnp.float32) * w.astype(jnp.float32), axis=-1)  # [out]
        return y.reshape(*x.shape[:-1], w.shape[0]).astype(out_dtype)
    precision = lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if form == "tf32x3" else None
    y = lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, zero_centered: bool = False) -> jax.Array:
    """RMSNorm in float32. zero_centered: x_hat * (1 + w) (Qwen3.5), else x_hat * w (Llama).

    Qwen3.5 multiplies in float32 then casts; Llama-style casts x_hat first, then multiplies
    by the weight: both orders are reproduced so bf16 results match their references.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if zero_centered:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gated RMSNorm of the GDN output: (w * rmsnorm(x)) * silu(gate), as transformers orders it."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    normed = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(dtype)
    h = weight.astype(dtype) * normed
    return (h.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(dtype)


def swiglu(x: jax.Array, gate_w: jax.Array, up_w: jax.Array, down_w: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x))."""
    return linear(jax.nn.silu(linear(x, gate_w)) * linear(x, up_w), down_w)


def swiglu_fused(x: jax.Array, gate_up_w: jax.Array, down_w: jax.Array, groups: int = 1) -> jax.Array:
    """SwiGLU with gate and up stacked as one [2F, D] weight (one GEMV at decode); groups > 1: the rows grouped
    per tensor-parallel device (each group its gate columns, then its up columns: sharding.py)."""
    return swiglu_from(linear(x, gate_up_w), down_w, groups)


def swiglu_from(h: jax.Array, down_w: jax.Array, groups: int = 1) -> jax.Array:
    """SwiGLU's second half: the gate|up pre-activations h [..., 2F] (grouped as `swiglu_fused`'s) -> down_w's output."""
    F = h.shape[-1] // (2 * groups)
    gate, up = split_groups(h, (F, F), groups)
    return linear(jax.nn.silu(gate) * up, down_w)


# ---------------------------------------------------------------------------------------- RoPE

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: 1, except YaRN's attention temperature (HF's attention_scaling)."""
    if rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
    return _yarn_mscale(factor)


def _yarn_inv_freq(inv: np.ndarray, rotary_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """YaRN (arXiv 2309.00071): frequencies whose wavelength fits the original context many times
    (more than beta_fast rotations) stay, those with fewer than beta_slow rotations are interpolated
    by `factor`, with a linear ramp between the two correction dimensions."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in old_len
        return rotary_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (frequency / factor)
    return (inv / factor * (1 - keep) + inv * keep).astype(np.float32)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """Inverse frequencies [rotary_dim // 2] (float32); `scaling` (HF rope_parameters / rope_scaling):
    default, linear (positions / factor), llama3 or yarn frequency scaling."""
    inv = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim))
    inv = inv.astype(np.float32)
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope type {kind!r} is not supported; supported: {ROPE_TYPES}")
    if kind == "linear":
        return (inv / float(scaling["factor"])).astype(np.float32)
    if kind == "yarn":
        return _yarn_inv_freq(inv, rotary_dim, theta, scaling)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_angles(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, rotary_dim // 2] float32 for integer positions [B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF Llama/Qwen) on the first 2*len(cos) dims of x [B, T, N, hd]; rest passes."""
    rot = 2 * cos.shape[-1]
    dtype = x.dtype
    # HF casts cos/sin to the activation dtype before rotating; do the same for bf16 parity.
    cos = jnp.concatenate([cos, cos], axis=-1)[:, :, None, :].astype(dtype)
    sin = jnp.concatenate([sin, sin], axis=-1)[:, :, None, :].astype(dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos + rotated * sin
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on interleaved pairs (x[2i], x[2i+1]) as complex numbers (GPT-J / Huginn), in float32."""
    dtype = x.dtype
    xf = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    re = xf[..., 0] * c - xf[..., 1] * s
    im = xf[..., 0] * s + xf[..., 1] * c
    return jnp.stack([re, im], axis=-1).reshape(x.shape).astype(dtype)


# ------------------------------------------------------------------------------------ attention

def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Grouped-query attention without repeating K/V in memory (XLA's path: the score matrix in float32).

    q [B, T, NH, hd]; k, v [B, S, NKV, hd]; mask [B, T, S] bool (True = may attend).
    Returns [B, T, NH, hd] in q.dtype. Scores and softmax in float32.
    """
    return attention_kernels.masked_attention(q, k, v, mask, scale)


def write_cache(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [B, T, ...] into cache [B, S, ...] at per-sequence offsets start [B]."""
    def one(c, n, s):
        return lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), s, axis=0)
    return jax.vmap(one)(cache, new, start)


def scatter_cache(cache: jax.Array, new: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
    """Write the rows of new [B, T, ...] where valid [B, T] into cache [B, S, ...] at positions [B, T]; the other
    rows write nothing (sent past the cache and dropped), so a padded prefill leaves the cache as an unpadded one."""
    slots = jnp.where(valid, positions, cache.shape[1])
    rows = jnp.broadcast_to(jnp.arange(cache.shape[0])[:, None], slots.shape)
    return cache.at[rows, slots].set(new.astype(cache.dtype), mode="drop")


def causal_cache_mask(query_positions: jax.Array, cache_len: int) -> jax.Array:
    """[B, T, S] mask: key slot s is visible to a query at position p iff s <= p."""
    slots = jnp.arange(cache_len, dtype=jnp.int32)
    return slots[None, None, :] <= query_positions[:, :, None]
