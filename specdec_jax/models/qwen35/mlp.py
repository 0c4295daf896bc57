"""Qwen3.5's MLPs: the dense SwiGLU and the MoE block (softmax router, top-k experts, sigmoid-gated shared expert),
transformers' `modeling_qwen3_5_moe.py` numerics. Split from qwen35.py to keep each module within its size budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import attention, experts

from .config import Qwen35Config
from .. import layers as L


# Up to this many rows (decode steps and verifications) the router's top-k is taken by ranks from compare matrices
# ([N, E, E] compares in one reduction) instead of XLA's TopK, a sort on the GPU; more rows (prefill chunks) take
# lax.top_k. Both give the same experts in the same order (ties: the lower expert id first) and the same weights
# (`test_the_compared_top_k_is_lax_top_k`). 0: always lax.top_k. On an H100, AR at the 10-layer 35B-A3B shape:
# 745.1 -> 756.3 tok/s alone (docs/LOG.md, 2026-12-07 evening).
TOPK_COMPARE_MAX_ROWS = 64


# Whether decode-shape forwards on the expert kernel run the shared expert as one more tile of its launches (expert id
# E, read where it is stored; weight sigmoid(shared_expert_gate(x)), summed after the k routed experts in float32)
# instead of XLA GEMMs and an add, where its intermediate size is a routed expert's (35B-A3B: 512) and there is no
# mesh. Under it the fused MoE input layout holds the router and the shared expert gate as one `router_gate` weight
# and the shared gate|up apart (`fuse_moe_inputs`). Part of the compiled programs' key (`decoding.compiled`). Off until
# a GPU measures it (`benchmarks/gpu_moe.sh variants`; docs/LOG.md, 2026-12-08: built while device loans were paused).
SHARED_EXPERT_TILE = False


def top_k(probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """probs [N, E] -> (values [N, k], indices [N, k] int32) as `lax.top_k` gives them."""
    N, E = probs.shape
    if N > TOPK_COMPARE_MAX_ROWS:
        values, indices = lax.top_k(probs, k)
        return values, indices.astype(jnp.int32)
    ids = jnp.arange(E, dtype=jnp.int32)
    ahead = (probs[:, None, :] > probs[:, :, None]) | ((probs[:, None, :] == probs[:, :, None])
                                                       & (ids[None, :] < ids[:, None])[None])  # [N, E(i), E(j)]
    rank = jnp.sum(ahead, axis=-1, dtype=jnp.int32)  # [N, E]: the experts ahead of expert i
    at = rank[:, None, :] == jnp.arange(k, dtype=jnp.int32)[None, :, None]  # [N, k, E]: one expert per rank
    indices = jnp.sum(jnp.where(at, ids[None, None, :], 0), axis=-1, dtype=jnp.int32)
    values = jnp.sum(jnp.where(at, probs[:, None, :], jnp.zeros((), probs.dtype)), axis=-1)  # one term: exact
    return values, indices


def route_logits(router_logits: jax.Array, cfg: Qwen35Config, valid: jax.Array | None = None):
    """Router logits [N, E] -> softmax (float32), top-k renormalised: (weights [N, k] in the logits' dtype, experts
    [N, k] int32). Tokens where `valid` [N] is False (padding rows) select no expert: id -1, weight 0."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top_w, top_i = top_k(probs, cfg.num_experts_per_tok)  # [N, k]
    top_w = (top_w / jnp.sum(top_w, axis=-1, keepdims=True)).astype(router_logits.dtype)
    if valid is not None:
        top_i = jnp.where(valid[:, None], top_i, -1)
        top_w = jnp.where(valid[:, None], top_w, jnp.zeros((), top_w.dtype))
    return top_w, top_i.astype(jnp.int32)


def route(p: dict, cfg: Qwen35Config, xt: jax.Array, valid: jax.Array | None = None):
    """The router on tokens xt [N, D] (`route_logits`), from any parameter layout (`moe_inputs`)."""
    return route_logits(moe_inputs(p, cfg, xt, shared_gate_up=False)[0], cfg, valid)


