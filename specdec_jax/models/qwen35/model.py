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

import functools

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels import attention as attention_kernels
from pallas_kernels import gated_delta

from ... import sharding
from .config import FULL_ATTENTION, Qwen35Config
from .. import layers as L
from .gdn import (MAX_RECURRENT_VERIFY, conv_channels, conv_window_at, packed_form,  # noqa: F401 (public here)
                         gdn_gates, gdn_heads, gdn_mixer, gdn_projections, gdn_rule, gdn_state_rule,
                         linear_key_heads, split_projection, stacked_conv_windows_at, stacked_state_rule)
from .mlp import (fuse_moe_inputs, mlp, moe_input_form, moe_mlp, to_moe_input_form,  # noqa: F401 (public here)
                  unfuse_moe_inputs)

# ------------------------------------------------------------------------------------------ state

@struct.dataclass
class Qwen35State:
    """Immutable decode state. Rollback = keep an old state; nothing is ever overwritten in place.

    keys/values: per full-attention layer [B, S, NKV, hd] (slots >= length are stale or empty).
    conv: every GDN layer's last (kernel - 1) pre-conv qkv inputs in one array [n_gdn, B, kernel - 1, C].
    recurrent: every GDN layer's state in one array [n_gdn, B, HV, K, V] float32 (index: cfg.slot of the layer).
    One array each, not one per layer: the step kernels read and write their layer's blocks in place, and a
    commit replays (or rebuilds) every layer's state in one kernel launch, and takes every layer's conv window
    in one op, instead of one per layer.
    length: [B] int32 tokens committed per sequence.
    """

    keys: tuple
    values: tuple
    conv: jax.Array
    recurrent: jax.Array
    length: jax.Array

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def batch_rows(self, rows: slice) -> "Qwen35State":
        """The state of the batch rows `rows` (the batch axis is 0 in keys, values and length, 1 in the stacked conv
        and recurrent states)."""
        pick = lambda x: x[rows]
        return Qwen35State(keys=tuple(map(pick, self.keys)), values=tuple(map(pick, self.values)),
                           conv=self.conv[:, rows], recurrent=self.recurrent[:, rows], length=self.length[rows])


def kv_heads(cfg: Qwen35Config) -> int:
    """Key/value heads in the caches and in qkv_proj: num_key_value_heads, or one copy per device when the mesh
    is larger (sharding.py)."""
    return sharding.stored_units(cfg.num_key_value_heads, cfg.tp_size)


