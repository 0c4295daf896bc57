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

This module owns the driver: `spec_step` (propose, verify at full depth, accept, commit),
`sampler_step`, the jitted prefill and loop, and `generate_looped_spec`. The plan (methods, options,
`LoopedSpecPlan`, `make_plan`) is in `looped_plan`; the state and the drafting (sequential drafts,
DAS-Wave's window) in `looped_draft`; both are re-exported here. The target model is reached through
its family interface (`models.family.looped_family(R)`: init state, forward, verify, commit, decode shape,
and the prelude / core / coda stages the parallel sampler runs by hand).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import InputError
from ..options import check_context_length
from ..results import GenerateResult
from ..models.looped import model as looped
from ..models.family import looped_family
from . import buckets
from .acceptance import leading_true, accept
from .autoregressive import stream_chunks
from .buckets import split_prompts
from .compiled import compiled, compiler_options, output_structs
from .decode_shape import pad_rows
from .prefill import chunk_runner, prefill_buffer
from .looped_draft import (LoopedSpecState, das_wave_propose, draft_forward, sequential_propose,  # noqa: F401
                           shift_left, window_rope, window_update, write_slot)
from .looped_plan import LOOPED_SPEC_METHODS, READ_MODES, LoopedSpecPlan, make_plan  # noqa: F401
from .speculative import append_rows, eos_mask, emit_accepted, forced_acceptance
from .sampling import SamplingConfig, select_token

# The former private name of what moved to looped_draft (tests/test_looped_spec.py uses it).
_shift_left = shift_left


def _record_len(plan: LoopedSpecPlan, max_new_tokens: int) -> int:
    if plan.method == "parallel-sampler":  # rounds may commit nothing; slot 0 commits within ceil(R / r') rounds
        return max_new_tokens * (-(-plan.num_steps // plan.inner_steps) + 1) + 1
    return max_new_tokens  # every block emits at least one token


# ---------------------------------------------------------------------------------------- steps

def spec_step(params, cfg, state: LoopedSpecState, key, *, plan: LoopedSpecPlan, sampling: SamplingConfig,
              max_new_tokens: int, eos_ids: tuple[int, ...], accept_p=None) -> LoopedSpecState:
    """One block of self-spec / mature-spec / das-wave: propose gamma tokens, verify anchor + proposals
    in one full-depth forward from the committed cache, accept, commit (ragged per row). accept_p: None, or
    a traced probability forcing the accepted count (`speculative.forced_acceptance`; cost benchmarks only)."""
    G, R = plan.gamma, plan.num_steps
    family = looped_family(R)
    k_draft, k_accept = jax.random.split(key)
    active = ~state.done
    length = state.cache.length
    if plan.method == "das-wave":
        drafts, q, win_x, win_depth, rounds = das_wave_propose(params, cfg, state, k_draft, plan, sampling)
        cache = state.cache  # the window's K/V never touched the cache
    else:
        drafts, q, cache = sequential_propose(params, cfg, state.cache, state.anchor, k_draft, plan, sampling)
        rounds = jnp.full_like(length, G)  # one draft forward per token
    verify_ids = jnp.concatenate([state.anchor[:, None], drafts], axis=1)  # [B, G + 1]
    if plan.decode_rows:  # the exact path: the decode shape every exact AR step runs at
        logits, verified = family.decode_forward(params, cfg, cache, pad_rows(verify_ids, plan.decode_rows),
                                                 jnp.full_like(length, plan.decode_rows))
        logits = logits[:, :G + 1]
    else:
        logits, verified, _ = family.verify(params, cfg, cache, verify_ids)
    n_acc, next_token = accept(drafts, q, logits, k_accept, sampling)
    if accept_p is not None:  # the real acceptance stays a dependency, so its cost is still paid
        n_acc, next_token = forced_acceptance(n_acc, logits, accept_p, jax.random.fold_in(k_accept, 1))
    # Keep anchor + accepted drafts (the verifier wrote every slot for them); a finished row keeps nothing.
    emitted, n_emit, n_keep, hit_eos = emit_accepted(drafts, n_acc, next_token, active, eos_ids)
    new_anchor = jnp.take_along_axis(emitted, jnp.maximum(n_emit - 1, 0)[:, None], axis=1)[:, 0]
    n_out = state.n_out + n_emit
    state = state.replace(
        cache=family.commit(state.cache, verified, None, n_keep),
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
        state = state.replace(win_x=shift_left(win_x, n_keep), win_depth=shift_left(win_depth, n_keep),
                              win_tok=shift_left(drafts, n_keep), win_n=jnp.where(active, win_n, state.win_n))
    return state


def sampler_step(params, cfg, state: LoopedSpecState, key, *, plan: LoopedSpecPlan, sampling: SamplingConfig,
                 max_new_tokens: int, eos_ids: tuple[int, ...]) -> LoopedSpecState:
    """One round of the parallel (diffusion-forcing) sampler; see the module docstring."""
    cache, anchor = state.cache, state.anchor
    G, R = plan.gamma, plan.num_steps
    family = looped_family(R)
    live = ~state.done
    slot = jnp.arange(G, dtype=jnp.int32)[None, :]
    active = slot < state.win_n[:, None]
    cos, sin = window_rope(cfg, cache, G)
    tokens = jnp.concatenate([anchor[:, None], state.win_tok[:, :-1]], axis=1)  # slot i's input
    e_new, pk, pv = family.prelude(params, cfg, cache, tokens, cos, sin)
    fresh = (state.win_depth == 0)[..., None]
    e = jnp.where(fresh, e_new, (plan.ema * state.win_e.astype(jnp.float32)
                                 + (1 - plan.ema) * e_new.astype(jnp.float32)).astype(e_new.dtype))
    x0 = jnp.where(fresh, looped.initial_state(cfg, e), state.win_x)
    Lc = cfg.n_layers_in_recurrent_block
    zero_kv = jnp.zeros((Lc, anchor.shape[0], G, cfg.num_key_value_heads, cfg.head_dim), cache.core_k.dtype)

    def inner(_, c):
        x, depth, _, _ = c
        x_new, k, v = family.core(params, cfg, cache, x, e, depth[..., None], cos, sin, R - 1, R - 1)
        return jnp.where(active[..., None], x_new, x), depth + active, k.astype(zero_kv.dtype), v.astype(zero_kv.dtype)

    x, depth, ck, cv = lax.fori_loop(0, plan.inner_steps, inner, (x0, state.win_depth, zero_kv, zero_kv))
    logits, _, dk, dv = family.coda(params, cfg, cache, x, cos, sin, "all")
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
        core_k=write_slot(cache.core_k, ck, R - 1, start), core_v=write_slot(cache.core_v, cv, R - 1, start),
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
        win_x=shift_left(x, n), win_e=shift_left(e, n), win_tok=shift_left(props, n),
        win_depth=shift_left(depth, n), draft_rounds=state.draft_rounds + live,
        win_n=jnp.where(live, jnp.minimum(state.win_n - n + 1, G), state.win_n),
    )


# ------------------------------------------------------------------------------------ jit + loop

def _begin(params, cfg, cache, logits, key, budget, *, plan: LoopedSpecPlan, sampling: SamplingConfig,
           eos_ids: tuple[int, ...], max_new_tokens: int) -> LoopedSpecState:
    """The loop's state after the prompt: the cache, and the first new token chosen from the prompt's last logits
    [B, V] as AR chooses it. max_new_tokens: the output buffer (static); budget: the tokens to generate (traced)."""
    B = logits.shape[0]
    first = select_token(logits, key, sampling)
    W, D = plan.window, cfg.n_embd
    latent_dtype = params["wte"].dtype
    return LoopedSpecState(
        cache=cache, anchor=first,
        out=jnp.zeros((B, max_new_tokens + plan.gamma + 1), jnp.int32).at[:, 0].set(first),
        n_out=jnp.ones((B,), jnp.int32), done=eos_mask(first, eos_ids) | (budget <= 1),
        steps=jnp.int32(0), accepted=jnp.full((_record_len(plan, max_new_tokens), B), -1, jnp.int32),
        win_x=jnp.zeros((B, W, D), latent_dtype), win_e=jnp.zeros((B, W, D), latent_dtype),
        win_tok=jnp.zeros((B, W), jnp.int32), win_depth=jnp.zeros((B, W), jnp.int32),
        win_n=jnp.full((B,), 1 if plan.method == "parallel-sampler" else 0, jnp.int32),
        draft_rounds=jnp.zeros((B,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("cfg", "plan", "max_len", "sampling", "eos_ids", "max_new_tokens",
                                             "state_dtype"))
def _prefill(params, prompt, key, initial=None, *, cfg, plan: LoopedSpecPlan, max_len: int,
             sampling: SamplingConfig, eos_ids: tuple[int, ...], max_new_tokens: int, state_dtype):
    """Prompt [B, T] (every row valid) at full depth R in one forward -> LoopedSpecState whose anchor is the first
    new token. initial: None, or a cache of max_len slots the prompt continues (each row at its own length). The
    benchmarks' exact-shape prefill; `generate_looped_spec` runs `prefill.prefill_buffer`, then `_begin_program`."""
    family = looped_family(plan.num_steps)
    cache = family.init_state(cfg, prompt.shape[0], max_len, state_dtype) if initial is None else initial
    logits, cache = family.forward(params, cfg, cache, prompt, logits_for="last")
    return _begin(params, cfg, cache, logits[:, 0], key, max_new_tokens, plan=plan, sampling=sampling,
                  eos_ids=eos_ids, max_new_tokens=max_new_tokens)


# After the family's prefill program (`prefill.prefill_buffer`, shared with AR at the same depth), `_begin` as a program
# of its own; the cache passes through it (donated: not copied).
@functools.partial(jax.jit, static_argnames=("cfg", "plan", "sampling", "eos_ids", "max_new_tokens"),
                   donate_argnames=("cache",))
def _begin_program(params, cache, logits, key, budget, *, cfg, plan: LoopedSpecPlan, sampling: SamplingConfig,
                   eos_ids: tuple[int, ...], max_new_tokens: int) -> LoopedSpecState:
    return _begin(params, cfg, cache, logits, key, budget, plan=plan, sampling=sampling, eos_ids=eos_ids,
                  max_new_tokens=max_new_tokens)


@functools.partial(jax.jit, static_argnames=("cfg", "plan", "sampling", "eos_ids", "max_new_tokens"),
                   donate_argnames=("state",))
def _loop(params, state, key, accept_p=None, budget=None, limit=None, *, cfg, plan: LoopedSpecPlan,
          sampling: SamplingConfig, eos_ids: tuple[int, ...], max_new_tokens: int):
    """Blocks until every row is done -> (tokens [B, max_new_tokens] padded past each row's count, state, key).
    max_new_tokens: the output buffer (static); budget: the tokens to generate (traced; None: max_new_tokens);
    limit: None, or stop once state.steps reaches it (traced: a stream runs the loop in chunks of blocks, the state
    and key carried from chunk to chunk)."""
    if plan.method == "parallel-sampler" and accept_p is not None:
        raise ValueError("accept_p: the parallel sampler has no acceptance step to force")
    budget = max_new_tokens if budget is None else budget
    step_fn = sampler_step if plan.method == "parallel-sampler" else functools.partial(spec_step, accept_p=accept_p)
    step = functools.partial(step_fn, params, cfg, plan=plan, sampling=sampling, max_new_tokens=budget,
                             eos_ids=eos_ids)

    def body(carry):
        state, key = carry
        key, sub = jax.random.split(key)
        return step(state, sub), key

    def cond(carry):
        running = ~jnp.all(carry[0].done)
        return running if limit is None else running & (carry[0].steps < limit)

    state, key = lax.while_loop(cond, body, (state, key))
    pad = eos_ids[0] if eos_ids else 0
    filled = jnp.arange(max_new_tokens)[None, :] < jnp.minimum(state.n_out, budget)[:, None]
    return jnp.where(filled, state.out[:, :max_new_tokens], pad), state, key


# ----------------------------------------------------------------------------------- public call

def generate_looped_spec(model, input_ids, max_new_tokens: int, method: str, *, num_steps: int | None = None,
                         sampling: SamplingConfig | None = None, seed: int = 0, eos_ids: tuple[int, ...] | None = None,
                         max_len: int | None = None, initial=None, stream=None, **method_options) -> GenerateResult:
    """Self-speculative generation for a looped model; the whole loop runs on device.

    input_ids: [B, T], or a list of B 1-D sequences of any lengths (ragged); method in LOOPED_SPEC_METHODS;
    num_steps: target depth R (default the config's mean_recurrence); sampling: SamplingConfig (default greedy);
    eos_ids: None = the config's, () = never stop; max_len: cache length (default the bucket of prompt +
    max_new_tokens + the verification's rows, `buckets`). initial: None, or a full cache at depth R (an earlier
    generation's `state.model`) that the rows continue: row b's tokens go after the initial.length[b] it holds (the
    cache grown to fit). stream: None, or (chunk_steps, emit): the loop runs chunk_steps blocks a call and emit(tokens
    [B, k]) gets the positions every row has reached (`autoregressive.stream_chunks`).
    Programs are keyed on buckets: the prompt is prefilled in chunks from a padded buffer with its lengths traced,
    and max_new_tokens is traced inside an output buffer of the cache's length.
    method_options: see `make_plan`. Options are validated (InputError) before any compute.

    Returns GenerateResult(tokens [B, max_new_tokens], stats): new_tokens, seconds, tokens_per_second,
    prefill_seconds, decode_seconds, decode_tokens_per_second, compile_seconds, compiled_programs, verify_steps,
    mean_accepted, tokens_per_step, accepted_counts, core_applications_per_token (core-block
    applications of drafting + verification per token after the first, prelude / coda / head not
    counted; AR: num_steps), plus the plan's options. das-wave and the parallel sampler add rounds
    (summed over rows). For the parallel sampler verify_steps is 0 and mean_accepted /
    tokens_per_step are committed tokens per round.
    """
    cfg = model.config
    if getattr(cfg, "family", None) != "looped":
        raise InputError(f"generate_looped_spec needs a looped model; got a {getattr(cfg, 'family', '?')} model")
    rows = split_prompts(input_ids, cfg.vocab_size)
    R = cfg.mean_recurrence if num_steps is None else num_steps
    plan = make_plan(method, R, **method_options)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer; got {max_new_tokens!r}")
    N = int(max_new_tokens)
    B = len(rows)
    extra, extra_what = ((plan.decode_rows, f"decode_rows ({plan.decode_rows})") if plan.decode_rows
                         else (plan.gamma, f"gamma ({plan.gamma})"))
    held = np.zeros(B, np.int32)
    if initial is not None:
        if initial.mode != "full" or initial.step_slots != plan.num_steps:
            raise InputError(f"state holds a {initial.mode} cache of {initial.step_slots} step slots; {method} at "
                             f"num_steps={plan.num_steps} continues a full cache of {plan.num_steps} (run it at the "
                             f"state's settings)")
        if int(initial.length.shape[0]) != B:
            raise InputError(f"state has {int(initial.length.shape[0])} rows; got {B} prompts")
        held = np.asarray(initial.length, np.int32)
    longest = int(max(h + len(r) for h, r in zip(held, rows)))
    needed = longest + N + extra
    what = (f"{'history + ' if initial is not None else ''}prompt ({longest} tokens"
            f"{' in the longest row' if B > 1 else ''}) + max_new_tokens ({N}) + {extra_what}")
    check_context_length(needed, cfg.max_position_embeddings, what)
    if max_len is not None:
        max_len = int(max_len)
        if needed > max_len:
            raise InputError(f"{what} = {needed} exceeds the cache length max_len={max_len}")
    else:
        max_len = buckets.cache_length(needed, B, cfg.max_position_embeddings)
    if initial is not None:
        if max_len < initial.max_len:
            raise InputError(f"max_len={max_len} is shorter than the state's cache ({initial.max_len} slots)")
        initial = looped.grown_cache(initial, max_len)
    sampling = SamplingConfig() if sampling is None else sampling
    eos_ids = tuple(cfg.eos_token_id) if eos_ids is None else tuple(int(i) for i in eos_ids)
    dtype = model.params["wte"].dtype
    # The prompt buffer: row b's tokens after the held[b] its cache holds; chunks of the longest new part.
    chunk = buckets.prefill_chunk(max(len(r) for r in rows), B, max_len)
    ids = np.zeros((B, buckets.prompt_buffer(max_len, chunk)), np.int32)
    for b, (h, r) in enumerate(zip(held, rows)):
        ids[b, h:h + len(r)] = r
    lens = held + np.asarray([len(r) for r in rows], np.int32)
    buffer = max_len  # the output buffer; max_new_tokens (< max_len) is traced
    budget = jnp.int32(N)

    # The first token is drawn with the key AR uses for it, so seeded runs start identically.
    key_loop, key_first = jax.random.split(jax.random.PRNGKey(seed))
    # The prompt buffer at full depth R, `chunk` tokens a pass: the family's prefill program for this bucket, the one
    # AR at depth R runs (a fresh row starts at 0: starts only for a continuation).
    family = looped_family(plan.num_steps)
    prefill_args = (model.params, jnp.asarray(ids), jnp.asarray(lens), initial,
                    None if initial is None else jnp.asarray(held))
    static_p = dict(run=chunk_runner(family.prefill_forward), init_state=family.init_state, cfg=cfg, max_len=max_len,
                    state_dtype=dtype, chunk=chunk)
    static_b = dict(cfg=cfg, plan=plan, sampling=sampling, eos_ids=eos_ids, max_new_tokens=buffer)
    static_l = dict(cfg=cfg, plan=plan, sampling=sampling, eos_ids=eos_ids, max_new_tokens=buffer)
    options = compiler_options("looped")  # the options AR's loop compiles with (exactness: compiled.EXACT_GPU_OPTIONS)
    prefill_c, compile_p = compiled(prefill_buffer, static_p, *prefill_args, options=options)
    logits_struct, cache_struct, _ = output_structs(prefill_c)
    begin_c, compile_b = compiled(_begin_program, static_b, model.params, cache_struct, logits_struct, key_first,
                                  budget, options=options)
    state_struct = output_structs(begin_c)  # the loop's input: what the compiled begin returns (no second trace)
    limit = jnp.int32(np.iinfo(np.int32).max)
    loop_c, compile_l = compiled(_loop, static_l, model.params, state_struct, key_loop, None, budget, limit,
                                 options=options)
    compile_s = compile_p + compile_b + compile_l

    t0 = time.perf_counter()
    logits, cache, _ = prefill_c(*prefill_args)
    state = jax.block_until_ready(begin_c(model.params, cache, logits, key_first, budget))
    t1 = time.perf_counter()
    if stream is None:
        tokens, state, _ = jax.block_until_ready(loop_c(model.params, state, key_loop, None, budget, limit))
    else:
        held_state = [state, key_loop, None]

        def run_chunk(limit_steps):
            out, held_state[0], held_state[1] = loop_c(model.params, held_state[0], held_state[1], None, budget,
                                                       jnp.int32(limit_steps))
            held_state[2] = out
            return np.asarray(out), np.asarray(held_state[0].n_out), np.asarray(held_state[0].done)

        stream_chunks(run_chunk, N, stream[0], stream[1])
        tokens, state = held_state[2], held_state[0]
    t2 = time.perf_counter()
    tokens = np.asarray(tokens)[:, :N]
    steps = int(state.steps)
    counts = np.asarray(state.accepted)[:steps]  # [steps, B]
    valid = counts >= 0
    n_new = int(np.minimum(np.asarray(state.n_out), N).sum())
    sampler = plan.method == "parallel-sampler"
    mean_acc = float(counts[valid].mean()) if valid.any() else 0.0
    passes = int(np.asarray(state.draft_rounds).sum())
    stats = {
        "method": plan.method, **plan.describe(), "new_tokens": n_new, "batch": B,
        "seconds": t2 - t0, "prefill_seconds": t1 - t0, "decode_seconds": t2 - t1, "compile_seconds": compile_s,
        "compiled_programs": int(compile_p > 0) + int(compile_b > 0) + int(compile_l > 0),
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
    # The cache is the decode state a continuation needs, except the parallel sampler's: it commits a position's
    # deepest slot only, so its cache is not the target's at every depth.
    return GenerateResult(tokens=tokens, stats=stats, state=None if sampler else state.cache)
