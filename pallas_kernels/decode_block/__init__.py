"""Decode blocks: a transformer layer's few-row pieces (normed products with fused epilogues, gated attention over a
KV cache) in few launches, for drafts, whose numerics need not match the target's bit for bit.

    implementation = "reference"  pure jnp (reference.py), runs everywhere
                     "pallas"     Pallas (Triton) kernels (kernels.py); interpret mode off the GPU (tests)

`default_implementation()`: see DEFAULT_ON_GPU. README.md has the math and the measurements.
"""

from __future__ import annotations

import jax

from . import reference
from .reference import EPILOGUES, Gathered, HeadSum, Partials, rope_frequencies

IMPLEMENTATIONS = ("reference", "pallas")
MAX_ROWS = 16  # positions per batch row a forward through the blocks takes: decode and chain verification sizes
MAX_OPERAND_ROWS = 64  # rows of a product's operand (batch x padded positions): the input tile lives in registers
ATTENTION_BLOCKS = (64, 128, 256)  # cache slots per attention block `cached_attention` runs with
CACHE_MULTIPLE = 256  # a cache's length must be a multiple of it (of every block size)
# The settings below were measured on an H200 with the tiny checkpoint's MTP head (hd 64) in bf16, time per chained
# forward (README.md, "Measurements"). Slots per block 64 / 128 / 256: 29.7 / 28.3 / 28.2 µs at cache fill 200, 41.3 /
# 38.7 / 37.8 at 1000: the largest block whose [slots, hd] tile is at most BLOCK_ELEMENTS (hd 64: 256 slots; larger
# head dims take fewer slots: not measured). Splits over the cache 1 / 2 / 4: 29.7 / 31.8 / 35.3 µs at fill 200, 41.3 /
# 37.3 / 37.6 at 1000, 71.3 / 52.7 / 47.3 at 3000 (XLA's forward: 33.4, 37.2, 34.9): one program per head up to
# SPLIT_SLOTS[0] cache slots, 2 up to SPLIT_SLOTS[1], 4 beyond. The fc input gathered by its product: 30.6 -> 29.5 µs
# (T = 1), 31.6 -> 30.2 (T = 4) at fill 200.
BLOCK_ELEMENTS = 16384
SPLIT_SLOTS = (1024, 2048)
SPLITS: int | None = None  # programs per (batch row, head) over a cache; None: by the cache's length (SPLIT_SLOTS)
SLOTS: int | None = None  # cache slots per attention block, one of ATTENTION_BLOCKS; None: the largest that fits
# (attention, linear) warps per program; against XLA's forward at T = 1 / 4 / 5 rows: (8, 4) 1.03 / 1.13 / 1.17x,
# (4, 4) 0.98-1.10x, (8, 8) 0.99-1.14x, (16, 8) 0.91-1.07x, (2, *) 0.74-0.84x, (1, *) 0.41-0.51x.
WARPS = (8, 4)
GATHER = True  # products gather their input rows (`Gathered`); False: XLA pads them first
# The attention projecting each head's output (`HeadSum`, one launch fewer) instead of a product of its own: 29.6 /
# 30.9 / 37.4 / 38.0 us per chained forward against 29.1 / 31.1 / 38.0 / 38.9 (fill 200 / 1000, T = 1 and 4): within
# +-2%, nothing measurable, so off.
FUSE_OUT_PROJ = False


def warps() -> tuple[int, int]:
    """(attention, linear) warps per program."""
    return WARPS


