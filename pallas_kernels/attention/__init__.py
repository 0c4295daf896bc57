"""Causal attention of new query rows over a KV cache: one signature, two implementations.

    implementation = "reference"     plain jnp (reference.py): the score matrix [B, NH, T, S] in float32; everywhere
                     "pallas"        flash attention (flash.py, Pallas Triton): no score matrix, and only the key
                                     tiles a block's positions can see are read (prefill chunks)
                     "pallas-split"  few rows over a long cache (decode.py): the cache split into fixed spans, one
                                     program per span and head, the partial softmaxes merged in span order
                     "cudnn"         cuDNN's fused attention (prefix.py, the function below jax.nn.dot_product_attention): the
                                     chunk's prefix and its own causal square, merged by their log-sum-exps; bf16 or
                                     fp16 with a head size cuDNN takes, else the flash kernel
                     "dpa-xla"       the same two parts in plain jnp: the cuDNN path's decomposition and merge,
                                     testable anywhere
    (the Pallas kernels run in interpret mode off the GPU: tests)

`path(implementation, rows, cache_len)` is what the models take: on the GPU ("auto"), cuDNN for prefill-sized
forwards (FLASH_MIN_ROWS rows and more) over caches of CUDNN_MIN_CACHE slots and more, the flash kernel for shorter
ones, the split kernel for decode and verification over caches of SPLIT_MIN_CACHE slots and more, XLA's masked
attention below that; off the GPU, XLA's everywhere. The choice for few rows depends on the cache length alone, so an
exact generation's AR steps and verifications (the same row count) run the same program; prefill is shared by AR
and speculation alike. README.md has the derivation; docs/LOG.md the measurements.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from . import prefix, reference
from .reference import causal_mask, masked_attention

IMPLEMENTATIONS = ("reference", "pallas", "pallas-split", "cudnn", "dpa-xla")
FLASH_MIN_ROWS = 65  # query rows per forward from which prefill takes the flash kernel (decode shapes: at most 64)
# The kernels' settings, each the fastest measured on an H100 at the 9B shape's heads (docs/LOG.md, 2026-12-06, long
# context): the flash kernel's tiles (rows per program, keys per tile, warps, pipeline stages); the cache length from
# which few rows take the split kernel (XLA's path was faster at 8K slots, the kernel at 64K); its span of slots.
BLOCKS = {"block_m": 128, "block_k": 64, "num_warps": 8, "num_stages": 2}
SPLIT_MIN_CACHE = 16384
SPLIT_SPAN = 1024
# Prefill chunks over caches of this many slots and more take cuDNN's fused attention: on an H100 it ran a 1024-row
# chunk at 488 / 543 TFLOP/s after 32K / 128K tokens against the flash kernel's 315-356 / 408-435, and at 191 against
# 195-208 after 4K (docs/LOG.md, 2026-12-06 evening and 2026-12-07 night).
CUDNN_MIN_CACHE = 16384


@functools.cache
def _flash():
    try:
        from . import flash
    except ImportError:
        return None
    return flash


def path(implementation: str | None, rows: int, cache_len: int) -> str:
    """The implementation a forward of `rows` query rows over a cache of `cache_len` slots takes (see above)."""
    chosen = resolve(implementation)
    if chosen == "reference":
        return "reference"
    if rows >= FLASH_MIN_ROWS:
        if implementation in (None, "auto") and cache_len >= CUDNN_MIN_CACHE:
            return "cudnn"
        return chosen if chosen in ("cudnn", "dpa-xla") else "pallas"
    return "pallas-split" if cache_len >= SPLIT_MIN_CACHE or implementation == "pallas-split" else "reference"


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
                     implementation: str | None = "auto", blocks: dict | None = None,
                     new_kv: tuple | None = None) -> jax.Array:
    """q [B, T, NH, hd] at positions start [B] + t (t < T); k, v [B, S, NKV, hd] the cache (slots the new rows wrote
    included); slot s visible to a row at position p iff s <= p. Returns [B, T, NH, hd] in q.dtype.
    blocks: the flash kernel's tile sizes (BLOCKS when None). new_kv: None, or the new rows' own (k, v)
    [B, T, NKV, hd] (the two-part paths read them instead of the cache's slots start.., which need not all fit in
    the cache: a padded last chunk may reach past it)."""
    chosen = resolve(implementation)
    if chosen == "reference":
        return reference.causal_attention(q, k, v, start, scale)
    if chosen == "cudnn" and prefix.cudnn_takes(q):
        try:
            return prefix.prefix_square_attention(q, k, v, start, scale, new_kv, implementation="cudnn")
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as refused:  # at trace time: no cuDNN
            warnings.warn(f"attention: cuDNN refused a prefill chunk ({type(refused).__name__}: {refused}); "
                          "the flash kernel runs it", stacklevel=2)
    if chosen == "cudnn":
        chosen = "pallas"
    if chosen == "dpa-xla":
        return prefix.prefix_square_attention(q, k, v, start, scale, new_kv, implementation="xla")
    hd = q.shape[-1]
    padded = _next_pow2(hd)  # the Triton backend's tiles have power-of-two sides; zero columns change nothing
    if padded != hd:
        pad = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, padded - hd),))
        q, k, v = pad(q), pad(k), pad(v)
    interpret = jax.default_backend() != "gpu"
    if chosen == "pallas-split":
        from .decode import split_attention
        out = split_attention(q, k, v, start, scale=scale, interpret=interpret, span=SPLIT_SPAN)
    else:
        out = _flash().flash_attention(q, k, v, start, scale=scale, interpret=interpret, **(blocks or BLOCKS))
    return out[..., :hd]


__all__ = ["IMPLEMENTATIONS", "FLASH_MIN_ROWS", "BLOCKS", "SPLIT_MIN_CACHE", "SPLIT_SPAN", "CUDNN_MIN_CACHE", "path", "resolve", "causal_attention", "causal_mask",
           "masked_attention", "reference"]
