"""Qwen3.5's MLPs: the dense SwiGLU and the MoE block (softmax router, top-k experts, sigmoid-gated shared expert),
transformers' `modeling_qwen3_5_moe.py` numerics. Split from qwen35.py to keep each module within its size budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .config import Qwen35Config
from .. import layers as L


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
    if "shared_gate_up_proj" in p:
        shared = L.swiglu_fused(xt, p["shared_gate_up_proj"], p["shared_down_proj"], groups=cfg.tp_size)
        out = out + jax.nn.sigmoid(L.linear(xt, p["shared_expert_gate"])) * shared
    return out.reshape(B, T, D)


def mlp(p: dict, cfg: Qwen35Config, x: jax.Array) -> jax.Array:
    if cfg.is_moe:
        return moe_mlp(p, cfg, x)
    return L.swiglu_fused(x, p["gate_up_proj"], p["down_proj"], groups=cfg.tp_size)
