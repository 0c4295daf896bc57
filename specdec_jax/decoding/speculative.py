"""Speculative decoding for Qwen3.5: one jitted draft -> verify -> accept -> commit step, run inside a
`lax.while_loop` until every sequence has max_new_tokens (or EOS). Nothing leaves the device inside a step; the
loop's stop flag is read back once per step, except in the steps a generation with no EOS id is sure to take
(`sure_steps`), which on the GPU run first in a loop of known trip count.

The committed model state covers every token except the *anchor* (the last emitted token, not yet
processed). A step drafts `gamma` tokens after the anchor, verifies anchor + drafts in ONE forward
from the committed state, accepts a prefix, and commits anchor + accepted drafts:

- attention K/V stay where the verifier wrote them; `length` advances by the kept count,
- the conv state is the window at the accepted boundary,
- the GDN state is replayed from the committed state over the kept positions by the recurrence's own
  step (`rollback="replay"`, the default: one read and one write of the state, bit-identical to the
  recurrence), rebuilt from pseudo-values (`rollback="pseudo"`, no per-position state, exact in exact
  arithmetic) or selected from per-position snapshots (`rollback="snapshot"`, the vLLM/SGLang baseline).

Under replay rollback the loop carries each step's GDN replay into the next step (`defer_commit`): the step ends
with the rest of its commit and starts with the replay of the one before, beside its drafting and first projections,
which do not wait for it; the last one is applied after the loop. Same bits as committing within the step.

Batches are ragged: every sequence keeps its own length, accepted count and output offset.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from ..results import GenerateResult
from .compiled import compiled, compiler_options, output_structs
from ..models.qwen35 import model as qwen35
from .acceptance import accept
from .decode_shape import pad_rows
from .prefill import chunk_runner, prefill_buffer
from .autoregressive import stream_chunks
from .sampling import SamplingConfig, select_token

ROLLBACK_MODES = ("replay", "pseudo", "snapshot")
DEFAULT_ROLLBACK = "replay"
# On (replay rollback): on the H200 at the 9B shape a step at gamma 2 / 8 / 16 (p 1) 5.007 / 5.201 / 5.601 -> 4.974 /
# 5.138 / 5.500 ms, every chain method on the shipped Qwen equal to AR with it on (docs/LOG.md, 2026-12-03).
DEFER_DEFAULT = True


@struct.dataclass
class SpecState:
    """Everything a step reads and writes, besides the drafter's own state.

    model: committed Qwen35State (all tokens but the anchor). anchor [B]: last emitted token.
    history [B, H], hist_len [B]: prompt + emitted tokens (the anchor is the last), for drafters.
    out [B, N + gamma + 1], n_out [B]: emitted tokens; done [B]: EOS seen or budget reached.
    steps: verify steps taken; accepted [N, B]: accepted drafts per step (-1 = sequence inactive).
    budget: the new tokens each sequence is to emit (a traced scalar: the buffers hold N >= budget).
    """

    model: qwen35.Qwen35State
    anchor: jax.Array
    history: jax.Array
    hist_len: jax.Array
    out: jax.Array
    n_out: jax.Array
    done: jax.Array
    steps: jax.Array
    accepted: jax.Array
    budget: jax.Array


def append_rows(buf: jax.Array, start: jax.Array, new: jax.Array) -> jax.Array:
    """buf [B, N] with new [B, G] written at per-row offsets start [B]."""
    return jax.vmap(lambda b, s, n: lax.dynamic_update_slice_in_dim(b, n, s, axis=0))(buf, start, new)


def eos_mask(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.any(tokens[..., None] == jnp.asarray(eos_ids, jnp.int32), axis=-1)


def emit_accepted(drafts: jax.Array, n_acc: jax.Array, next_token: jax.Array, active: jax.Array,
                  eos_ids: tuple[int, ...], room=None):
    """What a step emits after acceptance (chain or tree path).

    drafts [B, G] (along the accepted path); returns emitted [B, G + 1] (accepted drafts, then the
    target's token; later slots repeat it and are never read), n_emit [B] (cut after the first EOS;
    0 for finished rows), n_keep [B] (positions to commit: anchor + accepted drafts), hit_eos [B].
    room: None, or [B] the tokens each row may still emit (its budget less what it holds): a step emits and commits
    no more, so the state after a generation holds exactly the tokens it returned but the last (`session`).
    """
    slot = jnp.arange(drafts.shape[1] + 1)[None, :]
    emitted = jnp.where(slot < n_acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), next_token[:, None])
    n_emit = n_acc + 1
    eos_here = eos_mask(emitted, eos_ids) & (slot < n_emit[:, None])
    hit_eos = jnp.any(eos_here, axis=1)
    n_emit = jnp.where(hit_eos, jnp.argmax(eos_here, axis=1) + 1, n_emit)
    if room is not None:
        hit_eos = hit_eos & (jnp.argmax(eos_here, axis=1) < room)
        n_emit = jnp.minimum(n_emit, room)
    n_emit = jnp.where(active, n_emit, 0)
    # A finished sequence keeps nothing: its state stays put.
    n_keep = jnp.where(active, jnp.minimum(n_acc + 1, n_emit), 0)
    return emitted, n_emit, n_keep, hit_eos


def advance(state: SpecState, model, emitted, n_emit, n_acc, hit_eos, active) -> SpecState:
    """The next SpecState: committed model state, new anchor, history/output appended, stats."""
    new_anchor = jnp.take_along_axis(emitted, jnp.maximum(n_emit - 1, 0)[:, None], axis=1)[:, 0]
    n_out = state.n_out + n_emit
    return SpecState(
        model=model,
        anchor=jnp.where(active, new_anchor, state.anchor),
        history=append_rows(state.history, state.hist_len, emitted),
        hist_len=state.hist_len + n_emit,
        out=append_rows(state.out, state.n_out, emitted),
        n_out=n_out,
        done=state.done | hit_eos | (n_out >= state.budget),
        steps=state.steps + 1,
        accepted=state.accepted.at[jnp.minimum(state.steps, state.accepted.shape[0] - 1)].set(
            jnp.where(active, n_acc, -1)),
        budget=state.budget,
    )


def forced_acceptance(n_real: jax.Array, logits: jax.Array, accept_p: jax.Array, key: jax.Array):
    """For cost measurements only (never reached from `generate`): the accepted count follows a seeded
    schedule, each draft kept with probability accept_p (traced scalar), stopping at the first
    rejection; the emitted token after them is the target's argmax there. The real acceptance's
    result n_real [B] stays a dependency, so its cost is still paid. Outputs are meaningless.
    logits [B, G + 1, V] -> (n_accepted [B], next_token [B])."""
    B, G = logits.shape[0], logits.shape[1] - 1
    hits = jax.random.uniform(key, (B, G)) < accept_p
    n_acc = jnp.sum(jnp.cumprod(hits.astype(jnp.int32), axis=-1), axis=-1)
    n_acc = jnp.where(n_real < 0, n_real, n_acc)  # never true: keeps the real acceptance live
    at = jnp.take_along_axis(logits, n_acc[:, None, None], axis=1)[:, 0]  # [B, V]
    return n_acc, jnp.argmax(at, axis=-1).astype(jnp.int32)


def verify_forward(params, cfg, model: qwen35.Qwen35State, verify_ids: jax.Array, *, rollback: str, impl: str,
                   decode_rows: int = 0):
    """The verifier's forward of anchor + drafts [B, G + 1]: (logits [B, G + 1, V], verified state, extras).

    decode_rows > 0: the exact path. The rows are padded to that count and run as a decode-shape forward
    (`qwen35.forward(n_valid=...)`), the shape every AR step of an exact generation runs at, so each
    token's logits are computed by the same kernels, in the same reduction order, as AR computes them.
    Nothing a drafter asks for besides the final hidden states is computed here: an extra output can change
    how XLA fuses the forward, and with it where bf16 values are rounded (measured on the H200: with residual
    deltas recorded here, residual-reuse's output differed from AR's on 2 of 32 prompts)."""
    B, G1 = verify_ids.shape
    if not decode_rows:
        return qwen35.forward(params, cfg, model, verify_ids, impl=impl, collect=rollback)
    padded = pad_rows(verify_ids, decode_rows)
    logits, verified, extras = qwen35.forward(params, cfg, model, padded, impl=impl, collect=rollback,
                                              n_valid=jnp.full((B,), decode_rows, jnp.int32), live_rows=G1)
    return logits[:, :G1], verified, dict(extras, hidden=extras["hidden"][:, :G1])


def spec_step(params, cfg, state: SpecState, drafter_state, key, *, drafter, gamma: int,
              sampling: SamplingConfig, rollback: str, max_new_tokens: int, eos_ids: tuple[int, ...],
              impl: str = "auto", accept_p=None, decode_rows: int = 0):
    """One speculative step. Returns (state, drafter_state, emitted [B, gamma+1], n_emitted [B]).

    accept_p: None, or a traced probability that replaces the acceptance outcome by a seeded schedule
    (`forced_acceptance`; benchmarks of the step cost at a known tokens-per-step only).
    decode_rows: 0, or the exact path's row count (>= gamma + 1; see `verify_forward`)."""
    return _step(params, cfg, state, drafter_state, key, drafter=drafter, gamma=gamma, sampling=sampling,
                 rollback=rollback, max_new_tokens=max_new_tokens, eos_ids=eos_ids, impl=impl, accept_p=accept_p,
                 decode_rows=decode_rows)[:4]


