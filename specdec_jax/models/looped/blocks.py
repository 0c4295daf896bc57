"""Layer math of the looped models, shared by every forward (see `looped`): the variant's norm, RoPE,
attention, MLP and transformer block, runs of blocks over a cached prefix, the embedding, the
initial recurrent state and the adapter (`inject`). Pure functions of (params, cfg, arrays).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .config import LoopedConfig
from .. import layers as L


def block_norm(cfg: LoopedConfig, x: jax.Array, w: jax.Array) -> jax.Array:
    # Official RMSNorm: float32 normalisation, cast back, then times the weight (Llama style).
    return L.rms_norm(x, w, cfg.norm_eps, zero_centered=False)


@functools.cache
def _inv_freq(cfg: LoopedConfig) -> np.ndarray:
    if cfg.variant == "huginn":
        return L.rope_inv_freq(cfg.head_dim, cfg.rope_base)
    return L.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)


def apply_rope(cfg: LoopedConfig, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    if cfg.variant == "huginn":
        return L.apply_rope_interleaved(x, cos, sin)
    return L.apply_rope_half(x, cos, sin)


def attend_prefix(q: jax.Array, k: jax.Array, v: jax.Array, prefix: tuple | None, length: jax.Array,
            scale: float) -> jax.Array:
    """Causal attention of T new tokens over a cached prefix plus themselves (one softmax).

    q [B, T, H, hd]; k, v [B, T, NKV, hd] (the new tokens); prefix (k, v) [B, S, NKV, hd] whose
    slots < length[b] are visible, or None (no prefix). Two score blocks instead of writing the new
    K/V into a copy of the prefix buffer: the prefix is read straight from its cache slot.
    """
    B, T, H, hd = q.shape
    NKV = k.shape[2]
    qg = q.reshape(B, T, NKV, H // NKV, hd)
    causal = jnp.tril(jnp.ones((T, T), bool))
    s_new = jnp.einsum("btngd,bsnd->bngts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    s_new = jnp.where(causal, s_new, -jnp.inf)  # [B, NKV, G, T, T]
    if prefix is None:
        p = jax.nn.softmax(s_new, axis=-1).astype(v.dtype)
        out = jnp.einsum("bngts,bsnd->btngd", p, v, preferred_element_type=jnp.float32)
        return out.reshape(B, T, H, hd).astype(q.dtype)
    k_pre, v_pre = prefix
    S = k_pre.shape[1]
    visible = jnp.arange(S, dtype=jnp.int32)[None, :] < length[:, None]  # [B, S]
    s_pre = jnp.einsum("btngd,bsnd->bngts", qg, k_pre.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    s_pre = jnp.where(visible[:, None, None, None, :], s_pre, -jnp.inf)  # [B, NKV, G, T, S]
    p = jax.nn.softmax(jnp.concatenate([s_pre, s_new], axis=-1), axis=-1).astype(v.dtype)
    out = (jnp.einsum("bngts,bsnd->btngd", p[..., :S], v_pre.astype(v.dtype), preferred_element_type=jnp.float32)
           + jnp.einsum("bngts,bsnd->btngd", p[..., S:], v, preferred_element_type=jnp.float32))
    return out.reshape(B, T, H, hd).astype(q.dtype)


def block_attention(ap: dict, cfg: LoopedConfig, h: jax.Array, cos: jax.Array, sin: jax.Array,
               prefix: tuple | None, length: jax.Array, attend=None):
    """h [B, T, D] -> (out [B, T, D], k, v [B, T, NKV, hd] of the new tokens, post-RoPE).

    attend: None (`attend_prefix` over prefix + new tokens), or attend(q, k, v) -> [B, T, H, hd] (the exact
    path's write-then-attend over the cache slot)."""
    B, T, _ = h.shape
    qkv = L.linear(h, ap["Wqkv"])
    q, k, v = jnp.split(qkv, [cfg.q_dim, cfg.q_dim + cfg.kv_dim], axis=-1)
    if cfg.variant == "raven_olmo2":
        q = block_norm(cfg, q, ap["q_norm"])  # over all heads at once, as OLMo-2 does
        k = block_norm(cfg, k, ap["k_norm"])
    q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)
    k = k.reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
    v = v.reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
    if cfg.qk_bias:
        q = q + ap["qk_bias"][0].astype(q.dtype)  # [1, H, hd] broadcast over B, T
        k = k + ap["qk_bias"][1].astype(k.dtype)
    q, k = apply_rope(cfg, q, cos, sin), apply_rope(cfg, k, cos, sin)
    if attend is None:
        out = attend_prefix(q, k, v, prefix, length, cfg.head_dim ** -0.5)  # SDPA default scale
    else:
        out = attend(q, k, v)
    return L.linear(out.reshape(B, T, cfg.q_dim), ap["proj"]), k, v


