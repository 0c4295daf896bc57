"""Looped-model weights: variant detection, expected shapes, official key names, loading and init.

`load_looped` reads an official checkpoint folder (config.json + safetensors) into a `Model`;
`load_looped_params` validates every key and shape against the config; `official_tensors` is its
inverse (checkpoint writing); `init_random_params` makes random weights on the device.
The parameter tree mirrors the official names (see `load_looped_params`).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp

from ...errors import CheckpointError
from ...loading import TensorSource, build_tree, flatten_tree, resolve_dtype
from .config import LoopedConfig, looped_config_from_dict, settle_variant, validate_config

_IGNORED_KEYS = ("freqs_cis",)  # Huginn's RoPE buffer: recomputed here


def detect_variant(cfg: LoopedConfig, source_keys) -> str:
    """'huginn' | 'raven_llama' | 'raven_olmo2' from the norms of the first block in the weights.

    huginn: norm_1..norm_4 (SandwichBlock); raven_llama: norm_1, norm_2 only (pre-norm);
    raven_olmo2: norm_1, norm_2 (post-norms) plus attn.q_norm / attn.k_norm. Anything else raises.
    """
    keys = set(source_keys)
    for stack in ("prelude", "core_block", "coda"):
        prefix = f"transformer.{stack}.0."
        names = {k[len(prefix):] for k in keys if k.startswith(prefix)}
        if names:
            break
    else:
        raise CheckpointError("no looped-model blocks in the weights (expected keys like "
                              "'transformer.core_block.0.attn.Wqkv.weight')")
    norms = tuple(sorted(n.removesuffix(".weight") for n in names if "norm" in n))
    known = {("norm_1", "norm_2", "norm_3", "norm_4"): "huginn",
             ("norm_1", "norm_2"): "raven_llama",
             ("attn.k_norm", "attn.q_norm", "norm_1", "norm_2"): "raven_olmo2"}
    if norms not in known:
        raise CheckpointError(
            f"unknown looped variant: block '{prefix[:-1]}' has norms {list(norms)}; supported: huginn "
            f"(norm_1..norm_4), raven_llama (norm_1, norm_2), raven_olmo2 (norm_1, norm_2, attn.q_norm, "
            f"attn.k_norm)")
    return known[norms]


def _block_shapes(cfg: LoopedConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    D, F = cfg.n_embd, cfg.intermediate_size
    shapes = {f"{prefix}.attn.Wqkv.weight": (cfg.q_dim + 2 * cfg.kv_dim, D),
              f"{prefix}.attn.proj.weight": (D, cfg.q_dim),
              f"{prefix}.mlp.fc.weight": (2 * F, D),
              f"{prefix}.mlp.proj.weight": (D, F),
              f"{prefix}.norm_1.weight": (D,),
              f"{prefix}.norm_2.weight": (D,)}
    if cfg.qk_bias:
        shapes[f"{prefix}.attn.qk_bias"] = (2, 1, cfg.n_heads, cfg.head_dim)
    if cfg.variant == "huginn":
        shapes[f"{prefix}.norm_3.weight"] = (D,)
        shapes[f"{prefix}.norm_4.weight"] = (D,)
    if cfg.variant == "raven_olmo2":
        shapes[f"{prefix}.attn.q_norm.weight"] = (cfg.q_dim,)
        shapes[f"{prefix}.attn.k_norm.weight"] = (cfg.kv_dim,)
    return shapes


def expected_shapes(cfg: LoopedConfig) -> dict[str, tuple[int, ...]]:
    """{official key: shape} of every tensor the model reads (lm_head only when untied)."""
    D, V = cfg.n_embd, cfg.vocab_size
    shapes = {"transformer.wte.weight": (V, D), "transformer.adapter.weight": (D, 2 * D),
              "transformer.ln_f.weight": (D,)}
    for stack, n in (("prelude", cfg.n_layers_in_prelude), ("core_block", cfg.n_layers_in_recurrent_block),
                     ("coda", cfg.n_layers_in_coda)):
        for i in range(n):
            shapes.update(_block_shapes(cfg, f"transformer.{stack}.{i}"))
    if cfg.adapter_bias:
        shapes["transformer.adapter.bias"] = (D,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def param_path(key: str) -> tuple:
    """'transformer.core_block.0.attn.Wqkv.weight' -> ('core_block', 0, 'attn', 'Wqkv')."""
    if key == "transformer.adapter.bias":
        return ("adapter_bias",)
    parts = key.removeprefix("transformer.").removesuffix(".weight").split(".")
    return tuple(int(p) if p.isdigit() else p for p in parts)


def _key_of(path: tuple) -> str:
    name = ".".join(str(p) for p in path)
    if path[0] == "lm_head":
        return "lm_head.weight"
    if path[0] == "adapter_bias":
        return "transformer.adapter.bias"
    return f"transformer.{name}" + ("" if path[-1] == "qk_bias" else ".weight")


def load_looped_params(source: TensorSource, cfg: LoopedConfig, dtype) -> tuple[LoopedConfig, dict]:
    """Settle the variant from the weights, validate every key and shape, then read the tensors.

    Returns (cfg with its variant settled, params). params mirrors the official names:
    {'wte', 'prelude': [block], 'adapter', 'core_block': [block], 'coda': [block], 'ln_f',
    'lm_head' (untied only)}; block = {'attn': {'Wqkv', 'proj', ['qk_bias'], ['q_norm', 'k_norm']},
    'mlp': {'fc', 'proj'}, 'norm_1', 'norm_2', ['norm_3', 'norm_4']}; matrices [out, in].
    """
    dtype = resolve_dtype(dtype)
    keys = source.keys()
    cfg = settle_variant(cfg, detect_variant(cfg, keys))
    validate_config(cfg, source.description)
    expected = expected_shapes(cfg)
    allowed = set(expected) | set(_IGNORED_KEYS) | {"lm_head.weight"}  # a tied head may still be stored
    unexpected = sorted(k for k in keys if k not in allowed)
    if unexpected:
        raise CheckpointError(
            f"{source.description} has tensors the {cfg.variant} config does not describe (layer counts or "
            f"options differ?): {', '.join(unexpected[:6])}{' ...' if len(unexpected) > 6 else ''}")
    source.check(expected)
    spec = {param_path(k): k for k in expected}
    return cfg, build_tree(spec, lambda key: source.read(key, dtype))


def official_tensors(params: dict, cfg: LoopedConfig) -> dict[str, jax.Array]:
    """Inverse of `load_looped_params`: {official key: array}, for writing checkpoints."""
    return {_key_of(path): leaf for path, leaf in flatten_tree(params).items()}


def init_random_params(cfg: LoopedConfig, key: jax.Array, dtype=jnp.bfloat16, std: float = 0.02) -> dict:
    """Random params made on the device (benchmarks, tests): matrices ~ N(0, std), norms 1 + N(0, std)."""
    shapes = expected_shapes(cfg)

    @functools.partial(jax.jit, static_argnames=("shape", "is_norm"))
    def leaf(k, shape, is_norm):
        x = jax.random.normal(k, shape, jnp.float32) * std
        return (x + 1.0 if is_norm else x).astype(dtype)

    subkeys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    spec = {param_path(k): k for k in shapes}
    return build_tree(spec, lambda k: leaf(subkeys[k], shapes[k], "norm" in k or "ln_f" in k))


def load_looped(path: str | os.PathLike, dtype=None):
    """Checkpoint folder (official config.json + safetensors) -> `Model` (dtype default bfloat16)."""
    from ..qwen35.config import generation_eos_ids, read_config_json
    from ...results import Model
    path = os.fspath(path)
    raw = read_config_json(path)
    where = os.path.join(path, "config.json")
    cfg = looped_config_from_dict(raw, where)
    cfg = dataclasses.replace(cfg, eos_token_id=generation_eos_ids(path, cfg.eos_token_id))
    jdtype = resolve_dtype(dtype)
    cfg, params = load_looped_params(TensorSource(path), cfg, jdtype)
    if raw.get("variant") and raw["variant"] != cfg.variant:
        raise CheckpointError(f"{where}: variant {raw['variant']!r} disagrees with the weights, which are "
                              f"{cfg.variant!r}")
    return Model(config=cfg, params=params, path=path, dtype=jdtype)
