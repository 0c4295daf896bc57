"""Causal attention of a block of new queries over a KV cache, in plain jnp (the CPU path and the kernels' reference).

Query row t of batch row b sits at position start[b] + t; cache slot s is visible to it iff s <= start[b] + t.
Grouped-query attention: query head h reads key/value head h // (NH // NKV). Scores and softmax in float32, the
probabilities cast to the values' dtype before the value product (as the models' XLA path does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_mask(start: jax.Array, rows: int, cache_len: int) -> jax.Array:
    """[B, rows, cache_len] bool: slot s visible to query row t of batch row b iff s <= start[b] + t."""
    positions = start[:, None] + jnp.arange(rows, dtype=jnp.int32)[None, :]
    return jnp.arange(cache_len, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """q [B, T, NH, hd]; k, v [B, S, NKV, hd]; mask [B, T, S] bool (True: may attend). [B, T, NH, hd] in q.dtype.
    K/V heads are not repeated in memory: the query heads are grouped by the head they read."""
    B, T, NH, hd = q.shape
    NKV = k.shape[2]
    qg = q.reshape(B, T, NKV, NH // NKV, hd)
    scores = jnp.einsum("btngd,bsnd->bngts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # Rows with nothing to attend to (never produced by the models) would be NaN; keep them 0.
    probs = jnp.where(mask[:, None, None, :, :], probs, 0.0).astype(v.dtype)
    out = jnp.einsum("bngts,bsnd->btngd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, NH, hd).astype(q.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, scale: float) -> jax.Array:
    """q [B, T, NH, hd] at positions start [B] + t over the cache k, v [B, S, NKV, hd]: [B, T, NH, hd]."""
    return masked_attention(q, k, v, causal_mask(start, q.shape[1], k.shape[1]), scale)
