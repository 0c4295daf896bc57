"""Autoregressive generation fully on device: one jitted prefill, one jitted `lax.while_loop` decode.

Family-agnostic: the loop runs a `FamilyOps` -- `init_state(cfg, batch, max_len, dtype)`,
`step(params, cfg, state, ids [B, T]) -> (last-position logits [B, vocab], new state)` (the prefill, and
decode unless given) and optionally `decode(params, cfg, state, ids [B, 1])`, the decode step (the exact
path's runs at the generation's decode shape) -- which `ar_ops` builds from a model family
(`models.family`); `generate_ar` runs a model through its family.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..results import GenerateResult
from .compiled import compiled, output_structs
from .compiled import compiler_options as family_compiler_options
from .decode_shape import pad_rows
from .prefill import chunk_runner, prefill_buffer
from .sampling import SamplingConfig, select_token

if TYPE_CHECKING:  # the families import both model modules; `import specdec_jax` stays light without them
    from ..models.family import Family


class FamilyOps(NamedTuple):
    init_state: Callable
    step: Callable  # (params, cfg, state, ids) -> (logits [B, V], state)
    decode: Callable | None = None  # as step, for one token per row; None: step
    # the family's prefill_forward (params, cfg, state, ids [B, C], n_valid [B]) -> (logits [B, 1, V], state), or None
    prefill_chunk: Callable | None = None


@functools.cache
def ar_ops(family: Family, decode_rows: int = 0) -> FamilyOps:
    """The AR loop's operations on `family` (cached, so compiled loops are reused). decode_rows > 0: the exact
    path, each decode step a `decode_forward` at that padded row count (the shape a verification runs at)."""
    def step(params, cfg, state, ids):
        logits, state = family.forward(params, cfg, state, ids, logits_for="last")
        return logits[:, 0], state

    def decode(params, cfg, state, ids):  # ids [B, 1]; logits of every row, as a verification computes them
        logits, state = family.decode_forward(params, cfg, state, pad_rows(ids, decode_rows),
                                              jnp.ones((ids.shape[0],), jnp.int32), live_rows=ids.shape[1])
        return logits[:, 0], state

    return FamilyOps(init_state=family.init_state, step=step, decode=decode if decode_rows else None,
                     prefill_chunk=family.prefill_forward)


def _eos_hit(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.any(tokens[..., None] == jnp.asarray(eos_ids, jnp.int32), axis=-1)


@functools.partial(jax.jit, static_argnames=("ops", "cfg", "max_len", "state_dtype"))
def _prefill(params, prompt, *, ops: FamilyOps, cfg, max_len: int, state_dtype):
    state = ops.init_state(cfg, prompt.shape[0], max_len, state_dtype)
    return ops.step(params, cfg, state, prompt)


@functools.partial(jax.jit, static_argnames=("ops", "cfg"))
def _prefill_from(params, prompt, initial, *, ops: FamilyOps, cfg):
    """The prompt [B, T] after the tokens `initial` holds (a continued generation of a family without padded
    prefill: every row T new tokens, each at its own offset)."""
    return ops.step(params, cfg, initial, prompt)


def _ar_begin(first_logits, key, *, sampling: SamplingConfig, eos_ids: tuple[int, ...], buffer: int):
    """The AR loop's carry before its first step: (i = 1, tokens [B, buffer] holding the first token, chosen from the
    prefill logits; done [B]; the last token [B]; key)."""
    B = first_logits.shape[0]
    key, sub = jax.random.split(key)
    first = select_token(first_logits, sub, sampling)  # [B]
    tokens = jnp.zeros((B, buffer), jnp.int32).at[:, 0].set(first)
    return jnp.int32(1), tokens, _eos_hit(first, eos_ids), first, key


def _ar_steps(params, state, carry, limit, *, ops: FamilyOps, cfg, sampling: SamplingConfig,
              eos_ids: tuple[int, ...]):
    """One forward a token while i < limit and a row is running: (state, carry) -> (state, carry)."""
    pad = eos_ids[0] if eos_ids else 0

    def cond(c):
        i, _, _, done, _, _ = c
        return (i < limit) & ~jnp.all(done)

    def body(c):
        i, state, tokens, done, last, key = c
        logits, state = (ops.decode or ops.step)(params, cfg, state, last[:, None])
        key, sub = jax.random.split(key)
        nxt = jnp.where(done, pad, select_token(logits, sub, sampling))
        tokens = lax.dynamic_update_slice_in_dim(tokens, nxt[:, None], i, axis=1)
        return i + 1, state, tokens, done | _eos_hit(nxt, eos_ids), nxt, key

    i, state, tokens, done, last, key = lax.while_loop(cond, body, (carry[0], state) + tuple(carry[1:]))
    return state, (i, tokens, done, last, key)


def _padded_tokens(tokens, i, eos_ids):
    """Rows that finished early (or all rows, when the loop stopped) are padded with EOS past the i tokens run."""
    filled = jnp.arange(tokens.shape[1])[None, :] < i
    return jnp.where(filled, tokens, eos_ids[0] if eos_ids else 0)


@functools.partial(jax.jit, static_argnames=("ops", "cfg", "max_new_tokens", "sampling", "eos_ids"),
                   donate_argnames=("state",))
def _decode_loop(params, state, first_logits, key, budget=None, *, ops: FamilyOps, cfg, max_new_tokens: int,
                 sampling: SamplingConfig, eos_ids: tuple[int, ...]):
    """Tokens [B, max_new_tokens]: the first from the prefill logits, the rest one forward each. budget: None (every
    one of the max_new_tokens, a loop of known trip count), or a traced count <= max_new_tokens (max_new_tokens is
    then only the buffer's length; `buckets`)."""
    budget = max_new_tokens if budget is None else budget
    carry = _ar_begin(first_logits, key, sampling=sampling, eos_ids=eos_ids, buffer=max_new_tokens)
    state, (i, tokens, _, _, _) = _ar_steps(params, state, carry, budget, ops=ops, cfg=cfg, sampling=sampling,
                                            eos_ids=eos_ids)
    return _padded_tokens(tokens, i, eos_ids), state, i


# Streaming: the same loop cut into chunks of steps, its carry passed from one chunk to the next.
_stream_begin = jax.jit(_ar_begin, static_argnames=("sampling", "eos_ids", "buffer"))
_stream_steps = jax.jit(_ar_steps, static_argnames=("ops", "cfg", "sampling", "eos_ids"),
                        donate_argnames=("state", "carry"))


def stream_chunks(run_chunk, n_tokens: int, chunk_steps: int, emit) -> None:
    """Drive a chunked decode loop from the host: run_chunk(limit) -> (tokens [B, >= n_tokens] padded past each row's
    count, counts [B] of tokens each row holds, done [B]) runs until `limit` (its steps or tokens) and returns where
    it stands; emit(tokens [B, k]) gets every token position all rows hold, once. The last emit pads finished rows
    to n_tokens (what `generate` returns)."""
    emitted = 0
    limit = 0
    while emitted < n_tokens:
        limit += chunk_steps
        tokens, counts, done = run_chunk(limit)
        tokens, counts, done = np.asarray(tokens), np.asarray(counts), np.asarray(done)
        ready = int(np.min(np.where(done, n_tokens, np.minimum(counts, n_tokens))))
        if ready > emitted:
            emit(tokens[:, emitted:ready])
            emitted = ready


def generated_counts(tokens: np.ndarray, steps: int, eos_ids: tuple[int, ...]) -> np.ndarray:
    """Tokens each row really generated [B]: through its first EOS (inclusive), else all `steps`
    (rows that stopped early are padding afterwards, not generated tokens)."""
    produced = tokens[:, :steps]
    if not eos_ids:
        return np.full(tokens.shape[0], steps)
    hit = np.isin(produced, np.asarray(eos_ids))
    return np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, steps)


