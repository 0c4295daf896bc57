"""Qwen3.5 parameters: how each parameter of the functional model is assembled from checkpoint tensors
(`param_specs`: names, shapes, fused projections, stacked experts), loading with every key and shape checked
first (`load_params`), the inverse for saving (`hf_tensors`), and the tensor-parallel layout of the fused
rows (`fused_segments`, `split_counts`, `with_mesh`, `place_param`, `shard_params`). Split from `qwen35.py`,
which keeps the state, the layers and the forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ... import sharding
from .config import FULL_ATTENTION, Qwen35Config
from . import mlp as _mlp
from ...errors import CheckpointError
from ...loading import TensorSource, build_tree, flatten_tree
from ...sharding import Segment, SplitCount

# ------------------------------------------------------------------------------------- parameters

class Leaf(NamedTuple):
    """How one parameter is assembled from checkpoint tensors: each group's parts are concatenated
    along axis 0 (fused projections: one GEMV instead of several at decode), and groups are
    stacked when `stack` (per-expert tensors -> one [E, ...] array)."""

    groups: tuple[tuple[tuple[str, tuple], ...], ...]
    stack: bool = False

    def with_prefix(self, prefix: str) -> "Leaf":
        return Leaf(tuple(tuple((prefix + k, s) for k, s in g) for g in self.groups), self.stack)

    def parts(self):
        return [part for group in self.groups for part in group]


def _one(key: str, shape: tuple) -> Leaf:
    return Leaf((((key, shape),),))


def _concat(*parts: tuple[str, tuple]) -> Leaf:
    return Leaf((tuple(parts),))


def _attention_specs(cfg: Qwen35Config) -> dict[str, Leaf]:
    D, hd = cfg.hidden_size, cfg.head_dim
    nH, nKV = cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        "qkv_proj": _concat(("self_attn.q_proj.weight", (2 * nH * hd, D)), ("self_attn.k_proj.weight", (nKV * hd, D)),
                            ("self_attn.v_proj.weight", (nKV * hd, D))),
        "o_proj": _one("self_attn.o_proj.weight", (D, nH * hd)),
        "q_norm": _one("self_attn.q_norm.weight", (hd,)),
        "k_norm": _one("self_attn.k_norm.weight", (hd,)),
    }


def _gdn_specs(cfg: Qwen35Config) -> dict[str, Leaf]:
    D, HV = cfg.hidden_size, cfg.linear_num_value_heads
    return {
        "in_proj": _concat(("linear_attn.in_proj_qkv.weight", (cfg.conv_dim, D)),
                           ("linear_attn.in_proj_z.weight", (cfg.linear_value_dim, D)),
                           ("linear_attn.in_proj_b.weight", (HV, D)), ("linear_attn.in_proj_a.weight", (HV, D))),
        "conv": _one("linear_attn.conv1d.weight", (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim)),
        "A_log": _one("linear_attn.A_log", (HV,)),
        "dt_bias": _one("linear_attn.dt_bias", (HV,)),
        "norm": _one("linear_attn.norm.weight", (cfg.linear_value_head_dim,)),
        "out_proj": _one("linear_attn.out_proj.weight", (D, cfg.linear_value_dim)),
    }


def _mlp_specs(cfg: Qwen35Config, keys: set[str], prefix: str) -> dict[str, Leaf]:
    """Dense SwiGLU, or MoE with fused ('experts.gate_up_proj') or per-expert expert weights."""
    D = cfg.hidden_size
    if not cfg.is_moe:
        F = cfg.intermediate_size
        return {"gate_up_proj": _concat(("mlp.gate_proj.weight", (F, D)), ("mlp.up_proj.weight", (F, D))),
                "down_proj": _one("mlp.down_proj.weight", (D, F))}
    E, I, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    specs: dict[str, Leaf] = {"router": _one("mlp.gate.weight", (E, D))}
    if prefix + "mlp.experts.gate_up_proj" in keys or prefix + "mlp.experts.0.gate_proj.weight" not in keys:
        specs["experts_gate_up"] = _one("mlp.experts.gate_up_proj", (E, 2 * I, D))
        specs["experts_down"] = _one("mlp.experts.down_proj", (E, D, I))
    else:  # per-expert tensors are stacked at load into the fused layout
        specs["experts_gate_up"] = Leaf(tuple(
            ((f"mlp.experts.{e}.gate_proj.weight", (I, D)), (f"mlp.experts.{e}.up_proj.weight", (I, D)))
            for e in range(E)), stack=True)
        specs["experts_down"] = Leaf(tuple(((f"mlp.experts.{e}.down_proj.weight", (D, I)),) for e in range(E)),
                                     stack=True)
    if S:
        specs["shared_gate_up_proj"] = _concat(("mlp.shared_expert.gate_proj.weight", (S, D)),
                                               ("mlp.shared_expert.up_proj.weight", (S, D)))
        specs["shared_down_proj"] = _one("mlp.shared_expert.down_proj.weight", (D, S))
        specs["shared_expert_gate"] = _one("mlp.shared_expert_gate.weight", (1, D))
    return specs


def _layer_specs(cfg: Qwen35Config, layer_type: str, keys: set[str], prefix: str) -> dict[str, Any]:
    D = cfg.hidden_size
    mixer = _attention_specs(cfg) if layer_type == FULL_ATTENTION else _gdn_specs(cfg)
    return {
        "input_norm": _one("input_layernorm.weight", (D,)),
        "post_norm": _one("post_attention_layernorm.weight", (D,)),
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
    """Yield (param path, Leaf with full keys) for one layer's spec tree."""
    for name, node in layer_tree.items():
        items = node.items() if isinstance(node, dict) else [(None, node)]
        for leaf_name, leaf in items:
            yield path + (name,) + ((leaf_name,) if leaf_name else ()), leaf.with_prefix(key_prefix)


