"""Qwen3.5 multi-token-prediction (MTP) head, vLLM's structure (`qwen3_next_mtp.py` / `qwen3_5_mtp.py`).

Fed the target's final-normed hidden state h_t at position t and the embedding of the token at
t + 1, the head predicts the token at t + 2:

    e = RMSNorm0(embed(ids_{t+1}), pre_fc_norm_embedding)        # zero-centred RMSNorm (x̂·(1 + w))
    h = RMSNorm0(h_t, pre_fc_norm_hidden)
    x = fc(concat[e, h])                                          # mtp.fc.weight [D, 2D], embedding first
    x = x + attn(RMSNorm0(x, input_norm))                         # one full-attention decoder layer,
    x = x + mlp(RMSNorm0(x, post_norm))                           #   own KV cache, target's structure
    hidden_out = RMSNorm0(x, mtp.norm);  logits = lm_head(hidden_out)   # shared lm_head / embed_tokens

The layer's RoPE positions are the positions t of the hidden states (vLLM's EAGLE/MTP proposer
shifts the ids left by one and keeps the target positions). `hidden_out` is what a chained second
MTP step consumes as its hidden input.

params["mtp"] = {"fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm",
                 "layers": [{"input_norm", "post_norm", "mixer": {qkv_proj, o_proj, q_norm, k_norm},
                             "mlp": {...}}]}  (same leaf names as the target's attention layers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .. import sharding
from ..config import Qwen35Config
from . import layers as L
from . import qwen35


def _norm(x: jax.Array, w: jax.Array, cfg: Qwen35Config) -> jax.Array:
    return L.rms_norm(x, w, cfg.rms_norm_eps, zero_centered=True)


def init_mtp_cache(cfg: Qwen35Config, batch: int, max_len: int, dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    """Empty K and V caches of the MTP layer, each [B, S, NKV, hd] (split over its heads under a mesh, as the
    target's caches)."""
    shape = (batch, max_len, qwen35.kv_heads(cfg), cfg.head_dim)
    return tuple(sharding.constrain(jnp.zeros(shape, dtype), cfg.mesh, sharding.STATE_PARTITIONS[field])
                 for field in ("keys", "values"))


def mtp_forward(params: dict, cfg: Qwen35Config, hidden: jax.Array, next_ids: jax.Array, k_cache: jax.Array,
                v_cache: jax.Array, positions: jax.Array, *, layer: int = 0, compute_logits: bool = True):
    """MTP head on T positions continuing its own KV cache.

    hidden [B, T, D]: the target's final-normed hidden states at positions `positions` [B, T] int32
    (consecutive per row; new K/V are written at positions[:, 0] ...); next_ids [B, T]: the tokens at
    positions + 1. k_cache, v_cache [B, S, NKV, hd]; slots <= the query position are attended to
    (slots past the committed length must be stale-but-masked, as in the target's cache).
    Returns (logits [B, T, vocab] float32 predicting the tokens at positions + 2 (None when
    compute_logits=False: a shortlist drafter projects hidden_out itself), hidden_out [B, T, D]
    (after mtp.norm), new k_cache, new v_cache).
    """
    mp = params["mtp"]
    dtype = params["embed"].dtype
    e = _norm(params["embed"][next_ids].astype(dtype), mp["pre_fc_norm_embedding"], cfg)  # [B, T, D]
    h = _norm(hidden.astype(dtype), mp["pre_fc_norm_hidden"], cfg)  # [B, T, D]
    x = L.linear(jnp.concatenate([e, h], axis=-1), mp["fc"])  # [B, T, D]
    p = mp["layers"][layer]
    mask = L.causal_cache_mask(positions, k_cache.shape[1])  # [B, T, S]
    a, k_cache, v_cache = qwen35.attention_mixer(p["mixer"], cfg, _norm(x, p["input_norm"], cfg), k_cache, v_cache,
                                                 positions, mask)
    x = x + a
    x = x + qwen35.mlp(p["mlp"], cfg, _norm(x, p["post_norm"], cfg))
    hidden_out = _norm(x, mp["norm"], cfg)
    if not compute_logits:
        return None, hidden_out, k_cache, v_cache
    logits = lax.dot_general(hidden_out, qwen35.lm_head_weight(params).astype(dtype), (((2,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return logits, hidden_out, k_cache, v_cache


def mtp_forward_train(params: dict, cfg: Qwen35Config, hidden: jax.Array, next_ids: jax.Array):
    """Whole-sequence MTP forward (causal, fresh cache of length T) for training and tests.

    hidden [B, T, D] at positions 0..T-1; next_ids [B, T] the tokens at 1..T.
    Returns (logits [B, T, vocab] float32 predicting tokens 2..T+1, hidden_out [B, T, D]).
    """
    B, T = next_ids.shape
    k_cache, v_cache = init_mtp_cache(cfg, B, T, params["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
    logits, hidden_out, _, _ = mtp_forward(params, cfg, hidden, next_ids, k_cache, v_cache, positions)
    return logits, hidden_out


def init_mtp_params(cfg: Qwen35Config, key: jax.Array, dtype=jnp.float32, *, num_layers: int = 1,
                    std: float = 0.02) -> dict:
    """Fresh `params["mtp"]`: matrices ~ N(0, std) (output projections scaled by 1/sqrt(2)), norms zero
    (zero-centred RMSNorm: identity). Shapes follow the target's full-attention layers (dense or MoE)."""
    D = cfg.hidden_size
    specs = qwen35.param_specs(cfg, {"model.embed_tokens.weight", "mtp.fc.weight"}
                               | {f"mtp.layers.{i}.x" for i in range(num_layers)}, "init_mtp_params")
    keys = jax.random.split(key, len(specs) + 1)
    tree: dict = {"fc": (jax.random.normal(keys[-1], (D, 2 * D), jnp.float32) * std).astype(dtype),
                  "layers": [{} for _ in range(num_layers)]}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tree[name] = jnp.zeros((D,), dtype)
    for k, (path, leaf) in zip(keys, specs.items()):
        if path[:2] != ("mtp", "layers"):
            continue
        node = tree["layers"][path[2]]
        for part in path[3:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _init_leaf(k, path, leaf_shape(leaf), dtype, std)
    return tree


def leaf_shape(leaf) -> tuple[int, ...]:
    """Shape of the parameter a `qwen35.Leaf` assembles (fused along axis 0, stacked if `stack`)."""
    group = leaf.groups[0]
    first = group[0]
    shape = (sum(s[0] for _, s in group),) + tuple(first[1][1:])
    if first[0].endswith("conv1d.weight"):
        shape = (shape[0], shape[2])  # stored [C, 1, W]; kept as [C, W]
    return ((len(leaf.groups),) + shape) if leaf.stack else shape


_OUT_PROJ = ("o_proj", "out_proj", "down_proj", "experts_down", "shared_down_proj")


def _init_leaf(key, path: tuple, shape: tuple, dtype, std: float, out_scale: float = 2 ** -0.5) -> jax.Array:
    name = path[-1]
    if len(shape) == 1:
        return jnp.zeros(shape, dtype)  # zero-centred norms
    scale = std * (out_scale if name in _OUT_PROJ else 1.0)
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)
