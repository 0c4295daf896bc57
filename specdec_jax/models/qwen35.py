"""Qwen3.5 hybrid language model (dense and MoE, with the MTP head's parameters) in functional JAX.

Three of every four layers (by `layer_types`) are Gated DeltaNet layers with a fixed-size state;
the rest are gated full attention with a preallocated KV cache. Everything follows transformers'
`modeling_qwen3_5.py` / `modeling_qwen3_5_moe.py` numerics: zero-centred RMSNorm in float32,
gated RMSNorm on the GDN output, partial rotate-half RoPE, attention output times sigmoid(gate).

Entry points (all pure; `forward` is what prefill, decode and verification share):
    init_state(cfg, batch, max_len, dtype) -> Qwen35State
    forward(params, cfg, state, input_ids, *, impl, collect) -> (logits, state, extras)
    prefill / decode_step: jitted wrappers with the state donated.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from pallas_kernels import gated_delta

from ..config import FULL_ATTENTION, Qwen35Config
from ..errors import CheckpointError
from ..loading import TensorSource
from . import layers as L


# ------------------------------------------------------------------------------------------ state

@struct.dataclass
class Qwen35State:
    """Immutable decode state. Rollback = keep an old state; nothing is ever overwritten in place.

    keys/values: per full-attention layer [B, S, NKV, hd] (slots >= length are stale or empty).
    conv: per GDN layer, the last (kernel - 1) pre-conv qkv inputs [B, kernel - 1, C].
    recurrent: per GDN layer [B, HV, K, V] float32.
    length: [B] int32 tokens committed per sequence.
    """

    keys: tuple
    values: tuple
    conv: tuple
    recurrent: tuple
    length: jax.Array

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0


def init_state(cfg: Qwen35Config, batch: int, max_len: int, dtype=jnp.bfloat16) -> Qwen35State:
    n_attn, n_lin = len(cfg.attention_layers), len(cfg.linear_layers)
    kv_shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    rec_shape = (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    conv_shape = (batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)
    return Qwen35State(
        keys=tuple(jnp.zeros(kv_shape, dtype) for _ in range(n_attn)),
        values=tuple(jnp.zeros(kv_shape, dtype) for _ in range(n_attn)),
        conv=tuple(jnp.zeros(conv_shape, dtype) for _ in range(n_lin)),
        recurrent=tuple(jnp.zeros(rec_shape, jnp.float32) for _ in range(n_lin)),
        length=jnp.zeros((batch,), jnp.int32),
    )


# ------------------------------------------------------------------------------------- parameters

def _attention_specs(cfg: Qwen35Config) -> dict[str, tuple[str, tuple]]:
    D, hd = cfg.hidden_size, cfg.head_dim
    nH, nKV = cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        "q_proj": ("self_attn.q_proj.weight", (2 * nH * hd, D)),
        "k_proj": ("self_attn.k_proj.weight", (nKV * hd, D)),
        "v_proj": ("self_attn.v_proj.weight", (nKV * hd, D)),
        "o_proj": ("self_attn.o_proj.weight", (D, nH * hd)),
        "q_norm": ("self_attn.q_norm.weight", (hd,)),
        "k_norm": ("self_attn.k_norm.weight", (hd,)),
    }


def _gdn_specs(cfg: Qwen35Config) -> dict[str, tuple[str, tuple]]:
    D, HV = cfg.hidden_size, cfg.linear_num_value_heads
    return {
        "in_proj_qkv": ("linear_attn.in_proj_qkv.weight", (cfg.conv_dim, D)),
        "in_proj_z": ("linear_attn.in_proj_z.weight", (cfg.linear_value_dim, D)),
        "in_proj_b": ("linear_attn.in_proj_b.weight", (HV, D)),
        "in_proj_a": ("linear_attn.in_proj_a.weight", (HV, D)),
        "conv": ("linear_attn.conv1d.weight", (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim)),
        "A_log": ("linear_attn.A_log", (HV,)),
        "dt_bias": ("linear_attn.dt_bias", (HV,)),
        "norm": ("linear_attn.norm.weight", (cfg.linear_value_head_dim,)),
        "out_proj": ("linear_attn.out_proj.weight", (D, cfg.linear_value_dim)),
    }


def _mlp_specs(cfg: Qwen35Config, keys: set[str], prefix: str) -> dict[str, Any]:
    """Dense SwiGLU, or MoE with fused ('experts.gate_up_proj') or per-expert expert weights."""
    D = cfg.hidden_size
    if not cfg.is_moe:
        F = cfg.intermediate_size
        return {"gate_proj": ("mlp.gate_proj.weight", (F, D)), "up_proj": ("mlp.up_proj.weight", (F, D)),
                "down_proj": ("mlp.down_proj.weight", (D, F))}
    E, I, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    specs: dict[str, Any] = {"router": ("mlp.gate.weight", (E, D))}
    if prefix + "mlp.experts.gate_up_proj" in keys or prefix + "mlp.experts.0.gate_proj.weight" not in keys:
        specs["experts_gate_up"] = ("mlp.experts.gate_up_proj", (E, 2 * I, D))
        specs["experts_down"] = ("mlp.experts.down_proj", (E, D, I))
    else:  # per-expert tensors are stacked at load into the fused layout
        specs["experts_gate_up"] = ("per_expert_gate_up", [
            [(f"mlp.experts.{e}.gate_proj.weight", (I, D)), (f"mlp.experts.{e}.up_proj.weight", (I, D))]
            for e in range(E)])
        specs["experts_down"] = ("per_expert_down", [[(f"mlp.experts.{e}.down_proj.weight", (D, I))]
                                                     for e in range(E)])
    if S:
        specs.update({
            "shared_gate_proj": ("mlp.shared_expert.gate_proj.weight", (S, D)),
            "shared_up_proj": ("mlp.shared_expert.up_proj.weight", (S, D)),
            "shared_down_proj": ("mlp.shared_expert.down_proj.weight", (D, S)),
            "shared_expert_gate": ("mlp.shared_expert_gate.weight", (1, D)),
        })
    return specs


def _layer_specs(cfg: Qwen35Config, layer_type: str, keys: set[str], prefix: str) -> dict[str, Any]:
    D = cfg.hidden_size
    mixer = _attention_specs(cfg) if layer_type == FULL_ATTENTION else _gdn_specs(cfg)
    return {
        "input_norm": ("input_layernorm.weight", (D,)),
        "post_norm": ("post_attention_layernorm.weight", (D,)),
        "mixer": mixer,
        "mlp": _mlp_specs(cfg, keys, prefix),
    }


def detect_prefix(keys: set[str], where: str) -> str:
    """'model.language_model.' (multimodal checkpoints) or 'model.' (text-only)."""
    for prefix in ("model.language_model.", "model."):
        if prefix + "embed_tokens.weight" in keys:
            return prefix
    raise CheckpointError(f"tensor 'model.language_model.embed_tokens.weight' (or 'model.embed_tokens.weight') "
                          f"is missing from {where}")


def _spec_leaves(layer_tree: dict, key_prefix: str, path: tuple):
    """Yield (param path, (HF key | per-expert key groups, shape | None)) for one layer's spec tree."""
    for name, node in layer_tree.items():
        items = node.items() if isinstance(node, dict) else [(None, node)]
        for leaf, (key, shape) in items:
            leaf_path = path + (name,) + ((leaf,) if leaf else ())
            if isinstance(shape, list):  # per-expert tensors, stacked at load
                yield leaf_path, ([[(key_prefix + k, s) for k, s in group] for group in shape], None)
            else:
                yield leaf_path, (key_prefix + key, shape)


