"""Decode loops that read their stop condition on the host once per several steps.

On the GPU, XLA runs a `lax.while_loop` whose trip count it cannot know by copying the predicate to the host
after every iteration and waiting for it; the device then idles while the host issues the next iteration's
kernels (at the Qwen3.5-9B shape a speculative step spent about 0.2 ms of its 5.4 ms outside any kernel, an AR
token with a known trip count 0.09 ms: benchmarks/results/kernel_profile_qwen35_9b_random_profile.md).
`chunked_while_loop` runs `steps_per_check` bodies per iteration -- an inner loop with a fixed trip count,
which XLA runs without reading anything back -- for as long as every one of them is certainly needed, then
one body per iteration to the end. So no step runs that the plain loop would not run, except after an EOS
(up to steps_per_check - 1 steps, which the loops' bodies make no-ops for finished rows).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

# Decode steps per host check: a GPU measurement chooses it (see DEFAULT_STEPS_PER_CHECK's users).
DEFAULT_STEPS_PER_CHECK = 1


def chunked_while_loop(cond: Callable, body: Callable, carry, *, steps_per_check: int, room: Callable):
    """The result of `lax.while_loop(cond, body, carry)`, reading `cond` once per `steps_per_check` bodies.

    room(carry) -> bool scalar: True only when cond holds before each of the next `steps_per_check` bodies,
    unless a row stops early for a reason the bound cannot see (EOS); body must leave a carry whose cond is
    false unchanged in everything the caller reads (finished rows are no-ops). steps_per_check == 1: the
    plain loop."""
    if steps_per_check > 1:
        def chunk(c):
            return lax.fori_loop(0, steps_per_check, lambda _, x: body(x), c)

        carry = lax.while_loop(lambda c: cond(c) & room(c), chunk, carry)
    return lax.while_loop(cond, body, carry)


def spec_room(done: jax.Array, n_out: jax.Array, max_new_tokens: int, tokens_per_step: int,
              steps_per_check: int) -> jax.Array:
    """`room` of a speculative loop: some unfinished row [B] still lacks tokens after steps_per_check - 1 steps
    that each emit at most tokens_per_step tokens, so every step of the next chunk has work."""
    bound = n_out + (steps_per_check - 1) * tokens_per_step
    return jnp.any(~done & (bound < max_new_tokens))