def generate_autoregressive(ops: FamilyOps, params, cfg, prompt: np.ndarray, max_new_tokens: int, *,
                            max_len: int, sampling: SamplingConfig, seed: int, eos_ids: tuple[int, ...],
                            state_dtype, return_state: bool = False, compiler_options: dict | None = None,
                            lens: np.ndarray | None = None, chunk: int = 0, token_buffer: int = 0,
                            stream=None, initial=None, starts=None) -> GenerateResult:
    """Compile (with the XLA `compiler_options`), then time prefill and decode separately (compile time reported
    apart). lens: None (prompt [B, T] all valid, one prefill forward), or each row's valid length in the padded
    prompt buffer [B, P], prefilled `chunk` tokens at a time (`buckets`); token_buffer > 0: the decode loop's
    output buffer, max_new_tokens then traced (0: max_new_tokens is part of the program). stream: None, or
    (chunk_steps, emit): the loop runs chunk_steps steps a call and emit(tokens [B, k]) gets them (`stream_chunks`).
    initial, starts: continue from a state holding each row's first starts[b] tokens of the prompt buffer (lens None:
    from a state `initial` of max_len slots, the whole prompt after what it holds).
    result.state: ARState (the model state after the loop, and the tokens each row ran)."""
    prompt = jnp.asarray(prompt, jnp.int32)
    key = jax.random.PRNGKey(seed)
    if lens is None and initial is not None:
        static_p = dict(ops=ops, cfg=cfg)
        prefill_fn, prefill_args = _prefill_from, (params, prompt, initial)
    elif lens is None:
        static_p = dict(ops=ops, cfg=cfg, max_len=max_len, state_dtype=state_dtype)
        prefill_fn, prefill_args = _prefill, (params, prompt)
    else:
        # The family's one prefill program for this bucket, shared with its speculative methods (`prefill_buffer`).
        static_p = dict(run=chunk_runner(ops.prefill_chunk), init_state=ops.init_state, cfg=cfg, max_len=max_len,
                        state_dtype=state_dtype, chunk=chunk)
        prefill_fn, prefill_args = prefill_buffer, (params, prompt, jnp.asarray(lens, jnp.int32), initial,
                                                    None if starts is None else jnp.asarray(starts, jnp.int32))
    static_d = dict(ops=ops, cfg=cfg, max_new_tokens=token_buffer or max_new_tokens, sampling=sampling,
                    eos_ids=eos_ids)
    budget = (jnp.int32(max_new_tokens),) if token_buffer else ()
    prefill_c, compile_p = compiled(prefill_fn, static_p, *prefill_args, options=compiler_options)
    logits_shape, state_shape = output_structs(prefill_c)[:2]  # prefill_buffer's third output: no hidden states
    if stream is not None:
        return _generate_streamed(ops, params, cfg, prefill_c, prefill_args, compile_p, logits_shape, state_shape,
                                  key, max_new_tokens, sampling, eos_ids, token_buffer or max_new_tokens, stream,
                                  compiler_options, return_state)
    decode_c, compile_d = compiled(_decode_loop, static_d, params, state_shape, logits_shape, key, *budget,
                                   options=compiler_options)
    compile_s = compile_p + compile_d

    t0 = time.perf_counter()
    logits, state = jax.block_until_ready(prefill_c(*prefill_args)[:2])
    t1 = time.perf_counter()
    tokens, state, steps = jax.block_until_ready(decode_c(params, state, logits, key, *budget))
    t2 = time.perf_counter()
    return _ar_result(np.asarray(tokens)[:, :max_new_tokens], state, int(steps), eos_ids, t0, t1, t2, compile_s,
                      int(compile_p > 0) + int(compile_d > 0), return_state)


