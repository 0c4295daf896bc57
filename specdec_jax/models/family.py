"""One interface over the model families: what a decoding loop needs from a model.

A `Family` is a frozen set of pure functions over (params, cfg, state); frozen and built once per setting,
so it hashes and can be a static argument of a jitted loop:

    init_state(cfg, batch, max_len, dtype) -> state       an empty state (no tokens, length 0)
    forward(params, cfg, state, ids [B, T], logits_for="all") -> (logits float32 [B, T | 1, V], state)
                                                          T new tokens; the state advances by T
    verify(params, cfg, state, ids [B, T]) -> (logits [B, T, V], verified, extras)
                                                          a forward that keeps what `commit` needs
    commit(before, verified, extras, n_keep [B]) -> state
                                                          the state as if only the first n_keep of the T
                                                          verified tokens had run (ragged per row)
    decode_forward(params, cfg, state, ids [B, T], n_valid [B], live_rows=None) -> (logits [B, T, V], state)
                                                          the exact path's decode shape: T padded rows,
                                                          the state advances by n_valid; live_rows (static):
                                                          no valid row lies past it (a hint; Qwen3.5 runs its
                                                          GDN recurrence on those rows only)
    state_dtype(model) -> dtype                           what a fresh state of `model` holds

`QWEN35`, the Qwen3.5 hybrid: its commit replays the GDN recurrence over the kept tokens from the state
the verification started at (`qwen35.commit`); attention K/V past the new length are masked. `looped_family
(num_steps, cache_mode)`, a looped model run at recurrence depth num_steps: its state is the depth-indexed
cache, so its commit only moves the length back (entries past it are masked and later overwritten), and it
adds the model's three stages: `prelude` (embedding + prelude layers), `core` (one recurrence step) and
`coda` (coda layers + head). `family_for(cfg, **settings)` picks a config's family.

A new family: its model module in models/, its config parser in layer 1, an entry in `_BUILDERS`, and
its methods in `methods.REGISTRY`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from .looped import model as looped
from .qwen35 import model as qwen35


@dataclasses.dataclass(frozen=True)
class Family:
    """The operations a decoding loop runs on a model (signatures in the module docstring)."""

    name: str
    init_state: Callable
    forward: Callable
    verify: Callable
    commit: Callable
    decode_forward: Callable
    state_dtype: Callable
    prefill_forward: Callable | None = None  # (params, cfg, state, ids [B, C], n_valid [B]) -> (logits [B, 1, V],
    # state): a padded prefill chunk, rows past n_valid padding, logits at each row's last valid row (None: the
    # family prefills exact shapes only)

    def describe(self) -> dict:
        """Settings that choose among this family's models (reported in generation stats)."""
        return {}


@dataclasses.dataclass(frozen=True)
class LoopedFamily(Family):
    """A looped model at depth `num_steps` with a `cache_mode` cache, plus its three stages:
    prelude(params, cfg, cache, ids, cos, sin) -> (embedded [B, T, D], prelude K, V);
    core(params, cfg, cache, x, embedded, step, cos, sin, read_k=None, read_v=None) -> (x, K, V);
    coda(params, cfg, cache, x, cos, sin, logits_for) -> (logits, latent, coda K, V).
    The cache is only read by the stages; the caller writes the returned K/V."""

    num_steps: int = 0
    cache_mode: str = "full"
    prelude: Callable = looped.prelude
    core: Callable = looped.core_step
    coda: Callable = looped.coda_head

    def describe(self) -> dict:
        return {"num_steps": self.num_steps, "cache_mode": self.cache_mode}


# --------------------------------------------------------------------------------------------- Qwen3.5

def _qwen_forward(params, cfg, state, ids, logits_for: str = "all"):
    logits, state, _ = qwen35.forward(params, cfg, state, ids, logits_for=logits_for)
    return logits, state


def _qwen_verify(params, cfg, state, ids):
    return qwen35.forward(params, cfg, state, ids, collect="replay")


def _qwen_decode_forward(params, cfg, state, ids, n_valid, live_rows=None):
    logits, state, _ = qwen35.forward(params, cfg, state, ids, n_valid=n_valid, live_rows=live_rows)
    return logits, state


def _qwen_prefill_forward(params, cfg, state, ids, n_valid):
    logits, state, _ = qwen35.forward(params, cfg, state, ids, logits_for="last", prefill_lens=n_valid)
    return logits, state


QWEN35 = Family(name="qwen3_5", init_state=qwen35.init_state, forward=_qwen_forward, verify=_qwen_verify,
                commit=qwen35.commit, decode_forward=_qwen_decode_forward, state_dtype=lambda model: model.dtype,
                prefill_forward=_qwen_prefill_forward)


# ---------------------------------------------------------------------------------------------- looped

def _looped_commit(before, verified, extras, n_keep):
    """Keep the first n_keep verified tokens: every slot of them is already written; the rest lie past the
    length, masked, and later overwritten."""
    return verified.replace(length=before.length + n_keep)


def looped_family(num_steps: int, cache_mode: str = "full") -> LoopedFamily:
    """The looped family at recurrence depth `num_steps` (one object per setting, so one compile per setting)."""
    return _looped_family(int(num_steps), cache_mode)  # one cache key however the arguments are spelled


@functools.cache
def _looped_family(num_steps: int, cache_mode: str) -> LoopedFamily:
    def init_state(cfg, batch, max_len, dtype):
        return looped.init_cache(cfg, batch, max_len, num_steps, cache_mode, dtype)

    def forward(params, cfg, cache, ids, logits_for: str = "all"):
        logits, cache, _ = looped.forward(params, cfg, cache, ids, num_steps=num_steps, logits_for=logits_for)
        return logits, cache

    def verify(params, cfg, cache, ids):
        return looped.forward(params, cfg, cache, ids, num_steps=num_steps)

    def decode_forward(params, cfg, cache, ids, n_valid, live_rows=None):  # attention only: no hint to use
        return looped.decode_forward(params, cfg, cache, ids, n_valid, num_steps=num_steps)

    def prefill_forward(params, cfg, cache, ids, n_valid):
        logits, cache, _ = looped.forward(params, cfg, cache, ids, num_steps=num_steps, logits_for="last",
                                          prefill_lens=n_valid)
        return logits, cache

    return LoopedFamily(name="looped", init_state=init_state, forward=forward, verify=verify, commit=_looped_commit,
                        decode_forward=decode_forward, state_dtype=lambda model: model.params["wte"].dtype,
                        prefill_forward=prefill_forward, num_steps=num_steps, cache_mode=cache_mode)


def _looped_for(cfg, num_steps=None, cache_mode: str = "full") -> LoopedFamily:
    return looped_family(looped.check_steps(num_steps, cfg), looped.check_cache_mode(cache_mode))


_BUILDERS = {"qwen3_5": lambda cfg: QWEN35, "looped": _looped_for}


def family_for(cfg, **settings) -> Family:
    """The family of a model config; settings choose among its models (looped: num_steps, default the
    config's mean recurrence, and cache_mode), checked here (InputError)."""
    return _BUILDERS[cfg.family](cfg, **settings)
