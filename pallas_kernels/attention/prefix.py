"""A prefill chunk's causal attention as two fused attentions: its prefix and its own causal square.

cuDNN's causal mask is aligned to the first key (query row t sees keys 0..t), while a chunk's rows sit at positions
start + t of the cache. So the chunk runs as
  - the prefix: every row against the cache's slots 0 .. start - 1 (all visible; a padding mask by length), and
  - the square: the rows against their own keys, causal (both start at position start, so the masks align),
and the two softmaxes are merged by their log-sum-exps r1, r2 (README.md):
    o = (exp(r1 - m) o1 + exp(r2 - m) o2) / (exp(r1 - m) + exp(r2 - m)),   m = max(r1, r2).
A row with an empty prefix (start 0) takes the square alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 256


def cudnn_takes(q: jax.Array) -> bool:
    """Whether cuDNN's fused attention takes queries like q [B, T, NH, hd] (16-bit, hd a multiple of 8 up to 256)."""
    hd = q.shape[-1]
    return q.dtype in CUDNN_DTYPES and hd % 8 == 0 and hd <= CUDNN_MAX_HEAD_DIM


def _own_rows(x: jax.Array, start: jax.Array, rows: int) -> jax.Array:
    """x [B, S, ...] -> [B, rows, ...]: each batch row's slots start[b] .. start[b] + rows - 1."""
    return jax.vmap(lambda xb, sb: jax.lax.dynamic_slice_in_dim(xb, sb, rows, axis=0))(x, start)


def _as_rows(residual: jax.Array, B: int, T: int, NH: int) -> jax.Array:
    """The log-sum-exp as [B, T, NH] (jax versions differ in whether cuDNN's comes as [B, NH, T])."""
    return residual if residual.shape == (B, T, NH) else jnp.swapaxes(residual, 1, 2)


def prefix_square_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, scale: float,
                            new_kv: tuple | None = None, *, implementation: str = "cudnn") -> jax.Array:
    """q [B, T, NH, hd] at positions start [B] + t over the cache k, v [B, S, NKV, hd] -> [B, T, NH, hd] in q.dtype.
    new_kv: the rows' own (k, v) [B, T, NKV, hd], or None to read them from the cache (then start + T <= S).
    implementation: jax.nn.dot_product_attention's ("cudnn" on the GPU; "xla" anywhere)."""
    B, T, NH, _ = q.shape
    own_k, own_v = new_kv if new_kv is not None else (_own_rows(k, start, T), _own_rows(v, start, T))
    dtype = q.dtype
    o1, r1 = jax.nn.dot_product_attention(q, k.astype(dtype), v.astype(dtype), scale=scale,
                                          key_value_seq_lengths=start.astype(jnp.int32),
                                          implementation=implementation, return_residual=True)
    o2, r2 = jax.nn.dot_product_attention(q, own_k.astype(dtype), own_v.astype(dtype), scale=scale, is_causal=True,
                                          implementation=implementation, return_residual=True)
    has_prefix = (start > 0)[:, None, None]  # [B, 1, 1]: an empty prefix's output and log-sum-exp are undefined
    r1 = jnp.where(has_prefix, _as_rows(r1, B, T, NH).astype(jnp.float32), -jnp.inf)
    r2 = _as_rows(r2, B, T, NH).astype(jnp.float32)
    m = jnp.maximum(r1, r2)  # finite: every row sees its own key
    w1, w2 = jnp.exp(r1 - m)[..., None], jnp.exp(r2 - m)[..., None]  # [B, T, NH, 1]
    o1 = jnp.where(has_prefix[..., None], o1.astype(jnp.float32), 0.0)
    return ((o1 * w1 + o2.astype(jnp.float32) * w2) / (w1 + w2)).astype(dtype)
