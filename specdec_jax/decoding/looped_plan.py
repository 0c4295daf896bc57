"""The plan of looped self-speculation: the methods, their options and defaults, validated once into a
static (hashable) `LoopedSpecPlan` by `make_plan`. See `looped_spec` for what each method does.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import InputError
from ..options import float_option, int_option
from .decode_shape import exact_rows

LOOPED_SPEC_METHODS = ("self-spec", "mature-spec", "das-wave", "parallel-sampler")
READ_MODES = ("aligned", "deep")

METHOD_OPTIONS = {
    "self-spec": ("draft_steps", "gamma", "exact", "decode_rows"),
    "mature-spec": ("draft_steps", "gamma", "read_k", "read_v", "exact", "decode_rows"),
    "das-wave": ("gamma", "k", "read_k", "read_v", "carry", "window_init", "rounds", "exact", "decode_rows"),
    "parallel-sampler": ("gamma", "inner_steps", "epsilon", "ema", "exact"),
}
_DEFAULT_GAMMA = {"self-spec": 4, "mature-spec": 4, "das-wave": 16, "parallel-sampler": 16}


# ------------------------------------------------------------------------------------------ plan

@dataclasses.dataclass(frozen=True)
class LoopedSpecPlan:
    """Static (hashable) settings of one method; built and validated by `make_plan`."""

    method: str
    num_steps: int  # R: depth of the target (verifier, prefill, AR)
    gamma: int  # drafts per block (self/mature/das) or wavefront width (parallel-sampler)
    draft_steps: int = 0  # d (self-spec, mature-spec)
    read_k: str = "aligned"
    read_v: str = "aligned"
    k: int = 1  # recurrent updates per round (das-wave)
    carry: bool = True
    window_init: int = 2
    rounds: int = 0  # rounds per block (das-wave); 0 = "fill": until the window is full
    inner_steps: int = 4  # r' (parallel-sampler)
    epsilon: float = 0.03
    ema: float = 0.1
    decode_rows: int = 0  # > 0: the exact path (the verifier a decode_forward of this many rows)

    @property
    def window(self) -> int:
        """Width of the carried window state (0 for the sequential drafters)."""
        return self.gamma if self.method in ("das-wave", "parallel-sampler") else 0

    def core_steps_per_pass(self) -> int:
        """Core-block applications of one drafting pass (a draft token, a das-wave or sampler round)."""
        return {"das-wave": self.k, "parallel-sampler": self.inner_steps}.get(self.method, self.draft_steps)

    def core_applications_per_token(self, passes: int, verifications: int, tokens: int) -> float:
        """Core-block applications of `passes` drafting passes + `verifications` full-depth verifications
        (none for the sampler), per token they produced (prelude / coda / head not counted; AR: R)."""
        verify = 0 if self.method == "parallel-sampler" else verifications * self.num_steps
        return float((passes * self.core_steps_per_pass() + verify) / max(tokens, 1))

    def describe(self) -> dict:
        keys = ("num_steps", "gamma") + tuple(k for k in METHOD_OPTIONS[self.method] if k != "exact")
        out = {name: getattr(self, name) for name in dict.fromkeys(keys)}
        out["exact"] = bool(self.decode_rows)
        if out.get("rounds") == 0:
            out["rounds"] = "fill"
        return out


def _read_option(options: dict, name: str, default: str) -> str:
    value = options.get(name, default)
    if value not in READ_MODES:
        raise InputError(f"{name} must be one of {READ_MODES}; got {value!r}")
    return value


def make_plan(method: str, num_steps: int, **options) -> LoopedSpecPlan:
    """Validate a method and its options (InputError naming the problem) -> LoopedSpecPlan.

    Options (defaults): self-spec: draft_steps (max(1, R // 8)), gamma (4). mature-spec: also
    read_k, read_v ("deep", "deep"). das-wave: gamma (16), k (2), read_k/read_v ("deep"), carry
    (True), window_init (2), rounds (gamma - window_init + 1; a fixed count >= that, or "fill":
    each block runs until its window is full, gamma - max(window_init, carried) + 1 rounds).
    parallel-sampler: gamma (16, wavefront width), inner_steps (4), epsilon (0.03),
    ema (0.1). Every method but the sampler: exact (True: the verifier runs at the decode shape of
    exact AR, `looped.decode_forward`, so greedy output equals exact AR bit for bit in any dtype;
    False: the faster-to-write two-block verifier) and decode_rows (the exact path's row count;
    default max(17, gamma + 1)).
    """
    if method not in LOOPED_SPEC_METHODS:
        raise InputError(f"unknown looped speculative method {method!r}; supported: {', '.join(LOOPED_SPEC_METHODS)}")
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 1:
        raise InputError(f"num_steps (recurrence depth) must be an integer >= 1; got {num_steps!r}")
    R = int(num_steps)
    unknown = sorted(set(options) - set(METHOD_OPTIONS[method]))
    if unknown:
        raise InputError(f"method {method!r}: unknown options {unknown}; accepted: {list(METHOD_OPTIONS[method])}")
    gamma = int_option(options, "gamma", _DEFAULT_GAMMA[method], 1)
    rows = exact_rows(options, gamma, "looped", "the parallel sampler is not lossless: it commits what has "
                                                "converged, not what a verifier accepted"
                      if method == "parallel-sampler" else None)
    plan = _make_plan(method, R, gamma, options)
    return dataclasses.replace(plan, decode_rows=rows)


def _make_plan(method: str, R: int, gamma: int, options: dict) -> LoopedSpecPlan:
    if method in ("self-spec", "mature-spec"):
        d = int_option(options, "draft_steps", max(1, R // 8), 1, R, f" (the draft depth cannot exceed num_steps={R})")
        deep = "deep" if method == "mature-spec" else "aligned"
        return LoopedSpecPlan(method, R, gamma, draft_steps=d, read_k=_read_option(options, "read_k", deep),
                              read_v=_read_option(options, "read_v", deep))
    if method == "das-wave":
        k = int_option(options, "k", 2, 1)
        window_init = int_option(options, "window_init", min(2, gamma), 1, gamma, f" (at most gamma={gamma})")
        need = gamma - window_init + 1
        rounds = 0 if options.get("rounds") == "fill" else int_option(
            options, "rounds", need, need, None, f" (or 'fill'; gamma - window_init + 1 = {need}: the window must "
                                                 f"be full when verified)")
        carry = options.get("carry", True)
        if not isinstance(carry, (bool, np.bool_)):
            raise InputError(f"carry must be a bool; got {carry!r}")
        return LoopedSpecPlan(method, R, gamma, read_k=_read_option(options, "read_k", "deep"),
                              read_v=_read_option(options, "read_v", "deep"), k=k, carry=bool(carry),
                              window_init=window_init, rounds=rounds)
    inner = int_option(options, "inner_steps", 4, 1)
    eps = float_option(options, "epsilon", 0.03, 0.0)
    # 1 would freeze the first embedding
    ema = float_option(options, "ema", 0.1, 0.0, 1.0, " (0 = no smoothing)", hi_open=True)
    return LoopedSpecPlan(method, R, gamma, inner_steps=inner, epsilon=eps, ema=ema, read_k="deep", read_v="deep",
                          window_init=1)