def _generate_streamed(ops, params, cfg, prefill_c, prefill_args, compile_p, logits_shape, state_shape, key,
                       max_new_tokens, sampling, eos_ids, buffer, stream, compiler_options, return_state):
    """`generate_autoregressive`'s loop in chunks of steps (`stream_chunks`), each chunk one call of the same loop."""
    chunk_steps, emit = stream
    begin_c, compile_b = compiled(_stream_begin, dict(sampling=sampling, eos_ids=eos_ids, buffer=buffer),
                                  logits_shape, key, options=compiler_options)
    steps_c, compile_s = compiled(_stream_steps, dict(ops=ops, cfg=cfg, sampling=sampling, eos_ids=eos_ids), params,
                                  state_shape, output_structs(begin_c), jnp.int32(0), options=compiler_options)
    pad = eos_ids[0] if eos_ids else 0
    t0 = time.perf_counter()
    logits, state = jax.block_until_ready(prefill_c(*prefill_args)[:2])
    t1 = time.perf_counter()
    held = [state, begin_c(logits, key)]

    def run_chunk(limit_steps):  # a step adds one token; the first came from the prefill
        held[:] = steps_c(params, held[0], held[1], jnp.int32(min(1 + limit_steps, max_new_tokens)))
        i, tokens, done = int(held[1][0]), np.asarray(held[1][1]), np.asarray(held[1][2])
        tokens = np.where(np.arange(tokens.shape[1])[None, :] < i, tokens, pad)
        return tokens, np.full(tokens.shape[0], i), done

    stream_chunks(run_chunk, max_new_tokens, chunk_steps, emit)
    t2 = time.perf_counter()
    i, tokens = int(held[1][0]), np.asarray(held[1][1])[:, :max_new_tokens]
    tokens = np.where(np.arange(max_new_tokens)[None, :] < i, tokens, pad)
    return _ar_result(tokens, held[0], i, eos_ids, t0, t1, t2, compile_p + compile_b + compile_s,
                      int(compile_p > 0) + int(compile_b > 0) + int(compile_s > 0), return_state)


