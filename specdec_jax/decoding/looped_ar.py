"""AR generation for looped models: the shared on-device loop (`autoregressive.py`) over the looped family
(`models.family.looped_family`: full-depth prefill and decode steps; on the exact path each decode step is a
`looped.decode_forward` at the generation's decode row count)."""

from __future__ import annotations

import numpy as np

from ..errors import InputError
from ..models.looped.config import parse_eos_ids
from ..models.family import looped_family
from ..models.looped.model import check_cache_mode, check_steps
from ..options import check_context_length, validate_input_ids
from .autoregressive import generate_ar
from .sampling import SamplingConfig


def generate(model, input_ids, max_new_tokens: int, num_steps: int | None = None, sampling=None, seed: int = 0,
             eos_token_id=None, max_len: int | None = None, *, eos_ids: tuple[int, ...] | None = None,
             cache_mode: str = "full", decode_rows: int = 0):
    """KV-cached generation on device: one jitted prefill, one jitted lax.while_loop decode.

    input_ids [B, T]; returns GenerateResult(tokens [B, max_new_tokens] new tokens only, stats with
    new_tokens, seconds, tokens_per_second, prefill_seconds, decode_seconds, compile_seconds,
    decode_tokens_per_second). num_steps: recurrence depth (default mean_recurrence); the initial
    state is zeros (deterministic). sampling: SamplingConfig (default greedy). eos_token_id: None =
    the config's, int or list; `eos_ids` is the same as an already-resolved tuple.
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
    check_cache_mode(cache_mode)
    if decode_rows and cache_mode != "full":
        raise InputError("the exact path (exact=True) needs cache_mode='full'; a compressed cache is another model")
    if eos_ids is not None and eos_token_id is not None:
        raise InputError("give eos_token_id or eos_ids, not both")
    if eos_ids is None:
        eos_ids = cfg.eos_token_id if eos_token_id is None else parse_eos_ids(
            np.atleast_1d(np.asarray(eos_token_id, np.int64)).tolist())
    sampling = SamplingConfig() if sampling is None else sampling
    return generate_ar(looped_family(num_steps, cache_mode), model, ids, int(max_new_tokens), decode_rows=decode_rows,
                       max_len=max_len, sampling=sampling, seed=seed, eos_ids=tuple(eos_ids))
