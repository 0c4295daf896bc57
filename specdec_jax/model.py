"""The `Model` handle returned by `specdec_jax.load` and the result of `generate`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded checkpoint: static config (hashable), parameter pytree, and where it came from."""

    config: Any  # Qwen35Config | LoopedConfig (frozen, jit-static)
    params: Any  # pytree of device arrays
    path: str | None = None
    dtype: Any = None

    @property
    def family(self) -> str:
        return self.config.family

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size


@dataclasses.dataclass
class GenerateResult:
    """tokens: [B, max_new_tokens] new tokens only (after its EOS a row is padded with the first EOS id).

    stats: new_tokens, seconds (prefill + decode, compile excluded), tokens_per_second,
    prefill_seconds, decode_seconds, compile_seconds, and for speculative methods
    verify_steps, mean_accepted, accepted_counts.
    """

    tokens: np.ndarray
    stats: dict


def block(x):
    """Wait for every array in a pytree (timing boundaries)."""
    return jax.block_until_ready(x)
