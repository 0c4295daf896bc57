"""Qwen3.5 multi-token-prediction (MTP) head, vLLM's structure (`qwen3_next_mtp.py` / `qwen3_5_mtp.py`).

Fed the target's final-normed hidden state h_t at position t and the embedding of the token at
t + 1, the head predicts the token at t + 2:

    e = RMSNorm0(embed(ids_{t+1}), pre_fc_norm_embedding)        # zero-centred RMSNorm (x̂·(1 + w))
    h = RMSNorm0(h_t, pre_fc_norm_hidden)
    x = fc(concat[e, h])                                          # mtp.fc.weight [D, 2D], embedding first
    x = x + attn(RMSNorm0(x, input_norm))                         # one full-attention decoder layer,
    x = x + mlp(RMSNorm0(x, post_norm))                           #   own KV cache, target's structure
    hidden_out = RMSNorm0(x, mtp.norm);  logits = lm_head(hidden_out)   # shared lm_head / embed_tokens

The layer's RoPE positions are the positions t of the hidden states (vLLM's EAGLE/MTP proposer
shifts the ids left by one and keeps the target positions). `hidden_out` is what a chained second
MTP step consumes as its hidden input.

params["mtp"] = {"fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm",
                 "layers": [{"input_norm", "post_norm", "mixer": {qkv_proj, o_proj, q_norm, k_norm},
                             "mlp": {...}}]}  (same leaf names as the target's attention layers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import decode_block

from ... import sharding
from .config import Qwen35Config
from .. import layers as L
from . import model as qwen35


def _norm(x: jax.Array, w: jax.Array, cfg: Qwen35Config) -> jax.Array:
    return L.rms_norm(x, w, cfg.rms_norm_eps, zero_centered=True)


def init_mtp_cache(cfg: Qwen35Config, batch: int, max_len: int, dtype=jnp.bfloat16, *,
                   round_to: int = 1) -> tuple[jax.Array, jax.Array]:
    """Empty K and V caches of the MTP layer, each [B, S, NKV, hd] (split over its heads under a mesh, as the
    target's caches); S is max_len rounded up to a multiple of round_to (the decode blocks read whole blocks of
    slots: `decode_block.CACHE_MULTIPLE`; slots past the written ones are masked)."""
    shape = (batch, -(-max_len // round_to) * round_to, qwen35.kv_heads(cfg), cfg.head_dim)
    return tuple(sharding.constrain(jnp.zeros(shape, dtype), cfg.mesh, sharding.STATE_PARTITIONS[field])
                 for field in ("keys", "values"))


def mtp_forward(params: dict, cfg: Qwen35Config, hidden: jax.Array, next_ids: jax.Array, k_cache: jax.Array,
                v_cache: jax.Array, positions: jax.Array, *, layer: int = 0, compute_logits: bool = True,
                head: jax.Array | None = None, valid: jax.Array | None = None):
    """MTP head on T positions continuing its own KV cache.

    hidden [B, T, D]: the target's final-normed hidden states at positions `positions` [B, T] int32
    (consecutive per row; new K/V are written at positions[:, 0] ...); next_ids [B, T]: the tokens at
    positions + 1. k_cache, v_cache [B, S, NKV, hd]; slots <= the query position are attended to
    (slots past the committed length must be stale-but-masked, as in the target's cache).
    Returns (logits [B, T, vocab] float32 predicting the tokens at positions + 2 (None when
    compute_logits=False: a shortlist drafter projects hidden_out itself), hidden_out [B, T, D]
    (after mtp.norm), new k_cache, new v_cache). head [N, D]: the output head's rows to project on (default the
    whole vocabulary's). valid: None (every row's K/V written from positions[:, 0]), or [B, T] bool: only those
    rows' K/V are written, at their positions (a padded buffer whose padding may run past the cache).
    """
    mp = params["mtp"]
    dtype = params["embed"].dtype
    e = _norm(params["embed"][next_ids].astype(dtype), mp["pre_fc_norm_embedding"], cfg)  # [B, T, D]
    h = _norm(hidden.astype(dtype), mp["pre_fc_norm_hidden"], cfg)  # [B, T, D]
    x = L.linear(jnp.concatenate([e, h], axis=-1), mp["fc"])  # [B, T, D]
    p = mp["layers"][layer]
    mask = L.causal_cache_mask(positions, k_cache.shape[1])  # [B, T, S]
    a, k_cache, v_cache = qwen35.attention_mixer(p["mixer"], cfg, _norm(x, p["input_norm"], cfg), k_cache, v_cache,
                                                 positions, mask, valid=valid)
    x = x + a
    x = x + qwen35.mlp(p["mlp"], cfg, _norm(x, p["post_norm"], cfg))
    hidden_out = _norm(x, mp["norm"], cfg)
    if not compute_logits:
        return None, hidden_out, k_cache, v_cache
    head = qwen35.lm_head_weight(params) if head is None else head
    logits = lax.dot_general(hidden_out, head.astype(dtype), (((2,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return logits, hidden_out, k_cache, v_cache


def blocks_supported(params: dict, cfg: Qwen35Config, rows: int, cache_len: int, head_rows: int | None = None,
                     batch: int = 1) -> bool:
    """Whether `mtp_forward_blocks` takes this head and shape: one device, a dense MLP, a power-of-two head dim,
    at most decode_block.MAX_ROWS positions (`rows`) per batch row and decode_block.MAX_OPERAND_ROWS padded rows in
    all, a cache of whole attention blocks and product sizes the kernels tile."""
    if cfg.mesh is not None or cfg.is_moe or len(params["mtp"]["layers"]) != 1:
        return False
    D, hd, nH, nKV = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, qwen35.kv_heads(cfg)
    F = params["mtp"]["layers"][0]["mlp"]["gate_up_proj"].shape[0] // 2
    vocab = qwen35.lm_head_weight(params).shape[0] if head_rows is None else head_rows
    linears = [(2 * D, D, 2), (D, 2 * (nH + nKV) * hd, 1), (nH * hd, D, 1), (D, F, 1), (F, D, 1), (D, vocab, 1)]
    padded = batch * max(16, 1 << (rows - 1).bit_length())  # the kernels' operand rows
    return (rows <= decode_block.MAX_ROWS and padded <= decode_block.MAX_OPERAND_ROWS and hd >= 16
            and hd & (hd - 1) == 0 and cache_len % decode_block.CACHE_MULTIPLE == 0
            and all(decode_block.linear_shape_supported(*shape) for shape in linears))


def mtp_forward_blocks(params: dict, cfg: Qwen35Config, hidden: jax.Array, next_ids: jax.Array, k_cache: jax.Array,
                       v_cache: jax.Array, positions: jax.Array, *, head: jax.Array | None = None,
                       implementation: str = "auto"):
    """`mtp_forward` for a few rows (`blocks_supported`) in seven launches: fc (the embedding gathered as it loads),
    qkv, attention (with the cache write; over `decode_block.attention_splits` programs per head), output projection
    (combining them; or inside the attention, per head, with `decode_block.fuse_out_proj`: six launches), SwiGLU,
    down projection, output head (pallas_kernels/decode_block). Same math; the float32
    rounding order differs, so it drafts, it does not decide. hidden [B, Th, D] with Th >= T (rows past T unread: a
    previous call's padded hidden_out may be passed). Returns (logits [B, T, N], hidden_out [B, Tp, D] with Tp >= T
    (rows past T are padding), k, v)."""
    mp = params["mtp"]
    p = mp["layers"][0]
    dtype = params["embed"].dtype
    B, T = next_ids.shape
    tp = max(16, 1 << (T - 1).bit_length())  # positions per batch row, and all rows (the kernels' operands):
    rows = 1 << (B * tp - 1).bit_length()  # powers of two >= 16 (Triton)
    nH, hd = cfg.num_attention_heads, cfg.head_dim
    pad_rows = lambda a: a if rows == B * tp else jnp.pad(a, ((0, rows - B * tp), (0, 0)))
    kw = dict(eps=cfg.rms_norm_eps, implementation=implementation)
    if decode_block.gather_inputs():
        x = decode_block.Gathered(params["embed"], next_ids.astype(jnp.int32), hidden.astype(dtype), tp)
    else:
        x = jnp.concatenate([params["embed"][next_ids].astype(dtype), hidden[:, :T].astype(dtype)], axis=-1)
        x = pad_rows(jnp.pad(x, ((0, 0), (0, tp - T), (0, 0))).reshape(B * tp, -1))
    x = decode_block.block_linear(x, mp["fc"].astype(dtype), norms=(mp["pre_fc_norm_embedding"],
                                                                   mp["pre_fc_norm_hidden"]), **kw)
    qkv = decode_block.block_linear(x, p["mixer"]["qkv_proj"].astype(dtype), norms=(p["input_norm"],), **kw)
    inv_freq = L.rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling_dict)
    freqs = decode_block.rope_frequencies(hd, inv_freq)
    qkv = (qkv if rows == B * tp else qkv[: B * tp]).reshape(B, tp, -1)
    splits = decode_block.attention_splits(k_cache.shape[1], hd)
    fused = splits == 1 and decode_block.fuse_out_proj()
    a, k_cache, v_cache = decode_block.cached_attention(
        qkv, positions[:, 0], k_cache, v_cache, p["mixer"]["q_norm"], p["mixer"]["k_norm"], freqs, n_heads=nH,
        n_new=T, mscale=L.rope_attention_factor(cfg.rope_scaling_dict), splits=splits,
        out_proj=p["mixer"]["o_proj"].astype(dtype) if fused else None, **kw)
    gate_up = dict(norms=(p["post_norm"],), epilogue="silu_mul", **kw)
    if fused:  # the heads' projections summed onto the residual stream as the SwiGLU product loads them
        h, x = decode_block.block_linear(decode_block.HeadSum(a, x[: B * tp]), p["mlp"]["gate_up_proj"].astype(dtype),
                                         want_input=True, **gate_up)
    else:  # (a Partials is combined at the product's padded rows)
        a = pad_rows(a.reshape(B * tp, nH * hd)) if splits == 1 else a
        x = decode_block.block_linear(a, p["mixer"]["o_proj"].astype(dtype), residual=x, **kw)
        h = decode_block.block_linear(x, p["mlp"]["gate_up_proj"].astype(dtype), **gate_up)
    x = decode_block.block_linear(h, p["mlp"]["down_proj"].astype(dtype), residual=x, **kw)
    head = qwen35.lm_head_weight(params) if head is None else head
    logits, hidden_out = decode_block.block_linear(x, head.astype(dtype), norms=(mp["norm"],), want_normed=True,
                                                   out_dtype=jnp.float32, **kw)
    per_row = lambda a: (a if rows == B * tp else a[: B * tp]).reshape(B, tp, a.shape[-1])
    return per_row(logits)[:, :T], per_row(hidden_out), k_cache, v_cache


def mtp_forward_train(params: dict, cfg: Qwen35Config, hidden: jax.Array, next_ids: jax.Array):
    """Whole-sequence MTP forward (causal, fresh cache of length T) for training and tests.

    hidden [B, T, D] at positions 0..T-1; next_ids [B, T] the tokens at 1..T.
    Returns (logits [B, T, vocab] float32 predicting tokens 2..T+1, hidden_out [B, T, D]).
    """
    B, T = next_ids.shape
    k_cache, v_cache = init_mtp_cache(cfg, B, T, params["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
    logits, hidden_out, _, _ = mtp_forward(params, cfg, hidden, next_ids, k_cache, v_cache, positions)
    return logits, hidden_out


def mtp_chain_train(params: dict, cfg: Qwen35Config, hidden: jax.Array, ids: jax.Array, depth: int,
                    ) -> list[tuple[jax.Array, jax.Array]]:
    """The head chained `depth` times from every position at once, as the drafter chains it (training, tests).

    hidden [B, T, D]: the target's final-normed hidden states at positions 0..T-1 (each row t is a chain's
    origin); ids [B, T + depth - 1]: the tokens at positions 1..T+depth-1. Depth k (1-based) of origin t is the
    head's k-th forward of a draft chain whose last committed position is t: it consumes depth k-1's
    hidden_out (depth 1: the target's h_t) and the token at t + k, sits at position t + k - 1 and predicts
    the token at t + k + 1. Its attention sees what the drafter's cache holds then: depth-1 entries of
    origins <= t (the committed ones, computed from the target's hiddens) and the chain's own entries of
    depths 2..k (origin t only). Returns [(logits [B, T, vocab] float32, hidden_out [B, T, D])] per depth.
    """
    mp, p = params["mtp"], params["mtp"]["layers"][0]
    dtype = params["embed"].dtype
    B, T, _ = hidden.shape
    head = qwen35.lm_head_weight(params).astype(dtype)
    keys, values, outs = [], [], []
    h_in = hidden.astype(dtype)
    for k in range(1, depth + 1):
        e = _norm(params["embed"][ids[:, k - 1:k - 1 + T]].astype(dtype), mp["pre_fc_norm_embedding"], cfg)
        x = L.linear(jnp.concatenate([e, _norm(h_in, mp["pre_fc_norm_hidden"], cfg)], axis=-1), mp["fc"])
        positions = jnp.broadcast_to(jnp.arange(k - 1, k - 1 + T, dtype=jnp.int32)[None], (B, T))
        q, kk, v, gate = qwen35.attention_projections(p["mixer"], cfg, _norm(x, p["input_norm"], cfg), positions)
        keys.append(kk)
        values.append(v)
        attn = _chain_attention(q, keys, values, cfg.head_dim ** -0.5)
        x = x + qwen35.attention_output(p["mixer"], attn, gate)
        x = x + qwen35.mlp(p["mlp"], cfg, _norm(x, p["post_norm"], cfg))
        h_in = _norm(x, mp["norm"], cfg)
        logits = lax.dot_general(h_in, head, (((2,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        outs.append((logits, h_in))
    return outs


def _chain_attention(q: jax.Array, keys: list, values: list, scale: float) -> jax.Array:
    """q [B, T, NH, hd] of depth len(keys); keys / values [B, T, NKV, hd] per depth 1..len(keys). Row t attends
    to depth 1 at rows <= t (causal) and to depths 2.. at row t alone. Scores and softmax in float32, as
    layers.attention. Returns [B, T, NH, hd] in q.dtype."""
    B, T, NH, hd = q.shape
    NKV = keys[0].shape[2]
    qg = q.reshape(B, T, NKV, NH // NKV, hd)
    committed = jnp.einsum("btngd,bsnd->bngts", qg, keys[0].astype(q.dtype), preferred_element_type=jnp.float32)
    causal = jnp.tril(jnp.ones((T, T), bool))
    committed = jnp.where(causal, committed * scale, -jnp.inf)  # [B, NKV, G, T, T]
    own = [jnp.einsum("btngd,btnd->bngt", qg, kk.astype(q.dtype), preferred_element_type=jnp.float32)[..., None]
           * scale for kk in keys[1:]]  # each [B, NKV, G, T, 1]
    probs = jax.nn.softmax(jnp.concatenate([committed, *own], axis=-1), axis=-1)
    out = jnp.einsum("bngts,bsnd->btngd", probs[..., :T].astype(values[0].dtype), values[0],
                     preferred_element_type=jnp.float32)
    for m, vv in enumerate(values[1:]):
        out = out + jnp.einsum("bngt,btnd->btngd", probs[..., T + m].astype(vv.dtype), vv,
                               preferred_element_type=jnp.float32)
    return out.reshape(B, T, NH, hd).astype(q.dtype)


def init_mtp_params(cfg: Qwen35Config, key: jax.Array, dtype=jnp.float32, *, num_layers: int = 1,
                    std: float = 0.02) -> dict:
    """Fresh `params["mtp"]`: matrices ~ N(0, std) (output projections scaled by 1/sqrt(2)), norms zero
    (zero-centred RMSNorm: identity). Shapes follow the target's full-attention layers (dense or MoE)."""
    D = cfg.hidden_size
    specs = qwen35.param_specs(cfg, {"model.embed_tokens.weight", "mtp.fc.weight"}
                               | {f"mtp.layers.{i}.x" for i in range(num_layers)}, "init_mtp_params")
    keys = jax.random.split(key, len(specs) + 1)
    tree: dict = {"fc": (jax.random.normal(keys[-1], (D, 2 * D), jnp.float32) * std).astype(dtype),
                  "layers": [{} for _ in range(num_layers)]}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tree[name] = jnp.zeros((D,), dtype)
    for k, (path, leaf) in zip(keys, specs.items()):
        if path[:2] != ("mtp", "layers"):
            continue
        node = tree["layers"][path[2]]
        for part in path[3:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _init_leaf(k, path, leaf_shape(leaf), dtype, std)
    return tree


def leaf_shape(leaf) -> tuple[int, ...]:
    """Shape of the parameter a `qwen35.Leaf` assembles (fused along axis 0, stacked if `stack`)."""
    group = leaf.groups[0]
    first = group[0]
    shape = (sum(s[0] for _, s in group),) + tuple(first[1][1:])
    if first[0].endswith("conv1d.weight"):
        shape = (shape[0], shape[2])  # stored [C, 1, W]; kept as [C, W]
    return ((len(leaf.groups),) + shape) if leaf.stack else shape


_OUT_PROJ = ("o_proj", "out_proj", "down_proj", "experts_down", "shared_down_proj")


def _init_leaf(key, path: tuple, shape: tuple, dtype, std: float, out_scale: float = 2 ** -0.5) -> jax.Array:
    name = path[-1]
    if len(shape) == 1:
        return jnp.zeros(shape, dtype)  # zero-centred norms
    scale = std * (out_scale if name in _OUT_PROJ else 1.0)
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)