def _ar_result(tokens, state, steps, eos_ids, t0, t1, t2, compile_s, programs, return_state) -> GenerateResult:
    """The GenerateResult of an AR run timed t0 (prefill) .. t1 (decode) .. t2."""
    n_new = int(generated_counts(tokens, int(steps), eos_ids).sum())
    B = tokens.shape[0]
    stats = {
        "method": "ar", "new_tokens": n_new, "seconds": t2 - t0, "prefill_seconds": t1 - t0,
        "decode_seconds": t2 - t1, "compile_seconds": compile_s, "compiled_programs": programs,
        "tokens_per_second": n_new / max(t2 - t0, 1e-9),
        "decode_tokens_per_second": max(n_new - B, 0) / max(t2 - t1, 1e-9),
    }
    if return_state:
        stats["state"] = state
    return GenerateResult(tokens=tokens, stats=stats, state=ARState(model=state, tokens_run=int(steps)))


class ARState(NamedTuple):
    """What an AR loop leaves: the model state, and how many tokens the loop ran (each row's first tokens_run - 1
    are in the state, unless the row met its EOS sooner: `session.Session.resumable`)."""
    model: object
    tokens_run: int


def generate_ar(family: Family, model, prompt, max_new_tokens: int, *, decode_rows: int = 0, max_len: int,
                sampling: SamplingConfig, seed: int, eos_ids: tuple[int, ...], lens=None, chunk: int = 0,
                token_buffer: int = 0, stream=None, initial=None, starts=None) -> GenerateResult:
    """AR generation of `model` through its family (inputs already checked); decode_rows > 0: the exact path.
    lens, chunk, token_buffer: a bucketed generation; stream: (chunk_steps, emit) (`generate_autoregressive`). stats
    add the family's settings (`Family.describe`), exact and decode_rows."""
    result = generate_autoregressive(ar_ops(family, decode_rows), model.params, model.config, prompt, max_new_tokens,
                                     max_len=max_len, sampling=sampling, seed=seed, eos_ids=eos_ids,
                                     state_dtype=family.state_dtype(model),
                                     compiler_options=family_compiler_options(family.name), lens=lens, chunk=chunk,
                                     token_buffer=token_buffer, stream=stream, initial=initial, starts=starts)
    result.stats.update(family.describe(), exact=bool(decode_rows), decode_rows=decode_rows or 1)
    return result
