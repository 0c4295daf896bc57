"""Looped-model configs (Huginn-0125 and the Raven retrofits): `LoopedConfig` and its parser.

The config layer: `read_config` (models/qwen35/config.py, which dispatches on `model_type`) builds a `LoopedConfig`
from config.json through `looped_config_from_dict` without importing model code; `models/looped/model.py` runs it.
"""

from __future__ import annotations

import dataclasses
import math

from ...errors import CheckpointError

VARIANTS = ("huginn", "raven_llama", "raven_olmo2")
INITIAL_STATE_MODES = ("random", "embed-init", "skip-adapter")


# ------------------------------------------------------------------------------------------ config

@dataclasses.dataclass(frozen=True)
class LoopedConfig:
    """Static (hashable) config of a looped model; names follow the official `RavenConfig`.

    vocab_size is the padded vocabulary the weights have. rope_scaling is a sorted tuple of
    (name, value) items. init_std is `init_values["std"]` (random initial state).
    """

    vocab_size: int
    n_embd: int
    n_heads: int
    num_key_value_heads: int
    head_dim: int
    n_layers_in_prelude: int
    n_layers_in_recurrent_block: int
    n_layers_in_coda: int
    intermediate_size: int
    norm_eps: float = 1e-6
    qk_bias: bool = True
    rope_base: float = 50_000.0  # Huginn's interleaved RoPE
    rope_theta: float = 50_000.0  # the retrofits' HF RoPE
    rope_scaling: tuple = ()
    tie_embeddings: bool = True
    embed_scale: float = 1.0
    mean_recurrence: int = 32
    init_std: float = 0.0
    initial_state_mode: str = "random"
    adapter_bias: bool = False  # config `bias`: the official code gives only the adapter a bias
    variant: str = "huginn"
    eos_token_id: tuple[int, ...] = ()
    max_position_embeddings: int = 4096

    family = "looped"

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None


