"""Hugging Face `config.json` -> frozen, hashable config dataclasses (jit-static).

`read_config(folder)` recognises the model family from `model_type` and returns a
`Qwen35Config` or a `LoopedConfig` (models/looped/config.py parses the looped ones).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ...errors import CheckpointError
from ...sharding import tp_size
from ..looped.config import looped_config_from_dict

QWEN35_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
LOOPED_MODEL_TYPES = ("huginn_raven",)
SUPPORTED_MODEL_TYPES = QWEN35_MODEL_TYPES + LOOPED_MODEL_TYPES

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    """Text model of Qwen3.5 (dense or MoE). Field names follow transformers' `Qwen3_5TextConfig`."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    # Frequency scaling of RoPE beyond "default" (linear / llama3 / yarn), as sorted (key, value) pairs.
    rope_scaling: tuple = ()
    max_position_embeddings: int = 32768
    # MoE (num_experts == 0 means dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    mtp_num_hidden_layers: int = 0
    eos_token_id: tuple[int, ...] = ()
    model_type: str = "qwen3_5_text"
    # The tensor-parallel mesh (axis "tp", Auto axes) the parameters are laid out for, None: one device. Not an HF
    # field: `load(path, mesh=...)` sets it (models/qwen35.with_mesh); being static, it keys every compiled program.
    mesh: Any = None

    family = "qwen3_5"

    @property
    def tp_size(self) -> int:
        """Devices the heads, MLP columns, experts and vocabulary are split over (1 without a mesh)."""
        return tp_size(self.mesh)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_value_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    def slot(self, layer: int) -> int:
        """Index of a layer's cache among the layers of its type."""
        kind = self.layer_types[layer]
        return self.layer_types[:layer].count(kind)

    def to_hf_dict(self) -> dict[str, Any]:
        """A flat `qwen3_5_text` / `qwen3_5_moe_text` config.json that transformers loads."""
        d: dict[str, Any] = {
            "architectures": ["Qwen3_5MoeForCausalLM" if self.is_moe else "Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_moe_text" if self.is_moe else "qwen3_5_text",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "layer_types": list(self.layer_types),
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", **(self.rope_scaling_dict or {}),
                                "rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
        }
        if self.is_moe:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size,
                     shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        else:
            d["intermediate_size"] = self.intermediate_size
        if self.mtp_num_hidden_layers:
            d["mtp_num_hidden_layers"] = self.mtp_num_hidden_layers
        if self.eos_token_id:
            d["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)
        return d


def _eos_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _require(d: dict, key: str, where: str):
    if key not in d:
        raise CheckpointError(f"{where}: config field '{key}' is missing")
    return d[key]


def qwen35_config_from_dict(raw: dict, where: str = "config.json") -> Qwen35Config:
    """Parse a Qwen3.5 config: multimodal (nested `text_config`) or flat text config."""
    model_type = raw.get("model_type")
    text = raw
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{where}: model_type '{model_type}' needs a nested 'text_config' object")
    is_moe = "moe" in str(model_type) or "num_experts" in text
    n_layers = int(_require(text, "num_hidden_layers", where))
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)]
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers or not set(layer_types) <= {FULL_ATTENTION, LINEAR_ATTENTION}:
        raise CheckpointError(
            f"{where}: layer_types must list {n_layers} entries of '{LINEAR_ATTENTION}'/'{FULL_ATTENTION}'; "
            f"got {list(layer_types)}")
    # transformers >= 5 writes `rope_parameters`; older configs the same dict as `rope_scaling`.
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10_000.0)))
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    rope_scaling = _rope_scaling(rope, text, where)
    # As transformers: a nested (multimodal) config ties only if its top level says so.
    tie = raw.get("tie_word_embeddings", False)
    if text.get("attention_bias"):
        raise CheckpointError(f"{where}: attention_bias=true is not supported (Qwen3.5 checkpoints have no "
                              f"attention biases)")
    hidden = int(_require(text, "hidden_size", where))
    n_heads = int(_require(text, "num_attention_heads", where))
    cfg = Qwen35Config(
        vocab_size=int(_require(text, "vocab_size", where)),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(text.get("num_key_value_heads", n_heads)),
        head_dim=int(text.get("head_dim") or hidden // n_heads),
        intermediate_size=int(text.get("intermediate_size", 0) or 0),
        layer_types=layer_types,
        linear_num_key_heads=int(_require(text, "linear_num_key_heads", where)),
        linear_num_value_heads=int(_require(text, "linear_num_value_heads", where)),
        linear_key_head_dim=int(_require(text, "linear_key_head_dim", where)),
        linear_value_head_dim=int(_require(text, "linear_value_head_dim", where)),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        partial_rotary_factor=partial,
        tie_word_embeddings=bool(tie),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(text.get("max_position_embeddings") or 32768),
        num_experts=int(text.get("num_experts", 0) or 0) if is_moe else 0,
        num_experts_per_tok=int(text.get("num_experts_per_tok", 0) or 0) if is_moe else 0,
        moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0) if is_moe else 0,
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0) or 0) if is_moe else 0,
        mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", raw.get("mtp_num_hidden_layers", 0)) or 0),
        eos_token_id=_eos_tuple(text.get("eos_token_id", raw.get("eos_token_id"))),
        model_type=str(model_type),
    )
    _validate_qwen35(cfg, where)
    return cfg