def param_specs(cfg: Qwen35Config, keys: set[str], where: str) -> dict[tuple, Leaf]:
    """{param path: Leaf} for every parameter to load."""
    prefix = detect_prefix(keys, where)
    D, V = cfg.hidden_size, cfg.vocab_size
    specs: dict[tuple, Leaf] = {
        ("embed",): _one(prefix + "embed_tokens.weight", (V, D)),
        ("final_norm",): _one(prefix + "norm.weight", (D,)),
    }
    for i, layer_type in enumerate(cfg.layer_types):
        key_prefix = f"{prefix}layers.{i}."
        specs.update(_spec_leaves(_layer_specs(cfg, layer_type, keys, key_prefix), key_prefix, ("layers", i)))
    if not cfg.tie_word_embeddings:
        specs[("lm_head",)] = _one("lm_head.weight", (V, D))
    if any(k.startswith("mtp.") for k in keys):
        specs[("mtp", "fc")] = _one("mtp.fc.weight", (D, 2 * D))
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            specs[("mtp", name)] = _one(f"mtp.{name}.weight", (D,))
        for i in sorted({int(k.split(".")[2]) for k in keys if k.startswith("mtp.layers.")}):
            key_prefix = f"mtp.layers.{i}."
            specs.update(_spec_leaves(_layer_specs(cfg, FULL_ATTENTION, keys, key_prefix), key_prefix,
                                      ("mtp", "layers", i)))
    return specs


def _is_conv(key: str) -> bool:
    return key.endswith("conv1d.weight")  # stored [C, 1, W]; kept as [C, W]


# ------------------------------------------------------------------------------ tensor parallelism

def _gdn_conv_segments(cfg: Qwen35Config) -> tuple[Segment, ...]:
    H, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    return (Segment(H, cfg.linear_key_head_dim), Segment(H, cfg.linear_key_head_dim),
            Segment(HV, cfg.linear_value_head_dim))


