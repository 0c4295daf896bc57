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


def ar_samples(model, ids: np.ndarray, max_new_tokens: int, *, temperature: float, top_k: int = 0, seed: int = 1):
    """AR's sampled tokens [n, max_new_tokens] for the prompts ids [n, T], the reference the sampling tests compare
    with, drawn by the plain AR loop: one forward of the exact prompt and one decode row a step. The public
    `generate` draws from the same distribution but, for a batch of 20,000 rows, pads the prompt to a 16-token chunk
    and runs each step at the exact path's 8 rows: several times the CPU work (~10 s of a test's time)."""
    from specdec_jax.decoding.autoregressive import generate_ar
    from specdec_jax.decoding.sampling import SamplingConfig
    from specdec_jax.models.family import QWEN35
    return generate_ar(QWEN35, model, np.asarray(ids, np.int32), max_new_tokens,
                       max_len=ids.shape[1] + max_new_tokens, sampling=SamplingConfig(temperature, top_k),
                       seed=seed, eos_ids=()).tokens
