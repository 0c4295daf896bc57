"""Looped (recurrent-depth) models in functional JAX: Huginn-0125 and the Raven retrofits.

Official code: seal-rg/recurrent-pretraining `recpre/raven_modeling_minimal.py` (Huginn) and
retrofitting-recurrence `raven_modeling_minimal_llama.py` / `raven_modeling_minimal_olmo.py`.
All three share one skeleton (D = n_embd, r = num_steps):

    e   = prelude(wte(ids) * embed_scale)                    # [B, T, D]
    x_0 = initial state (zeros by default; see `initial_state`)
    x_s = core_block(adapter(concat[x_{s-1}, e]))            # s = 1..r, shared weights
    lat = ln_f(x_r)  (Huginn only: its iterate_forward ends in ln_f; the retrofits return x_r as is)
    logits = lm_head(ln_f(coda(lat)))                         # float32

Variants (told apart by the weights; `detect_variant`):
    huginn       SandwichBlock  x = n2(attn(n1 x) + x); x = n4(mlp(n3 x) + x); qk_bias; RoPE on
                 interleaved pairs (base `rope_base`); embed_scale sqrt(D); tied head.
    raven_llama  pre-norm       x += attn(n1 x); x += mlp(n2 x); GQA; rotate-half RoPE with
                 `rope_theta` and llama3 `rope_scaling`; embed_scale from init_values (1.0).
    raven_olmo2  post-norm      x += n1(attn(x)); x += n2(mlp(x)); RMSNorm on the whole q and k
                 projections (q_norm over H*hd, k_norm over NKV*hd) before RoPE; head_dim from config.

KV cache (`LoopedCache`) is depth-indexed like the official "full" lookup: one slot per prelude
layer, per (recurrence step, core layer) and per coda layer. The attention of core layer j at step
s reads the verified prefix from step slot `read_step_k[s]` (K) and `read_step_v[s]` (V) -- by
default s itself -- and its new K/V are written to slot s. Compressed mode keeps one slot per core
layer ("latest recurrence wins"): the prefix is always read at the last depth it was computed at.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from ..errors import CheckpointError, InputError
from ..looped_config import (INITIAL_STATE_MODES, VARIANTS, LoopedConfig, looped_config_from_dict,  # noqa: F401
                             parse_eos_ids, settle_variant, validate_config)
from ..options import check_context_length, validate_input_ids
from ..loading import TensorSource, build_tree, flatten_tree, resolve_dtype
from . import layers as L

CACHE_MODES = ("full", "compressed")
_IGNORED_KEYS = ("freqs_cis",)  # Huginn's RoPE buffer: recomputed here


# -------------------------------------------------------------------------------------- parameters

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
    from ..config import generation_eos_ids, read_config_json
    from ..model import Model
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


# ------------------------------------------------------------------------------------------- cache

@struct.dataclass
class LoopedCache:
    """Depth-indexed KV cache (immutable; slots at positions >= length are stale and masked).

    prelude_k/v: [P, B, S, NKV, hd]; core_k/v: [R, L, B, S, NKV, hd] ("full": one slot per
    recurrence step and core layer) or [1, L, B, S, NKV, hd] ("compressed"); coda_k/v:
    [C, B, S, NKV, hd]; length: [B] int32 committed tokens per sequence.
    """

    prelude_k: jax.Array
    prelude_v: jax.Array
    core_k: jax.Array
    core_v: jax.Array
    coda_k: jax.Array
    coda_v: jax.Array
    length: jax.Array
    mode: str = struct.field(pytree_node=False, default="full")

    @property
    def max_len(self) -> int:
        return self.core_k.shape[3]

    @property
    def step_slots(self) -> int:
        return self.core_k.shape[0]


def _cache_shapes(cfg: LoopedConfig, batch: int, max_len: int, num_steps: int, mode: str) -> dict:
    if mode not in CACHE_MODES:
        raise InputError(f"cache mode {mode!r} is not supported; use one of {', '.join(CACHE_MODES)}")
    if num_steps < 1:
        raise InputError(f"num_steps must be >= 1; got {num_steps}")
    tail = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    slots = num_steps if mode == "full" else 1
    return {"prelude": (cfg.n_layers_in_prelude,) + tail,
            "core": (slots, cfg.n_layers_in_recurrent_block) + tail,
            "coda": (cfg.n_layers_in_coda,) + tail}


def init_cache(cfg: LoopedConfig, batch: int, max_len: int, num_steps: int, mode: str = "full",
               dtype=jnp.bfloat16) -> LoopedCache:
    """Empty cache for `batch` sequences of up to `max_len` tokens and recurrences up to `num_steps`.

    mode "full": slots [num_steps, L] (exact; reads can pick any depth); "compressed": one slot per
    core layer, overwritten by each recurrence -- a different model (every step reads the prefix at
    its deepest stored depth), kept for its memory figure.
    """
    shapes = _cache_shapes(cfg, batch, max_len, num_steps, mode)
    z = {name: jnp.zeros(shape, dtype) for name, shape in shapes.items()}
    return LoopedCache(prelude_k=z["prelude"], prelude_v=jnp.zeros_like(z["prelude"]),
                       core_k=z["core"], core_v=jnp.zeros_like(z["core"]),
                       coda_k=z["coda"], coda_v=jnp.zeros_like(z["coda"]),
                       length=jnp.zeros((batch,), jnp.int32), mode=mode)


def cache_bytes(cfg: LoopedConfig, batch: int, max_len: int, num_steps: int, mode: str = "full",
                dtype=jnp.bfloat16) -> int:
    """Bytes `init_cache` allocates (K and V of every slot plus the [B] int32 lengths)."""
    shapes = _cache_shapes(cfg, batch, max_len, num_steps, mode)
    elems = sum(math.prod(s) for s in shapes.values())
    return 2 * elems * jnp.dtype(dtype).itemsize + 4 * batch


def write_tokens(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [..., B, T, N, hd] into buf [..., B, S, N, hd] at token offsets start [B].

    The leading dims of `new` may be shorter than buf's (they fill slots 0..n-1): a forward with
    fewer recurrences than the cache has slots writes only the slots it computed. One
    dynamic_update_slice per sequence (B is small) rather than a vmap, which would lower to a
    scatter; a DUS updates the donated buffer in place.
    """
    lead = buf.ndim - 4
    zero = jnp.zeros((), jnp.int32)
    start = start.astype(jnp.int32)
    for b in range(buf.shape[lead]):
        row = lax.slice_in_dim(new, b, b + 1, axis=lead).astype(buf.dtype)
        buf = lax.dynamic_update_slice(buf, row, (zero,) * lead + (jnp.int32(b), start[b], zero, zero))
    return buf