def fused_segments(cfg: Qwen35Config) -> dict[str, tuple[Segment, ...]]:
    """Leaf name -> the parts its row axis joins, in the checkpoint's order (what the specs above concatenate):
    the grouped tensor-parallel layout is built from these (sharding.grouped_rows)."""
    nH, nKV, hd, HV = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.linear_num_value_heads
    out = {"qkv_proj": (Segment(nH, 2 * hd), Segment(nKV, hd), Segment(nKV, hd)),  # (q ; gate) per head | k | v
           "in_proj": _gdn_conv_segments(cfg) + (Segment(HV, cfg.linear_value_head_dim), Segment(HV), Segment(HV)),
           "conv": _gdn_conv_segments(cfg)}
    if not cfg.is_moe:
        out["gate_up_proj"] = (Segment(cfg.intermediate_size), Segment(cfg.intermediate_size))
    elif cfg.shared_expert_intermediate_size:
        S = cfg.shared_expert_intermediate_size
        out["shared_gate_up_proj"] = (Segment(S), Segment(S))
    return out


def split_counts(cfg: Qwen35Config) -> tuple[SplitCount, ...]:
    """Every count the mesh splits (sharding.PARAM_PARTITIONS); key/value and GDN key heads may be copied."""
    counts = [SplitCount("num_attention_heads", cfg.num_attention_heads),
              SplitCount("num_key_value_heads", cfg.num_key_value_heads, repeatable=True),
              SplitCount("vocab_size", cfg.vocab_size)]
    if cfg.linear_layers:
        counts += [SplitCount("linear_num_value_heads", cfg.linear_num_value_heads),
                   SplitCount("linear_num_key_heads", cfg.linear_num_key_heads, repeatable=True)]
    if cfg.is_moe:
        counts.append(SplitCount("num_experts", cfg.num_experts))
        if cfg.shared_expert_intermediate_size:
            counts.append(SplitCount("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size))
    else:
        counts.append(SplitCount("intermediate_size", cfg.intermediate_size))
    return tuple(counts)


def with_mesh(cfg: Qwen35Config, mesh, where: str) -> Qwen35Config:
    """cfg laid out for `mesh` (its axes made Auto: GSPMD places what the jitted steps compute), after checking that
    the mesh has a "tp" axis and that every count can be split over it: one InputError naming `where` otherwise."""
    sharding.check_mesh(mesh, where)
    sharding.check_split(split_counts(cfg), mesh, where)
    return dataclasses.replace(cfg, mesh=sharding.auto_axes(mesh))


def place_param(path: tuple, x: jax.Array, cfg: Qwen35Config) -> jax.Array:
    """One parameter as `cfg.mesh` holds it: fused rows in grouped order, split by its role
    (sharding.param_partition). Unchanged without a mesh."""
    if cfg.mesh is None:
        return x
    segments = fused_segments(cfg).get(path[-1])
    if segments is not None:
        x = x[sharding.grouped_rows(segments, cfg.tp_size)]
    return sharding.place(x, cfg.mesh, sharding.param_partition(path))


def shard_params(params: dict, cfg: Qwen35Config) -> dict:
    """A one-device parameter tree (checkpoint row order, e.g. built in memory) laid out over `cfg.mesh`
    (cfg from `with_mesh`)."""
    params = moe_layout(params, cfg, fused=False)
    return build_tree({path: (path, x) for path, x in flatten_tree(params).items()},
                      lambda item: place_param(item[0], item[1], cfg))


# Whether a one-device MoE model holds each layer's router, shared gate|up and shared expert gate as one weight
# (`mlp.fuse_moe_inputs`: one product on the block's input instead of three). On an H100, AR at the 10-layer 35B-A3B
# shape, alternating in one process: 745.1 -> 749.0 tok/s alone, and part of the settings that took it to 768.2
# (docs/LOG.md, 2026-12-07 evening).
FUSE_MOE_INPUTS = True


def _map_mlps(params: dict, fn) -> dict:
    """params with fn applied to every layer's MLP parameters (the MTP head's layers too)."""
    def layers(ls):
        return [{**layer, "mlp": fn(layer["mlp"])} for layer in ls]
    out = {**params, "layers": layers(params["layers"])}
    if params.get("mtp") and params["mtp"].get("layers"):
        out["mtp"] = {**params["mtp"], "layers": layers(params["mtp"]["layers"])}
    return out


def moe_layout(params: dict, cfg: Qwen35Config, fused: bool | None = None, shared_tile: bool | None = None) -> dict:
    """params in the MoE input layout `fused` (None: FUSE_MOE_INPUTS where there is no mesh): each layer's router,
    shared gate|up and shared expert gate as one weight, or as three (the checkpoint's). shared_tile (None:
    mlp.SHARED_EXPERT_TILE where the shapes allow it, `mlp.shared_tile_fits`): fused means the router and the gate as
    one weight, the gate|up apart for the expert kernel's shared tile. Small weights only are copied (the router and
    the gates); the expert stacks and the shared expert's down projection are the same arrays."""
    if not cfg.is_moe:
        return params
    fused = FUSE_MOE_INPUTS and cfg.mesh is None if fused is None else fused
    shared_tile = _mlp.SHARED_EXPERT_TILE if shared_tile is None else shared_tile
    form = ("router_gate" if shared_tile and _mlp.shared_tile_fits(cfg) else "router_shared") if fused else "plain"
    return _map_mlps(params, lambda p: _mlp.to_moe_input_form(p, cfg, form))


def load_params(source: TensorSource, cfg: Qwen35Config, dtype) -> dict:
    """Validate every key and shape first (headers only), then stream tensors to the device (under `cfg.mesh`:
    each tensor split over the mesh as it is read, `place_param`)."""
    specs = param_specs(cfg, set(source.keys()), source.description)
    source.check({k: s for leaf in specs.values() for k, s in leaf.parts()})

    def read(path: tuple, leaf: Leaf):
        def one(key):
            x = source.read(key, dtype)
            return x[:, 0, :] if _is_conv(key) else x
        groups = [jnp.concatenate([one(k) for k, _ in g], axis=0) if len(g) > 1 else one(g[0][0])
                  for g in leaf.groups]
        return place_param(path, jnp.stack(groups) if leaf.stack else groups[0], cfg)

    return moe_layout(build_tree({path: (path, leaf) for path, leaf in specs.items()}, lambda item: read(*item)), cfg)


def hf_tensors(params: dict, cfg: Qwen35Config, prefix: str = "model.") -> dict[str, jax.Array]:
    """Inverse of load_params (fused expert layout): {HF key: array}, for saving checkpoints."""
    if cfg.mesh is not None:
        raise ValueError("hf_tensors reads the checkpoint's row order; these parameters are laid out for a mesh "
                         "(load the checkpoint without mesh= to save it)")
    params = moe_layout(params, cfg, fused=False)
    keys = {prefix + "embed_tokens.weight"}  # selects the prefix and the fused expert layout
    specs = param_specs(cfg, keys | ({"mtp.fc.weight"} if params.get("mtp") else set()), "params")
    mtp_layers = len(params["mtp"]["layers"]) if params.get("mtp") else 0
    for i in range(mtp_layers):
        key_prefix = f"mtp.layers.{i}."
        specs.update(_spec_leaves(_layer_specs(cfg, FULL_ATTENTION, keys, key_prefix), key_prefix,
                                  ("mtp", "layers", i)))
    out: dict[str, jax.Array] = {}
    for path, leaf in specs.items():
        x = params
        for part in path:
            x = x[part]
        for e, group in enumerate(leaf.groups):
            y = x[e] if leaf.stack else x
            offset = 0
            for key, shape in group:
                piece = y[offset:offset + shape[0]]
                offset += shape[0]
                out[key] = piece[:, None, :] if _is_conv(key) else piece
    return out