def attention_splits(cache_len: int, head_dim: int) -> int:
    """Programs per (batch row, query head) `cached_attention` spreads a cache of cache_len slots over: SPLITS where
    set, else by the cache's length (SPLIT_SLOTS); at most one per attention block."""
    most = SPLITS if SPLITS is not None else 2 ** sum(cache_len > slots for slots in SPLIT_SLOTS)  # 1, 2, 4
    return max(1, min(most, cache_len // attention_block(head_dim, cache_len)))


def attention_block(head_dim: int, cache_len: int = CACHE_MULTIPLE) -> int:
    """Cache slots per attention block: SLOTS where set, else the largest of ATTENTION_BLOCKS dividing cache_len whose
    [slots, head_dim] tile holds at most BLOCK_ELEMENTS values (at least the smallest)."""
    if SLOTS is not None:
        return SLOTS
    fits = [b for b in ATTENTION_BLOCKS if b * head_dim <= BLOCK_ELEMENTS and cache_len % b == 0]
    return max(fits or [ATTENTION_BLOCKS[0]])


def gather_inputs() -> bool:
    """Whether a forward through the blocks hands its products `Gathered` inputs (GATHER)."""
    return GATHER


def fuse_out_proj() -> bool:
    """Whether a forward through the blocks projects the attention's output per head inside the attention (summed by
    the next product: one launch fewer) or in a product of its own (FUSE_OUT_PROJ)."""
    return FUSE_OUT_PROJ


def _kernels():
    from . import kernels
    return kernels


def default_implementation() -> str:
    """Pallas on the GPU, the reference elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def resolve(implementation: str | None) -> str:
    impl = default_implementation() if implementation in (None, "auto") else implementation
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"decode_block: implementation must be one of {IMPLEMENTATIONS} or 'auto'; got {impl!r}")
    return impl


def linear_shape_supported(din: int, dout: int, segments: int = 1) -> bool:
    """Whether `block_linear` takes a [*, din] x [dout, din] product (normed in `segments` equal parts)."""
    if din % segments:
        return False
    seg = din // segments
    return all(n % 16 == 0 for n in (seg, dout))


def block_linear(x, w, *, norms=(), eps=1e-6, residual=None, epilogue="none", want_normed=False, out_dtype=None,
                 want_input=False, implementation="auto"):
    """y = epilogue(norm(x) @ w^T) (+ residual): reference.block_linear. x [M, Din], M a power of two >= 16, or a
    `Gathered` (rows gathered as they load), `Partials` (an attention combined as it loads) or `HeadSum` (summed as it
    loads; want_input: that sum is a second output)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"block_linear: epilogue must be one of {EPILOGUES}; got {epilogue!r}")
    kw = dict(norms=tuple(norms), eps=eps, residual=residual, epilogue=epilogue, want_normed=want_normed,
              out_dtype=out_dtype, want_input=want_input)
    if resolve(implementation) == "reference":
        return reference.block_linear(x, w, **kw)
    return _kernels().block_linear(x, w, num_warps=warps()[1], interpret=jax.default_backend() != "gpu", **kw)


def cached_attention(qkv, start, k_cache, v_cache, q_norm, k_norm, freqs, *, n_heads, n_new, eps=1e-6,
                     mscale=1.0, splits=1, out_proj=None, implementation="auto"):
    """Gated attention of a few new rows over a KV cache, the new keys / values written: reference.cached_attention
    (splits > 1: a `Partials`, for a `block_linear` to combine; out_proj: each head's projection, for a `HeadSum`)."""
    kw = dict(n_heads=n_heads, n_new=n_new, eps=eps, mscale=mscale, splits=splits, out_proj=out_proj)
    if resolve(implementation) == "reference":
        return reference.cached_attention(qkv, start, k_cache, v_cache, q_norm, k_norm, freqs,
                                          block_s=attention_block(k_cache.shape[-1], k_cache.shape[1]), **kw)
    return _kernels().cached_attention(qkv, start, k_cache, v_cache, q_norm, k_norm, freqs,
                                       block_s=attention_block(k_cache.shape[-1], k_cache.shape[1]),
                                       num_warps=warps()[0],
                                       interpret=jax.default_backend() != "gpu", **kw)


__all__ = ["IMPLEMENTATIONS", "MAX_ROWS", "MAX_OPERAND_ROWS", "EPILOGUES", "block_linear", "cached_attention",
           "rope_frequencies", "Gathered", "Partials", "HeadSum", "default_implementation", "resolve",
           "linear_shape_supported", "warps", "WARPS", "attention_splits", "SPLITS", "attention_block",
           "SLOTS", "ATTENTION_BLOCKS", "CACHE_MULTIPLE", "gather_inputs", "GATHER", "fuse_out_proj",
           "FUSE_OUT_PROJ"]
