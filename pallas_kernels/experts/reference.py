"""A token copy's SwiGLU expert in plain jnp: the experts' weights gathered per copy (few copies) or the copies sorted
by expert and run through XLA's grouped product (`lax.ragged_dot`, many copies). The CPU paths and the kernel's
reference.

Copy (n, s) of token n runs expert e = expert_ids[n, s]:  (g ; u) = gate_up[e] @ x[n],  y = down[e] @ (silu(g) * u).
Products accumulate in float32; silu(g) * u is cast to x's dtype before the down product (transformers' numerics).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def _swiglu(h: jax.Array, inter: int, dtype) -> jax.Array:
    """h [..., 2I] fp32 (gate ; up) -> silu(gate) * up [..., I] in dtype."""
    return (jax.nn.silu(h[..., :inter]) * h[..., inter:]).astype(dtype)


def gathered(x, expert_ids, gate_up, down, selected):
    """x [N, D], expert_ids [N, k] (clamped into range), selected [N, k] bool -> [N, k, D]: each copy's weights
    gathered ([N, k, 2I, D] in memory: few copies only)."""
    inter = down.shape[2]
    h = jnp.einsum("nd,nkfd->nkf", x, gate_up[expert_ids].astype(x.dtype), preferred_element_type=F32)
    y = jnp.einsum("nki,nkdi->nkd", _swiglu(h, inter, x.dtype), down[expert_ids].astype(x.dtype),
                   preferred_element_type=F32).astype(x.dtype)
    return jnp.where(selected[..., None], y, jnp.zeros((), x.dtype))


def sorted_ragged(x, expert_ids, gate_up, down, selected):
    """As `gathered`, the copies sorted by expert and run as grouped products (XLA's ragged_dot over the transposed
    weights); copies that select no expert sort last, past every group, and come out zero."""
    N, k = expert_ids.shape
    E, inter = gate_up.shape[0], down.shape[2]
    flat = jnp.where(selected, expert_ids, E).reshape(-1)  # [N k], E: no expert
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E + 1)[:E].astype(jnp.int32)
    rows = x[order // k]  # [N k, D]
    h = lax.ragged_dot(rows, jnp.swapaxes(gate_up, 1, 2).astype(x.dtype), sizes, preferred_element_type=F32)
    y_sorted = lax.ragged_dot(_swiglu(h, inter, x.dtype), jnp.swapaxes(down, 1, 2).astype(x.dtype), sizes,
                              preferred_element_type=F32).astype(x.dtype)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(N, k, -1)
    return jnp.where(selected[..., None], y, jnp.zeros((), x.dtype))


def dense(x, gate_up, down, selected):
    """One expert for every token: x [N, D], gate_up [2I, D], down [D, I], selected [N] bool -> [N, D], zero where
    not selected (a model's shared expert on XLA's paths)."""
    inter = down.shape[1]
    h = jnp.einsum("nd,fd->nf", x, gate_up.astype(x.dtype), preferred_element_type=F32)
    y = jnp.einsum("ni,di->nd", _swiglu(h, inter, x.dtype), down.astype(x.dtype),
                   preferred_element_type=F32).astype(x.dtype)
    return jnp.where(selected[:, None], y, jnp.zeros((), x.dtype))
