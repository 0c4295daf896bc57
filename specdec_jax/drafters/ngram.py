"""Prompt-lookup (n-gram) drafter: propose what followed the latest earlier occurrence of the last
n tokens (n = max_n .. 1) in prompt + generated text. Fixed-size buffers, vectorised, on device.

Deterministic: its draft distribution q is one-hot at the proposal (acceptance handles that).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from .stateless import StatelessDrafter


@dataclasses.dataclass(frozen=True)
class NgramDrafter(StatelessDrafter):
    """max_n: longest suffix tried first; min_n: shortest suffix accepted as a match."""

    max_n: int = 3
    min_n: int = 1
    name = "ngram"

    def propose(self, params, cfg, drafter_state, history, hist_len, gamma: int, key, **_):
        """history [B, H] (the anchor is history[b, hist_len[b] - 1]) -> drafts [B, gamma], None."""
        drafts = jax.vmap(lambda h, n: ngram_lookup(h, n, gamma, self.max_n, self.min_n))(history, hist_len)
        return drafts, None, drafter_state


def ngram_lookup(history: jax.Array, length: jax.Array, gamma: int, max_n: int, min_n: int = 1) -> jax.Array:
    """One sequence: history [H] with `length` valid tokens -> proposal [gamma] int32.

    For n from max_n down to min_n, the latest start p < length - n with
    history[p : p + n] == history[length - n : length] wins; the proposal is history[p + n :]
    (positions past the known text repeat the last known token). No match: the last token repeated.
    """
    H = history.shape[0]
    pos = jnp.arange(H, dtype=jnp.int32)
    padded = jnp.concatenate([history, jnp.zeros((max_n + gamma,), history.dtype)])
    best_start = jnp.int32(-1)
    for n in range(min_n, max_n + 1):  # longer matches override shorter ones
        suffix = lax.dynamic_slice_in_dim(padded, jnp.maximum(length - n, 0), n)  # [n]
        match = jnp.ones((H,), bool)
        for j in range(n):
            match &= lax.dynamic_slice_in_dim(padded, j, H) == suffix[j]
        # An earlier occurrence that has at least one following known token (p + n < length).
        match &= (pos + n < length) & (length >= n)
        latest = jnp.max(jnp.where(match, pos, -1))
        best_start = jnp.where(latest >= 0, latest + n, best_start)
    last = history[jnp.maximum(length - 1, 0)]
    idx = best_start + jnp.arange(gamma, dtype=jnp.int32)
    known = (best_start >= 0) & (idx < length)
    proposal = jnp.where(known, padded[jnp.clip(idx, 0, H - 1)], -1)
    # Unknown positions continue the last known proposal token (or the anchor).
    fill = jnp.where(best_start >= 0, padded[jnp.clip(jnp.minimum(best_start + gamma, length) - 1, 0, H - 1)], last)
    return jnp.where(proposal >= 0, proposal, fill).astype(jnp.int32)