def moe_inputs(p: dict, cfg: Qwen35Config, xt: jax.Array, shared_gate_up: bool = True):
    """What the MoE block computes from its input xt [N, D] by products with stored weights: (router logits [N, E],
    the shared expert's gate|up pre-activations [N, 2S] or None, the shared expert gate's pre-activation [N, 1] or
    None). One product where the layer holds them fused (`router_shared`, `fuse_moe_inputs`), else three; with
    `router_gate` (the shared expert as a kernel tile) one for the router and the gate, and the gate|up's own where
    `shared_gate_up` asks for it (None otherwise, and where the layout leaves it to that product)."""
    E = cfg.num_experts
    if "router_shared" in p:
        y = L.linear(xt, p["router_shared"])  # [N, E + 2S + 1]
        return y[:, :E], y[:, E:-1], y[:, -1:]
    own = lambda: L.linear(xt, p["shared_gate_up_proj"]) if shared_gate_up else None
    if "router_gate" in p:
        y = L.linear(xt, p["router_gate"])  # [N, E + 1]
        return y[:, :E], own(), y[:, E:]
    if "shared_gate_up_proj" not in p:
        return L.linear(xt, p["router"]), None, None
    return L.linear(xt, p["router"]), own(), L.linear(xt, p["shared_expert_gate"])


def shared_tile_fits(cfg: Qwen35Config) -> bool:
    """Whether the model's shared expert has a routed expert's shape (S = I), so the expert kernel can run it as a
    tile (SHARED_EXPERT_TILE), and there is no mesh (the kernel does not split)."""
    return (cfg.is_moe and cfg.mesh is None and bool(cfg.shared_expert_intermediate_size)
            and cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size)


def fuse_moe_inputs(p: dict, shared_tile: bool = False) -> dict:
    """A MoE layer's parameters with the router [E, D], the shared expert's gate|up [2S, D] and the shared expert
    gate [1, D] stacked as one `router_shared` [E + 2S + 1, D]: the three products on the block's input become one
    (a decode step's three small GEMMs per layer, one launch). shared_tile (the shared expert as a tile of the expert
    kernel, SHARED_EXPERT_TILE): the router and the gate stacked as `router_gate` [E + 1, D], the gate|up kept as
    stored (the kernel reads it). Other layers, and layers already fused or without a shared expert, come back as
    they are. Not under a mesh: the router is replicated and gate|up split by columns."""
    if "router" not in p or "shared_gate_up_proj" not in p:
        return p
    if shared_tile:
        q = {k: v for k, v in p.items() if k not in ("router", "shared_expert_gate")}
        q["router_gate"] = jnp.concatenate([p["router"], p["shared_expert_gate"]], axis=0)
        return q
    q = {k: v for k, v in p.items() if k not in ("router", "shared_gate_up_proj", "shared_expert_gate")}
    q["router_shared"] = jnp.concatenate([p["router"], p["shared_gate_up_proj"], p["shared_expert_gate"]], axis=0)
    return q


def unfuse_moe_inputs(p: dict, cfg: Qwen35Config) -> dict:
    """`fuse_moe_inputs` undone, either form (the checkpoint's layout: saving, tensor-parallel placement)."""
    E = cfg.num_experts
    if "router_gate" in p:
        w = p["router_gate"]
        q = {k: v for k, v in p.items() if k != "router_gate"}
        q.update(router=w[:E], shared_expert_gate=w[E:])
        return q
    if "router_shared" not in p:
        return p
    w = p["router_shared"]
    q = {k: v for k, v in p.items() if k != "router_shared"}
    q.update(router=w[:E], shared_gate_up_proj=w[E:-1], shared_expert_gate=w[-1:])
    return q


def moe_input_form(p: dict) -> str:
    """Which MoE input layout a layer's parameters are in: "router_shared", "router_gate" or "plain" (the
    checkpoint's)."""
    return "router_shared" if "router_shared" in p else "router_gate" if "router_gate" in p else "plain"


def to_moe_input_form(p: dict, cfg: Qwen35Config, form: str) -> dict:
    """A layer's MLP parameters in `form` (`moe_input_form`'s names)."""
    p = unfuse_moe_inputs(p, cfg)
    return p if form == "plain" else fuse_moe_inputs(p, shared_tile=form == "router_gate")


def expert_implementation(cfg: Qwen35Config, impl: str) -> str:
    """The expert products' implementation for the model's `impl`: the grouped kernel where the model asks for Pallas
    kernels ("pallas"), the experts' own default for "auto" (`experts.resolve`), XLA's under a mesh (the kernel does
    not split) and for the reference implementations."""
    if cfg.mesh is not None or impl == "reference" or impl == "naive":
        return "xla"
    return "pallas" if impl == "pallas" else "auto"


