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

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_kernels import gated_delta

from .. import sharding
from ..config import FULL_ATTENTION, Qwen35Config
from ..errors import CheckpointError
from ..loading import TensorSource, build_tree, flatten_tree
from ..sharding import STATE_HEADS, TOKEN_HEADS, Segment, SplitCount
from . import layers as L

# Longest verification the step recurrence runs (snapshot and replay rollback; the Pallas recurrent
# kernel unrolls its steps up to this length).
MAX_RECURRENT_VERIFY = 64

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


def kv_heads(cfg: Qwen35Config) -> int:
    """Key/value heads in the caches and in qkv_proj: num_key_value_heads, or one copy per device when the mesh
    is larger (sharding.py)."""
    return sharding.stored_units(cfg.num_key_value_heads, cfg.tp_size)


def linear_key_heads(cfg: Qwen35Config) -> int:
    """GDN key heads as stored (q and k): linear_num_key_heads, or one copy per device when the mesh is larger."""
    return sharding.stored_units(cfg.linear_num_key_heads, cfg.tp_size)


def conv_channels(cfg: Qwen35Config) -> int:
    """Channels of the GDN conv and its state: cfg.conv_dim, with the key-head copies of a large mesh."""
    return 2 * linear_key_heads(cfg) * cfg.linear_key_head_dim + cfg.linear_value_dim


def init_state(cfg: Qwen35Config, batch: int, max_len: int, dtype=jnp.bfloat16) -> Qwen35State:
    """Empty state; under a mesh each field is created split over its heads (sharding.STATE_PARTITIONS)."""
    n_attn, n_lin = len(cfg.attention_layers), len(cfg.linear_layers)
    kv_shape = (batch, max_len, kv_heads(cfg), cfg.head_dim)
    rec_shape = (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    conv_shape = (batch, cfg.linear_conv_kernel_dim - 1, conv_channels(cfg))

    def zeros(field, shape, dtype):
        return sharding.constrain(jnp.zeros(shape, dtype), cfg.mesh, sharding.STATE_PARTITIONS[field])

    return Qwen35State(
        keys=tuple(zeros("keys", kv_shape, dtype) for _ in range(n_attn)),
        values=tuple(zeros("values", kv_shape, dtype) for _ in range(n_attn)),
        conv=tuple(zeros("conv", conv_shape, dtype) for _ in range(n_lin)),
        recurrent=tuple(zeros("recurrent", rec_shape, jnp.float32) for _ in range(n_lin)),
        length=zeros("length", (batch,), jnp.int32),
    )


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
    return build_tree({path: (path, x) for path, x in flatten_tree(params).items()},
                      lambda item: place_param(item[0], item[1], cfg))


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

    return build_tree({path: (path, leaf) for path, leaf in specs.items()}, lambda item: read(*item))


def hf_tensors(params: dict, cfg: Qwen35Config, prefix: str = "model.") -> dict[str, jax.Array]:
    """Inverse of load_params (fused expert layout): {HF key: array}, for saving checkpoints."""
    if cfg.mesh is not None:
        raise ValueError("hf_tensors reads the checkpoint's row order; these parameters are laid out for a mesh "
                         "(load the checkpoint without mesh= to save it)")
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


# ---------------------------------------------------------------------------------------- layers

def lm_head_weight(params: dict) -> jax.Array:
    return params["lm_head"] if params.get("lm_head") is not None else params["embed"]


def gdn_projections(p: dict, cfg: Qwen35Config, x: jax.Array):
    """The fused input projection split: x [B, T, D] -> qkv [B, T, conv_channels] (pre-conv), z [B, T, HV, V],
    b, a [B, T, HV]. Under a mesh the rows are grouped per device (sharding.py): qkv stays grouped, as the conv
    weight and conv state are."""
    B, T, _ = x.shape
    HV, V = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    widths = sharding.group_widths(fused_segments(cfg)["in_proj"], cfg.tp_size)  # q, k, v, z, b, a
    proj = L.linear(x, p["in_proj"])  # [B, T, C + HV*V + 2*HV]: qkv | z | b | a
    qkv, z, b, a = sharding.split_groups(proj, (sum(widths[:3]),) + widths[3:], cfg.tp_size)
    return qkv, z.reshape(B, T, HV, V), b, a


def gdn_heads(cfg: Qwen35Config, conv: jax.Array):
    """The conv output [B, T, conv_channels] as heads: q, k [B, T, H, K] (H = linear_key_heads(cfg)),
    v [B, T, HV, V]."""
    B, T, _ = conv.shape
    q, k, v = sharding.split_groups(conv, sharding.group_widths(_gdn_conv_segments(cfg), cfg.tp_size), cfg.tp_size)
    H, K = linear_key_heads(cfg), cfg.linear_key_head_dim
    return (q.reshape(B, T, H, K), k.reshape(B, T, H, K),
            v.reshape(B, T, cfg.linear_num_value_heads, cfg.linear_value_head_dim))


# The outputs of a gated-delta op, per device under a mesh: every field split over its heads.
_GDN_OUTPUT_SPECS = gated_delta.GatedDeltaOutput(o=TOKEN_HEADS, final_state=STATE_HEADS, v_new=TOKEN_HEADS,
                                                 g_cumsum=TOKEN_HEADS, all_states=TOKEN_HEADS)


def gdn_rule(cfg: Qwen35Config, rule, q, k, v, g, beta, initial_state, state_steps=None, **options):
    """rule (gated_delta.fused_recurrent_gated_delta_rule or chunk_gated_delta_rule) from initial_state; under a
    mesh once per device on its own heads (sharding.over_heads: the heads are independent, and a Pallas kernel
    cannot be split by GSPMD). options: the rule's static keyword arguments."""
    def run(q, k, v, g, beta, s0, steps):
        return rule(q, k, v, g, beta, initial_state=s0, **({} if steps is None else {"state_steps": steps}),
                    **options)

    run = sharding.over_heads(run, cfg.mesh, (TOKEN_HEADS,) * 5 + (STATE_HEADS, P()), _GDN_OUTPUT_SPECS)
    return run(q, k, v, g, beta, initial_state, state_steps)


def gdn_state_rule(mesh, rule, initial_state, *per_token, n, **options):
    """A commit rule (gated_delta.replay_state or commit_state) of the state [B, HV, K, V] over per-token tensors
    [B, T, heads, ...] and counts n [B]; under a mesh (cfg.mesh) once per device on its own heads."""
    run = sharding.over_heads(lambda s0, *xs: rule(s0, *xs[:-1], xs[-1], **options), mesh,
                              (STATE_HEADS,) + (TOKEN_HEADS,) * len(per_token) + (P(),), STATE_HEADS)
    return run(initial_state, *per_token, n)


def gdn_gates(p: dict, b: jax.Array, a: jax.Array):
    """beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias) (float32), both [B, T, HV]."""
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32)
                                                                   + p["dt_bias"].astype(jnp.float32))
    return jax.nn.sigmoid(b), g


