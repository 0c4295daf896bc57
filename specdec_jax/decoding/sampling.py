"""Token selection shared by every decoding method: greedy, or sampling with temperature/top-k/top-p.

`warp_logits` is the one transform applied identically to target and draft distributions, so
speculative sampling (acceptance.py) compares like with like.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..errors import InputError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static sampling settings. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if not self.temperature >= 0:
            raise InputError(f"temperature must be >= 0; got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 = off); got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1]; got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp_logits(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Temperature, then top-k, then top-p (nucleus) masking; returns float32 logits ([..., V])."""
    x = logits.astype(jnp.float32) / max(cfg.temperature, 1e-6)
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if cfg.top_p < 1.0:
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_x, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        cutoff_idx = jnp.sum(mass_before < cfg.top_p, axis=-1, keepdims=True) - 1
        cutoff = jnp.take_along_axis(sorted_x, cutoff_idx, axis=-1)
        x = jnp.where(x < cutoff, -jnp.inf, x)
    return x


def probabilities(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """The distribution a method samples from ([..., V] float32); one-hot argmax when greedy."""
    if cfg.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(warp_logits(logits, cfg), axis=-1)


def select_token(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Next token ids [...] from logits [..., V]: argmax when greedy, else a sample."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, warp_logits(logits, cfg), axis=-1).astype(jnp.int32)


def shortlist_choice(logits: jax.Array, shortlist: jax.Array, vocab: int, key: jax.Array, cfg: SamplingConfig):
    """A draft chosen among a token shortlist: logits [..., N] over shortlist [N] (token ids) ->
    (token ids [...], q [..., vocab] or None when greedy): q is the distribution the draft was drawn
    from, zero off the shortlist, so rejection sampling against the target stays exact."""
    ids = shortlist[select_token(logits, key, cfg)].astype(jnp.int32)
    if cfg.greedy:
        return ids, None
    q = probabilities(logits, cfg)
    full = jnp.zeros(q.shape[:-1] + (vocab,), q.dtype)
    return ids, full.at[..., shortlist].set(q)
