"""The depth-indexed KV cache of looped models (`LoopedCache`) and its in-place token writes.

One slot per prelude layer, per (recurrence step, core layer) and per coda layer ("full"), or one
slot per core layer ("compressed": latest recurrence wins). Built by `init_cache`, sized by
`cache_bytes`; `write_tokens` / `write_layer` write new tokens' K/V at per-sequence offsets (`scatter_tokens`: a
padded prefill chunk's valid rows only); `grown_cache` gives a finished generation's cache the slots the next needs
(continuation).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from ...errors import InputError
from .config import LoopedConfig

CACHE_MODES = ("full", "compressed")


@struct.dataclass
class LoopedCache:
    """Depth-indexed KV cache (immutable; slots at positions >= length are stale and masked).

    prelude_k/v: [P, B, S, NKV, hd]; core_k/v: [R, L, B, S, NKV, hd] ("full": one slot per
    recurrence step and core layer) or [1, L, B, S, NKV, hd] ("compressed"); coda_k/v:
    [C, B, S, NKV, hd]; length: [B] int32 committed tokens per sequence.
    """

    prelude_k: jax.Array
    prelude_v: jax.Array
    core_k: jax.Array
    core_v: jax.Array
    coda_k: jax.Array
    coda_v: jax.Array
    length: jax.Array
    mode: str = struct.field(pytree_node=False, default="full")

    @property
    def max_len(self) -> int:
        return self.core_k.shape[3]

    @property
    def step_slots(self) -> int:
        return self.core_k.shape[0]


def check_cache_mode(mode) -> str:
    """`mode` if it is one of CACHE_MODES, else one InputError naming them."""
    if mode not in CACHE_MODES:
        raise InputError(f"cache_mode {mode!r} is not supported; use one of {', '.join(CACHE_MODES)}")
    return mode


def _cache_shapes(cfg: LoopedConfig, batch: int, max_len: int, num_steps: int, mode: str) -> dict:
    if mode not in CACHE_MODES:
        raise InputError(f"cache mode {mode!r} is not supported; use one of {', '.join(CACHE_MODES)}")
    if num_steps < 1:
        raise InputError(f"num_steps must be >= 1; got {num_steps}")
    tail = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    slots = num_steps if mode == "full" else 1
    return {"prelude": (cfg.n_layers_in_prelude,) + tail,
            "core": (slots, cfg.n_layers_in_recurrent_block) + tail,
            "coda": (cfg.n_layers_in_coda,) + tail}


def init_cache(cfg: LoopedConfig, batch: int, max_len: int, num_steps: int, mode: str = "full",
               dtype=jnp.bfloat16) -> LoopedCache:
    """Empty cache for `batch` sequences of up to `max_len` tokens and recurrences up to `num_steps`.

    mode "full": slots [num_steps, L] (exact; reads can pick any depth); "compressed": one slot per
    core layer, overwritten by each recurrence -- a different model (every step reads the prefix at
    its deepest stored depth), kept for its memory figure.
    """
    shapes = _cache_shapes(cfg, batch, max_len, num_steps, mode)
    z = {name: jnp.zeros(shape, dtype) for name, shape in shapes.items()}
    return LoopedCache(prelude_k=z["prelude"], prelude_v=jnp.zeros_like(z["prelude"]),
                       core_k=z["core"], core_v=jnp.zeros_like(z["core"]),
                       coda_k=z["coda"], coda_v=jnp.zeros_like(z["coda"]),
                       length=jnp.zeros((batch,), jnp.int32), mode=mode)


def cache_bytes(cfg: LoopedConfig, batch: int, max_len: int, num_steps: int, mode: str = "full",
                dtype=jnp.bfloat16) -> int:
    """Bytes `init_cache` allocates (K and V of every slot plus the [B] int32 lengths)."""
    shapes = _cache_shapes(cfg, batch, max_len, num_steps, mode)
    elems = sum(math.prod(s) for s in shapes.values())
    return 2 * elems * jnp.dtype(dtype).itemsize + 4 * batch


def write_tokens(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [..., B, T, N, hd] into buf [..., B, S, N, hd] at token offsets start [B].

    The leading dims of `new` may be shorter than buf's (they fill slots 0..n-1): a forward with
    fewer recurrences than the cache has slots writes only the slots it computed. One
    dynamic_update_slice per sequence (B is small) rather than a vmap, which would lower to a
    scatter; a DUS updates the donated buffer in place.
    """
    lead = buf.ndim - 4
    zero = jnp.zeros((), jnp.int32)
    start = start.astype(jnp.int32)
    for b in range(buf.shape[lead]):
        row = lax.slice_in_dim(new, b, b + 1, axis=lead).astype(buf.dtype)
        buf = lax.dynamic_update_slice(buf, row, (zero,) * lead + (jnp.int32(b), start[b], zero, zero))
    return buf


def scatter_tokens(buf: jax.Array, new: jax.Array, start: jax.Array, n_valid: jax.Array) -> jax.Array:
    """`write_tokens` for a padded prefill chunk: only row b's first n_valid[b] tokens of new [..., B, T, N, hd] are
    written (at start[b] onwards); the padding rows are sent past the cache and dropped, so they neither clobber a
    slot nor move a write back (a dynamic_update_slice running past the end would be shifted back over valid slots)."""
    lead = buf.ndim - 4
    B, T = new.shape[lead], new.shape[lead + 1]
    positions = start.astype(jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    slots = jnp.where(jnp.arange(T)[None, :] < n_valid[:, None], positions, buf.shape[lead + 1])
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
    index = tuple(slice(0, new.shape[i]) for i in range(lead)) + (rows, slots)
    return buf.at[index].set(new.astype(buf.dtype), mode="drop")


def write_layer(buf: jax.Array, new: jax.Array, lead: tuple, start: jax.Array) -> jax.Array:
    """buf [*lead_dims, B, S, N, hd] with new [B, T, N, hd] written into buf[lead] at token offsets start [B]
    (one in-place dynamic_update_slice per row)."""
    zero = jnp.zeros((), jnp.int32)
    lead = tuple(jnp.asarray(i, jnp.int32) for i in lead)
    for b in range(new.shape[0]):
        row = new[b][(None,) * (len(lead) + 1)].astype(buf.dtype)
        buf = lax.dynamic_update_slice(buf, row, lead + (jnp.int32(b), start[b].astype(jnp.int32), zero, zero))
    return buf


def cache_lengths(cache: LoopedCache | None, B: int) -> jax.Array:
    """Committed tokens per sequence [B] (0 without a cache)."""
    return jnp.zeros((B,), jnp.int32) if cache is None else cache.length


def cache_positions(cache: LoopedCache | None, B: int, T: int) -> jax.Array:
    """Positions [B, T] of T new tokens after each sequence's committed prefix."""
    return cache_lengths(cache, B)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]



def _token_axis(buf: jax.Array) -> int:
    return buf.ndim - 3  # [..., B, S, N, hd]


def grown_cache(cache: LoopedCache, max_len: int) -> LoopedCache:
    """The cache with max_len token slots (never fewer than it has); the new slots lie past every length."""
    extra = max(0, int(max_len) - cache.max_len)
    if not extra:
        return cache

    def pad(buf):
        widths = [(0, 0)] * buf.ndim
        widths[_token_axis(buf)] = (0, extra)
        return jnp.pad(buf, widths)

    return cache.replace(prelude_k=pad(cache.prelude_k), prelude_v=pad(cache.prelude_v), core_k=pad(cache.core_k),
                         core_v=pad(cache.core_v), coda_k=pad(cache.coda_k), coda_v=pad(cache.coda_v))