def _step(params, cfg, state: SpecState, drafter_state, key, *, drafter, gamma, sampling, rollback, max_new_tokens,
          eos_ids, impl, accept_p, decode_rows, pending=None, defer=False):
    """`spec_step`, returning (state, drafter_state, emitted, n_emitted, pending). pending: the GDN commit a step
    before left pending (`qwen35.commit_deferred`), applied first; defer: leave this step's GDN commit pending (returned,
    with state.model's recurrent states not yet advanced) instead of applying it."""
    B = state.anchor.shape[0]
    if pending is not None:
        state = state.replace(model=qwen35.apply_pending(state.model, pending, impl=impl, mesh=cfg.mesh))
    k_draft, k_accept = jax.random.split(key)
    active = ~state.done
    if gamma > 0:
        drafts, draft_probs, drafter_state = drafter.propose(params, cfg, drafter_state, state.history,
                                                             state.hist_len, gamma, k_draft, sampling=sampling)
    else:
        drafts, draft_probs = jnp.zeros((B, 0), jnp.int32), None
    verify_ids = jnp.concatenate([state.anchor[:, None], drafts], axis=1)  # [B, gamma + 1]
    logits, verified, extras = verify_forward(params, cfg, state.model, verify_ids, rollback=rollback, impl=impl,
                                              decode_rows=decode_rows)
    n_acc, next_token = accept(drafts, draft_probs, logits, k_accept, sampling)
    if accept_p is not None:
        n_acc, next_token = forced_acceptance(n_acc, logits, accept_p, jax.random.fold_in(k_accept, 1))
    emitted, n_emit, n_keep, hit_eos = emit_accepted(drafts, n_acc, next_token, active, eos_ids,
                                                     room=state.budget - state.n_out)
    if defer:
        model, pending = qwen35.commit_deferred(state.model, verified, extras, n_keep)
    else:
        model, pending = qwen35.commit(state.model, verified, extras, n_keep, impl=impl, mesh=cfg.mesh), None
    state = advance(state, model, emitted, n_emit, n_acc, hit_eos, active)
    drafter_state = drafter.update(drafter_state, emitted=emitted, n_emitted=n_emit, n_keep=n_keep, verified=extras,
                                   params=params, cfg=cfg)
    return state, drafter_state, emitted, n_emit, pending


