"""Statistical checks shared by the sampling tests (chain and tree speculation)."""

from __future__ import annotations

import jax
import numpy as np


def chi2_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample chi-square homogeneity test on count vectors a, b (equal totals)."""
    keep = (a + b) > 0
    stat = float(np.sum((a[keep] - b[keep]) ** 2 / (a[keep] + b[keep])))
    df = int(keep.sum()) - 1
    return float(jax.scipy.special.gammaincc(df / 2, stat / 2))


def assert_first_tokens_match(reference: np.ndarray, candidate: np.ndarray, vocab_size: int) -> None:
    """The joint distribution of the first 3 tokens [n, 3] of `candidate` matches `reference`
    (p > 1e-3), and a sampler that ignores the target fails the same test (so it can fail)."""
    V = vocab_size
    code = lambda t: t[:, 0] * V * V + t[:, 1] * V + t[:, 2]
    a = np.bincount(code(np.asarray(reference)), minlength=V ** 3)
    b = np.bincount(code(np.asarray(candidate)), minlength=V ** 3)
    assert chi2_pvalue(a, b) > 1e-3
    wrong = np.asarray(jax.random.randint(jax.random.PRNGKey(0), (len(reference), 3), 0, V))
    assert chi2_pvalue(a, np.bincount(code(wrong), minlength=V ** 3)) < 1e-6