def param_specs(cfg: Qwen35Config, keys: set[str], where: str) -> dict[tuple, tuple[Any, Any]]:
    """{param path: (full HF key | stacked key groups, shape)} for every parameter to load."""
    prefix = detect_prefix(keys, where)
    D, V = cfg.hidden_size, cfg.vocab_size
    specs: dict[tuple, tuple[Any, Any]] = {
        ("embed",): (prefix + "embed_tokens.weight", (V, D)),
        ("final_norm",): (prefix + "norm.weight", (D,)),
    }
    for i, layer_type in enumerate(cfg.layer_types):
        key_prefix = f"{prefix}layers.{i}."
        specs.update(_spec_leaves(_layer_specs(cfg, layer_type, keys, key_prefix), key_prefix, ("layers", i)))
    if not cfg.tie_word_embeddings:
        specs[("lm_head",)] = ("lm_head.weight", (V, D))
    if any(k.startswith("mtp.") for k in keys):
        specs[("mtp", "fc")] = ("mtp.fc.weight", (D, 2 * D))
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            specs[("mtp", name)] = (f"mtp.{name}.weight", (D,))
        for i in sorted({int(k.split(".")[2]) for k in keys if k.startswith("mtp.layers.")}):
            key_prefix = f"mtp.layers.{i}."
            specs.update(_spec_leaves(_layer_specs(cfg, FULL_ATTENTION, keys, key_prefix), key_prefix,
                                      ("mtp", "layers", i)))
    return specs