def defer_commit(rollback: str) -> bool:
    """Whether the speculative loop carries each step's GDN commit into the next step (`qwen35.commit_deferred`),
    where it runs beside the drafting and the first layer's projections, which do not wait for it, instead of
    last in its own step. Replay rollback only, where DEFER_DEFAULT holds (read when `generate_speculative` is
    called: the loop takes the result as its static `defer`)."""
    return rollback == "replay" and bool(DEFER_DEFAULT)


# The step alone as one jitted call (state and drafter state donated), for callers that drive their own
# loop; generation uses the same function inside `lax.while_loop` (_spec_loop).
spec_step_jit = jax.jit(spec_step, static_argnames=("cfg", "drafter", "gamma", "sampling", "rollback",
                                                     "max_new_tokens", "eos_ids", "impl", "decode_rows"),
                        donate_argnames=("state", "drafter_state"))


@functools.cache
def prefill_runner(impl: str = "auto", hidden: bool = False):
    """The chunk runner (`prefill.prefill_buffer`) of a speculative generation's prefill. With the default GDN
    implementation and no hidden states to collect it is AR's own (`prefill.chunk_runner` of the family's
    prefill_forward), so AR and these methods prefill through one compiled program; hidden: also the final-normed
    hidden states of every position (what an MTP drafter starts from)."""
    from ..models.family import QWEN35  # the families import both model modules: only when a generation runs
    if impl == "auto" and not hidden:
        return chunk_runner(QWEN35.prefill_forward)

    def run(params, cfg, state, ids, n_valid):
        logits, state, extras = qwen35.forward(params, cfg, state, ids, impl=impl, logits_for="last",
                                               collect="hidden" if hidden else None, prefill_lens=n_valid)
        return logits[:, 0], state, extras.get("hidden")
    return run


