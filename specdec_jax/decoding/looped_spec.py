"""Self-speculative decoding for looped (recurrent-depth) models: the target drafts for itself.

One jitted step inside a `lax.while_loop`, no host round-trips, static shapes (gamma, draft depth
d, updates per round k, full depth R, window width), traced counts (accepted tokens, lengths, active
window width). Batches are ragged: every row keeps its own length, accepted count and output offset.

Committed state (all methods): a full depth-indexed `LoopedCache` holding every emitted token but the
*anchor* (the last emitted token, not yet processed), each written by a full-depth (R) pass, so
every step slot s of a committed position holds that position's step-s K/V of the target itself.

Methods (the first three are exact: greedy output == full-depth AR; sampling is distributed as AR):

self-spec     d-step drafts, one token at a time: draft j is `forward(num_steps=d)` of the previous
              token at position L + j, step s reading the verified prefix from slot s (aligned, the
              official Huginn `generate_speculative` semantics).
mature-spec   the same drafts with Deep reads: step s reads the prefix's K (read_k) and/or V
              (read_v) from slot R - 1, the mature full-depth entries the verifier wrote. "aligned" /
              "deep" per K and V: aligned/aligned = self-spec, aligned/deep = Mature-V (Deep V),
              deep/deep = Deep K/V.
              Provisional draft positions (earlier drafts of the same block, at positions >= L): a
              draft writes slots 0..d-1 of its own position; when a read is "deep" it also copies its
              slot d-1 (the deepest it has) into slot R - 1, so later drafts read earlier drafts at
              the deepest depth that exists for them (<= d), and the aligned reads see step s.
das-wave      carried parallel refinement. Window slot i is position L + i; slot 0's input is the
              anchor, slot i's input is slot i-1's current proposal. Round r of a block has active
              width w_r = min(gamma, w_0 + r), w_0 = max(window_init, carried slots): it starts at
              window_init = 2 and grows by one per round. A round: prelude over the window's input
              tokens; k recurrent updates of every active slot in parallel, each reading the
              verified prefix (Deep K/V by default; "aligned" = the slot of that slot's own depth)
              and the window's own K/V of that update (causal, in-pass; never written to the cache,
              so discarded between rounds); coda + head -> new proposals. A slot that becomes
              active starts from the initial state (zeros). A block runs `rounds` rounds (static,
              default gamma - window_init + 1, so the window is full when verified; rounds="fill":
              only until the window is full, gamma - w_0 + 1 rounds traced per row, so carried slots
              save rounds instead of getting more refinement). Then an independent full-depth
              verifier runs anchor + gamma proposals from the committed cache; commit anchor +
              accepted proposals (length += accepted + 1), emit the target token at the first
              mismatch, and carry the latent states, depths and proposals of the slots past the
              committed ones into the next block (shifted by the committed count; carry=False:
              every block starts from an empty window).
parallel-sampler  Geiping et al. 2025 (arXiv 2510.14961), diffusion-forcing style, NOT lossless. A
              wavefront of up to gamma positions; each round: prelude over the current guesses
              (embedding EMA: e = ema * e_prev + (1 - ema) * e_new), inner_steps (r') recurrences
              of every active position reading the committed prefix at slot R - 1 and the wavefront
              in-pass, coda -> new guesses. A leading run of positions whose latent moved less than
              epsilon (||x - x_prev|| / ||x||, over the round) -- or that reached R recurrences --
              and whose input token equals the committed token before it, is frozen: its tokens are
              emitted, its K/V (prelude, core at slot R - 1, coda) become the committed prefix. The
              wavefront then grows by one position (up to gamma).

Entry point: `generate_looped_spec(model, input_ids, max_new_tokens, method, ...)`.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from ..errors import InputError
from ..options import check_context_length, float_option, int_option, validate_input_ids
from ..model import GenerateResult
from ..models import layers as L
from ..models import looped
from .acceptance import leading_true, accept
from .compiled import compiled
from .decode_shape import exact_rows, pad_rows
from .speculative import append_rows, eos_mask, emit_accepted, forced_acceptance
from .sampling import SamplingConfig, probabilities, select_token

LOOPED_SPEC_METHODS = ("self-spec", "mature-spec", "das-wave", "parallel-sampler")
READ_MODES = ("aligned", "deep")

_OPTIONS = {
    "self-spec": ("draft_steps", "gamma", "exact", "decode_rows"),
    "mature-spec": ("draft_steps", "gamma", "read_k", "read_v", "exact", "decode_rows"),
    "das-wave": ("gamma", "k", "read_k", "read_v", "carry", "window_init", "rounds", "exact", "decode_rows"),
    "parallel-sampler": ("gamma", "inner_steps", "epsilon", "ema", "exact"),
}
_DEFAULT_GAMMA = {"self-spec": 4, "mature-spec": 4, "das-wave": 16, "parallel-sampler": 16}


# ------------------------------------------------------------------------------------------ plan

@dataclasses.dataclass(frozen=True)
class LoopedSpecPlan:
    """Static (hashable) settings of one method; built and validated by `make_plan`."""

    method: str
    num_steps: int  # R: depth of the target (verifier, prefill, AR)
    gamma: int  # drafts per block (self/mature/das) or wavefront width (parallel-sampler)
    draft_steps: int = 0  # d (self-spec, mature-spec)
    read_k: str = "aligned"
    read_v: str = "aligned"
    k: int = 1  # recurrent updates per round (das-wave)
    carry: bool = True
    window_init: int = 2
    rounds: int = 0  # rounds per block (das-wave); 0 = "fill": until the window is full
    inner_steps: int = 4  # r' (parallel-sampler)
    epsilon: float = 0.03
    ema: float = 0.1
    decode_rows: int = 0  # > 0: the exact path (the verifier a decode_forward of this many rows)

    @property
    def window(self) -> int:
        """Width of the carried window state (0 for the sequential drafters)."""
        return self.gamma if self.method in ("das-wave", "parallel-sampler") else 0

    def core_steps_per_pass(self) -> int:
        """Core-block applications of one drafting pass (a draft token, a das-wave or sampler round)."""
        return {"das-wave": self.k, "parallel-sampler": self.inner_steps}.get(self.method, self.draft_steps)

    def core_applications_per_token(self, passes: int, verifications: int, tokens: int) -> float:
        """Core-block applications of `passes` drafting passes + `verifications` full-depth verifications
        (none for the sampler), per token they produced (prelude / coda / head not counted; AR: R)."""
        verify = 0 if self.method == "parallel-sampler" else verifications * self.num_steps
        return float((passes * self.core_steps_per_pass() + verify) / max(tokens, 1))

    def describe(self) -> dict:
        keys = ("num_steps", "gamma") + tuple(k for k in _OPTIONS[self.method] if k != "exact")
        out = {name: getattr(self, name) for name in dict.fromkeys(keys)}
        out["exact"] = bool(self.decode_rows)
        if out.get("rounds") == 0:
            out["rounds"] = "fill"
        return out


def _read_option(options: dict, name: str, default: str) -> str:
    value = options.get(name, default)
    if value not in READ_MODES:
        raise InputError(f"{name} must be one of {READ_MODES}; got {value!r}")
    return value


def make_plan(method: str, num_steps: int, **options) -> LoopedSpecPlan:
    """Validate a method and its options (InputError naming the problem) -> LoopedSpecPlan.

    Options (defaults): self-spec: draft_steps (max(1, R // 8)), gamma (4). mature-spec: also
    read_k, read_v ("deep", "deep"). das-wave: gamma (16), k (2), read_k/read_v ("deep"), carry
    (True), window_init (2), rounds (gamma - window_init + 1; a fixed count >= that, or "fill":
    each block runs until its window is full, gamma - max(window_init, carried) + 1 rounds).
    parallel-sampler: gamma (16, wavefront width), inner_steps (4), epsilon (0.03),
    ema (0.1). Every method but the sampler: exact (True: the verifier runs at the decode shape of
    exact AR, `looped.decode_forward`, so greedy output equals exact AR bit for bit in any dtype;
    False: the faster-to-write two-block verifier) and decode_rows (the exact path's row count;
    default max(17, gamma + 1)).
    """
    if method not in LOOPED_SPEC_METHODS:
        raise InputError(f"unknown looped speculative method {method!r}; supported: {', '.join(LOOPED_SPEC_METHODS)}")
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 1:
        raise InputError(f"num_steps (recurrence depth) must be an integer >= 1; got {num_steps!r}")
    R = int(num_steps)
    unknown = sorted(set(options) - set(_OPTIONS[method]))
    if unknown:
        raise InputError(f"method {method!r}: unknown options {unknown}; accepted: {list(_OPTIONS[method])}")
    gamma = int_option(options, "gamma", _DEFAULT_GAMMA[method], 1)
    rows = exact_rows(options, gamma, "looped", "the parallel sampler is not lossless: it commits what has "
                                                "converged, not what a verifier accepted"
                      if method == "parallel-sampler" else None)
    plan = _make_plan(method, R, gamma, options)
    return dataclasses.replace(plan, decode_rows=rows)


def _make_plan(method: str, R: int, gamma: int, options: dict) -> LoopedSpecPlan:
    if method in ("self-spec", "mature-spec"):
        d = int_option(options, "draft_steps", max(1, R // 8), 1, R, f" (the draft depth cannot exceed num_steps={R})")
        deep = "deep" if method == "mature-spec" else "aligned"
        return LoopedSpecPlan(method, R, gamma, draft_steps=d, read_k=_read_option(options, "read_k", deep),
                              read_v=_read_option(options, "read_v", deep))
    if method == "das-wave":
        k = int_option(options, "k", 2, 1)
        window_init = int_option(options, "window_init", min(2, gamma), 1, gamma, f" (at most gamma={gamma})")
        need = gamma - window_init + 1
        rounds = 0 if options.get("rounds") == "fill" else int_option(
            options, "rounds", need, need, None, f" (or 'fill'; gamma - window_init + 1 = {need}: the window must "
                                                 f"be full when verified)")
        carry = options.get("carry", True)
        if not isinstance(carry, (bool, np.bool_)):
            raise InputError(f"carry must be a bool; got {carry!r}")
        return LoopedSpecPlan(method, R, gamma, read_k=_read_option(options, "read_k", "deep"),
                              read_v=_read_option(options, "read_v", "deep"), k=k, carry=bool(carry),
                              window_init=window_init, rounds=rounds)
    inner = int_option(options, "inner_steps", 4, 1)
    eps = float_option(options, "epsilon", 0.03, 0.0, float("inf"))
    ema = float_option(options, "ema", 0.1, 0.0, 1.0, " (0 = no smoothing)")
    if ema >= 1.0:
        raise InputError(f"ema must be < 1 (1 would freeze the first embedding); got {ema}")
    return LoopedSpecPlan(method, R, gamma, inner_steps=inner, epsilon=eps, ema=ema, read_k="deep", read_v="deep",
                          window_init=1)


# ----------------------------------------------------------------------------------------- state

@struct.dataclass
class LoopedSpecState:
    """Everything a step reads and writes.

    cache: committed LoopedCache (all tokens but the anchor). anchor [B]: last emitted token.
    out [B, N + gamma + 1], n_out [B]: emitted tokens; done [B]: EOS seen or budget reached.
    steps: loop iterations (verify blocks, or sampler rounds); accepted [M, B]: accepted drafts per
    block (committed tokens per round for the sampler; -1 = row inactive).
    Window (das-wave, parallel-sampler; width 0 otherwise): win_x [B, W, D] latent states,
    win_e [B, W, D] embeddings (sampler EMA), win_tok [B, W] proposals (slot i's guess of the token
    at position L + i + 1), win_depth [B, W] recurrences applied, win_n [B] carried slots (das-wave)
    or active width (sampler). draft_rounds [B]: drafting passes so far (sequential: draft tokens,
    das-wave: rounds, sampler: rounds), for the work accounting in the stats.
    """

    cache: looped.LoopedCache
    anchor: jax.Array
    out: jax.Array
    n_out: jax.Array
    done: jax.Array
    steps: jax.Array
    accepted: jax.Array
    win_x: jax.Array
    win_e: jax.Array
    win_tok: jax.Array
    win_depth: jax.Array
    win_n: jax.Array
    draft_rounds: jax.Array


def _shift_left(a: jax.Array, n: jax.Array) -> jax.Array:
    """Per-row shift of a [B, W, ...] left by n [B] (0 <= n), zero-filled: row[i] <- row[i + n]."""
    W = a.shape[1]
    padded = jnp.concatenate([a, jnp.zeros_like(a)], axis=1)
    return jax.vmap(lambda row, s: lax.dynamic_slice_in_dim(row, s, W, axis=0))(padded, jnp.minimum(n, W))


def _record_len(plan: LoopedSpecPlan, max_new_tokens: int) -> int:
    if plan.method == "parallel-sampler":  # rounds may commit nothing; slot 0 commits within ceil(R / r') rounds
        return max_new_tokens * (-(-plan.num_steps // plan.inner_steps) + 1) + 1
    return max_new_tokens  # every block emits at least one token


# ------------------------------------------------------------------------------ cache plumbing

def _copy_slot(buf: jax.Array, src: int, dst: int, pos: jax.Array) -> jax.Array:
    """buf [R, Lc, B, S, N, hd]: copy step slot `src` into slot `dst` at one position pos[b] per row."""
    _, Lc, B, _, N, hd = buf.shape
    z = jnp.zeros((), jnp.int32)
    for b in range(B):  # B is small; a DUS per row updates the buffer in place
        piece = lax.dynamic_slice(buf, (jnp.int32(src), z, jnp.int32(b), pos[b], z, z), (1, Lc, 1, 1, N, hd))
        buf = lax.dynamic_update_slice(buf, piece, (jnp.int32(dst), z, jnp.int32(b), pos[b], z, z))
    return buf


def _write_slot(buf: jax.Array, new: jax.Array, slot: int, start: jax.Array) -> jax.Array:
    """buf [R, Lc, B, S, N, hd] with new [Lc, B, T, N, hd] written into step slot `slot` at start [B]."""
    z = jnp.zeros((), jnp.int32)
    for b in range(buf.shape[2]):
        row = lax.slice_in_dim(new, b, b + 1, axis=1).astype(buf.dtype)[None]
        buf = lax.dynamic_update_slice(buf, row, (jnp.int32(slot), z, jnp.int32(b), start[b], z, z))
    return buf


def _draft_slots(mode: str, draft_steps: int, num_slots: int) -> jax.Array:
    """Read schedule [draft_steps]: aligned (step s reads slot s) or deep (every step reads R - 1)."""
    if mode == "aligned":
        return jnp.arange(draft_steps, dtype=jnp.int32)
    return jnp.full((draft_steps,), num_slots - 1, jnp.int32)


def draft_forward(params, cfg, cache: looped.LoopedCache, ids: jax.Array, *, draft_steps: int,
                  read_k: str = "aligned", read_v: str = "aligned"):
    """One sequential draft token: logits [B, V] for ids [B, 1] at position cache.length, and the cache
    with the draft's provisional K/V written (length + 1).

    Step s (s < draft_steps) reads the prefix K from slot s ("aligned") or R - 1 ("deep"), V likewise
    (R = cache.step_slots), and writes slot s. With a deep read and draft_steps < R the draft's deepest
    K (V) -- slot draft_steps - 1 -- is also copied into slot R - 1, so a later draft reading "deep"
    sees this provisional position at the deepest depth that exists for it. The verifier rewrites
    every slot of these positions.
    """
    R = cache.step_slots
    rk, rv = _draft_slots(read_k, draft_steps, R), _draft_slots(read_v, draft_steps, R)
    logits, new, _ = looped.forward(params, cfg, cache, ids, num_steps=draft_steps, read_step_k=rk, read_step_v=rv,
                                    logits_for="last")
    if draft_steps < R:
        if read_k == "deep":
            new = new.replace(core_k=_copy_slot(new.core_k, draft_steps - 1, R - 1, cache.length))
        if read_v == "deep":
            new = new.replace(core_v=_copy_slot(new.core_v, draft_steps - 1, R - 1, cache.length))
    return logits[:, 0], new


# ------------------------------------------------------------------- window (per-position) core

def _attend_pp(q, k, v, k_pre, v_pre, length, scale):
    """looped._attend where the prefix may differ per query: k_pre/v_pre [B, S, N, hd] (shared) or
    [B, T, S, N, hd] (query t reads its own prefix slot). One softmax over prefix + new tokens."""
    B, T, H, hd = q.shape
    NKV = k.shape[2]
    qg = q.reshape(B, T, NKV, H // NKV, hd)
    causal = jnp.tril(jnp.ones((T, T), bool))
    s_new = jnp.einsum("btngd,bsnd->bngts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    s_new = jnp.where(causal, s_new, -jnp.inf)
    eq_k = "btngd,bsnd->bngts" if k_pre.ndim == 4 else "btngd,btsnd->bngts"
    s_pre = jnp.einsum(eq_k, qg, k_pre.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    S = k_pre.shape[-3]
    visible = jnp.arange(S, dtype=jnp.int32)[None, :] < length[:, None]  # [B, S]
    s_pre = jnp.where(visible[:, None, None, None, :], s_pre, -jnp.inf)
    p = jax.nn.softmax(jnp.concatenate([s_pre, s_new], axis=-1), axis=-1).astype(v.dtype)
    eq_v = "bngts,bsnd->btngd" if v_pre.ndim == 4 else "bngts,btsnd->btngd"
    out = (jnp.einsum(eq_v, p[..., :S], v_pre.astype(v.dtype), preferred_element_type=jnp.float32)
           + jnp.einsum("bngts,bsnd->btngd", p[..., S:], v, preferred_element_type=jnp.float32))
    return out.reshape(B, T, H, hd).astype(q.dtype)


def _attention_pp(ap, cfg, h, cos, sin, k_pre, v_pre, length):
    """looped._attention with per-query prefix slots (see _attend_pp)."""
    B, T, _ = h.shape
    qkv = L.linear(h, ap["Wqkv"])
    q, k, v = jnp.split(qkv, [cfg.q_dim, cfg.q_dim + cfg.kv_dim], axis=-1)
    if cfg.variant == "raven_olmo2":
        q = looped.block_norm(cfg, q, ap["q_norm"])
        k = looped.block_norm(cfg, k, ap["k_norm"])
    q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)
    k = k.reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
    v = v.reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
    if cfg.qk_bias:
        q = q + ap["qk_bias"][0].astype(q.dtype)
        k = k + ap["qk_bias"][1].astype(k.dtype)
    q, k = looped.apply_rope(cfg, q, cos, sin), looped.apply_rope(cfg, k, cos, sin)
    out = _attend_pp(q, k, v, k_pre, v_pre, length, cfg.head_dim ** -0.5)
    return L.linear(out.reshape(B, T, cfg.q_dim), ap["proj"])


def _block_pp(lp, cfg, x, cos, sin, k_pre, v_pre, length):
    """looped._block with per-query prefix slots."""
    norm = functools.partial(looped.block_norm, cfg)
    if cfg.variant == "huginn":
        x = norm(_attention_pp(lp["attn"], cfg, norm(x, lp["norm_1"]), cos, sin, k_pre, v_pre, length) + x,
                 lp["norm_2"])
        return norm(looped.block_mlp(lp["mlp"], norm(x, lp["norm_3"])) + x, lp["norm_4"])
    if cfg.variant == "raven_llama":
        x = _attention_pp(lp["attn"], cfg, norm(x, lp["norm_1"]), cos, sin, k_pre, v_pre, length) + x
        return looped.block_mlp(lp["mlp"], norm(x, lp["norm_2"])) + x
    x = norm(_attention_pp(lp["attn"], cfg, x, cos, sin, k_pre, v_pre, length), lp["norm_1"]) + x
    return norm(looped.block_mlp(lp["mlp"], x), lp["norm_2"]) + x


def _gather_slots(buf: jax.Array, slot) -> jax.Array:
    """buf [R, B, S, N, hd]; slot int -> [B, S, N, hd]; slot [B, T] -> [B, T, S, N, hd] (per query)."""
    if isinstance(slot, int):
        return buf[slot]
    return jax.vmap(lambda rows, s: jnp.take(rows, s, axis=0), in_axes=(1, 0))(buf, slot)


def window_update(params, cfg, cache: looped.LoopedCache, x, e, depth, cos, sin, read_k: str, read_v: str):
    """One recurrence of every window slot in parallel: x, e [B, W, D]; depth [B, W] = recurrences
    each slot has had. The verified prefix is read from slot R - 1 ("deep") or from the slot of the
    slot's own depth, min(depth, R - 1) ("aligned", per query); the window attends to its own K/V of
    this update (causal, in-pass; nothing is written). Returns (x [B, W, D], k, v [Lc, B, W, N, hd]).
    """
    R = cache.step_slots
    if read_k == "deep" and read_v == "deep":
        # step only matters for skip-adapter (depth 0 passes the prelude output through)
        return looped.core_step(params, cfg, cache, x, e, depth[..., None], cos, sin, R - 1, R - 1)
    own = jnp.minimum(depth, R - 1)
    sk = own if read_k == "aligned" else R - 1
    sv = own if read_v == "aligned" else R - 1
    h = looped.inject(params, cfg, x, e, depth[..., None] == 0)
    for j, lp in enumerate(params["core_block"]):
        h = _block_pp(lp, cfg, h, cos, sin, _gather_slots(cache.core_k[:, j], sk),
                      _gather_slots(cache.core_v[:, j], sv), cache.length)
    return h, None, None


def _window_prelude(params, cfg, cache, tokens, cos, sin):
    """Prelude over window input tokens [B, W] after the committed prefix -> (e [B, W, D], prelude K/V)."""
    e = looped.embed(params, cfg, tokens)
    return looped.run_blocks(params.get("prelude", []), cfg, e, cos, sin, cache.prelude_k, cache.prelude_v, cache.length)


def _window_rope(cfg, cache, width: int):
    positions = cache.length[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    return looped.rope_tables(cfg, positions)


# ------------------------------------------------------------------------------------- drafting

def _sequential_propose(params, cfg, cache, anchor, key, plan: LoopedSpecPlan, sampling: SamplingConfig):
    """gamma drafts at depth d, one at a time. Returns (drafts [B, G], q [B, G, V] | None, cache with
    the drafts' provisional entries and length reset to the committed length)."""
    length = cache.length

    def body(carry, k):
        cache, tok = carry
        logits, cache = draft_forward(params, cfg, cache, tok[:, None], draft_steps=plan.draft_steps,
                                      read_k=plan.read_k, read_v=plan.read_v)
        new = select_token(logits, k, sampling)
        q = jnp.zeros((tok.shape[0], 0), jnp.float32) if sampling.greedy else probabilities(logits, sampling)
        return (cache, new), (new, q)

    (cache, _), (drafts, qs) = lax.scan(body, (cache, anchor), jax.random.split(key, plan.gamma))
    q = None if sampling.greedy else jnp.swapaxes(qs, 0, 1)
    return drafts.T, q, cache.replace(length=length)


def _das_wave_propose(params, cfg, state: LoopedSpecState, key, plan: LoopedSpecPlan, sampling: SamplingConfig):
    """One block of DAS-Wave rounds. Returns (proposals [B, G], q | None, x [B, G, D], depth [B, G],
    rounds [B]): the window after the row's last round, from which the carry is cut after the commit."""
    cache, anchor = state.cache, state.anchor
    B, G = anchor.shape[0], plan.gamma
    slot = jnp.arange(G, dtype=jnp.int32)[None, :]
    cos, sin = _window_rope(cfg, cache, G)
    carried = slot < state.win_n[:, None]
    x = jnp.where(carried[..., None], state.win_x, jnp.zeros_like(state.win_x))
    depth = jnp.where(carried, state.win_depth, 0)
    props = jnp.where(carried, state.win_tok, anchor[:, None])  # a fresh slot's first input: the anchor
    w0 = jnp.clip(jnp.maximum(plan.window_init, state.win_n), 1, G)
    # Rounds per row: until the window is full, or the fixed count (then always full at the end).
    rounds = jnp.full((B,), plan.rounds, jnp.int32) if plan.rounds else G - w0 + 1
    logits0 = jnp.zeros((B, G if not sampling.greedy else 0, cfg.vocab_size), jnp.float32)

    def one_round(carry):
        r, x, depth, props, last_logits, key = carry
        key, sub = jax.random.split(key)
        # A row past its rounds keeps its window as is (results do not depend on the batch).
        active = (slot < jnp.minimum(w0 + r, G)[:, None]) & (r < rounds)[:, None]
        tokens = jnp.concatenate([anchor[:, None], props[:, :-1]], axis=1)
        e, _, _ = _window_prelude(params, cfg, cache, tokens, cos, sin)
        x = jnp.where((depth == 0)[..., None], looped.initial_state(cfg, e), x)

        def update(_, c):
            x, depth = c
            x_new = window_update(params, cfg, cache, x, e, depth, cos, sin, plan.read_k, plan.read_v)[0]
            return jnp.where(active[..., None], x_new, x), depth + active

        x, depth = lax.fori_loop(0, plan.k, update, (x, depth), unroll=plan.k <= 4)
        logits = looped.coda_head(params, cfg, cache, x, cos, sin, "all")[0]  # [B, G, V]
        props = jnp.where(active, select_token(logits, sub, sampling), props)
        if not sampling.greedy:
            last_logits = jnp.where((r < rounds)[:, None, None], logits, last_logits)
        return r + 1, x, depth, props, last_logits, key

    init = (jnp.int32(0), x, depth, props, logits0, key)
    if plan.rounds:  # a static trip count: no loop predicate to bring back to the host each round
        _, x, depth, props, logits, _ = lax.fori_loop(0, plan.rounds, lambda _, c: one_round(c), init)
    else:
        _, x, depth, props, logits, _ = lax.while_loop(lambda c: c[0] < jnp.max(rounds), one_round, init)
    q = None if sampling.greedy else probabilities(logits, sampling)
    return props, q, x, depth, rounds


# ---------------------------------------------------------------------------------------- steps

def spec_step(params, cfg, state: LoopedSpecState, key, *, plan: LoopedSpecPlan, sampling: SamplingConfig,
              max_new_tokens: int, eos_ids: tuple[int, ...], accept_p=None) -> LoopedSpecState:
    """One block of self-spec / mature-spec / das-wave: propose gamma tokens, verify anchor + proposals
    in one full-depth forward from the committed cache, accept, commit (ragged per row). accept_p: None, or
    a traced probability forcing the accepted count (`speculative.forced_acceptance`; cost benchmarks only)."""
    G, R = plan.gamma, plan.num_steps
    k_draft, k_accept = jax.random.split(key)
    active = ~state.done
    length = state.cache.length
    if plan.method == "das-wave":
        drafts, q, win_x, win_depth, rounds = _das_wave_propose(params, cfg, state, k_draft, plan, sampling)
        cache = state.cache  # the window's K/V never touched the cache
    else:
        drafts, q, cache = _sequential_propose(params, cfg, state.cache, state.anchor, k_draft, plan, sampling)
        rounds = jnp.full_like(length, G)  # one draft forward per token
    verify_ids = jnp.concatenate([state.anchor[:, None], drafts], axis=1)  # [B, G + 1]
    if plan.decode_rows:  # the exact path: the decode shape every exact AR step runs at
        logits, verified = looped.decode_forward(params, cfg, cache, pad_rows(verify_ids, plan.decode_rows),
                                                 jnp.full_like(length, plan.decode_rows), num_steps=R)
        logits = logits[:, :G + 1]
    else:
        logits, verified, _ = looped.forward(params, cfg, cache, verify_ids, num_steps=R)
    n_acc, next_token = accept(drafts, q, logits, k_accept, sampling)
    if accept_p is not None:  # the real acceptance stays a dependency, so its cost is still paid
        n_acc, next_token = forced_acceptance(n_acc, logits, accept_p, jax.random.fold_in(k_accept, 1))
    # Keep anchor + accepted drafts (the verifier wrote every slot for them); a finished row keeps nothing.
    emitted, n_emit, n_keep, hit_eos = emit_accepted(drafts, n_acc, next_token, active, eos_ids)
    new_anchor = jnp.take_along_axis(emitted, jnp.maximum(n_emit - 1, 0)[:, None], axis=1)[:, 0]
    n_out = state.n_out + n_emit
    state = state.replace(
        cache=verified.replace(length=length + n_keep),
        anchor=jnp.where(active, new_anchor, state.anchor),
        out=append_rows(state.out, state.n_out, emitted),
        n_out=n_out,
        done=state.done | hit_eos | (n_out >= max_new_tokens),
        steps=state.steps + 1,
        accepted=state.accepted.at[jnp.minimum(state.steps, state.accepted.shape[0] - 1)].set(
            jnp.where(active, n_acc, -1)),
        draft_rounds=state.draft_rounds + jnp.where(active, rounds, 0),
    )
    if plan.method == "das-wave":
        # Slots past the committed ones keep their latent states: old slot n_keep + i is new slot i.
        win_n = jnp.maximum(G - n_keep, 0) if plan.carry else jnp.zeros_like(n_keep)
        state = state.replace(win_x=_shift_left(win_x, n_keep), win_depth=_shift_left(win_depth, n_keep),
                              win_tok=_shift_left(drafts, n_keep), win_n=jnp.where(active, win_n, state.win_n))
    return state


def sampler_step(params, cfg, state: LoopedSpecState, key, *, plan: LoopedSpecPlan, sampling: SamplingConfig,
                 max_new_tokens: int, eos_ids: tuple[int, ...]) -> LoopedSpecState:
    """One round of the parallel (diffusion-forcing) sampler; see the module docstring."""
    cache, anchor = state.cache, state.anchor
    G, R = plan.gamma, plan.num_steps
    live = ~state.done
    slot = jnp.arange(G, dtype=jnp.int32)[None, :]
    active = slot < state.win_n[:, None]
    cos, sin = _window_rope(cfg, cache, G)
    tokens = jnp.concatenate([anchor[:, None], state.win_tok[:, :-1]], axis=1)  # slot i's input
    e_new, pk, pv = _window_prelude(params, cfg, cache, tokens, cos, sin)
    fresh = (state.win_depth == 0)[..., None]
    e = jnp.where(fresh, e_new, (plan.ema * state.win_e.astype(jnp.float32)
                                 + (1 - plan.ema) * e_new.astype(jnp.float32)).astype(e_new.dtype))
    x0 = jnp.where(fresh, looped.initial_state(cfg, e), state.win_x)
    Lc = cfg.n_layers_in_recurrent_block
    zero_kv = jnp.zeros((Lc, anchor.shape[0], G, cfg.num_key_value_heads, cfg.head_dim), cache.core_k.dtype)

    def inner(_, c):
        x, depth, _, _ = c
        x_new, k, v = looped.core_step(params, cfg, cache, x, e, depth[..., None], cos, sin, R - 1, R - 1)
        return jnp.where(active[..., None], x_new, x), depth + active, k.astype(zero_kv.dtype), v.astype(zero_kv.dtype)

    x, depth, ck, cv = lax.fori_loop(0, plan.inner_steps, inner, (x0, state.win_depth, zero_kv, zero_kv))
    logits, _, dk, dv = looped.coda_head(params, cfg, cache, x, cos, sin, "all")
    props = jnp.where(active, select_token(logits, key, sampling), state.win_tok)
    x32, x032 = x.astype(jnp.float32), x0.astype(jnp.float32)
    moved = jnp.linalg.norm(x32 - x032, axis=-1) / jnp.maximum(jnp.linalg.norm(x32, axis=-1), 1e-12)
    # A frozen slot's input must be the token committed before it, so the cache matches the output.
    stable = jnp.concatenate([jnp.ones_like(anchor[:, None], bool), state.win_tok[:, :-1] == props[:, :-1]], axis=1)
    ready = active & stable & (((moved < plan.epsilon) & ~fresh[..., 0]) | (depth >= R))
    n = jnp.where(live, leading_true(ready), 0)
    col = jnp.arange(G)[None, :]
    eos_here = eos_mask(props, eos_ids) & (col < n[:, None])
    hit_eos = jnp.any(eos_here, axis=1)
    n = jnp.where(hit_eos, jnp.argmax(eos_here, axis=1) + 1, n)
    start = cache.length
    new_cache = cache.replace(
        prelude_k=looped.write_tokens(cache.prelude_k, pk, start),
        prelude_v=looped.write_tokens(cache.prelude_v, pv, start),
        core_k=_write_slot(cache.core_k, ck, R - 1, start), core_v=_write_slot(cache.core_v, cv, R - 1, start),
        coda_k=looped.write_tokens(cache.coda_k, dk, start), coda_v=looped.write_tokens(cache.coda_v, dv, start),
        length=start + n)
    new_anchor = jnp.take_along_axis(props, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
    n_out = state.n_out + n
    return state.replace(
        cache=new_cache,
        anchor=jnp.where(n > 0, new_anchor, anchor),
        out=append_rows(state.out, state.n_out, props),
        n_out=n_out,
        done=state.done | hit_eos | (n_out >= max_new_tokens),
        steps=state.steps + 1,
        accepted=state.accepted.at[jnp.minimum(state.steps, state.accepted.shape[0] - 1)].set(jnp.where(live, n, -1)),
        win_x=_shift_left(x, n), win_e=_shift_left(e, n), win_tok=_shift_left(props, n),
        win_depth=_shift_left(depth, n), draft_rounds=state.draft_rounds + live,
        win_n=jnp.where(live, jnp.minimum(state.win_n - n + 1, G), state.win_n),
    )


# ------------------------------------------------------------------------------------ jit + loop

@functools.partial(jax.jit, static_argnames=("cfg", "plan", "max_len", "sampling", "eos_ids", "max_new_tokens",
                                             "state_dtype"))
def _prefill(params, prompt, key, *, cfg, plan: LoopedSpecPlan, max_len: int, sampling: SamplingConfig,
             eos_ids: tuple[int, ...], max_new_tokens: int, state_dtype):
    """Prompt at full depth R -> LoopedSpecState whose anchor is the first new token (chosen as AR does)."""
    B = prompt.shape[0]
    cache = looped.init_cache(cfg, B, max_len, plan.num_steps, "full", state_dtype)
    logits, cache, _ = looped.forward(params, cfg, cache, prompt, num_steps=plan.num_steps, logits_for="last")
    first = select_token(logits[:, 0], key, sampling)
    W, D = plan.window, cfg.n_embd
    latent_dtype = params["wte"].dtype
    return LoopedSpecState(
        cache=cache, anchor=first,
        out=jnp.zeros((B, max_new_tokens + plan.gamma + 1), jnp.int32).at[:, 0].set(first),
        n_out=jnp.ones((B,), jnp.int32), done=eos_mask(first, eos_ids) | (max_new_tokens <= 1),
        steps=jnp.int32(0), accepted=jnp.full((_record_len(plan, max_new_tokens), B), -1, jnp.int32),
        win_x=jnp.zeros((B, W, D), latent_dtype), win_e=jnp.zeros((B, W, D), latent_dtype),
        win_tok=jnp.zeros((B, W), jnp.int32), win_depth=jnp.zeros((B, W), jnp.int32),
        win_n=jnp.full((B,), 1 if plan.method == "parallel-sampler" else 0, jnp.int32),
        draft_rounds=jnp.zeros((B,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("cfg", "plan", "sampling", "eos_ids", "max_new_tokens"),
                   donate_argnames=("state",))
def _loop(params, state, key, accept_p=None, *, cfg, plan: LoopedSpecPlan, sampling: SamplingConfig,
          eos_ids: tuple[int, ...], max_new_tokens: int):
    if plan.method == "parallel-sampler" and accept_p is not None:
        raise ValueError("accept_p: the parallel sampler has no acceptance step to force")
    step_fn = sampler_step if plan.method == "parallel-sampler" else functools.partial(spec_step, accept_p=accept_p)
    step = functools.partial(step_fn, params, cfg, plan=plan, sampling=sampling, max_new_tokens=max_new_tokens,
                             eos_ids=eos_ids)

    def body(carry):
        state, key = carry
        key, sub = jax.random.split(key)
        return step(state, sub), key

    state, _ = lax.while_loop(lambda c: ~jnp.all(c[0].done), body, (state, key))
    pad = eos_ids[0] if eos_ids else 0
    filled = jnp.arange(max_new_tokens)[None, :] < state.n_out[:, None]
    return jnp.where(filled, state.out[:, :max_new_tokens], pad), state


# ----------------------------------------------------------------------------------- public call

def generate_looped_spec(model, input_ids, max_new_tokens: int, method: str, *, num_steps: int | None = None,
                         sampling: SamplingConfig | None = None, seed: int = 0, eos_ids: tuple[int, ...] | None = None,
                         max_len: int | None = None, **method_options) -> GenerateResult:
    """Self-speculative generation for a looped model; the whole loop runs on device.

    input_ids [B, T]; method in LOOPED_SPEC_METHODS; num_steps: target depth R (default the config's
    mean_recurrence); sampling: SamplingConfig (default greedy); eos_ids: None = the config's, () =
    never stop; max_len: cache length (default and minimum prompt + max_new_tokens + gamma).
    method_options: see `make_plan`. Options are validated (InputError) before any compute.

    Returns GenerateResult(tokens [B, max_new_tokens], stats): new_tokens, seconds, tokens_per_second,
    prefill_seconds, decode_seconds, decode_tokens_per_second, compile_seconds, verify_steps,
    mean_accepted, tokens_per_step, accepted_counts, core_applications_per_token (core-block
    applications of drafting + verification per token after the first, prelude / coda / head not
    counted; AR: num_steps), plus the plan's options. das-wave and the parallel sampler add rounds
    (summed over rows). For the parallel sampler verify_steps is 0 and mean_accepted /
    tokens_per_step are committed tokens per round.
    """
    cfg = model.config
    if getattr(cfg, "family", None) != "looped":
        raise InputError(f"generate_looped_spec needs a looped model; got a {getattr(cfg, 'family', '?')} model")
    ids = validate_input_ids(input_ids, cfg.vocab_size)
    R = cfg.mean_recurrence if num_steps is None else num_steps
    plan = make_plan(method, R, **method_options)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer; got {max_new_tokens!r}")
    N = int(max_new_tokens)
    extra, extra_what = ((plan.decode_rows, f"decode_rows ({plan.decode_rows})") if plan.decode_rows
                         else (plan.gamma, f"gamma ({plan.gamma})"))
    needed = ids.shape[1] + N + extra
    what = f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({N}) + {extra_what}"
    check_context_length(needed, cfg.max_position_embeddings, what)
    max_len = needed if max_len is None else int(max_len)
    if needed > max_len:
        raise InputError(f"{what} = {needed} exceeds the cache length max_len={max_len}")
    sampling = SamplingConfig() if sampling is None else sampling
    eos_ids = tuple(cfg.eos_token_id) if eos_ids is None else tuple(int(i) for i in eos_ids)
    dtype = model.params["wte"].dtype

    prompt = jnp.asarray(ids, jnp.int32)
    # The first token is drawn with the key AR uses for it, so seeded runs start identically.
    key_loop, key_first = jax.random.split(jax.random.PRNGKey(seed))
    static_p = dict(cfg=cfg, plan=plan, max_len=max_len, sampling=sampling, eos_ids=eos_ids, max_new_tokens=N,
                    state_dtype=dtype)
    static_l = dict(cfg=cfg, plan=plan, sampling=sampling, eos_ids=eos_ids, max_new_tokens=N)
    prefill_c, compile_p = compiled(_prefill, static_p, model.params, prompt, key_first)
    state_struct = jax.eval_shape(functools.partial(_prefill, **static_p), model.params, prompt, key_first)
    loop_c, compile_l = compiled(_loop, static_l, model.params, state_struct, key_loop)
    compile_s = compile_p + compile_l

    t0 = time.perf_counter()
    state = jax.block_until_ready(prefill_c(model.params, prompt, key_first))
    t1 = time.perf_counter()
    tokens, state = jax.block_until_ready(loop_c(model.params, state, key_loop))
    t2 = time.perf_counter()
    tokens = np.asarray(tokens)
    steps = int(state.steps)
    counts = np.asarray(state.accepted)[:steps]  # [steps, B]
    valid = counts >= 0
    B = ids.shape[0]
    n_new = int(np.minimum(np.asarray(state.n_out), N).sum())
    sampler = plan.method == "parallel-sampler"
    mean_acc = float(counts[valid].mean()) if valid.any() else 0.0
    passes = int(np.asarray(state.draft_rounds).sum())
    stats = {
        "method": plan.method, **plan.describe(), "new_tokens": n_new, "batch": B,
        "seconds": t2 - t0, "prefill_seconds": t1 - t0, "decode_seconds": t2 - t1, "compile_seconds": compile_s,
        "tokens_per_second": n_new / max(t2 - t0, 1e-9),
        "decode_tokens_per_second": max(n_new - B, 0) / max(t2 - t1, 1e-9),
        "verify_steps": 0 if sampler else steps,
        "mean_accepted": mean_acc,
        "tokens_per_step": mean_acc if sampler else (float((counts[valid] + 1).mean()) if valid.any() else 0.0),
        "accepted_counts": counts.T.tolist(),
        "core_applications_per_token": plan.core_applications_per_token(passes, int(valid.sum()), n_new - B),
    }
    if plan.method in ("das-wave", "parallel-sampler"):
        stats["rounds"] = passes  # summed over rows
    return GenerateResult(tokens=tokens, stats=stats)