def moe_mlp(p: dict, cfg: Qwen35Config, x: jax.Array, valid: jax.Array | None = None, impl: str = "auto",
            live_rows: int | None = None) -> jax.Array:
    """Router, top-k experts and the sigmoid-gated shared expert. valid [B, T] bool: rows that are padding select no
    expert (they read no expert weight; their output is the shared expert's alone, or nothing where the shared expert
    is a kernel tile). live_rows (static) or None: no valid row of a sequence lies past its first live_rows (an AR
    step padded to a verification's rows: 1), so the expert products run on those rows only and the layout's size
    follows the rows that can select experts. Routing and the shared expert (where it is not a tile) still run on
    all T rows: a row's products keep one shape in AR and in verification. Each token's output sums its k experts in
    rank order in float32 (then the shared expert where it is a tile), whatever other rows share its forward
    (`pallas_kernels.experts`)."""
    B, T, D = x.shape
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    xt = x.reshape(B * T, D)
    chosen = expert_implementation(cfg, impl)
    if chosen == "xla":
        chosen = "gather" if B * T * k <= E else "ragged"
    decode_shape = T < attention.FLASH_MIN_ROWS  # decode shapes as attention's
    chosen = experts.implementation_for(chosen, B * T * k, p["experts_gate_up"].shape, p["experts_down"].shape,
                                        experts.tiles_for(decode_shape))
    # The shared expert as one more tile of the kernel's launches (SHARED_EXPERT_TILE): decode shapes on the kernel,
    # a layout that holds its gate|up apart, a routed expert's shape.
    tile = (SHARED_EXPERT_TILE and decode_shape and chosen == "pallas" and "shared_gate_up_proj" in p
            and experts.shared_fits(p["experts_gate_up"].shape, p["experts_down"].shape,
                                    p["shared_gate_up_proj"].shape, p["shared_down_proj"].shape))
    router_logits, shared_gate_up, shared_gate = moe_inputs(p, cfg, xt, shared_gate_up=not tile)
    flat_valid = None if valid is None else valid.reshape(B * T)
    top_w, top_i = route_logits(router_logits, cfg, flat_valid)
    # Only the kernel computes a row in the same bits whatever the rows beside it, so only it drops the padding rows.
    R = T if live_rows is None or chosen != "pallas" else max(1, min(int(live_rows), T))
    xe = xt
    shared, shared_on, shared_w = None, None, None
    if tile:  # every valid row selects the shared expert (padding rows: none), weight sigmoid(gate)
        shared = (p["shared_gate_up_proj"], p["shared_down_proj"])
        shared_on = jnp.ones((B * T,), bool) if flat_valid is None else flat_valid
        shared_w = jax.nn.sigmoid(shared_gate).astype(x.dtype)  # [B T, 1]
    if R < T:  # [B * T, ...] -> the first R rows of each sequence, [B * R, ...]
        first = lambda a: a.reshape(B, T, *a.shape[1:])[:, :R].reshape(B * R, *a.shape[1:])
        xe, top_w, top_i = first(xt), first(top_w), first(top_i)
        if tile:
            shared_on, shared_w = first(shared_on), first(shared_w)
    y = experts.expert_swiglu(xe, top_i, p["experts_gate_up"], p["experts_down"], implementation=chosen,
                              decode_shape=decode_shape, shared=shared,
                              shared_selected=shared_on)  # [B R, k (+ 1), D]
    out = (y[:, 0] * top_w[:, :1]).astype(jnp.float32)
    for s in range(1, top_i.shape[1]):  # rank order: a row's sum never depends on the batch's shape
        out = out + (y[:, s] * top_w[:, s:s + 1]).astype(jnp.float32)
    if tile:  # then the shared expert, a fixed last term
        out = out + (y[:, k] * shared_w).astype(jnp.float32)
    out = out.astype(x.dtype)
    if R < T:  # the rows past live_rows are padding: no expert output
        out = jnp.pad(out.reshape(B, R, D), ((0, 0), (0, T - R), (0, 0))).reshape(B * T, D)
    if shared_gate_up is not None:
        shared_out = L.swiglu_from(shared_gate_up, p["shared_down_proj"], groups=cfg.tp_size)
        out = out + jax.nn.sigmoid(shared_gate) * shared_out
    return out.reshape(B, T, D)


def mlp(p: dict, cfg: Qwen35Config, x: jax.Array, valid: jax.Array | None = None, impl: str = "auto",
        live_rows: int | None = None) -> jax.Array:
    """The layer's MLP on x [B, T, D]; valid [B, T] and live_rows (MoE only): False for padding rows, which select no
    expert; no valid row past the first live_rows of a sequence (`moe_mlp`)."""
    if cfg.is_moe:
        return moe_mlp(p, cfg, x, valid, impl, live_rows)
    return L.swiglu_fused(x, p["gate_up_proj"], p["down_proj"], groups=cfg.tp_size)
