"""The product the kernel computes, in plain JAX: fp32 operands, fp32 products and sums (precision HIGHEST)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [N, K]^T -> [M, N] float32."""
    return lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), (((1,), (1,)), ((), ())),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
