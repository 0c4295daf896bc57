"""Speculative acceptance: which drafts to keep, and which token to emit after them.

Both rules take drafts [B, G] and the target's logits at anchor + drafts [B, G + 1, V] (position i
predicts the token after draft i - 1) and return

    n_accepted [B]  number of leading drafts kept (0..G)
    next_token [B]  the token emitted after them: the target's correction at the first
                    rejection, or a bonus token from position G when every draft was kept.

Greedy: keep drafts while they equal the target argmax. Sampling (Leviathan et al. / Chen et al.):
keep draft x with probability min(1, p(x) / q(x)); on rejection sample from
normalize(max(0, p - q)); after G acceptances sample the bonus from p. The emitted sequence is then
distributed exactly as sampling from the target alone. p and q go through the same
temperature / top-k / top-p transform (sampling.warp_logits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .sampling import SamplingConfig, probabilities


def leading_true(mask: jax.Array) -> jax.Array:
    """Number of leading True values along the last axis: [B, G] -> [B]."""
    return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=-1), axis=-1)


def greedy_accept(drafts: jax.Array, target_logits: jax.Array):
    """drafts [B, G]; target_logits [B, G + 1, V] -> (n_accepted [B], next_token [B])."""
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, G + 1]
    n = leading_true(drafts == target[:, :-1])
    return n, jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]


def sampling_accept(drafts: jax.Array, draft_probs: jax.Array, target_probs: jax.Array, key: jax.Array):
    """Exact speculative sampling from already-warped distributions.

    drafts [B, G]; draft_probs q [B, G, V] (the distributions the drafts were drawn from; one-hot
    for deterministic drafters); target_probs p [B, G + 1, V].
    """
    B, G = drafts.shape
    V = target_probs.shape[-1]
    k_accept, k_resample = jax.random.split(key)
    p_draft = jnp.take_along_axis(target_probs[:, :G], drafts[..., None], axis=-1)[..., 0]  # [B, G]
    q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]  # [B, G]
    u = jax.random.uniform(k_accept, (B, G))
    # u < p/q written as u*q < p: no division, and q = 0 (a draft q could not produce) rejects.
    n = leading_true(u * q_draft < p_draft)
    q_ext = jnp.concatenate([draft_probs, jnp.zeros((B, 1, V), draft_probs.dtype)], axis=1)  # bonus: q = 0
    p_n = jnp.take_along_axis(target_probs, n[:, None, None], axis=1)[:, 0]  # [B, V]
    q_n = jnp.take_along_axis(q_ext, n[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # p == q exactly leaves no residual mass; rejection then has probability 0, so any choice is exact.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
    next_token = jax.random.categorical(k_resample, jnp.log(residual), axis=-1).astype(jnp.int32)
    return n, next_token


def accept(drafts: jax.Array, draft_logits_or_probs, target_logits: jax.Array, key: jax.Array,
           sampling: SamplingConfig, *, draft_is_probs: bool = True):
    """Dispatch on the sampling config. draft_logits_or_probs may be None for deterministic drafts."""
    if sampling.greedy:
        return greedy_accept(drafts, target_logits)
    p = probabilities(target_logits, sampling)
    if draft_logits_or_probs is None:
        q = jax.nn.one_hot(drafts, target_logits.shape[-1], dtype=jnp.float32)
    elif draft_is_probs:
        q = draft_logits_or_probs
    else:
        q = probabilities(draft_logits_or_probs, sampling)
    return sampling_accept(drafts, q, p, key)
