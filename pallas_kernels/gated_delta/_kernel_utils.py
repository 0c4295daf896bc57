"""Helpers shared by the gated-delta Pallas kernels (padding, precisions, in-kernel math).

The kernels use the Pallas Triton backend (README.md, "Backend choice"): every value inside a kernel
must have power-of-two dimensions, so K and V are zero-padded to a power of two >= 16 outside the
kernel. Zero padding is exact: padded key coordinates add nothing to k.k or q.k, padded state rows
and value columns start at zero and stay zero (their pseudo-values are beta * (0 - 0)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
L2_EPS = 1e-6  # same eps as reference.l2_normalize


def next_pow2(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad `x` along `axis` up to `size` (no-op when already that size)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def is_low_precision(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def dot_precisions(low_precision: bool, interpret: bool):
    """(precision of fp32-operand products, precision of the triangular-inverse merge).

    fp32 inputs ask for IEEE fp32 everywhere (the kernels then match the reference to ~1e-6).
    16-bit inputs: fp32-operand products run as TF32 on the tensor cores (error ~5e-4, below the
    bf16 input rounding), the inverse merge included (3xTF32 there needs ~80 more registers per
    thread and spills; fla also merges in TF32). On CPU (interpret) every product is fp32: HIGHEST.
    """
    if interpret or not low_precision:
        return lax.Precision.HIGHEST, lax.Precision.HIGHEST
    return lax.Precision.DEFAULT, lax.Precision.DEFAULT


def mm(a: jax.Array, b: jax.Array, precision, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """a @ b (optionally a^T or b^T) with fp32 accumulation; operands must share a dtype."""
    contract_a = 0 if trans_a else 1
    contract_b = 1 if trans_b else 0
    # Precision presets only make sense for fp32 operands; 16-bit operands use the default MMA.
    prec = precision if a.dtype == F32 else None
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), precision=prec,
                           preferred_element_type=F32)


def l2norm_rows(x: jax.Array) -> jax.Array:
    """Row-wise x / sqrt(sum(x^2) + eps) in fp32, returned in x's dtype (x is [N, K])."""
    xf = x.astype(F32)
    xf = xf * lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + L2_EPS)
    return xf.astype(x.dtype)


def l2norm_vec(x: jax.Array) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) for one fp32 vector [K]."""
    return x * lax.rsqrt(jnp.sum(x * x) + L2_EPS)


def check_block_v(block_v) -> int:
    """Value columns per program: a power of two, so it divides the padded V (also a power of two)
    or covers it; any other width would leave columns of the outputs unwritten."""
    if isinstance(block_v, bool) or not isinstance(block_v, int) or block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"gated_delta: block_v must be a power of two >= 1; got {block_v!r}")
    return block_v


def iota2(n: int):
    """Row and column indices of an [n, n] block (int32)."""
    return lax.broadcasted_iota(jnp.int32, (n, n), 0), lax.broadcasted_iota(jnp.int32, (n, n), 1)


def inv_norms(x: jax.Array) -> jax.Array:
    """1 / sqrt(sum(x^2) + eps) per row of x [C, K], fp32 [C]."""
    xf = x.astype(F32)
    return lax.rsqrt(jnp.sum(xf * xf, axis=1) + L2_EPS)