def _begin(params, prompt, logits, model, hidden, lens, key, budget=None, starts=None, drafter_initial=None, *, cfg,
           max_len, sampling, eos_ids, gamma, max_new_tokens, drafter):
    """The prefill's outputs -> (SpecState whose anchor is the first new token, chosen exactly as AR chooses it; the
    drafter's state). prompt [B, P] and lens [B]: the prompt buffer and each row's valid length; logits [B, V] at each
    row's last prompt token; model: the state after the prompt; hidden [B, P, D] or None (the drafter's
    `needs_hidden`). budget, starts, drafter_initial: as `_spec_prefill`'s."""
    B, T = prompt.shape
    budget = jnp.int32(max_new_tokens) if budget is None else budget.astype(jnp.int32)
    first = select_token(logits, key, sampling)
    rows = jnp.arange(B)
    history = jnp.zeros((B, max(max_len, T) + gamma + 1), jnp.int32).at[:, :T].set(prompt).at[rows, lens].set(first)
    out = jnp.zeros((B, max_new_tokens + gamma + 1), jnp.int32).at[:, 0].set(first)
    done = eos_mask(first, eos_ids) | (budget <= 1)
    state = SpecState(model=model, anchor=first, history=history, hist_len=lens + 1,
                      out=out, n_out=jnp.ones((B,), jnp.int32), done=done, steps=jnp.int32(0),
                      accepted=jnp.full((max_new_tokens, B), -1, jnp.int32), budget=budget)
    if starts is not None:  # the drafter sees the tokens prefilled here, from index 0
        prompt = jax.vmap(lambda row, s: jnp.roll(row, -s))(prompt, starts)
        lens = lens - starts
    carry = {} if drafter_initial is None else {"carry": drafter_initial}
    return state, drafter.init(params, cfg, prompt, max_len + gamma + 1, hidden=hidden, first_token=first, lens=lens,
                               **carry)