def conv_window_at(window: jax.Array, n: jax.Array, width: int) -> jax.Array:
    """The conv state after the first n [B] of the new inputs: window [B, W-1+T, C] -> [B, width=W-1, C]."""
    return jax.vmap(lambda w, a: lax.dynamic_slice_in_dim(w, a, width, axis=0))(window, n)


def gdn_mixer(p: dict, cfg: Qwen35Config, x: jax.Array, conv_state: jax.Array, rec_state: jax.Array,
              impl: str, collect, n_valid=None):
    """Gated DeltaNet token mixer. x [B, T, D] -> out [B, T, D], new conv/recurrent state, extras.

    n_valid [B] or None: rows past it are padding (decode shape); the new states are those after n_valid."""
    B, T, _ = x.shape
    HV, V, W = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    qkv, z, b, a = gdn_projections(p, cfg, x)

    window = jnp.concatenate([conv_state.astype(qkv.dtype), qkv], axis=1)  # [B, W-1+T, C]
    w = p["conv"].astype(jnp.float32)  # [C, W]
    conv = sum(window[:, i:i + T].astype(jnp.float32) * w[:, i] for i in range(W))  # [B, T, C]
    conv = jax.nn.silu(conv.astype(qkv.dtype))
    new_conv = window[:, T:] if n_valid is None else conv_window_at(window, n_valid, W - 1)  # [B, W-1, C]

    q, k, v = gdn_heads(cfg, conv)
    beta, g = gdn_gates(p, b, a)

    snapshots, replay = collect == "snapshot", collect == "replay"
    kwargs = dict(output_final_state=True, return_pseudo_values=bool(collect) and not replay, use_qk_l2norm=True,
                  implementation=impl)
    if (snapshots or replay or n_valid is not None) and T > MAX_RECURRENT_VERIFY:
        raise ValueError(f"{collect or 'a decode-shape forward'} runs at most {MAX_RECURRENT_VERIFY} positions "
                         f"through the step recurrence; got T={T}")
    recurrent = gated_delta.fused_recurrent_gated_delta_rule
    if n_valid is not None:
        # Decode shape: every row, AR step or verification, through the same step kernel; the state is
        # the one after the valid rows.
        res = gdn_rule(cfg, recurrent, q, k, v, g, beta, rec_state, n_valid, return_all_states=snapshots, **kwargs)
    elif snapshots:
        res = gdn_rule(cfg, recurrent, q, k, v, g, beta, rec_state, return_all_states=True, **kwargs)
    elif T == 1 or replay or (collect and T <= MAX_RECURRENT_VERIFY
                              and gated_delta.resolve(impl, "recurrent") == "pallas"):
        # Decode; verification under replay rollback (the commit re-runs this very step, so the committed
        # state is the recurrence's); short verification when the recurrent op is a Pallas kernel (one
        # launch per layer, measured faster than the chunk kernels on the GPU: see verify_forms_choice()).
        res = gdn_rule(cfg, recurrent, q, k, v, g, beta, rec_state, **kwargs)
    else:
        # Prefill (an unrolled 64-step kernel took minutes to compile), and verification elsewhere: the
        # chunked form is parallel over T (as an XLA loop the step recurrence is T dependent launches).
        res = gdn_rule(cfg, gated_delta.chunk_gated_delta_rule, q, k, v, g, beta, rec_state, **kwargs)
    o = L.gated_rms_norm(res.o.astype(x.dtype), z, p["norm"], cfg.rms_norm_eps)  # [B, T, HV, V]
    out = L.linear(o.reshape(B, T, HV * V), p["out_proj"])
    extras = {}
    if replay:  # what the step needs to run again: keys (normalised in the kernel), values, gates
        extras = {"k": k, "v": v, "g": g, "beta": beta, "conv_window": window}
    elif collect:
        extras = {"k": k, "g": g, "v_new": res.v_new, "conv_window": window}
        if snapshots:
            extras["all_states"] = res.all_states  # [B, T, HV, K, V]: the per-position baseline
    return out, new_conv, res.final_state, extras


