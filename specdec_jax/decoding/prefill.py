"""Chunked prefill of padded, ragged prompts: the prompt buffer [B, P] is run through the model `chunk` tokens at a
time (a loop whose trip count, the chunks the longest prompt needs, is traced), each chunk with its rows' valid
counts, so one compiled program prefills every prompt that fits its buffer, and activations stay those of one
chunk however long the prompt."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax


def chunked_prefill(run_chunk: Callable, state, ids: jax.Array, lens: jax.Array, chunk: int, *, starts=None):
    """Prefill prompts ids [B, P] (row b's first lens[b] >= 1 tokens are valid) from `state`, `chunk` tokens a pass.
    starts [B] or None: row b's tokens before starts[b] are already in `state` (a continuation: ids is the whole
    history, lens its length); the chunks run from there. hidden (below) is then indexed from each row's start.

    run_chunk(state, ids [B, chunk], n_valid [B]) -> (last-valid-row logits [B, V], state, hidden [B, chunk, D] or
    None); n_valid may be 0 (a row already done: its state must not move). Where it gives hidden states, every
    prompt position's is gathered into a [B, P, D] buffer (what an MTP drafter starts from).
    Returns (each row's logits at its last prompt token [B, V], state, hidden [B, P, D] or None)."""
    B, P = ids.shape
    if P % chunk:
        raise ValueError(f"chunked_prefill: the prompt buffer ({P}) must hold whole chunks of {chunk}")
    starts = jnp.zeros_like(lens) if starts is None else starts
    lens = (lens - starts).astype(jnp.int32)  # the tokens each row runs
    ids = jnp.pad(ids, ((0, 0), (0, chunk)))  # a row's last chunk may start anywhere before P
    n_chunks = (jnp.max(lens) + chunk - 1) // chunk
    # Jitted and inlined where it is called: the shapes below come from its one trace, which the loop's body reuses
    # (a chunk at the same shapes), instead of tracing the model's forward twice. The program is the same.
    run_chunk = jax.jit(run_chunk, inline=True)
    logits_shape, _, hidden_shape = jax.eval_shape(run_chunk, state, ids[:, :chunk], lens)
    logits0 = jnp.zeros(logits_shape.shape, logits_shape.dtype)
    hidden0 = None if hidden_shape is None else jnp.zeros((B, P) + hidden_shape.shape[2:], hidden_shape.dtype)

    def body(c, carry):
        state, last, hidden = carry
        start = c * chunk
        piece = jax.vmap(lambda row, s: lax.dynamic_slice_in_dim(row, s, chunk))(ids, starts + start)  # [B, chunk]
        n_valid = jnp.clip(lens - start, 0, chunk).astype(jnp.int32)
        logits, state, h = run_chunk(state, piece, n_valid)
        ends_here = (lens > start) & (lens <= start + chunk)
        last = jnp.where(ends_here[:, None], logits, last)
        if hidden is not None:
            hidden = lax.dynamic_update_slice_in_dim(hidden, h.astype(hidden.dtype), start, axis=1)
        return state, last, hidden

    state, last, hidden = lax.fori_loop(0, n_chunks, body, (state, logits0, hidden0))
    return last, state, hidden


@functools.cache
def chunk_runner(prefill_forward: Callable) -> Callable:
    """A family's prefill_forward (params, cfg, state, ids [B, C], n_valid [B]) -> (logits [B, 1, V], state) as
    `prefill_buffer` runs a chunk: (params, cfg, state, ids, n_valid) -> (logits [B, V], state, None). One object per
    forward (cached), so every caller passing the same forward shares `prefill_buffer`'s compiled program."""
    def run(params, cfg, state, ids, n_valid):
        logits, state = prefill_forward(params, cfg, state, ids, n_valid)
        return logits[:, 0], state, None
    return run


@functools.partial(jax.jit, static_argnames=("run", "init_state", "cfg", "max_len", "state_dtype", "chunk"))
def prefill_buffer(params, ids, lens, initial=None, starts=None, *, run: Callable, init_state: Callable, cfg,
                   max_len: int, state_dtype, chunk: int):
    """The padded prompt buffer ids [B, P] with valid lengths lens [B], `chunk` tokens a pass (`chunked_prefill`), from
    `initial` (a state holding each row's first starts[b] tokens: a continuation) or init_state(cfg, B, max_len,
    state_dtype). run(params, cfg, state, ids [B, chunk], n_valid [B]) -> (logits [B, V], state, hidden or None)
    must be one object per forward (`chunk_runner`, or a cached runner of one's own): it is part of the program's key.
    Returns (each row's logits at its last prompt token [B, V], state, hidden [B, P, D] or None)."""
    state = init_state(cfg, ids.shape[0], max_len, state_dtype) if initial is None else initial
    return chunked_prefill(functools.partial(run, params, cfg), state, ids, lens, chunk, starts=starts)
