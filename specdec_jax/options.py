"""Typed option and input checks shared by the public calls: one InputError naming the option (or input), the
bound and the value."""

from __future__ import annotations

import math

import numpy as np

from .errors import InputError


def int_option(options: dict, name: str, default, lo: int, hi: int | None = None, why: str = "") -> int:
    """options[name] (or `default`) as an int in [lo, hi]; bools, floats and strings are refused."""
    value = options.get(name, default)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InputError(f"{name} must be an integer; got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise InputError(f"{name} must be {range_text(lo, hi)}{why}; got {value}")
    return int(value)


def range_text(lo, hi=None, lo_open: bool = False, hi_open: bool = False) -> str:
    """The one wording of a bound, shared by the API and the CLI: ">= 1", "in [0, 64]", "in (0, 1]"; hi None
    (or inf): no upper bound."""
    fmt = lambda x: f"{x:g}" if isinstance(x, float) else str(x)
    if hi is None or hi == math.inf:
        return f"{'>' if lo_open else '>='} {fmt(lo)}"
    return f"in {'(' if lo_open else '['}{fmt(lo)}, {fmt(hi)}{')' if hi_open else ']'}"


def bool_option(options: dict, name: str, default: bool) -> bool:
    """options[name] (or `default`) as a bool; ints, strings and None are refused."""
    value = options.get(name, default)
    if not isinstance(value, (bool, np.bool_)):
        raise InputError(f"{name} must be True or False; got {value!r}")
    return bool(value)


def check_context_length(needed: int, limit: int, what: str) -> None:
    """The positions a generation needs (`what` spells out the sum) must fit the model's context."""
    if needed > limit:
        raise InputError(f"{what} = {needed} exceeds the model's context length (max_position_embeddings={limit})")


def float_option(options: dict, name: str, default, lo: float, hi: float = math.inf, why: str = "", *,
                 lo_open: bool = False, hi_open: bool = False) -> float:
    """options[name] (or `default`) as a finite float between lo and hi (each bound closed unless `*_open`; hi
    inf: unbounded); NaN, infinities, bools and strings are refused."""
    value = options.get(name, default)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputError(f"{name} must be a number; got {value!r}")
    x = float(value)
    above = x > lo if lo_open else x >= lo
    below = x < hi if hi_open else x <= hi
    if not (math.isfinite(x) and above and below):  # NaN fails every comparison
        bound = range_text(float(lo), float(hi), lo_open, hi_open)
        raise InputError(f"{name} must be {'a finite number ' if hi == math.inf else ''}{bound}{why}; got {value}")
    return x


def validate_input_ids(input_ids, vocab_size: int) -> np.ndarray:
    """[B, T] int array with 0 <= id < vocab and T >= 1, else InputError naming the problem."""
    try:
        ids = np.asarray(input_ids)
    except Exception as e:  # ragged lists and the like
        raise InputError(f"input_ids must be an integer array [batch, tokens]; could not convert: {e}") from None
    if ids.ndim == 1:
        raise InputError(f"input_ids must be 2-D [batch, tokens]; got shape {ids.shape} (wrap a single prompt "
                         f"as [ids])")
    if ids.ndim != 2:
        raise InputError(f"input_ids must be 2-D [batch, tokens]; got shape {ids.shape}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise InputError(f"input_ids is empty (shape {ids.shape}): a prompt needs at least one token")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"input_ids must hold integers; got dtype {ids.dtype}")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        b, t = map(int, np.argwhere(bad)[0])
        raise InputError(f"input_ids[{b}, {t}] = {int(ids[b, t])} is outside the vocabulary [0, {vocab_size})")
    return ids.astype(np.int32)