def _freeze(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def parse_eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


# RavenConfig.attribute_map: configs may spell these fields the transformers way.
_ALIASES = {"n_heads": "num_attention_heads", "n_embd": "hidden_size"}


def _need(raw: dict, key: str, where: str):
    value = raw.get(key)
    if value is None and key in _ALIASES:
        value = raw.get(_ALIASES[key])
    if value is None:
        alias = f" (or '{_ALIASES[key]}')" if key in _ALIASES else ""
        raise CheckpointError(f"{where}: config field '{key}'{alias} is missing")
    return value


def looped_config_from_dict(raw: dict, where: str = "config.json") -> LoopedConfig:
    """Parse an official `huginn_raven` config.json (RavenConfig.to_dict()).

    The variant recorded here is provisional (a non-official `variant` key if present; else
    "raven_olmo2" when head_dim * n_heads != n_embd, "raven_llama" when the config carries the
    retrofits' `rope_theta` / `rope_parameters`, else "huginn"); the loader settles it from the
    weights (`detect_variant`). Huginn ignores rope_theta/rope_scaling, as its official code does.
    """
    fixed = {"block_class_name": "SandwichBlock", "norm_class_name": "RMSNorm_llama",
             "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU", "injection_type": "linear"}
    for name, supported in fixed.items():
        if raw.get(name, supported) != supported:
            raise CheckpointError(f"{where}: {name}={raw[name]!r} is not supported (only {supported!r})")
    if raw.get("test_time_noise", 0):
        raise CheckpointError(f"{where}: test_time_noise={raw['test_time_noise']} is not supported "
                              f"(it injects noise at inference; only 0)")
    n_embd = int(_need(raw, "n_embd", where))
    n_heads = int(_need(raw, "n_heads", where))
    init_values = raw.get("init_values") or {}
    head_dim = int(raw.get("head_dim") or n_embd // n_heads)
    # Only OLMo-2 retrofits decouple head_dim from n_embd; only the retrofits write rope_theta.
    # transformers >= 5 also writes the HF RoPE settings as one `rope_parameters` dict.
    rope_params = raw.get("rope_parameters") or {}
    retrofit = "rope_theta" in raw or bool(rope_params)
    guess = "raven_olmo2" if head_dim * n_heads != n_embd else "raven_llama" if retrofit else "huginn"
    variant = raw.get("variant") or guess
    if variant not in VARIANTS:
        raise CheckpointError(f"{where}: unknown looped variant {variant!r}; supported: {', '.join(VARIANTS)}")
    mode = raw.get("initial_state_mode", "random")
    if mode not in INITIAL_STATE_MODES:
        raise CheckpointError(f"{where}: initial_state_mode={mode!r} is not supported; "
                              f"supported: {', '.join(INITIAL_STATE_MODES)}")
    rope_base = float(raw.get("rope_base", 50_000))
    rope_scaling = raw.get("rope_scaling") or (
        rope_params if rope_params.get("rope_type", "default") != "default" else {})
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default")) if rope_scaling else "default"
    if rope_type not in ("default", "llama3"):
        raise CheckpointError(f"{where}: rope type {rope_type!r} is not supported (default or llama3)")
    cfg = LoopedConfig(
        vocab_size=int(raw.get("padded_vocab_size") or _need(raw, "vocab_size", where)),
        n_embd=n_embd,
        n_heads=n_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        n_layers_in_prelude=int(_need(raw, "n_layers_in_prelude", where)),
        n_layers_in_recurrent_block=int(_need(raw, "n_layers_in_recurrent_block", where)),
        n_layers_in_coda=int(_need(raw, "n_layers_in_coda", where)),
        intermediate_size=int(_need(raw, "intermediate_size", where)),
        norm_eps=float(raw.get("norm_eps", 1e-6)),
        qk_bias=bool(raw.get("qk_bias", True)),  # RavenConfig's defaults: qk_bias and tied embeddings
        rope_base=rope_base,
        rope_theta=float(raw.get("rope_theta") or rope_params.get("rope_theta") or rope_base),
        rope_scaling=_freeze(rope_scaling if rope_type == "llama3" else {}),
        tie_embeddings=bool(raw.get("tie_embeddings", raw.get("tie_word_embeddings", True))),
        # RavenConfig's default (sqrt(D), Huginn); the retrofit converters write 1.0.
        embed_scale=float(init_values.get("embed_scale", math.sqrt(n_embd))),
        mean_recurrence=int(raw.get("mean_recurrence", 32)),
        init_std=float(init_values.get("std", math.sqrt(2 / (5 * n_embd)))),
        initial_state_mode=mode,
        adapter_bias=bool(raw.get("bias", False)),
        variant=variant,
        eos_token_id=parse_eos_ids(raw.get("eos_token_id")),
        max_position_embeddings=int(raw.get("max_position_embeddings") or raw.get("block_size") or 4096),
    )
    if "variant" in raw:
        cfg = settle_variant(cfg, variant)
    validate_config(cfg, where, settled="variant" in raw)
    return cfg


def settle_variant(cfg: LoopedConfig, variant: str) -> LoopedConfig:
    """cfg with its variant fixed and the fields that variant's official code ignores set as it does.

    Only the OLMo-2 retrofit code reads `initial_state_mode` (the Huginn and Llama files always start
    from the random / zero state and always run the adapter, whatever the config says), and Huginn's
    code hard-codes the embedding scale to sqrt(n_embd) instead of reading `init_values.embed_scale`.
    """
    changes = {"variant": variant}
    if variant != "raven_olmo2":
        changes["initial_state_mode"] = "random"
    if variant == "huginn":
        changes["embed_scale"] = math.sqrt(cfg.n_embd)
    return dataclasses.replace(cfg, **changes)


def validate_config(cfg: LoopedConfig, where: str, settled: bool = True) -> None:
    """Raise on inconsistent fields; variant-specific rules only once the variant is settled."""
    problems = []
    if cfg.n_heads % cfg.num_key_value_heads:
        problems.append(f"n_heads={cfg.n_heads} is not a multiple of num_key_value_heads={cfg.num_key_value_heads}")
    if cfg.head_dim % 2:
        problems.append(f"head_dim={cfg.head_dim} must be even (RoPE rotates pairs)")
    if settled and cfg.variant != "raven_olmo2" and cfg.q_dim != cfg.n_embd:
        # Huginn and Raven-Llama split Wqkv at n_embd and derive head_dim = n_embd // n_heads.
        problems.append(f"variant {cfg.variant} needs n_heads*head_dim == n_embd; got {cfg.n_heads}*{cfg.head_dim} "
                        f"!= {cfg.n_embd}")
    if cfg.qk_bias and cfg.num_key_value_heads != cfg.n_heads:
        problems.append("qk_bias [2, 1, n_heads, head_dim] is added to k too, so it needs num_key_value_heads == "
                        f"n_heads; got {cfg.num_key_value_heads} != {cfg.n_heads}")
    if cfg.n_layers_in_recurrent_block < 1:
        problems.append("n_layers_in_recurrent_block must be >= 1")
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))
