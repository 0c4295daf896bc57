"""Qwen3.5's MLPs: the dense SwiGLU and the MoE block (softmax router, top-k experts, sigmoid-gated shared expert),
transformers' `modeling_qwen3_5_moe.py` numerics. Split from qwen35.py to keep each module within its size budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import attention, experts

from .config import Qwen35Config
from .. import layers as L


def route(p: dict, cfg: Qwen35Config, xt: jax.Array, valid: jax.Array | None = None):
    """Softmax router (float32), top-k renormalised: (weights [N, k] in x's dtype, experts [N, k] int32). Tokens
    where `valid` [N] is False (padding rows) select no expert: id -1, weight 0."""
    router_logits = L.linear(xt, p["router"])
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top_w, top_i = lax.top_k(probs, cfg.num_experts_per_tok)  # [N, k]
    top_w = (top_w / jnp.sum(top_w, axis=-1, keepdims=True)).astype(router_logits.dtype)
    if valid is not None:
        top_i = jnp.where(valid[:, None], top_i, -1)
        top_w = jnp.where(valid[:, None], top_w, jnp.zeros((), top_w.dtype))
    return top_w, top_i.astype(jnp.int32)


def expert_implementation(cfg: Qwen35Config, impl: str) -> str:
    """The expert products' implementation for the model's `impl`: the grouped kernel where the model asks for Pallas
    kernels ("pallas"), the experts' own default for "auto" (`experts.resolve`), XLA's under a mesh (the kernel does
    not split) and for the reference implementations."""
    if cfg.mesh is not None or impl == "reference" or impl == "naive":
        return "xla"
    return "pallas" if impl == "pallas" else "auto"


def moe_mlp(p: dict, cfg: Qwen35Config, x: jax.Array, valid: jax.Array | None = None, impl: str = "auto") -> jax.Array:
    """Router, top-k experts and the sigmoid-gated shared expert. valid [B, T] bool: rows that are padding select no
    expert (they read no expert weight; their output is the shared expert's alone). Each token's output sums its k
    experts in rank order in float32, whatever other rows share its forward (`pallas_kernels.experts`)."""
    B, T, D = x.shape
    xt = x.reshape(B * T, D)
    top_w, top_i = route(p, cfg, xt, None if valid is None else valid.reshape(B * T))
    chosen = expert_implementation(cfg, impl)
    if chosen == "xla":
        chosen = "gather" if B * T * cfg.num_experts_per_tok <= cfg.num_experts else "ragged"
    y = experts.expert_swiglu(xt, top_i, p["experts_gate_up"], p["experts_down"], implementation=chosen,
                              decode_shape=T < attention.FLASH_MIN_ROWS)  # [N, k, D]; decode shapes as attention's
    out = (y[:, 0] * top_w[:, :1]).astype(jnp.float32)
    for s in range(1, top_i.shape[1]):  # rank order: a row's sum never depends on the batch's shape
        out = out + (y[:, s] * top_w[:, s:s + 1]).astype(jnp.float32)
    out = out.astype(x.dtype)
    if "shared_gate_up_proj" in p:
        shared = L.swiglu_fused(xt, p["shared_gate_up_proj"], p["shared_down_proj"], groups=cfg.tp_size)
        out = out + jax.nn.sigmoid(L.linear(xt, p["shared_expert_gate"])) * shared
    return out.reshape(B, T, D)


def mlp(p: dict, cfg: Qwen35Config, x: jax.Array, valid: jax.Array | None = None, impl: str = "auto") -> jax.Array:
    """The layer's MLP on x [B, T, D]; valid [B, T] (MoE only): False for padding rows, which select no expert."""
    if cfg.is_moe:
        return moe_mlp(p, cfg, x, valid, impl)
    return L.swiglu_fused(x, p["gate_up_proj"], p["down_proj"], groups=cfg.tp_size)