_BEGIN_STATIC = ("cfg", "max_len", "sampling", "eos_ids", "gamma", "max_new_tokens", "drafter")
# The begin as a program of its own, after the shared prefill program; the model state passes through it (donated:
# no copy of the caches).
_spec_begin = jax.jit(_begin, static_argnames=_BEGIN_STATIC, donate_argnames=("model",))


@functools.partial(jax.jit, static_argnames=("cfg", "max_len", "sampling", "eos_ids", "state_dtype",
                                             "gamma", "max_new_tokens", "drafter", "impl", "chunk"))
def _spec_prefill(params, prompt, key, lens=None, budget=None, initial=None, starts=None, drafter_initial=None, *,
                  cfg, max_len, sampling, eos_ids, state_dtype, gamma, max_new_tokens, drafter, impl, chunk: int = 0):
    """Prompt -> SpecState whose anchor is the first new token (chosen exactly as AR chooses it), and the drafter's
    state: the model's prefill then `_begin`, as one program (generation runs them as two, `run_spec_loop`).

    lens: None (prompt [B, T] all valid, one forward), or each row's valid length in the padded prompt buffer
    [B, P], prefilled `chunk` tokens at a time (`buckets`, `prefill.prefill_buffer`). budget: None (max_new_tokens
    new tokens), or the traced count, max_new_tokens then the output buffer's length. initial, starts: a continuation
    (`session`): the model state holding each row's first starts[b] tokens of the buffer, which then holds each row's
    whole history; the drafter continues drafter_initial (its `carried` state after the earlier generation) over the
    tokens prefilled here, or starts on them where that is None."""
    B, T = prompt.shape
    needs_hidden = getattr(drafter, "needs_hidden", False)
    if lens is None:
        model = qwen35.init_state(cfg, B, max_len, state_dtype) if initial is None else initial
        logits, model, extras = qwen35.forward(params, cfg, model, prompt, impl=impl, logits_for="last",
                                               collect="hidden" if needs_hidden else None)
        logits, hidden, lens = logits[:, 0], extras.get("hidden"), jnp.full((B,), T, jnp.int32)
    else:
        logits, model, hidden = prefill_buffer(params, prompt, lens, initial, starts,
                                               run=prefill_runner(impl, needs_hidden), init_state=qwen35.init_state,
                                               cfg=cfg, max_len=max_len, state_dtype=state_dtype, chunk=chunk)
    return _begin(params, prompt, logits, model, hidden, lens, key, budget, starts, drafter_initial, cfg=cfg,
                  max_len=max_len, sampling=sampling, eos_ids=eos_ids, gamma=gamma, max_new_tokens=max_new_tokens,
                  drafter=drafter)


# Whether the sure steps run first in a loop of known trip count (`sure_steps_enabled`). None: on the GPU, off
# elsewhere (each step's program is compiled twice: CPU suite time); True / False force it (tests).
SURE_STEPS: bool | None = None


def sure_steps(max_new_tokens: int, tokens_per_step: int, eos_ids: tuple) -> int:
    """How many steps a generation takes whatever its drafts' acceptance: with no EOS id a sequence is done only when
    it holds max_new_tokens, the prefill gives the first and a step emits at most `tokens_per_step` (gamma + 1), so
    the first ceil((max_new_tokens - 1) / tokens_per_step) steps all run (the count a fully accepted generation
    takes). With an EOS id any step may be the last: none is sure."""
    if eos_ids or max_new_tokens <= 1:
        return 0
    return -(-(max_new_tokens - 1) // tokens_per_step)


def sure_steps_enabled() -> bool:
    """Whether the speculative loop runs its sure steps (`sure_steps`) in a loop of known trip count before the loop
    that tests `done` each step. A loop with no known trip count runs from the host, which reads its predicate back
    every step while the device waits (the next step cannot be launched before); AR's loop without EOS has a known
    trip count and pays none. SURE_STEPS where set, else on the GPU (read when the loop is traced, or by
    `generate_speculative` for its static `sure`). Measured on the H200 at the 9B shape: a step at gamma 2 / 4 / 8
    (p 1) 4.952 / 5.028 / 5.159 -> 4.894 / 4.982 / 5.071 ms, gamma 16 5.447 -> 5.498 ms; bf16 output equal to AR;
    compile at the 9B shape (n-gram) 19.9 -> 24.5 s (docs/LOG.md, 2026-12-03)."""
    return bool(SURE_STEPS) if SURE_STEPS is not None else jax.default_backend() == "gpu"


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "eos_ids", "gamma", "max_new_tokens", "drafter",
                                             "rollback", "impl", "decode_rows", "defer", "sure", "traced_budget"),
                   donate_argnames=("state", "drafter_state"))