def load_params(source: TensorSource, cfg: Qwen35Config, dtype) -> dict:
    """Validate every key and shape first (headers only), then stream tensors to the device."""
    from ..loading import build_tree
    keys = set(source.keys())
    specs = param_specs(cfg, keys, source.description)
    expected = {}
    for key, shape in specs.values():
        if shape is None:
            for group in key:
                expected.update(dict(group))
        else:
            expected[key] = shape
    source.check(expected)

    def read(spec):
        key, shape = spec
        if shape is None:  # stacked per-expert weights: [E, sum of group rows, ...]
            return jnp.stack([jnp.concatenate([source.read(k, dtype) for k, _ in group], axis=0)
                              for group in key])
        x = source.read(key, dtype)
        return x[:, 0, :] if key.endswith("conv1d.weight") else x  # [C, 1, W] -> [C, W]

    return build_tree(specs, read)


def hf_tensors(params: dict, cfg: Qwen35Config, prefix: str = "model.") -> dict[str, jax.Array]:
    """Inverse of load_params (fused expert layout): {HF key: array}, for saving checkpoints."""
    out: dict[str, jax.Array] = {prefix + "embed_tokens.weight": params["embed"],
                                 prefix + "norm.weight": params["final_norm"]}
    if params.get("lm_head") is not None:
        out["lm_head.weight"] = params["lm_head"]

    def emit(layer: dict, layer_type: str, key_prefix: str):
        for path, (key, _) in _spec_leaves(_layer_specs(cfg, layer_type, set(), key_prefix), key_prefix, ()):
            x = layer[path[0]] if len(path) == 1 else layer[path[0]][path[1]]
            out[key] = x[:, None, :] if key.endswith("conv1d.weight") else x

    for i, layer_type in enumerate(cfg.layer_types):
        emit(params["layers"][i], layer_type, f"{prefix}layers.{i}.")
    if params.get("mtp"):
        mtp = params["mtp"]
        out["mtp.fc.weight"] = mtp["fc"]
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out[f"mtp.{name}.weight"] = mtp[name]
        for i, layer in enumerate(mtp["layers"]):
            emit(layer, FULL_ATTENTION, f"mtp.layers.{i}.")
    return out


# ---------------------------------------------------------------------------------------- layers

def lm_head_weight(params: dict) -> jax.Array:
    return params["lm_head"] if params.get("lm_head") is not None else params["embed"]


def gdn_mixer(p: dict, cfg: Qwen35Config, x: jax.Array, conv_state: jax.Array, rec_state: jax.Array,
              impl: str, collect: bool):
    """Gated DeltaNet token mixer. x [B, T, D] -> out [B, T, D], new conv/recurrent state, extras."""
    B, T, _ = x.shape
    H, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    K, V, W = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    qkv = L.linear(x, p["in_proj_qkv"])  # [B, T, C]
    z = L.linear(x, p["in_proj_z"]).reshape(B, T, HV, V)
    b = L.linear(x, p["in_proj_b"])  # [B, T, HV]
    a = L.linear(x, p["in_proj_a"])  # [B, T, HV]

    window = jnp.concatenate([conv_state.astype(qkv.dtype), qkv], axis=1)  # [B, W-1+T, C]
    w = p["conv"].astype(jnp.float32)  # [C, W]
    conv = sum(window[:, i:i + T].astype(jnp.float32) * w[:, i] for i in range(W))  # [B, T, C]
    conv = jax.nn.silu(conv.astype(qkv.dtype))
    new_conv = window[:, T:]  # the last W-1 inputs  [B, W-1, C]

    key_dim = H * K
    q = conv[..., :key_dim].reshape(B, T, H, K)
    k = conv[..., key_dim:2 * key_dim].reshape(B, T, H, K)
    v = conv[..., 2 * key_dim:].reshape(B, T, HV, V)
    beta = jax.nn.sigmoid(b)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))

    kwargs = dict(initial_state=rec_state, output_final_state=True, return_pseudo_values=collect,
                  use_qk_l2norm=True, implementation=impl)
    if T <= 1 or (collect and T <= 64):
        res = gated_delta.fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    else:
        res = gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    o = L.gated_rms_norm(res.o.astype(x.dtype), z, p["norm"], cfg.rms_norm_eps)  # [B, T, HV, V]
    out = L.linear(o.reshape(B, T, HV * V), p["out_proj"])
    extras = {"k": k, "g": g, "v_new": res.v_new, "conv_window": window} if collect else {}
    return out, new_conv, res.final_state, extras


