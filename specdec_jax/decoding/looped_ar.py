"""AR generation for looped models: the shared on-device loop (`autoregressive.py`) over a looped model's
prefill and decode steps (full depth; on the exact path each decode step is a `looped.decode_forward` at
the generation's decode row count)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from ..errors import InputError
from ..looped_config import parse_eos_ids
from ..models import looped
from ..models.looped import CACHE_MODES, check_steps, init_cache
from ..options import check_context_length, validate_input_ids
from .autoregressive import FamilyOps, generate_autoregressive
from .decode_shape import pad_rows
from .sampling import SamplingConfig


@functools.cache
def _ar_ops(num_steps: int, mode: str, decode_rows: int = 0):
    """FamilyOps for the shared on-device AR loop; cached so compiled loops are reused. decode_rows > 0:
    each decode step is a `decode_forward` at that row count (the exact path)."""
    def init_state(cfg, batch, max_len, dtype):
        return init_cache(cfg, batch, max_len, num_steps, mode, dtype)

    def step(params, cfg, cache, ids):
        logits, cache, _ = looped.forward(params, cfg, cache, ids, num_steps=num_steps, logits_for="last")
        return logits[:, 0], cache

    def decode(params, cfg, cache, ids):  # ids [B, 1]
        logits, cache = looped.decode_forward(params, cfg, cache, pad_rows(ids, decode_rows),
                                       jnp.ones((ids.shape[0],), jnp.int32), num_steps=num_steps)
        return logits[:, 0], cache

    return FamilyOps(init_state=init_state, step=step, decode=decode if decode_rows else None)


def generate(model, input_ids, max_new_tokens: int, num_steps: int | None = None, sampling=None, seed: int = 0,
             eos_token_id=None, max_len: int | None = None, *, eos_ids: tuple[int, ...] | None = None,
             cache_mode: str = "full", decode_rows: int = 0):
    """KV-cached generation on device: one jitted prefill, one jitted lax.while_loop decode.

    input_ids [B, T]; returns GenerateResult(tokens [B, max_new_tokens] new tokens only, stats with
    new_tokens, seconds, tokens_per_second, prefill_seconds, decode_seconds, compile_seconds,
    decode_tokens_per_second). num_steps: recurrence depth (default mean_recurrence); the initial
    state is zeros (deterministic). sampling: SamplingConfig (default greedy). eos_token_id: None =
    the config's, int or list; `eos_ids` is the same as an already-resolved tuple (api.generate).
    After its EOS a row is padded with the first EOS id. max_len: cache length (default prompt + max_new_tokens,
    + decode_rows on the exact path). decode_rows > 0: the exact path (every decode step a `decode_forward` of
    that many rows, as the self-speculative verifier runs; needs cache_mode "full").
    """
    cfg = model.config
    ids = validate_input_ids(input_ids, cfg.vocab_size)
    num_steps = check_steps(num_steps, cfg)
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer; got {max_new_tokens!r}")
    needed = ids.shape[1] + int(max_new_tokens) + decode_rows
    what = f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens})" + (
        f" + decode_rows ({decode_rows})" if decode_rows else "")
    check_context_length(needed, cfg.max_position_embeddings, what)
    max_len = needed if max_len is None else int(max_len)
    if needed > max_len:
        raise InputError(f"{what} = {needed} exceeds the cache length max_len={max_len}")
    if cache_mode not in CACHE_MODES:
        raise InputError(f"cache_mode {cache_mode!r} is not supported; use one of {', '.join(CACHE_MODES)}")
    if decode_rows and cache_mode != "full":
        raise InputError("the exact path (exact=True) needs cache_mode='full'; a compressed cache is another model")
    if eos_ids is not None and eos_token_id is not None:
        raise InputError("give eos_token_id or eos_ids, not both")
    if eos_ids is None:
        eos_ids = cfg.eos_token_id if eos_token_id is None else parse_eos_ids(
            np.atleast_1d(np.asarray(eos_token_id, np.int64)).tolist())
    sampling = SamplingConfig() if sampling is None else sampling
    dtype = model.params["wte"].dtype
    result = generate_autoregressive(_ar_ops(num_steps, cache_mode, decode_rows), model.params, cfg, ids,
                                     int(max_new_tokens), max_len=max_len, sampling=sampling, seed=seed,
                                     eos_ids=tuple(eos_ids), state_dtype=dtype)
    result.stats.update(num_steps=num_steps, cache_mode=cache_mode, exact=bool(decode_rows),
                        decode_rows=decode_rows or 1)
    return result
