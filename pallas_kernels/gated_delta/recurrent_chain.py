"""What the recurrent kernel's three modes share (`recurrent_kernel`: step, replay, pseudo-value replay): the step's
math on a [K, BV] fp32 state block, the loaders of a position's inputs, and the chain driver that runs the positions
unrolled or as a loop. Functions of values and refs inside a Pallas kernel; nothing here launches anything.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._kernel_utils import F32, l2norm_vec


def decayed_state(state, g):
    """e^{g} S on a [K, BV] fp32 state block."""
    return state * jnp.exp(g)


def rank_one_update(decayed, k, u):
    """decayed + k u^T: a step's state from its decayed state, key [K] and pseudo-value u [BV]."""
    return decayed + k[:, None] * u[None, :]


def gated_delta_step(state, k, v, g, beta):
    """One step of the recurrence on a [K, BV] fp32 state block: (new state, u). Shared by decode,
    verification and replay, so the three compute every state with the same instructions (the pseudo-value
    replay runs its `decayed_state` and `rank_one_update` on the u this step computed)."""
    # The prediction reads the undecayed state and scales the sum: (e^g S)^T k = e^g (S^T k) in exact arithmetic.
    # So the decayed state's one use is the update, as in the pseudo-value replay, and the compiler contracts the
    # update into the same fused multiply-add in both kernels (with a second use here it fused k u^T instead, and
    # a replay from u would have differed in the last bit; PTX checked locally, kernel README).
    u = beta * (v - jnp.exp(g) * jnp.sum(state * k[:, None], axis=0))  # [BV]
    return rank_one_update(decayed_state(state, g), k, u), u


def kept_count(refs, n_heads):
    """(the leading positions this program keeps, the refs after the counts)."""
    n_ref, refs = refs[0], refs[1:]
    return n_ref[pl.program_id(0) // n_heads], refs


def initial_state(s0_ref, layer, kdim: int, bv: int):
    """The [K, BV] fp32 state a program starts from: zeros without s0, else its block (layer `layer`'s if stacked)."""
    if s0_ref is None:
        return jnp.zeros((kdim, bv), F32)
    return (s0_ref[...] if layer is None else s0_ref[layer]).astype(F32)


def write_state(st_ref, layer, state) -> None:
    if layer is None:
        st_ref[...] = state
    else:
        st_ref[layer] = state


def plain_loader(q_ref, k_ref, v_ref, g_ref, beta_ref, l2norm: bool):
    """(fetch, prepare) of position t from the step inputs as the caller laid them out: fetch issues the loads (none
    depends on the state), prepare forms the step inputs (q, k, g, v, beta) and, as read, what a stash stores (k, g).
    q_ref None: the replay, which has no outputs."""
    def fetch(t):
        return (k_ref[t, :], None if q_ref is None else q_ref[t, :], g_ref[t], v_ref[t, :], beta_ref[t])

    def prepare(raw):
        k_raw, q_raw, g_raw, v_raw, beta_raw = raw
        k, q = k_raw.astype(F32), None if q_raw is None else q_raw.astype(F32)  # [K]
        if l2norm:
            k = l2norm_vec(k)
            q = None if q is None else l2norm_vec(q)
        g = g_raw.astype(F32)
        return q, k, g, v_raw.astype(F32), beta_raw.astype(F32), (k, g_raw)

    return fetch, prepare


def pseudo_loader(k_ref, g_ref, u_ref):
    """(fetch, prepare) of the pseudo-value replay's position t: the key (fp32, as the step used it), the gate and the
    pseudo-value the verification computed, as (None, k, g, u, None)."""
    def fetch(t):
        return k_ref[t, :], g_ref[t], u_ref[t, :]

    def prepare(raw):
        k_raw, g_raw, u = raw
        k = k_raw.astype(F32)
        g = g_raw.astype(F32)
        return None, k, g, u, None

    return fetch, prepare


def kept_only(step, n_valid):
    """`step` run on position t only where t < n_valid (a branch per unrolled step): at partial acceptance a replay
    costs its accepted positions, and the state after them is the same bits as running all T and keeping the first
    n_valid."""
    def kept(t, state, x):
        return lax.cond(t < n_valid, lambda s: step(t, s, x)[0], lambda s: s, state), None

    return kept


def run_chain(state, *, n_steps, unroll, preload, fetch_first, fetch, prepare, step, kept=None, stop_at=None,
              stash_row=None):
    """The chain of n_steps state updates `step(t, state, x) -> (state, u)` on the inputs `prepare(fetch(t))`.
    Unrolled, each position runs `kept` (default: `step`); as a loop, `step` runs for t < stop_at (a traced count,
    clipped to n_steps; default: every position). fetch_first: every position's loads issued before any input is
    formed (unrolled), or the next position's inputs formed after the step (loop): the same arithmetic either way.
    Returns (state, xs, us): the unrolled form's prepared inputs and pseudo-values (empty for the loop form, which
    hands each position to `stash_row` itself)."""
    kept = step if kept is None else kept

    def load(t):
        return prepare(fetch(t))

    us = []
    if unroll:
        # Preloaded: every position's loads are issued before any of them is used, then the step inputs are formed
        # (key / query normalisation, the packed form's gates), then the chain of state updates runs: the memory
        # latency is paid once, not once per step. (Issued position by position, each position's loads waited
        # behind the previous one's gates: log1p's special-value branch ends a basic block, and no load was moved
        # above it; one L2 round trip per position, PTX checked locally, kernel README.)
        order = range(n_steps)
        xs = ([prepare(raw) for raw in [fetch(t) for t in order]] if fetch_first else [load(t) for t in order]
              ) if preload else []
        for t in range(n_steps):
            if not preload:
                xs.append(load(t))
            state, u = kept(t, state, xs[t])
            us.append(u)
        return state, xs, us

    # One step's code in a loop; the next position's loads are issued before this step's update and its inputs
    # formed after it, so their latency overlaps the update (the arithmetic is the unrolled form's). A replay's
    # loop ends at the kept count (`stop_at`).
    def body(t, carry):
        state, x = carry
        raw_next = fetch(jnp.minimum(t + 1, n_steps - 1))
        x_next = None if fetch_first else prepare(raw_next)
        state, u = step(t, state, x)
        if stash_row:  # after the step: stores issued behind it, from values already held
            stash_row(t, x[5], u)
        return state, prepare(raw_next) if x_next is None else x_next

    upper = n_steps if stop_at is None else jnp.clip(stop_at, 0, n_steps)
    state, _ = lax.fori_loop(0, upper, body, (state, load(0)))
    return state, [], []