def _spec_loop(params, state, drafter_state, key, accept_p=None, step_limit=None, *, cfg, sampling, eos_ids, gamma,
               max_new_tokens, drafter, rollback, impl, decode_rows=0, defer=None, sure=None,
               traced_budget: bool = False):
    """The decode loop. defer: carry each step's GDN commit into the next (`defer_commit`; None: the default,
    DEFER_DEFAULT under replay rollback; a static argument, so that the setting is part of what is compiled).
    sure: run the sure steps (`sure_steps`) first in a loop of known trip count (None: `sure_steps_enabled()`).
    traced_budget: state.budget, not max_new_tokens (then the buffers' length), is the count: no step is sure.
    step_limit: None, or a traced step count at which the loop stops (a chunk of a streamed generation: the
    returned state continues it; step keys are folded from `key` and the step index, so chunks draw what one loop
    draws)."""
    step = functools.partial(_step, params, cfg, drafter=drafter, gamma=gamma, sampling=sampling,
                             rollback=rollback, max_new_tokens=max_new_tokens, eos_ids=eos_ids, impl=impl,
                             accept_p=accept_p, decode_rows=decode_rows)
    defer = (DEFER_DEFAULT and rollback == "replay") if defer is None else bool(defer)
    if defer and rollback != "replay":
        raise ValueError(f"defer: the GDN commit is deferred under replay rollback only; got rollback={rollback!r}")
    pending = None
    if defer:  # the first step's pending commit keeps zero positions: its replay leaves every state as it is
        # The step that leaves its commit pending, jitted and inlined where it is called: its one trace gives the
        # pending commit's shapes here and serves the loop's body (the whole step traced once, not twice). The body
        # applies the step before's pending commit first, as `_step` would: the same program.
        deferred = jax.jit(lambda s, d, k: step(s, d, k, defer=True), inline=True)
        shapes = jax.eval_shape(deferred, state, drafter_state, key)[4]
        pending = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def cond(carry):
        running = ~jnp.all(carry[0].done)
        return running if step_limit is None else running & (carry[0].steps < step_limit)

    def body(carry):
        state, drafter_state, key, pending = carry
        sub = jax.random.fold_in(key, state.steps)
        if defer:
            state = state.replace(model=qwen35.apply_pending(state.model, pending, impl=impl, mesh=cfg.mesh))
            state, drafter_state, _, _, pending = deferred(state, drafter_state, sub)
        else:
            state, drafter_state, _, _, pending = step(state, drafter_state, sub)
        return state, drafter_state, key, pending

    carry = (state, drafter_state, key, pending)
    n_sure = (sure_steps(max_new_tokens, gamma + 1, eos_ids)
              if (sure_steps_enabled() if sure is None else sure) and not traced_budget and step_limit is None else 0)
    if n_sure:  # every sequence is still running through these steps (no EOS id; a step emits at most gamma + 1)
        carry = lax.fori_loop(0, n_sure, lambda _, c: body(c), carry)
    state, drafter_state, _, pending = lax.while_loop(cond, body, carry)
    if defer:
        state = state.replace(model=qwen35.apply_pending(state.model, pending, impl=impl, mesh=cfg.mesh))
    pad = eos_ids[0] if eos_ids else 0
    filled = jnp.arange(max_new_tokens)[None, :] < state.n_out[:, None]
    tokens = jnp.where(filled, state.out[:, :max_new_tokens], pad)
    return tokens, state, drafter_state


