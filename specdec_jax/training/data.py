"""Token windows and held-out evaluation: training batches sampled at random offsets of the flat
token array, non-overlapping held-out windows, and the mean held-out metrics over them (Qwen3.5:
next token and MTP head; Huginn: every requested recurrence depth in one pass).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..models.looped import model as looped
from .recipe import TrainOptions, cast, ce_rows, mtp_chain_outputs, qwen35_outputs


def sample_windows(rng: np.random.Generator, data: np.ndarray, batch: int, width: int) -> np.ndarray:
    """[batch, width] int32 windows at uniform random offsets of the flat token array."""
    starts = rng.integers(0, data.shape[0] - width + 1, size=batch)
    return data[starts[:, None] + np.arange(width)[None, :]].astype(np.int32)


def eval_windows(data: np.ndarray, width: int, max_tokens: int = 0) -> np.ndarray:
    """Non-overlapping [N, width] int32 windows covering the held-out split; capped at max_tokens, the
    kept windows are spread evenly over the split (it is ordered by package: a prefix would not be a
    fair sample)."""
    total = data.shape[0] // width
    if total == 0:
        raise ValueError(f"held-out split has {data.shape[0]} tokens: fewer than one window of {width}")
    windows = data[: total * width].reshape(total, width)
    if max_tokens and max_tokens // width < total:
        keep = max(1, max_tokens // width)
        windows = windows[np.linspace(0, total - 1, keep).round().astype(np.int64)]
    return windows.astype(np.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "compute_dtype"))
def _qwen35_eval_batch(params, tokens, *, cfg, compute_dtype):
    return qwen35_outputs(params, cfg, tokens, compute_dtype=compute_dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "depths", "compute_dtype"))
def _huginn_eval_batch(params, tokens, *, cfg, depths, compute_dtype):
    """Per-row metrics at every depth in one pass: the state after d recurrences goes through the coda
    (looped.forward's exit_depths), which equals a forward with num_steps = d."""
    p = cast(params, compute_dtype)
    _, _, extras = looped.forward(p, cfg, None, tokens[:, :-1], num_steps=max(depths), exit_depths=depths)
    out = {}
    for d in depths:
        out[f"ce@{d}"], out[f"acc@{d}"] = ce_rows(extras["exit_logits"][d], tokens[:, 1:])
    return out


def _mean_metrics(fn, windows: np.ndarray, batch: int) -> dict[str, float]:
    """Mean of per-row metrics over all windows; the last batch is padded so one compile serves all."""
    sums: dict[str, float] = {}
    for i in range(0, windows.shape[0], batch):
        chunk = windows[i:i + batch]
        valid = chunk.shape[0]
        if valid < batch:
            chunk = np.concatenate([chunk, np.zeros((batch - valid,) + chunk.shape[1:], chunk.dtype)])
        for k, v in jax.device_get(fn(jnp.asarray(chunk))).items():
            sums[k] = sums.get(k, 0.0) + float(np.sum(np.asarray(v, np.float64)[:valid]))
    return {k: v / windows.shape[0] for k, v in sums.items()}


def evaluate_qwen35(params, cfg, windows, batch, o: TrainOptions) -> dict[str, float]:
    """Held-out ce, acc, ppl (next token) and mtp_ce, mtp_acc (MTP head), means over all windows."""
    m = _mean_metrics(functools.partial(_qwen35_eval_batch, params, cfg=cfg,
                                        compute_dtype=jnp.dtype(o.compute_dtype)), windows, batch)
    m["ppl"] = math.exp(m["ce"])
    return m


@functools.partial(jax.jit, static_argnames=("cfg", "depth", "compute_dtype"))
def _mtp_chain_eval_batch(params, tokens, *, cfg, depth, compute_dtype):
    return mtp_chain_outputs(params, cfg, tokens, depth=depth, compute_dtype=compute_dtype)


def evaluate_mtp_chain(params, cfg, windows, batch, depth: int, compute_dtype) -> dict[str, float]:
    """Held-out means of `mtp_chain_outputs` (windows [N, T + depth + 1]): per depth agreement, accuracy and
    cross-entropies, and mtp_accepted."""
    return _mean_metrics(functools.partial(_mtp_chain_eval_batch, params, cfg=cfg, depth=depth,
                                           compute_dtype=jnp.dtype(compute_dtype)), windows, batch)


def evaluate_huginn(params, cfg, windows, batch, o: TrainOptions, depths) -> dict[str, Any]:
    """{"per_depth": {r: {ce, acc, ppl}}, plus ce/acc/ppl at the mean recurrence (else the deepest r)}."""
    depths = tuple(sorted({int(r) for r in depths}))
    m = _mean_metrics(functools.partial(_huginn_eval_batch, params, cfg=cfg, depths=depths,
                                        compute_dtype=jnp.dtype(o.compute_dtype)), windows, batch)
    per_depth = {r: {"ce": m[f"ce@{r}"], "acc": m[f"acc@{r}"], "ppl": math.exp(m[f"ce@{r}"])} for r in depths}
    main = per_depth.get(o.mean_recurrence) or per_depth[depths[-1]]
    return {"per_depth": per_depth, **main}
