"""Drafting for looped self-speculation: the step state (`LoopedSpecState`), the sequential d-step
drafts (`draft_forward`, `sequential_propose`) and DAS-Wave's window, whose slots are refined in
parallel (`window_update`, `das_wave_propose`); cache plumbing and per-query-prefix attention they use.
`looped_spec` verifies and commits what these propose.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from ..models import layers as L
from ..models.looped import model as looped
from .looped_plan import LoopedSpecPlan
from .sampling import SamplingConfig, probabilities, select_token


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


def shift_left(a: jax.Array, n: jax.Array) -> jax.Array:
    """Per-row shift of a [B, W, ...] left by n [B] (0 <= n), zero-filled: row[i] <- row[i + n]."""
    W = a.shape[1]
    padded = jnp.concatenate([a, jnp.zeros_like(a)], axis=1)
    return jax.vmap(lambda row, s: lax.dynamic_slice_in_dim(row, s, W, axis=0))(padded, jnp.minimum(n, W))


# ------------------------------------------------------------------------------ cache plumbing

def _copy_slot(buf: jax.Array, src: int, dst: int, pos: jax.Array) -> jax.Array:
    """buf [R, Lc, B, S, N, hd]: copy step slot `src` into slot `dst` at one position pos[b] per row."""
    _, Lc, B, _, N, hd = buf.shape
    z = jnp.zeros((), jnp.int32)
    for b in range(B):  # B is small; a DUS per row updates the buffer in place
        piece = lax.dynamic_slice(buf, (jnp.int32(src), z, jnp.int32(b), pos[b], z, z), (1, Lc, 1, 1, N, hd))
        buf = lax.dynamic_update_slice(buf, piece, (jnp.int32(dst), z, jnp.int32(b), pos[b], z, z))
    return buf


def write_slot(buf: jax.Array, new: jax.Array, slot: int, start: jax.Array) -> jax.Array:
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
    """`looped.blocks.attend_prefix` where the prefix may differ per query: k_pre/v_pre [B, S, N, hd] (shared) or
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
    """`looped.blocks.block_attention` with per-query prefix slots (see _attend_pp)."""
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
    """`looped.blocks.apply_block` with per-query prefix slots."""
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


def window_rope(cfg, cache, width: int):
    positions = cache.length[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    return looped.rope_tables(cfg, positions)


# ------------------------------------------------------------------------------------- drafting

def sequential_propose(params, cfg, cache, anchor, key, plan: LoopedSpecPlan, sampling: SamplingConfig):
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


def das_wave_propose(params, cfg, state: LoopedSpecState, key, plan: LoopedSpecPlan, sampling: SamplingConfig):
    """One block of DAS-Wave rounds. Returns (proposals [B, G], q | None, x [B, G, D], depth [B, G],
    rounds [B]): the window after the row's last round, from which the carry is cut after the commit."""
    cache, anchor = state.cache, state.anchor
    B, G = anchor.shape[0], plan.gamma
    slot = jnp.arange(G, dtype=jnp.int32)[None, :]
    cos, sin = window_rope(cfg, cache, G)
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
        e, _, _ = looped.prelude(params, cfg, cache, tokens, cos, sin)
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
