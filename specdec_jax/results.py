"""The `Model` handle returned by `specdec_jax.load` and the result of `generate`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded checkpoint: static config (hashable), parameter pytree, where it came from, and its tokenizer
    (None when the folder has none; `generate_text` needs one)."""

    config: Any  # Qwen35Config | LoopedConfig (frozen, jit-static)
    params: Any  # pytree of device arrays
    path: str | None = None
    dtype: Any = None
    tokenizer: Any = dataclasses.field(default=None, compare=False, repr=False)  # a transformers tokenizer

    @property
    def family(self) -> str:
        return self.config.family

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size


@dataclasses.dataclass
class GenerateResult:
    """tokens: [B, max_new_tokens] new tokens only (after its EOS a row is padded with the first EOS id).

    stats, every method of every family (STATS_KEYS): method, new_tokens, seconds (prefill + decode, compile
    excluded), prefill_seconds, decode_seconds, compile_seconds, compiled_programs (programs this call compiled or
    loaded from the persistent cache: 0 when every one was reused), tokens_per_second, decode_tokens_per_second,
    peak_memory_bytes (the device's peak in this process so far; None where the device does not report it);
    speculative methods add verify_steps, mean_accepted, tokens_per_step, accepted_counts.
    """

    tokens: np.ndarray
    stats: dict
    state: Any = None  # the decode state after the call (a session.Session from `generate`): pass it back as
    # generate(..., state=result.state) to continue without prefilling the history again
    drafter_state: Any = None  # internal: (kind, state) of a speculative loop's drafter, which `generate` moves
    # into the Session (None there)


STATS_KEYS = ("method", "new_tokens", "seconds", "prefill_seconds", "decode_seconds", "compile_seconds",
              "compiled_programs", "tokens_per_second", "decode_tokens_per_second", "peak_memory_bytes")


@dataclasses.dataclass
class TextResult:
    """The result of `generate_text`, shaped like its prompt: for a str prompt, text (str, the continuation
    only) and tokens (list of int, through the first EOS); for a list of prompts, a list of each. stats: the
    generation's (see GenerateResult); per-prompt calls add their sums and `per_prompt`."""

    text: str | list[str]
    tokens: list[int] | list[list[int]]
    stats: dict


def block(x):
    """Wait for every array in a pytree (timing boundaries)."""
    return jax.block_until_ready(x)