# -------------------------------------------------------------------------------------- layers

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


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, prefix: tuple | None, length: jax.Array,
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


def _attention(ap: dict, cfg: LoopedConfig, h: jax.Array, cos: jax.Array, sin: jax.Array,
               prefix: tuple | None, length: jax.Array, attend=None):
    """h [B, T, D] -> (out [B, T, D], k, v [B, T, NKV, hd] of the new tokens, post-RoPE).

    attend: None (`_attend` over prefix + new tokens), or attend(q, k, v) -> [B, T, H, hd] (the exact
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
        out = _attend(q, k, v, prefix, length, cfg.head_dim ** -0.5)  # SDPA default scale
    else:
        out = attend(q, k, v)
    return L.linear(out.reshape(B, T, cfg.q_dim), ap["proj"]), k, v


def block_mlp(mp: dict, x: jax.Array) -> jax.Array:
    gate, up = jnp.split(L.linear(x, mp["fc"]), 2, axis=-1)  # fused [gate; up] rows
    return L.linear(jax.nn.silu(gate) * up, mp["proj"])


def _block(lp: dict, cfg: LoopedConfig, x: jax.Array, cos, sin, prefix, length, attend=None):
    """One transformer block of the variant: x [B, T, D] -> (x, k, v). attend: see `_attention`."""
    if cfg.variant == "huginn":
        a, k, v = _attention(lp["attn"], cfg, block_norm(cfg, x, lp["norm_1"]), cos, sin, prefix, length, attend)
        x = block_norm(cfg, a + x, lp["norm_2"])
        x = block_norm(cfg, block_mlp(lp["mlp"], block_norm(cfg, x, lp["norm_3"])) + x, lp["norm_4"])
    elif cfg.variant == "raven_llama":
        a, k, v = _attention(lp["attn"], cfg, block_norm(cfg, x, lp["norm_1"]), cos, sin, prefix, length, attend)
        x = a + x
        x = block_mlp(lp["mlp"], block_norm(cfg, x, lp["norm_2"])) + x
    else:  # raven_olmo2: post-norms inside the residual branches
        a, k, v = _attention(lp["attn"], cfg, x, cos, sin, prefix, length, attend)
        x = block_norm(cfg, a, lp["norm_1"]) + x
        x = block_norm(cfg, block_mlp(lp["mlp"], x), lp["norm_2"]) + x
    return x, k, v


def run_blocks(blocks: list, cfg: LoopedConfig, x: jax.Array, cos, sin, cache_k, cache_v, length):
    """Run a list of blocks; cache_k/v [n, B, S, NKV, hd] or None. Returns x and new K/V [n, B, T, NKV, hd]."""
    ks, vs = [], []
    for i, lp in enumerate(blocks):
        prefix = None if cache_k is None else (cache_k[i], cache_v[i])
        x, k, v = _block(lp, cfg, x, cos, sin, prefix, length)
        ks.append(k)
        vs.append(v)
    if not ks:
        B, T = x.shape[:2]
        empty = jnp.zeros((0, B, T, cfg.num_key_value_heads, cfg.head_dim), x.dtype)
        return x, empty, empty
    return x, jnp.stack(ks), jnp.stack(vs)


def _lengths(cache: LoopedCache | None, B: int) -> jax.Array:
    """Committed tokens per sequence [B] (0 without a cache)."""
    return jnp.zeros((B,), jnp.int32) if cache is None else cache.length


def _positions(cache: LoopedCache | None, B: int, T: int) -> jax.Array:
    return _lengths(cache, B)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]


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


# ---------------------------------------------------------------------------------- recurrence

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


def core_step(params: dict, cfg: LoopedConfig, cache: LoopedCache | None, x: jax.Array, embedded: jax.Array,
              step, cos: jax.Array, sin: jax.Array, read_k=None, read_v=None):
    """One core-block application: adapter(concat[x, embedded]) then the core layers.

    x, embedded [B, T, D]; step: recurrence index (int or traced); cos/sin from `rope_tables`;
    read_k / read_v: cache step slots the prefix K and V are read from (default `step`; always 0 in
    compressed mode). The cache is only read. Returns (x [B, T, D], k, v [L, B, T, NKV, hd]) -- the
    new tokens' K/V, to be written into slot `step` by the caller.
    """
    if cache is not None and cache.mode == "compressed":
        read_k = read_v = 0
    read_k = step if read_k is None else read_k
    read_v = step if read_v is None else read_v
    h = inject(params, cfg, x, embedded, jnp.asarray(step) == 0)
    length = _lengths(cache, x.shape[0])
    ks, vs = [], []
    for j, lp in enumerate(params["core_block"]):
        prefix = None if cache is None else (cache.core_k[read_k, j], cache.core_v[read_v, j])
        h, k, v = _block(lp, cfg, h, cos, sin, prefix, length)
        ks.append(k)
        vs.append(v)
    return h, jnp.stack(ks), jnp.stack(vs)


def _read_schedule(spec, num_steps: int, slots: int | None, name: str) -> jax.Array:
    """Per-step slot indices [num_steps] int32 from None (aligned), a scalar, or a [num_steps] array."""
    if spec is None:
        return jnp.arange(num_steps, dtype=jnp.int32)
    if isinstance(spec, (int, np.integer)) or (isinstance(spec, (np.ndarray, list, tuple))):
        values = np.atleast_1d(np.asarray(spec))
        if values.ndim != 1 or values.shape[0] not in (1, num_steps):
            raise InputError(f"{name} must be a scalar or have shape [{num_steps}]; got shape {values.shape}")
        if slots is not None and ((values < 0) | (values >= slots)).any():
            raise InputError(f"{name}={values.tolist()} is outside the cache's step slots [0, {slots})")
    spec = jnp.asarray(spec, jnp.int32)
    if spec.ndim > 1 or (spec.ndim == 1 and spec.shape[0] != num_steps):
        raise InputError(f"{name} must be a scalar or have shape [{num_steps}]; got shape {spec.shape}")
    return jnp.broadcast_to(spec, (num_steps,))


def _recur(params, cfg, cache, x, embedded, cos, sin, read_k, read_v, num_steps: int, depths: tuple[int, ...]):
    """x after each depth in `depths` (sorted, last = num_steps) and K/V of every step [R, L, B, T, NKV, hd].

    One lax.scan per segment between requested depths: the recurrence is never unrolled, and
    intermediate states come out of the same pass that continues to num_steps.
    """
    states, ks, vs = {}, [], []
    start = 0
    for stop in depths:
        def body(x, xs):
            step, rk, rv = xs
            x, k, v = core_step(params, cfg, cache, x, embedded, step, cos, sin, rk, rv)
            return x, (k, v)

        xs = (jnp.arange(start, stop, dtype=jnp.int32), read_k[start:stop], read_v[start:stop])
        x, (k, v) = lax.scan(body, x, xs)
        states[stop] = x
        ks.append(k)
        vs.append(v)
        start = stop
    return states, jnp.concatenate(ks), jnp.concatenate(vs)


def coda_head(params, cfg, cache, x, cos, sin, logits_for: str):
    """Latent after the recurrence -> (logits float32, latent, coda K/V [C, B, T, NKV, hd])."""
    latent = block_norm(cfg, x, params["ln_f"]) if cfg.variant == "huginn" else x
    length = _lengths(cache, x.shape[0])
    ck = None if cache is None else cache.coda_k
    cv = None if cache is None else cache.coda_v
    h, k, v = run_blocks(params.get("coda", []), cfg, latent, cos, sin, ck, cv, length)
    if logits_for == "last":
        h = h[:, -1:]
    h = block_norm(cfg, h, params["ln_f"])
    head = params["wte"] if cfg.tie_embeddings else params["lm_head"]
    return L.linear(h, head).astype(jnp.float32), latent, k, v


def forward(params: dict, cfg: LoopedConfig, cache: LoopedCache | None, input_ids: jax.Array, *,
            num_steps: int, read_step_k=None, read_step_v=None, exit_depths: tuple[int, ...] = (),
            init_key: jax.Array | None = None, init_scale: float = 1.0, logits_for: str = "all"):
    """T >= 1 new tokens continuing `cache` (positions from cache.length), recurrence depth num_steps.

    input_ids [B, T] int. cache None = no prefix and nothing written (full-sequence forward).
    read_step_k / read_step_v: step slot each recurrence step reads the prefix K / V from: None =
      aligned (step s reads slot s, the official behaviour), an int (all steps read that slot, e.g.
      num_steps - 1 = the mature full-depth K/V), or an int array [num_steps]; traced values allowed.
      New K/V of step s always go to slot s.
    exit_depths: static depths d (1 <= d <= num_steps) whose logits are also returned, computed from
      the state after d recurrences by (ln_f for Huginn,) coda, ln_f and head in the same pass. Their
      coda attends to the cached prefix's coda K/V (full depth) and writes nothing.
    init_key / init_scale: random initial state (see `initial_state`); default zeros.
    logits_for: "all" -> logits [B, T, V]; "last" -> [B, 1, V] (the coda still runs on every token).

    Returns (logits float32, new cache or None, extras): extras["latents"] [B, T, D] is the official
    `latent_states` (Huginn: ln_f of the final state); extras["exit_logits"] = {d: logits}.
    """
    if num_steps < 1:
        raise InputError(f"num_steps must be >= 1; got {num_steps}")
    if input_ids.ndim != 2 or input_ids.shape[1] < 1:
        raise InputError(f"input_ids must be [batch, tokens] with tokens >= 1; got shape {input_ids.shape}")
    if logits_for not in ("all", "last"):
        raise InputError(f"logits_for must be 'all' or 'last'; got {logits_for!r}")
    bad = [d for d in exit_depths if not 1 <= d <= num_steps]
    if bad:
        raise InputError(f"exit_depths {bad} must lie in [1, num_steps={num_steps}]")
    slots = None
    if cache is not None:
        slots = cache.step_slots
        if cache.mode == "full" and num_steps > slots:
            raise InputError(f"num_steps={num_steps} exceeds the cache's {slots} step slots (init_cache num_steps)")
        if cache.mode == "compressed" and (read_step_k is not None or read_step_v is not None):
            raise InputError("read_step_k/read_step_v need a 'full' cache: a compressed cache has one slot per layer")
    B, T = input_ids.shape
    read_k = _read_schedule(read_step_k, num_steps, slots, "read_step_k")
    read_v = _read_schedule(read_step_v, num_steps, slots, "read_step_v")
    cos, sin = rope_tables(cfg, _positions(cache, B, T))
    length = _lengths(cache, B)

    e = embed(params, cfg, input_ids)
    pk = None if cache is None else cache.prelude_k
    pv = None if cache is None else cache.prelude_v
    e, new_pk, new_pv = run_blocks(params.get("prelude", []), cfg, e, cos, sin, pk, pv, length)
    x0 = initial_state(cfg, e, init_key, init_scale)
    depths = tuple(sorted(set(exit_depths) | {num_steps}))
    states, new_ck, new_cv = _recur(params, cfg, cache, x0, e, cos, sin, read_k, read_v, num_steps, depths)
    logits, latent, new_dk, new_dv = coda_head(params, cfg, cache, states[num_steps], cos, sin, logits_for)
    exits = {d: logits if d == num_steps else coda_head(params, cfg, cache, states[d], cos, sin, logits_for)[0]
             for d in exit_depths}
    extras = {"latents": latent, "exit_logits": exits}
    if cache is None:
        return logits, None, extras
    if cache.mode == "compressed":  # latest recurrence wins
        new_ck, new_cv = new_ck[-1:], new_cv[-1:]
    start = cache.length
    new_cache = cache.replace(
        prelude_k=write_tokens(cache.prelude_k, new_pk, start),
        prelude_v=write_tokens(cache.prelude_v, new_pv, start),
        core_k=write_tokens(cache.core_k, new_ck, start), core_v=write_tokens(cache.core_v, new_cv, start),
        coda_k=write_tokens(cache.coda_k, new_dk, start), coda_v=write_tokens(cache.coda_v, new_dv, start),
        length=cache.length + T)
    return logits, new_cache, extras


def _write_layer(buf: jax.Array, new: jax.Array, lead: tuple, start: jax.Array) -> jax.Array:
    """buf [*lead_dims, B, S, N, hd] with new [B, T, N, hd] written into buf[lead] at token offsets start [B]
    (one in-place dynamic_update_slice per row)."""
    zero = jnp.zeros((), jnp.int32)
    lead = tuple(jnp.asarray(i, jnp.int32) for i in lead)
    for b in range(new.shape[0]):
        row = new[b][(None,) * (len(lead) + 1)].astype(buf.dtype)
        buf = lax.dynamic_update_slice(buf, row, lead + (jnp.int32(b), start[b].astype(jnp.int32), zero, zero))
    return buf


def decode_forward(params: dict, cfg: LoopedConfig, cache: LoopedCache, input_ids: jax.Array, n_valid: jax.Array,
                   *, num_steps: int):
    """The exact path's decode-shape forward at full depth: input_ids [B, T] (T = the generation's decode
    row count; rows past n_valid [B] are padding) -> (logits [B, T, V] float32, cache with length + n_valid).

    Aligned reads (step s reads and writes slot s, the official semantics), the initial state zeros. Each
    layer writes its new K/V into its cache slot first and then attends over the whole slot with a causal
    position mask, so a token's keys are reduced in one order -- by cache position -- whether it is an AR
    step's first row or a verification's j-th: with every decode forward of a generation at the same row
    count, AR and speculation compute the same logits bit for bit (the prefix-plus-new two-block softmax
    of `forward` splits the reduction where the committed prefix ends, which differs between the two).
    """
    if cache.mode != "full":
        raise InputError("the exact decode path needs a 'full' cache (one slot per recurrence step)")
    B, T = input_ids.shape
    start = cache.length
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    cos, sin = rope_tables(cfg, positions)
    mask = L.causal_cache_mask(positions, cache.max_len)
    scale = cfg.head_dim ** -0.5

    def run(blocks, x, kbuf, vbuf, lead):  # blocks in order; layer i writes slot lead + (i,)
        for i, lp in enumerate(blocks):
            bufs = {}

            def attend(q, k, v, at=lead + (i,)):
                bufs["k"], bufs["v"] = _write_layer(kbuf, k, at, start), _write_layer(vbuf, v, at, start)
                return L.attention(q, bufs["k"][at], bufs["v"][at], mask, scale)

            x, _, _ = _block(lp, cfg, x, cos, sin, None, start, attend)
            kbuf, vbuf = bufs["k"], bufs["v"]
        return x, kbuf, vbuf

    e = embed(params, cfg, input_ids)
    e, pk, pv = run(params.get("prelude", []), e, cache.prelude_k, cache.prelude_v, ())

    def core(carry, step):
        x, ck, cv = carry
        h = inject(params, cfg, x, e, step == 0)
        return run(params["core_block"], h, ck, cv, (step,)), None

    (x, ck, cv), _ = lax.scan(core, (initial_state(cfg, e), cache.core_k, cache.core_v),
                              jnp.arange(num_steps, dtype=jnp.int32))
    latent = block_norm(cfg, x, params["ln_f"]) if cfg.variant == "huginn" else x
    h, dk, dv = run(params.get("coda", []), latent, cache.coda_k, cache.coda_v, ())
    h = block_norm(cfg, h, params["ln_f"])
    head = params["wte"] if cfg.tie_embeddings else params["lm_head"]
    logits = L.linear(h, head).astype(jnp.float32)
    return logits, cache.replace(prelude_k=pk, prelude_v=pv, core_k=ck, core_v=cv, coda_k=dk, coda_v=dv,
                                 length=start + n_valid)


@functools.partial(jax.jit, static_argnames=("cfg", "num_steps", "exit_depths", "init_scale", "logits_for"),
                   donate_argnames=("cache",))
def _forward_jit(params, cfg, cache, input_ids, read_k, read_v, init_key, *, num_steps, exit_depths, init_scale,
                 logits_for):
    return forward(params, cfg, cache, input_ids, num_steps=num_steps, read_step_k=read_k, read_step_v=read_v,
                   exit_depths=exit_depths, init_key=init_key, init_scale=init_scale, logits_for=logits_for)


def forward_jit(params, cfg, cache, input_ids, num_steps, read_step_k=None, read_step_v=None, exit_depths=(),
                init_key=None, init_scale=1.0, logits_for="all"):
    """Jitted `forward` with the cache donated: (logits, new_cache, extras).

    With a full cache the read schedules are passed as int32 arrays [num_steps] (None -> aligned),
    so aligned, Deep-K/V, Mature-V and per-step reads share one compiled executable.
    """
    if cache is not None and cache.mode == "full":
        read_step_k = _read_schedule(read_step_k, num_steps, cache.step_slots, "read_step_k")
        read_step_v = _read_schedule(read_step_v, num_steps, cache.step_slots, "read_step_v")
    return _forward_jit(params, cfg, cache, input_ids, read_step_k, read_step_v, init_key, num_steps=num_steps,
                        exit_depths=tuple(exit_depths), init_scale=init_scale, logits_for=logits_for)


# ---------------------------------------------------------------------------------- public calls

def check_steps(num_steps, cfg: LoopedConfig) -> int:
    num_steps = cfg.mean_recurrence if num_steps is None else num_steps
    if not isinstance(num_steps, (int, np.integer)) or isinstance(num_steps, bool) or num_steps < 1:
        raise InputError(f"num_steps (recurrence depth) must be an integer >= 1; got {num_steps!r}")
    return int(num_steps)


def forward_logits(model, input_ids, num_steps: int | None = None, *, exit_depths: tuple[int, ...] = (),
                   return_extras: bool = False):
    """Logits [B, T, vocab] float32 for every position of input_ids [B, T], fresh (no) cache.

    num_steps: recurrence depth (default the config's mean_recurrence). return_extras: also return
    the extras of `forward` (latents, exit logits).
    """
    cfg = model.config
    ids = validate_input_ids(input_ids, cfg.vocab_size)
    num_steps = check_steps(num_steps, cfg)
    logits, _, extras = forward_jit(model.params, cfg, None, jnp.asarray(ids), num_steps,
                                    exit_depths=tuple(exit_depths))
    return (logits, extras) if return_extras else logits