def generate_speculative(params, cfg, prompt: np.ndarray, max_new_tokens: int, *, drafter, gamma: int,
                         max_len: int, sampling: SamplingConfig, seed: int, eos_ids: tuple[int, ...], state_dtype,
                         rollback: str = DEFAULT_ROLLBACK, impl: str = "auto", decode_rows: int = 0,
                         return_state: bool = False, lens=None, chunk: int = 0,
                         token_buffer: int = 0, stream=None, initial=None, starts=None,
                         drafter_initial=None) -> GenerateResult:
    """Compile, then time prefill and the speculative loop (compile time reported apart).

    max_len must leave room for the last verification: prompt + max_new_tokens + gamma, or + decode_rows
    on the exact path (decode_rows > 0: every verification padded to that many rows, as exact AR runs).
    lens, chunk: a padded, ragged prompt buffer prefilled in chunks (`_spec_prefill`); token_buffer > 0: the output
    buffers' length, max_new_tokens then traced (`buckets`). stream: None, or (chunk_steps, emit): the loop runs
    chunk_steps steps a call, emit(tokens [B, k]) getting them (`autoregressive.stream_chunks`). initial, starts,
    drafter_initial: a continuation (`_spec_prefill`).
    """
    if rollback not in ROLLBACK_MODES:
        raise ValueError(f"rollback must be one of {ROLLBACK_MODES}; got {rollback!r}")
    if decode_rows and decode_rows < gamma + 1:
        raise ValueError(f"decode_rows={decode_rows} must be >= gamma + 1 = {gamma + 1}")
    prompt = jnp.asarray(prompt, jnp.int32)
    # The first token is drawn with the key AR uses for it, so seeded runs start identically.
    key_loop, key_first = jax.random.split(jax.random.PRNGKey(seed))
    buffer = token_buffer or max_new_tokens
    static_p = dict(cfg=cfg, max_len=max_len, sampling=sampling, eos_ids=eos_ids, state_dtype=state_dtype,
                    gamma=gamma, max_new_tokens=buffer, drafter=drafter, impl=impl, chunk=chunk)
    static_l = dict(cfg=cfg, sampling=sampling, eos_ids=eos_ids, gamma=gamma, max_new_tokens=buffer,
                    drafter=drafter, rollback=rollback, impl=impl, decode_rows=decode_rows,
                    defer=defer_commit(rollback), sure=sure_steps_enabled(), traced_budget=bool(token_buffer))
    return run_spec_loop(params, prompt, key_first, key_loop, static_p, _spec_loop, static_l, max_new_tokens,
                         {"method": drafter.name, "gamma": gamma, "rollback": rollback, "exact": bool(decode_rows),
                          "decode_rows": decode_rows or gamma + 1}, return_state, lens=lens,
                         budget=max_new_tokens if token_buffer else None, stream=stream, initial=initial,
                         starts=starts, drafter_initial=drafter_initial)