def init_state(cfg: Qwen35Config, batch: int, max_len: int, dtype=jnp.bfloat16) -> Qwen35State:
    """Empty state; under a mesh each field is created split over its heads (sharding.STATE_PARTITIONS)."""
    n_attn, n_lin = len(cfg.attention_layers), len(cfg.linear_layers)
    kv_shape = (batch, max_len, kv_heads(cfg), cfg.head_dim)
    rec_shape = (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    conv_shape = (n_lin, batch, cfg.linear_conv_kernel_dim - 1, conv_channels(cfg))

    def zeros(field, shape, dtype):
        return sharding.constrain(jnp.zeros(shape, dtype), cfg.mesh, sharding.STATE_PARTITIONS[field])

    return Qwen35State(
        keys=tuple(zeros("keys", kv_shape, dtype) for _ in range(n_attn)),
        values=tuple(zeros("values", kv_shape, dtype) for _ in range(n_attn)),
        conv=zeros("conv", conv_shape, dtype),
        recurrent=zeros("recurrent", (n_lin,) + rec_shape, jnp.float32),
        length=zeros("length", (batch,), jnp.int32),
    )


def grow_state(state: Qwen35State, max_len: int) -> Qwen35State:
    """The state with attention caches of max_len slots, never fewer than it has (the new slots empty)."""
    pad = lambda x: jnp.pad(x, ((0, 0), (0, max(0, max_len - state.max_len))) + ((0, 0),) * (x.ndim - 2))
    return state.replace(keys=tuple(map(pad, state.keys)), values=tuple(map(pad, state.values)))


# ------------------------------------------------------------------------------------- parameters
# The parameter layout, loading and saving live in params.py; these names stay reachable here.
from .params import (Leaf, detect_prefix, fused_segments, hf_tensors, load_params,  # noqa: E402,F401
                            moe_layout, param_specs, place_param, shard_params, split_counts, with_mesh)


# ---------------------------------------------------------------------------------------- layers

def lm_head_weight(params: dict) -> jax.Array:
    return params["lm_head"] if params.get("lm_head") is not None else params["embed"]


def attention_projections(p: dict, cfg: Qwen35Config, x: jax.Array, positions: jax.Array):
    """The gated attention's inputs for rows at `positions` [B, T]: q [B, T, nH, hd] and k [B, T, nKV, hd]
    (head-normed, RoPE applied), v [B, T, nKV, hd] and the output gate's pre-activation [B, T, nH * hd]."""
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
    return q, k, v, gate.reshape(B, T, nH * hd)


def attention_output(p: dict, attn: jax.Array, gate: jax.Array) -> jax.Array:
    """attn [B, T, nH, hd] (the heads' weighted values), gate [B, T, nH * hd] -> o_proj(attn * sigmoid(gate))."""
    B, T = attn.shape[:2]
    return L.linear(attn.reshape(B, T, -1) * jax.nn.sigmoid(gate), p["o_proj"])


def attention_mixer(p: dict, cfg: Qwen35Config, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    positions: jax.Array, mask: jax.Array | None, valid=None, flash: str | None = None):
    """Gated full attention. positions [B, T]; mask [B, T, S]; valid: None, or [B, T] bool, the rows whose K/V are
    written (a padded prefill: padding rows write nothing). flash: None, or the kernel of a causal attention from
    positions[:, 0] (`attention_path`; the mask is then unused). Returns out and the updated caches."""
    q, k, v, gate = attention_projections(p, cfg, x, positions)
    if valid is None:
        k_cache = L.write_cache(k_cache, k, positions[:, 0])
        v_cache = L.write_cache(v_cache, v, positions[:, 0])
    else:
        k_cache = L.scatter_cache(k_cache, k, positions, valid)
        v_cache = L.scatter_cache(v_cache, v, positions, valid)
    if flash is not None:  # rows at consecutive positions from positions[:, 0]: causal over the cache
        attn = attention_kernels.causal_attention(q, k_cache, v_cache, positions[:, 0], scale=cfg.head_dim ** -0.5,
                                                  implementation=flash, new_kv=(k, v))
    else:
        attn = L.attention(q, k_cache, v_cache, mask, cfg.head_dim ** -0.5)  # [B, T, nH, hd]
    return attention_output(p, attn, gate), k_cache, v_cache


def attention_path(impl: str, rows: int, cache_len: int) -> str | None:
    """The causal-attention kernel a forward of `rows` query rows over `cache_len` slots takes (None: XLA's masked
    attention; `attention_kernels.path`): with impl "auto", the GPU's kernels (flash for prefill chunks, the split
    kernel for few rows over long caches); "pallas" asks for them anywhere (interpret mode off the GPU); any other
    GDN implementation keeps XLA's attention."""
    chosen = {"auto": "auto", "pallas": "pallas"}.get(impl, "reference")
    kernel = attention_kernels.path(chosen, rows, cache_len)
    return None if kernel == "reference" else kernel


@functools.cache
def _inv_freq_cached(rotary_dim: int, theta: float, scaling: tuple):
    return L.rope_inv_freq(rotary_dim, theta, dict(scaling) if scaling else None)


def _inv_freq(cfg: Qwen35Config):
    return _inv_freq_cached(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)


# --------------------------------------------------------------------------------------- forward

def forward(params: dict, cfg: Qwen35Config, state: Qwen35State, input_ids: jax.Array, *,
            impl: str = "auto", collect=None, logits_for: str = "all", n_valid=None, skip: tuple = (),
            skip_deltas=None, record: tuple = (), head=None, live_rows=None, prefill_lens=None):
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
    live_rows: None, or (static, with n_valid) a bound on the valid rows (1 for an AR step, gamma + 1 for a
    verification): the GDN recurrence runs on that many rows, the padding rows past them getting a zero GDN
    output (every other op still runs all T rows, so each product keeps its row count).
    skip (static layer indices): layers not run (self-drafts); their state slots pass through unchanged.
    skip_deltas: None, or [B, T, len(skip), D]: what each skipped layer adds to the residual stream instead.
    record (static layer indices): extras["deltas"] [B, T, len(record), D], what each of those layers
    (mixer + MLP) added to the residual stream.
    head: None (the model's output head), or [N, D]: logits over N rows only (a draft's token shortlist).
    prefill_lens: None, or [B] int32 (traced): a padded prefill (chunked GDN rule), rows past prefill_lens are
    padding: their K/V are not written, their GDN steps leave the state as it is, the conv window is taken at the
    valid boundary, length advances by prefill_lens, and "last" logits are those of each row's last valid row
    (a row with none gets row 0's, unread). The state is the one an unpadded forward of the valid rows leaves.
    """
    B, T = input_ids.shape
    dtype = params["embed"].dtype
    x = params["embed"][input_ids].astype(dtype)  # [B, T, D]
    positions = state.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    flash = attention_path(impl, T, state.max_len) if state.keys else None
    mask = L.causal_cache_mask(positions, state.max_len) if state.keys and flash is None else None
    keys, values = list(state.keys), list(state.values)
    conv, rec = state.conv, state.recurrent
    gdn_extras, deltas, replay_inputs = [], [], None
    valid = None if prefill_lens is None else jnp.arange(T, dtype=jnp.int32)[None, :] < prefill_lens[:, None]
    live = valid if n_valid is None else jnp.arange(T, dtype=jnp.int32)[None, :] < n_valid[:, None]  # [B, T] | None
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
                                                          positions, mask, valid, flash)
        else:
            h, new_conv, rec, ex = gdn_mixer(p["mixer"], cfg, h, conv[slot], rec, slot, impl,
                                             None if collect == "hidden" else collect, n_valid, live_rows,
                                             replay_inputs, prefill_lens)
            conv = conv.at[slot].set(new_conv)
            replay_inputs = ex.pop("replay_inputs", replay_inputs)
            gdn_extras.append(ex)
        x = x + h
        x = x + mlp(p["mlp"], cfg, L.rms_norm(x, p["post_norm"], cfg.rms_norm_eps, zero_centered=True), live, impl,
                    live_rows if n_valid is not None else None)
        if i in record:
            deltas.append(x - x_in)
    hidden = L.rms_norm(x, params["final_norm"], cfg.rms_norm_eps, zero_centered=True)
    if logits_for != "last":
        head_in = hidden
    elif prefill_lens is None:
        head_in = hidden[:, -1:]
    else:  # each row's last valid row
        head_in = jnp.take_along_axis(hidden, jnp.maximum(prefill_lens - 1, 0)[:, None, None], axis=1)
    head = lm_head_weight(params) if head is None else head
    logits = L.linear(head_in, head.astype(dtype), out_dtype=jnp.float32)  # [B, T | 1, vocab]
    new_state = Qwen35State(keys=tuple(keys), values=tuple(values), conv=conv, recurrent=rec,
                            length=state.length + (T if n_valid is None and prefill_lens is None
                                                   else (n_valid if prefill_lens is None else prefill_lens)))
    extras = {"gdn": gdn_extras, "hidden": hidden} if collect else {}
    if replay_inputs is not None:  # (k, g, u) [n_gdn, B, T, ...]: every GDN layer's, for the replay commit
        extras["replay_inputs"] = replay_inputs
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
    `forward(..., collect="replay" | "pseudo" | "snapshot")` returned. Attention K/V stay where the verifier
    wrote them (entries past the new length are masked and later overwritten); the conv state is
    the window at the accepted boundary (every layer's in one op); the GDN states are replayed from `before` over the kept
    positions by the recurrence's own step (`replay_state`, bit-identical to the recurrence), rebuilt
    from pseudo-values (`commit_state`), both for every layer in one call, or, in snapshot mode, selected from
    the per-position states. `commit_deferred` then `apply_pending`, at once.
    mesh: the model's cfg.mesh (None: one device); the commit kernels then run per device on their heads.
    """
    state, pending = commit_deferred(before, verified, extras, n_keep)
    return apply_pending(state, pending, impl=impl, mesh=mesh)


def commit_deferred(before: Qwen35State, verified: Qwen35State, extras: dict, n_keep: jax.Array):
    """`commit` but for the GDN states: (the committed state whose recurrent states are still `before`'s, the pending
    GDN commit), which `apply_pending` completes with the same bits. A decode loop may carry the pending commit into
    its next step, where nothing the step starts with (drafting, the first layer's projections) waits for it."""
    n_keep = n_keep.astype(jnp.int32)
    gdn = extras["gdn"]
    if len(gdn) != before.recurrent.shape[0]:
        raise ValueError(f"commit: the verification collected {len(gdn)} GDN layers; the state has "
                         f"{before.recurrent.shape[0]} (a forward that skipped layers cannot be committed)")
    conv = (stacked_conv_windows_at([ex["conv_window"] for ex in gdn], n_keep, before.conv.shape[2]) if gdn
            else before.conv)
    pending = {"n": n_keep}  # the per-token inputs of one commit rule, named as `apply_pending` reads them
    # No GDN layer: {"n"} alone is pending, and `apply_pending` returns the state as it is.
    if gdn and "replay_inputs" in extras:  # every layer's k, g and pseudo-values, stacked by the verification's kernels
        pending["replay_inputs"] = extras["replay_inputs"]
    elif gdn and "beta" in gdn[0]:
        pending.update({name: [ex[name] for ex in gdn] for name in ("k", "v", "g", "beta")})
    elif gdn and "all_states" in gdn[0]:
        idx = jnp.maximum(n_keep - 1, 0)
        pending["picked"] = jnp.stack([jnp.take_along_axis(ex["all_states"], idx[:, None, None, None, None], axis=1)[:, 0]
                                       for ex in gdn])  # [L, B, HV, K, V]
    elif gdn:
        pending.update({name: [ex[name] for ex in gdn] for name in ("k", "g", "v_new")})
    state = Qwen35State(keys=verified.keys, values=verified.values, conv=conv, recurrent=before.recurrent,
                        length=before.length + n_keep)
    return state, pending


def apply_pending(state: Qwen35State, pending: dict, *, impl: str = "auto", mesh=None) -> Qwen35State:
    """`state` with the pending GDN commit of `commit_deferred` applied to its recurrent states (every layer in one
    call). A pending commit of zero kept positions leaves them as they are."""
    n = pending["n"]
    if "replay_inputs" in pending:
        rec = stacked_state_rule(mesh, gated_delta.replay_pseudo_values, state.recurrent, pending["replay_inputs"], n,
                                 implementation=impl)
    elif "beta" in pending:
        rec = stacked_state_rule(mesh, gated_delta.replay_state, state.recurrent,
                                 tuple(pending[name] for name in ("k", "v", "g", "beta")), n, use_qk_l2norm=True,
                                 implementation=impl)
    elif "picked" in pending:
        rec = jnp.where((n > 0)[None, :, None, None, None], pending["picked"], state.recurrent)
    elif "v_new" in pending:
        rec = stacked_state_rule(mesh, gated_delta.commit_state, state.recurrent,
                                 tuple(pending[name] for name in ("k", "g", "v_new")), n, use_qk_l2norm=True,
                                 implementation=impl)
    else:
        return state
    return state.replace(recurrent=rec)