def attention_mixer(p: dict, cfg: Qwen35Config, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    positions: jax.Array, mask: jax.Array):
    """Gated full attention. positions [B, T]; mask [B, T, S]. Returns out and the updated caches."""
    B, T, _ = x.shape
    nH, nKV, hd = cfg.num_attention_heads, kv_heads(cfg), cfg.head_dim
    qkv = L.linear(x, p["qkv_proj"])  # [B, T, 2*nH*hd + 2*nKV*hd]: (q_h ; gate_h) per head | k | v
    widths = sharding.group_widths(fused_segments(cfg)["qkv_proj"], cfg.tp_size)
    qg, k, v = sharding.split_groups(qkv, widths, cfg.tp_size)  # grouped per device under a mesh
    qg = qg.reshape(B, T, nH, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    q = L.rms_norm(q, p["q_norm"], cfg.rms_norm_eps, zero_centered=True)
    k = k.reshape(B, T, nKV, hd)
    k = L.rms_norm(k, p["k_norm"], cfg.rms_norm_eps, zero_centered=True)
    v = v.reshape(B, T, nKV, hd)
    cos, sin = L.rope_angles(positions, _inv_freq(cfg))
    if (mscale := L.rope_attention_factor(cfg.rope_scaling_dict)) != 1.0:  # YaRN's attention temperature
        cos, sin = cos * mscale, sin * mscale
    q, k = L.apply_rope_half(q, cos, sin), L.apply_rope_half(k, cos, sin)
    k_cache = L.write_cache(k_cache, k, positions[:, 0])
    v_cache = L.write_cache(v_cache, v, positions[:, 0])
    attn = L.attention(q, k_cache, v_cache, mask, hd ** -0.5)  # [B, T, nH, hd]
    attn = attn.reshape(B, T, nH * hd) * jax.nn.sigmoid(gate.reshape(B, T, nH * hd))
    return L.linear(attn, p["o_proj"]), k_cache, v_cache


@functools.cache
def _inv_freq_cached(rotary_dim: int, theta: float, scaling: tuple):
    return L.rope_inv_freq(rotary_dim, theta, dict(scaling) if scaling else None)


def _inv_freq(cfg: Qwen35Config):
    return _inv_freq_cached(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)


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


# --------------------------------------------------------------------------------------- forward

def forward(params: dict, cfg: Qwen35Config, state: Qwen35State, input_ids: jax.Array, *,
            impl: str = "auto", collect=None, logits_for: str = "all", n_valid=None, skip: tuple = (),
            skip_deltas=None, record: tuple = ()):
    """Run T >= 1 new tokens [B, T] from `state`; returns (logits, new_state, extras).

    logits: [B, T, vocab] float32 ("all") or [B, 1, vocab] for the last position ("last").
    collect: None, or what speculative commit needs in `extras`: per GDN layer the conv window and
    k, v, g, beta ("replay": the commit re-runs the recurrence's step), k, g, v_new ("pseudo" or True:
    rebuild from pseudo-values), or those plus per-position recurrent states ("snapshot", the
    baseline); and the final-normed hidden states (for MTP drafters; "hidden" collects only those).
    n_valid: None, or [B] int32 (traced): a decode-shape forward (T <= MAX_RECURRENT_VERIFY) whose rows
    past n_valid are padding. Every row runs the same kernels whatever its index, so a token's logits
    do not depend on how many real rows share its forward; the state advances by n_valid (GDN state by
    the step recurrence, conv window at that boundary, length + n_valid). The padding rows' K/V land
    past the new length: masked, and overwritten by later tokens.
    skip (static layer indices): layers not run (self-drafts); their state slots pass through unchanged.
    skip_deltas: None, or [B, T, len(skip), D]: what each skipped layer adds to the residual stream instead.
    record (static layer indices): extras["deltas"] [B, T, len(record), D], what each of those layers
    (mixer + MLP) added to the residual stream.
    """
    B, T = input_ids.shape
    dtype = params["embed"].dtype
    x = params["embed"][input_ids].astype(dtype)  # [B, T, D]
    positions = state.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    mask = L.causal_cache_mask(positions, state.max_len) if state.keys else None
    keys, values = list(state.keys), list(state.values)
    conv, rec = list(state.conv), list(state.recurrent)
    gdn_extras, deltas = [], []
    for i, layer_type in enumerate(cfg.layer_types):
        if i in skip:
            if skip_deltas is not None:
                x = x + skip_deltas[:, :, skip.index(i)].astype(x.dtype)
            continue
        p = params["layers"][i]
        slot = cfg.slot(i)
        x_in = x
        h = L.rms_norm(x, p["input_norm"], cfg.rms_norm_eps, zero_centered=True)
        if layer_type == FULL_ATTENTION:
            h, keys[slot], values[slot] = attention_mixer(p["mixer"], cfg, h, keys[slot], values[slot],
                                                          positions, mask)
        else:
            h, conv[slot], rec[slot], ex = gdn_mixer(p["mixer"], cfg, h, conv[slot], rec[slot], impl,
                                                     None if collect == "hidden" else collect, n_valid)
            gdn_extras.append(ex)
        x = x + h
        x = x + mlp(p["mlp"], cfg, L.rms_norm(x, p["post_norm"], cfg.rms_norm_eps, zero_centered=True))
        if i in record:
            deltas.append(x - x_in)
    hidden = L.rms_norm(x, params["final_norm"], cfg.rms_norm_eps, zero_centered=True)
    head_in = hidden[:, -1:] if logits_for == "last" else hidden
    logits = lax.dot_general(head_in, lm_head_weight(params).astype(dtype), (((2,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    new_state = Qwen35State(keys=tuple(keys), values=tuple(values), conv=tuple(conv), recurrent=tuple(rec),
                            length=state.length + (T if n_valid is None else n_valid))
    extras = {"gdn": gdn_extras, "hidden": hidden} if collect else {}
    if record:
        extras["deltas"] = jnp.stack(deltas, axis=2)  # [B, T, len(record), D]
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


def commit(before: Qwen35State, verified: Qwen35State, extras: dict, n_keep: jax.Array, *,
           impl: str = "auto", mesh=None) -> Qwen35State:
    """State after keeping the first n_keep [B] of the T positions a verification forward ran.

    before: the committed state the verification started from; verified, extras: what
    `forward(..., collect="pseudo" | "snapshot")` returned. Attention K/V stay where the verifier
    wrote them (entries past the new length are masked and later overwritten); the conv state is
    the window at the accepted boundary; the GDN state is replayed from `before` over the kept
    positions by the recurrence's own step (`replay_state`, bit-identical to the recurrence), rebuilt
    from pseudo-values (`commit_state`) or, in snapshot mode, selected from the per-position states.
    mesh: the model's cfg.mesh (None: one device); the commit kernels then run per device on their heads.
    """
    n_keep = n_keep.astype(jnp.int32)
    conv, rec = [], []
    for s0, ex in zip(before.recurrent, extras["gdn"]):
        window = ex["conv_window"]  # [B, W-1+T, C]
        conv.append(conv_window_at(window, n_keep, window.shape[1] - ex["k"].shape[1]))
        if "beta" in ex:
            rec.append(gdn_state_rule(mesh, gated_delta.replay_state, s0, ex["k"], ex["v"], ex["g"], ex["beta"],
                                      n=n_keep, use_qk_l2norm=True, implementation=impl))
        elif "all_states" in ex:
            idx = jnp.maximum(n_keep - 1, 0)
            picked = jnp.take_along_axis(ex["all_states"], idx[:, None, None, None, None], axis=1)[:, 0]
            rec.append(jnp.where((n_keep > 0)[:, None, None, None], picked, s0))
        else:
            rec.append(gdn_state_rule(mesh, gated_delta.commit_state, s0, ex["k"], ex["g"], ex["v_new"], n=n_keep,
                                      use_qk_l2norm=True, implementation=impl))
    return Qwen35State(keys=verified.keys, values=verified.values, conv=tuple(conv), recurrent=tuple(rec),
                       length=before.length + n_keep)