def attention_mixer(p: dict, cfg: Qwen35Config, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    positions: jax.Array, mask: jax.Array):
    """Gated full attention. positions [B, T]; mask [B, T, S]. Returns out and the updated caches."""
    B, T, _ = x.shape
    nH, nKV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg = L.linear(x, p["q_proj"]).reshape(B, T, nH, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    q = L.rms_norm(q, p["q_norm"], cfg.rms_norm_eps, zero_centered=True)
    k = L.rms_norm(L.linear(x, p["k_proj"]).reshape(B, T, nKV, hd), p["k_norm"], cfg.rms_norm_eps,
                   zero_centered=True)
    v = L.linear(x, p["v_proj"]).reshape(B, T, nKV, hd)
    cos, sin = L.rope_angles(positions, _inv_freq(cfg))
    q, k = L.apply_rope_half(q, cos, sin), L.apply_rope_half(k, cos, sin)
    k_cache = L.write_cache(k_cache, k, positions[:, 0])
    v_cache = L.write_cache(v_cache, v, positions[:, 0])
    attn = L.attention(q, k_cache, v_cache, mask, hd ** -0.5)  # [B, T, nH, hd]
    attn = attn.reshape(B, T, nH * hd) * jax.nn.sigmoid(gate.reshape(B, T, nH * hd))
    return L.linear(attn, p["o_proj"]), k_cache, v_cache


@functools.cache
def _inv_freq_cached(rotary_dim: int, theta: float):
    return L.rope_inv_freq(rotary_dim, theta)


def _inv_freq(cfg: Qwen35Config):
    return _inv_freq_cached(cfg.rotary_dim, cfg.rope_theta)


def moe_mlp(p: dict, cfg: Qwen35Config, x: jax.Array) -> jax.Array:
    """Softmax router (float32), top-k renormalised, experts, plus the sigmoid-gated shared expert."""
    B, T, D = x.shape
    xt = x.reshape(B * T, D)
    N, E, k = B * T, cfg.num_experts, cfg.num_experts_per_tok
    router_logits = L.linear(xt, p["router"])
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top_w, top_i = lax.top_k(probs, k)  # [N, k]
    top_w = (top_w / jnp.sum(top_w, axis=-1, keepdims=True)).astype(router_logits.dtype)
    I = cfg.moe_intermediate_size
    if N * k <= E:
        # Few tokens (decode / verification): read only the selected experts' weights.
        gate_up = p["experts_gate_up"][top_i]  # [N, k, 2I, D]
        h = jnp.einsum("nd,nkfd->nkf", xt, gate_up.astype(x.dtype), preferred_element_type=jnp.float32)
        h = (jax.nn.silu(h[..., :I]) * h[..., I:]).astype(x.dtype)
        y = jnp.einsum("nki,nkdi->nkd", h, p["experts_down"][top_i].astype(x.dtype),
                       preferred_element_type=jnp.float32).astype(x.dtype)
    else:
        # Many tokens: sort token copies by expert and run grouped matmuls.
        flat_e = top_i.reshape(-1)
        order = jnp.argsort(flat_e)
        rows = xt[order // k]  # [N*k, D]
        sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
        h = lax.ragged_dot(rows, jnp.swapaxes(p["experts_gate_up"], 1, 2).astype(x.dtype), sizes,
                           preferred_element_type=jnp.float32)
        h = (jax.nn.silu(h[..., :I]) * h[..., I:]).astype(x.dtype)
        y_sorted = lax.ragged_dot(h, jnp.swapaxes(p["experts_down"], 1, 2).astype(x.dtype), sizes,
                                  preferred_element_type=jnp.float32).astype(x.dtype)
        y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(N, k, D)
    out = jnp.sum((y * top_w[..., None]).astype(jnp.float32), axis=1).astype(x.dtype)
    if "shared_gate_proj" in p:
        shared = L.swiglu(xt, p["shared_gate_proj"], p["shared_up_proj"], p["shared_down_proj"])
        out = out + jax.nn.sigmoid(L.linear(xt, p["shared_expert_gate"])) * shared
    return out.reshape(B, T, D)


def mlp(p: dict, cfg: Qwen35Config, x: jax.Array) -> jax.Array:
    if cfg.is_moe:
        return moe_mlp(p, cfg, x)
    return L.swiglu(x, p["gate_proj"], p["up_proj"], p["down_proj"])


# --------------------------------------------------------------------------------------- forward

def forward(params: dict, cfg: Qwen35Config, state: Qwen35State, input_ids: jax.Array, *,
            impl: str = "auto", collect: bool = False, logits_for: str = "all"):
    """Run T >= 1 new tokens [B, T] from `state`; returns (logits, new_state, extras).

    logits: [B, T, vocab] float32 ("all") or [B, 1, vocab] for the last position ("last").
    collect: also return what speculative commit needs per GDN layer (k, g, v_new, conv window)
    and the final hidden states (for MTP drafters) in `extras`.
    """
    B, T = input_ids.shape
    dtype = params["embed"].dtype
    x = params["embed"][input_ids].astype(dtype)  # [B, T, D]
    positions = state.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    mask = L.causal_cache_mask(positions, state.max_len) if state.keys else None
    keys, values = list(state.keys), list(state.values)
    conv, rec = list(state.conv), list(state.recurrent)
    gdn_extras = []
    for i, layer_type in enumerate(cfg.layer_types):
        p = params["layers"][i]
        slot = cfg.slot(i)
        h = L.rms_norm(x, p["input_norm"], cfg.rms_norm_eps, zero_centered=True)
        if layer_type == FULL_ATTENTION:
            h, keys[slot], values[slot] = attention_mixer(p["mixer"], cfg, h, keys[slot], values[slot],
                                                          positions, mask)
        else:
            h, conv[slot], rec[slot], ex = gdn_mixer(p["mixer"], cfg, h, conv[slot], rec[slot], impl, collect)
            gdn_extras.append(ex)
        x = x + h
        x = x + mlp(p["mlp"], cfg, L.rms_norm(x, p["post_norm"], cfg.rms_norm_eps, zero_centered=True))
    hidden = L.rms_norm(x, params["final_norm"], cfg.rms_norm_eps, zero_centered=True)
    head_in = hidden[:, -1:] if logits_for == "last" else hidden
    logits = lax.dot_general(head_in, lm_head_weight(params).astype(dtype), (((2,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    new_state = Qwen35State(keys=tuple(keys), values=tuple(values), conv=tuple(conv), recurrent=tuple(rec),
                            length=state.length + T)
    extras = {"gdn": gdn_extras, "hidden": hidden} if collect else {}
    return logits, new_state, extras


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "logits_for"), donate_argnames=("state",))
def forward_jit(params, cfg, state, input_ids, impl="auto", logits_for="all"):
    """Jitted `forward` (state donated) returning (logits, new_state)."""
    logits, state, _ = forward(params, cfg, state, input_ids, impl=impl, logits_for=logits_for)
    return logits, state


def prefill(params, cfg, state, input_ids, impl="auto"):
    """Prompt [B, T] from `state` (usually fresh): last-position logits [B, vocab] and the new state."""
    logits, state = forward_jit(params, cfg, state, input_ids, impl=impl, logits_for="last")
    return logits[:, 0], state


def decode_step(params, cfg, state, token_ids, impl="auto"):
    """One token per sequence [B]: logits [B, vocab] and the new state."""
    logits, state = forward_jit(params, cfg, state, token_ids[:, None], impl=impl, logits_for="last")
    return logits[:, 0], state
