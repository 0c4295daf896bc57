"""The decode shape of an exact generation: every decode-time forward at one padded row count.

A GPU (or CPU) matrix product does not compute a row the same way at every row count: a 1-row AR step
and a (gamma + 1)-row verification run different GEMM algorithms, with different reduction orders, so
in bfloat16 their logits differ in the last bits and greedy outputs drift apart. On the exact path every
decode-time forward of a generation -- each AR step and each verification -- runs at the same row count
D >= gamma + 1 with a traced count of valid rows, so a token meets the same kernels, in the same order,
wherever it sits; the recurrent state advances by the valid rows only (step recurrence with a count).
In the memory-bound regime the padding costs little: the weights are read once either way (docs/exactness.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InputError

# Row count: max(default, gamma + 1). A generation is bit-identical to AR run at the same row count (its
# stats say which: `decode_rows`). Padding rows are not free at the 9B shape (H200, XLA GEMMs at 9-32 rows:
# a 32-row verification took 8.3 ms against 6.0 ms at 17 rows), so rows are not rounded up. Qwen3.5: 8 rows cover
# gamma <= 7 (the default 4, MTP's 3-4), and an AR step at 8 rows took 0.938x the time of a 1-row step, 9 rows 0.950x
# (with the GDN recurrence on the valid row only; docs/LOG.md, 2026-12-01 and 2026-12-02).
# Looped models: 17 rows, so das-wave's and the sampler's default gamma of 16 share AR's shape. Its price at the
# Huginn-0125 shape: AR at 17 rows took 38.24-38.75 ms per token (benchmarks/results/looped_cost_curve_huginn0125.md)
# against 29.3 and 31.3 ms at one row in other runs: about 1.24-1.32x, not yet paired in one run; the exact path's
# largest measured cost.
DEFAULT_DECODE_ROWS = {"qwen3_5": 8, "looped": 17}
MAX_DECODE_ROWS = 64  # the step recurrence's longest run (qwen35.MAX_RECURRENT_VERIFY)


def choose_decode_rows(gamma: int, requested, family: str) -> int:
    """The row count of an exact generation drafting `gamma` tokens (`requested`: the user's
    `decode_rows`, or None for the default); InputError when it cannot hold anchor + drafts."""
    need = gamma + 1
    if requested is None:
        rows = max(DEFAULT_DECODE_ROWS[family], need)
    else:
        if isinstance(requested, bool) or not isinstance(requested, int):
            raise InputError(f"decode_rows must be an integer; got {requested!r}")
        rows = requested
    if not need <= rows <= MAX_DECODE_ROWS:
        raise InputError(f"decode_rows={rows} must lie in [gamma + 1 = {need}, {MAX_DECODE_ROWS}] (the exact path "
                         f"verifies anchor + gamma drafts in one forward of decode_rows rows)")
    return rows


def pad_rows(ids: jax.Array, rows: int) -> jax.Array:
    """ids [B, G] -> [B, rows]: the last id repeated (padding rows are computed and never read)."""
    extra = rows - ids.shape[1]
    if extra < 0:
        raise ValueError(f"pad_rows: {ids.shape[1]} ids do not fit in {rows} rows")
    return jnp.concatenate([ids, jnp.repeat(ids[:, -1:], extra, axis=1)], axis=1) if extra else ids


def exact_rows(options: dict, gamma: int, family: str, why_not: str | None) -> int:
    """The exact path's decode row count from options "exact" (default: True where possible) and
    "decode_rows", or 0 (not exact). why_not: None when these settings can be exact, else the reason.
    A gamma too long for the exact path is an InputError unless exact=False is explicit."""
    exact = options.get("exact")
    if exact is not None and not isinstance(exact, (bool, np.bool_)):
        raise InputError(f"exact must be True or False; got {exact!r}")
    if exact and why_not:
        raise InputError(f"exact=True is not available: {why_not}")
    if exact is None:
        exact = why_not is None
    if exact and gamma + 1 > MAX_DECODE_ROWS:  # refused, never silently inexact: exactness is the default's promise
        how = " (rollback='pseudo')" if family == "qwen3_5" else ""
        raise InputError(f"gamma={gamma} needs gamma + 1 <= {MAX_DECODE_ROWS} rows for the exact path; pass "
                         f"exact=False to run it inexactly{how}")
    if not exact:
        if options.get("decode_rows") is not None:
            raise InputError("decode_rows sets the exact path's row count; it needs exact=True")
        return 0
    return choose_decode_rows(gamma, options.get("decode_rows"), family)