def run_spec_loop(params, prompt, key_first, key_loop, static_p: dict, loop, static_l: dict, max_new_tokens: int,
                  info: dict, return_state: bool, lens=None, budget=None, stream=None, initial=None,
                  starts=None, drafter_initial=None) -> GenerateResult:
    """Compile the prefill and a speculative loop (chain `_spec_loop` or tree `_tree_loop`), run them
    timed (compile reported apart), and collect the shared statistics (`info` first). lens, budget: the prefill's
    traced valid lengths and new-token count, or None (`_spec_prefill`; with lens the prefill runs as the family's
    shared program `prefill.prefill_buffer` and `_spec_begin`). stream: (chunk_steps, emit) or None
    (`generate_speculative`, `tree_spec.generate_tree`). The result's drafter_state is the drafter's `carried`
    state after the loop (None for a drafter without one), what a continuation's drafter_initial takes."""
    options = compiler_options("qwen3_5")
    if lens is None:  # prompts of one length, every row valid: one prefill program
        prefill_c, compile_p = compiled(_spec_prefill, static_p, params, prompt, key_first, options=options)
        prefill = lambda: prefill_c(params, prompt, key_first)
        shapes, programs = output_structs(prefill_c), int(compile_p > 0)
    else:  # the family's prefill program for this bucket (shared with AR and the other methods), then the begin
        lens = jnp.asarray(lens, jnp.int32)
        starts = None if starts is None else jnp.asarray(starts, jnp.int32)
        budget = None if budget is None else jnp.int32(budget)
        run = prefill_runner(static_p["impl"], getattr(static_p["drafter"], "needs_hidden", False))
        static_m = dict(run=run, init_state=qwen35.init_state, cfg=static_p["cfg"], max_len=static_p["max_len"],
                        state_dtype=static_p["state_dtype"], chunk=static_p["chunk"])
        model_c, compile_m = compiled(prefill_buffer, static_m, params, prompt, lens, initial, starts,
                                      options=options)
        logits_s, model_s, hidden_s = output_structs(model_c)
        begin_args = (lens, key_first, budget, starts, drafter_initial)
        begin_c, compile_b = compiled(_spec_begin, {k: static_p[k] for k in _BEGIN_STATIC}, params, prompt, logits_s,
                                      model_s, hidden_s, *begin_args, options=options)
        compile_p = compile_m + compile_b
        shapes, programs = output_structs(begin_c), int(compile_m > 0) + int(compile_b > 0)

        def prefill():
            logits, model, hidden = model_c(params, prompt, lens, initial, starts)
            return begin_c(params, prompt, logits, model, hidden, *begin_args)
    chunked = (None, jnp.int32(0)) if stream is not None else ()  # (accept_p, step_limit)
    loop_c, compile_l = compiled(loop, static_l, params, shapes[0], shapes[1], key_loop, *chunked, options=options)
    compile_s = compile_p + compile_l
    programs += int(compile_l > 0)

    t0 = time.perf_counter()
    state, dstate = jax.block_until_ready(prefill())
    t1 = time.perf_counter()
    if stream is None:
        tokens, state, dstate = jax.block_until_ready(loop_c(params, state, dstate, key_loop))
    else:
        held = [None, state, dstate]

        def run_chunk(limit_steps):
            held[:] = loop_c(params, held[1], held[2], key_loop, None, jnp.int32(limit_steps))
            return held[0], held[1].n_out, held[1].done

        stream_chunks(run_chunk, max_new_tokens, stream[0], stream[1])
        tokens, state, dstate = held
    t2 = time.perf_counter()
    tokens = np.asarray(tokens)[:, :max_new_tokens]
    steps = int(state.steps)
    accepted = np.asarray(state.accepted)[:steps]  # [steps, B]
    valid = accepted >= 0
    n_new = int(np.minimum(np.asarray(state.n_out), max_new_tokens).sum())
    stats = {
        **info, "new_tokens": n_new,
        "seconds": t2 - t0, "prefill_seconds": t1 - t0, "decode_seconds": t2 - t1, "compile_seconds": compile_s,
        "compiled_programs": programs,
        "tokens_per_second": n_new / max(t2 - t0, 1e-9),
        "decode_tokens_per_second": max(n_new - tokens.shape[0], 0) / max(t2 - t1, 1e-9),
        "verify_steps": steps,
        "mean_accepted": float(accepted[valid].mean()) if valid.any() else 0.0,
        "tokens_per_step": float((accepted[valid] + 1).mean()) if valid.any() else 0.0,
        "accepted_counts": accepted.T.tolist(),
    }
    if return_state:
        stats["state"] = state
    drafter = static_p["drafter"]
    carried = (drafter.carry_kind, drafter.carried(dstate)) if getattr(drafter, "carry_kind", None) else None
    return GenerateResult(tokens=tokens, stats=stats, state=state, drafter_state=carried)
