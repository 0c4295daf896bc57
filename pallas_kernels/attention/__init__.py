"""Causal attention of new query rows over a KV cache: one signature, two implementations.

    implementation = "reference"  plain jnp (reference.py): the score matrix [B, NH, T, S] in float32; runs everywhere
                     "pallas"     flash attention (flash.py, Pallas Triton): no score matrix, and only the key tiles
                                  a block's positions can see are read; interpret mode off the GPU (tests)

`resolve("auto")` is "pallas" on the GPU, else "reference". The models call it for prefill-sized forwards only
(`FLASH_MIN_ROWS`): decode and verification (at most 64 rows) keep the XLA path, which every exactness guarantee
was built on (a row's keys reduced in the same order whatever the number of rows), and whose score matrix is small.
README.md has the derivation and the measurements.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import reference
from .reference import causal_mask, masked_attention

IMPLEMENTATIONS = ("reference", "pallas")
FLASH_MIN_ROWS = 65  # query rows per forward from which prefill takes the flash kernel (decode shapes stay on XLA)
# Tile sizes of the flash kernel: (rows per program, keys per tile, warps, pipeline stages).
BLOCKS = {"block_m": 64, "block_k": 64, "num_warps": 4, "num_stages": 2}


@functools.cache
def _flash():
    try:
        from . import flash
    except ImportError:
        return None
    return flash


def resolve(implementation: str | None = "auto") -> str:
    """The implementation `implementation` ("auto" / None / a name) means here."""
    if implementation in (None, "auto"):
        return "pallas" if jax.default_backend() == "gpu" and _flash() is not None else "reference"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention: implementation must be one of {IMPLEMENTATIONS} or 'auto'; "
                         f"got {implementation!r}")
    return implementation


def _next_pow2(n: int) -> int:
    return max(16, 1 << (int(n) - 1).bit_length())


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, *, scale: float,
                     implementation: str | None = "auto", blocks: dict | None = None) -> jax.Array:
    """q [B, T, NH, hd] at positions start [B] + t (t < T); k, v [B, S, NKV, hd] the cache (slots the new rows wrote
    included); slot s visible to a row at position p iff s <= p. Returns [B, T, NH, hd] in q.dtype.
    blocks: the flash kernel's tile sizes (BLOCKS when None)."""
    if resolve(implementation) == "reference":
        return reference.causal_attention(q, k, v, start, scale)
    hd = q.shape[-1]
    padded = _next_pow2(hd)  # the Triton backend's tiles have power-of-two sides; zero columns change nothing
    if padded != hd:
        pad = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, padded - hd),))
        q, k, v = pad(q), pad(k), pad(v)
    out = _flash().flash_attention(q, k, v, start, scale=scale, interpret=jax.default_backend() != "gpu",
                                   **(blocks or BLOCKS))
    return out[..., :hd]


__all__ = ["IMPLEMENTATIONS", "FLASH_MIN_ROWS", "BLOCKS", "resolve", "causal_attention", "causal_mask",
           "masked_attention", "reference"]