_ROPE_SCALING_KEYS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                          "original_max_position_embeddings"),
                      "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                               "attention_factor", "mscale", "mscale_all_dim", "truncate")}


def _rope_scaling(rope: dict, text: dict, where: str) -> tuple:
    """The frequency-scaling part of a rope dict as sorted pairs (() for plain RoPE); unknown types raise.

    M-RoPE fields (mrope_section, mrope_interleaved) need no handling for text: its three position
    streams are equal, so the rotation is plain RoPE.
    """
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return ()
    if kind not in _ROPE_SCALING_KEYS:
        raise CheckpointError(f"{where}: rope_type {kind!r} is not supported; supported: default, "
                              f"{', '.join(_ROPE_SCALING_KEYS)}")
    out = {k: rope[k] for k in _ROPE_SCALING_KEYS[kind] if rope.get(k) is not None}
    if kind == "yarn" and "factor" not in out and "original_max_position_embeddings" in out:
        out["factor"] = float(text.get("max_position_embeddings", 0)) / float(out["original_max_position_embeddings"])
    missing = [k for k in (("factor", "original_max_position_embeddings") if kind != "linear" else ("factor",))
               if k not in out]
    if missing:
        raise CheckpointError(f"{where}: rope_type {kind!r} needs {', '.join(missing)} in rope_parameters")
    return tuple(sorted({"rope_type": kind, **out}.items()))


def _validate_qwen35(cfg: Qwen35Config, where: str) -> None:
    problems = []
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        problems.append(f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                        f"num_key_value_heads={cfg.num_key_value_heads}")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        problems.append(f"linear_num_value_heads={cfg.linear_num_value_heads} is not a multiple of "
                        f"linear_num_key_heads={cfg.linear_num_key_heads}")
    if cfg.rotary_dim % 2:
        problems.append(f"rotary dim head_dim*partial_rotary_factor={cfg.rotary_dim} must be even")
    if cfg.is_moe and not (0 < cfg.num_experts_per_tok <= cfg.num_experts):
        problems.append(f"num_experts_per_tok={cfg.num_experts_per_tok} must be in 1..num_experts={cfg.num_experts}")
    if not cfg.is_moe and cfg.intermediate_size <= 0:
        problems.append("intermediate_size must be positive for a dense model")
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))


def read_config_json(folder: str) -> dict:
    """Load `folder/config.json` with a clear error when the folder or file is missing/invalid."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder '{folder}' does not exist (expected an HF checkpoint folder)")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"'{path}' is missing: a checkpoint folder needs a config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"'{path}' is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"'{path}' must hold a JSON object")
    return raw


def generation_eos_ids(folder: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """EOS ids from `generation_config.json` when it names them (what transformers' generate stops at:
    chat checkpoints list their end-of-turn token there), else `default` (config.json's)."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return default
    try:
        with open(path) as f:
            value = json.load(f).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"'{path}' is not a valid JSON object: {e}") from None
    try:
        return _eos_tuple(value) or default
    except (TypeError, ValueError):
        raise CheckpointError(f"'{path}': eos_token_id must be an integer or a list of integers; got {value!r}") \
            from None


def read_config(folder: str):
    """Family-specific config for a checkpoint folder. Unknown `model_type` lists the supported ones."""
    raw = read_config_json(folder)
    where = os.path.join(folder, "config.json")
    model_type = raw.get("model_type")
    if model_type in QWEN35_MODEL_TYPES:
        cfg = qwen35_config_from_dict(raw, where)
        return dataclasses.replace(cfg, eos_token_id=generation_eos_ids(folder, cfg.eos_token_id))
    if model_type in LOOPED_MODEL_TYPES:
        return looped_config_from_dict(raw, where)
    raise CheckpointError(
        f"{where}: unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
