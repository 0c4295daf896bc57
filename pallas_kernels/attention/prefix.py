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


def _cudnn_call():
    """jax's cuDNN attention below `jax.nn.dot_product_attention` (jax 0.11 and 0.12 alike), or None. The public
    function casts the log-sum-exp to the output's dtype: in bf16 its rounding (2^-9 of a value that reaches 20-50
    for peaky heads) moved the merged output 8-25x further from the float32 softmax than bf16 attention itself
    (tests/test_attention.py), so the merge takes cuDNN's own float32 statistics."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    except ImportError:
        return None
    return dot_product_attention, MaskType


def cudnn_takes(q: jax.Array) -> bool:
    """Whether cuDNN's fused attention takes queries like q [B, T, NH, hd] (16-bit, hd a multiple of 8 up to 256)."""
    hd = q.shape[-1]
    return (q.dtype in CUDNN_DTYPES and hd % 8 == 0 and hd <= CUDNN_MAX_HEAD_DIM
            and _cudnn_call() is not None and q.shape[1] != q.shape[2])


def _own_rows(x: jax.Array, start: jax.Array, rows: int) -> jax.Array:
    """x [B, S, ...] -> [B, rows, ...]: each batch row's slots start[b] .. start[b] + rows - 1."""
    return jax.vmap(lambda xb, sb: jax.lax.dynamic_slice_in_dim(xb, sb, rows, axis=0))(x, start)


def _cudnn_part(q, k, v, scale, kv_len=None, causal=False):
    """One cuDNN attention: (out [B, T, NH, hd] in q.dtype, log-sum-exp [B, T, NH] float32)."""
    call, mask = _cudnn_call()
    B, T = q.shape[:2]
    if kv_len is None:
        q_len, mask_type = None, mask.CAUSAL if causal else mask.NO_MASK
    else:
        q_len, mask_type = jnp.full((B,), T, jnp.int32), mask.PADDING_CAUSAL if causal else mask.PADDING
    out, lse = call(q, k, v, None, None, q_len, kv_len, scale=scale, mask_type=mask_type, return_residual=True)
    return out, jnp.transpose(lse, (0, 2, 1)).astype(jnp.float32)  # cuDNN's statistics come as [B, NH, T]


def _xla_part(q, k, v, scale, kv_len=None, causal=False):
    """The same part in plain jnp (the CPU twin): scores and log-sum-exp in float32, probabilities cast to the
    values' dtype before the value product, as the reference does."""
    B, T, NH, hd = q.shape
    S, NKV = k.shape[1], k.shape[2]
    qg = q.reshape(B, T, NKV, NH // NKV, hd)
    scores = jnp.einsum("btngd,bsnd->bngts", qg, k, preferred_element_type=jnp.float32) * scale
    seen = jnp.ones((B, T, S), bool)
    if kv_len is not None:
        seen = seen & (jnp.arange(S)[None, None, :] < kv_len[:, None, None])
    if causal:
        seen = seen & (jnp.arange(S)[None, None, :] <= jnp.arange(T)[None, :, None])
    scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, NKV, G, T]; -inf where nothing is seen
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]).astype(v.dtype)
    out = jnp.einsum("bngts,bsnd->btngd", probs, v, preferred_element_type=jnp.float32).reshape(B, T, NH, hd)
    return out.astype(q.dtype), jnp.transpose(lse.reshape(B, NH, T), (0, 2, 1))


def prefix_square_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, scale: float,
                            new_kv: tuple | None = None, *, implementation: str = "cudnn") -> jax.Array:
    """q [B, T, NH, hd] at positions start [B] + t over the cache k, v [B, S, NKV, hd] -> [B, T, NH, hd] in q.dtype.
    new_kv: the rows' own (k, v) [B, T, NKV, hd], or None to read them from the cache (then start + T <= S).
    implementation: "cudnn" (the GPU) or "xla" (its twin, anywhere)."""
    own_k, own_v = new_kv if new_kv is not None else (_own_rows(k, start, q.shape[1]), _own_rows(v, start, q.shape[1]))
    dtype = q.dtype
    part = _cudnn_part if implementation == "cudnn" else _xla_part
    o1, r1 = part(q, k.astype(dtype), v.astype(dtype), scale, kv_len=start.astype(jnp.int32))
    o2, r2 = part(q, own_k.astype(dtype), own_v.astype(dtype), scale, causal=True)
    has_prefix = (start > 0)[:, None, None]  # [B, 1, 1]: an empty prefix's output and log-sum-exp are undefined
    r1 = jnp.where(has_prefix, r1, -jnp.inf)
    m = jnp.maximum(r1, r2)  # finite: every row sees its own key
    w1, w2 = jnp.exp(r1 - m)[..., None], jnp.exp(r2 - m)[..., None]  # [B, T, NH, 1]
    o1 = jnp.where(has_prefix[..., None], o1.astype(jnp.float32), 0.0)
    return ((o1 * w1 + o2.astype(jnp.float32) * w2) / (w1 + w2)).astype(dtype)