def block_mlp(mp: dict, x: jax.Array) -> jax.Array:
    gate, up = jnp.split(L.linear(x, mp["fc"]), 2, axis=-1)  # fused [gate; up] rows
    return L.linear(jax.nn.silu(gate) * up, mp["proj"])


def apply_block(lp: dict, cfg: LoopedConfig, x: jax.Array, cos, sin, prefix, length, attend=None):
    """One transformer block of the variant: x [B, T, D] -> (x, k, v). attend: see `block_attention`."""
    if cfg.variant == "huginn":
        a, k, v = block_attention(lp["attn"], cfg, block_norm(cfg, x, lp["norm_1"]), cos, sin, prefix, length, attend)
        x = block_norm(cfg, a + x, lp["norm_2"])
        x = block_norm(cfg, block_mlp(lp["mlp"], block_norm(cfg, x, lp["norm_3"])) + x, lp["norm_4"])
    elif cfg.variant == "raven_llama":
        a, k, v = block_attention(lp["attn"], cfg, block_norm(cfg, x, lp["norm_1"]), cos, sin, prefix, length, attend)
        x = a + x
        x = block_mlp(lp["mlp"], block_norm(cfg, x, lp["norm_2"])) + x
    else:  # raven_olmo2: post-norms inside the residual branches
        a, k, v = block_attention(lp["attn"], cfg, x, cos, sin, prefix, length, attend)
        x = block_norm(cfg, a, lp["norm_1"]) + x
        x = block_norm(cfg, block_mlp(lp["mlp"], x), lp["norm_2"]) + x
    return x, k, v


def run_blocks(blocks: list, cfg: LoopedConfig, x: jax.Array, cos, sin, cache_k, cache_v, length):
    """Run a list of blocks; cache_k/v [n, B, S, NKV, hd] or None. Returns x and new K/V [n, B, T, NKV, hd]."""
    ks, vs = [], []
    for i, lp in enumerate(blocks):
        prefix = None if cache_k is None else (cache_k[i], cache_v[i])
        x, k, v = apply_block(lp, cfg, x, cos, sin, prefix, length)
        ks.append(k)
        vs.append(v)
    if not ks:
        B, T = x.shape[:2]
        empty = jnp.zeros((0, B, T, cfg.num_key_value_heads, cfg.head_dim), x.dtype)
        return x, empty, empty
    return x, jnp.stack(ks), jnp.stack(vs)


def rope_tables(cfg: LoopedConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, head_dim // 2] float32 for integer positions [B, T]."""
    return L.rope_angles(positions, _inv_freq(cfg))


def embed(params: dict, cfg: LoopedConfig, input_ids: jax.Array) -> jax.Array:
    """Scaled token embeddings [B, T, D] (before the prelude)."""
    x = jnp.take(params["wte"], input_ids, axis=0)
    return x * cfg.embed_scale if cfg.embed_scale != 1 else x


def initial_state(cfg: LoopedConfig, embedded: jax.Array, key: jax.Array | None = None,
                  scale: float = 1.0) -> jax.Array:
    """Recurrent state x_0 [B, T, D] for prelude output `embedded` [B, T, D].

    initial_state_mode "embed-init"/"skip-adapter": x_0 = embedded (OLMo-2 retrofit options).
    "random": zeros when `key` is None or scale == 0 (the official `init_scale=0`, deterministic);
    otherwise the official draw: truncated normal cut at 3 std, std = init_std * scale, times
    embed_scale.
    """
    if cfg.initial_state_mode in ("embed-init", "skip-adapter"):
        return embedded
    std = cfg.init_std * scale
    if key is None or std <= 0:
        return jnp.zeros_like(embedded)
    x = jax.random.truncated_normal(key, -3.0, 3.0, embedded.shape, jnp.float32) * std
    if cfg.embed_scale != 1:
        x = x * cfg.embed_scale
    return x.astype(embedded.dtype)


def inject(params: dict, cfg: LoopedConfig, x: jax.Array, embedded: jax.Array, at_step_zero) -> jax.Array:
    """The adapter: Linear(concat[x, embedded]) (+ bias when the config has `bias`) -> [B, T, D].

    at_step_zero (bool, broadcastable to [B, T, 1]): with initial_state_mode "skip-adapter" those
    positions pass the prelude output through unchanged (OLMo-2 retrofit option).
    """
    h = L.linear(jnp.concatenate([x, embedded], axis=-1), params["adapter"])  # state first, then e
    if "adapter_bias" in params:
        h = h + params["adapter_bias"].astype(h.dtype)
    if cfg.initial_state_mode == "skip-adapter":
        h = jnp.where(at_step_zero, embedded, h)
    return h

