"""The training loop: AdamW after global-norm clipping, warmup + cosine schedule (over steps or wall
time), the jitted train step with donated parameters and optimizer state, and `run_training`, which
trains, evaluates on the held-out split and writes the checkpoint folder.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .checkpoint import MAX_CHECKPOINT_BYTES, folder_bytes, save_checkpoint, write_readme
from .data import eval_windows, evaluate_huginn, evaluate_qwen35, sample_windows
from .recipe import (ARCHS, TrainOptions, count_params, huginn_config, huginn_config_dict, huginn_loss,
                     init_huginn_params, init_qwen35_params, params_from_checkpoint, qwen35_config,
                     qwen35_config_json, qwen35_loss, sample_recurrence)


# ---------------------------------------------------------------------------------------- optimizer

def make_optimizer(weight_decay: float, grad_clip: float) -> optax.GradientTransformation:
    """Clip, then AdamW at unit learning rate (the step multiplies by the scheduled rate, so the rate
    can follow wall time without recompiling); decay on matrices only (not norms, biases, gates)."""
    mask = lambda params: jax.tree.map(lambda x: x.ndim == 2, params)
    return optax.chain(optax.clip_by_global_norm(grad_clip),
                       optax.adamw(1.0, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay, mask=mask))


def learning_rate(step: int, progress: float, o: TrainOptions) -> float:
    """Linear warmup over warmup_steps, times cosine from lr to lr * min_lr_ratio over progress in [0, 1]."""
    warm = min(1.0, (step + 1) / max(o.warmup_steps, 1))
    progress = min(max(progress, 0.0), 1.0)
    cosine = o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return o.lr * warm * cosine


def _global_norm(tree) -> jax.Array:
    norm = getattr(getattr(optax, "tree", None), "norm", None)  # optax >= 0.2.5; older: global_norm
    return norm(tree) if norm is not None else optax.global_norm(tree)


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation):
    """jit(step)(params, opt_state, tokens, lr, *loss_args) -> (params, opt_state, metrics); params and
    optimizer state donated."""
    def step(params, opt_state, tokens, lr, *loss_args):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, *loss_args)
        updates, opt_state = tx.update(grads, opt_state, params)
        updates = jax.tree.map(lambda u: (u * lr).astype(u.dtype), updates)
        params = optax.apply_updates(params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=_global_norm(grads))
        return params, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


# ------------------------------------------------------------------------------------------- driver

def _device_name() -> str:
    d = jax.devices()[0]
    return f"{getattr(d, 'device_kind', d.platform)} x{jax.device_count()} ({d.platform})"


def _earlier_run(folder: Path) -> dict:
    """The options and summary of the run that wrote `folder` (and what it continued from), if it logged them."""
    try:
        earlier = json.loads((folder / "train_log.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: earlier[k] for k in ("options", "summary", "init_from") if k in earlier}


def run_training(o: TrainOptions, train_ids: np.ndarray, heldout_ids: np.ndarray, *,
                 tokenizer_dir: str | os.PathLike | None = None, vocab_size: int | None = None,
                 data_description: str = "", eos_token_id: int = 0, extra_files=()) -> dict:
    """Train, evaluate on the held-out split, write the checkpoint folder `o.out` (with `extra_files`
    copied in); returns the summary."""
    if o.arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}; got {o.arch!r}")
    t_start = time.perf_counter()
    log = (lambda *a: None) if o.quiet else (lambda *a: print(*a, flush=True))
    vocab = int(vocab_size if vocab_size is not None else int(train_ids.max()) + 1)
    compute_dtype = jnp.dtype(o.compute_dtype)
    key = jax.random.PRNGKey(o.seed)
    data_rng = np.random.default_rng(o.seed)
    rec_rng = np.random.default_rng(o.seed + 1)
    init_key = jax.random.PRNGKey(o.seed + 2)  # huginn: random initial states (init_state_scale > 0)
    if o.arch == "qwen35":
        cfg = qwen35_config(vocab, o, eos_token_id)
        params = init_qwen35_params(cfg, key)
        width = o.seq_len + 2
        def loss_fn(params, tokens):
            return qwen35_loss(params, cfg, tokens, mtp_weight=o.mtp_weight, compute_dtype=compute_dtype,
                               mtp_distill=o.mtp_distill)
        config_json = qwen35_config_json(cfg)
        sizes = {k: config_json[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "intermediate_size",
                                               "linear_num_key_heads", "linear_num_value_heads",
                                               "linear_key_head_dim", "vocab_size", "mtp_num_hidden_layers")}
    else:
        cfg = huginn_config(vocab, o)
        params = init_huginn_params(cfg, key)
        width = o.seq_len + 1
        def loss_fn(params, tokens, n_no_grad, n_grad, init_key):
            return huginn_loss(params, cfg, tokens, n_no_grad, n_grad, init_key, backprop_depth=o.backprop_depth,
                               compute_dtype=compute_dtype, init_state_scale=o.init_state_scale,
                               remat_recurrence=o.remat_recurrence)
        config_json = huginn_config_dict(vocab, o, eos_token_id)
        sizes = {k: config_json[k] for k in ("n_embd", "n_heads", "n_layers_in_prelude",
                                               "n_layers_in_recurrent_block", "n_layers_in_coda",
                                               "intermediate_size", "vocab_size", "mean_recurrence",
                                               "mean_backprop_depth")}
    if o.init_from:  # continue from a checkpoint: its weights replace the fresh init (same names and shapes)
        params = params_from_checkpoint(o.init_from, o.arch, cfg, params)
        earlier_run = {"path": o.init_from, **_earlier_run(Path(o.init_from))}  # read now: `out` may be that folder
    n_params = count_params(params)
    tx = make_optimizer(o.weight_decay, o.grad_clip)
    opt_state = tx.init(params)
    train_step = make_train_step(loss_fn, tx)
    windows = eval_windows(heldout_ids, width, o.eval_max_tokens)
    if train_ids.shape[0] < width + 1:
        raise ValueError(f"train split has {train_ids.shape[0]} tokens: fewer than one window of {width}")
    log(f"{o.arch}: {n_params:,} parameters, vocab {vocab}, device {_device_name()}, "
        f"train {train_ids.shape[0]:,} tokens, held-out {windows.shape[0]} x {width}")

    def evaluate(params, depths=None):
        if o.arch == "qwen35":
            return evaluate_qwen35(params, cfg, windows, o.batch, o)
        return evaluate_huginn(params, cfg, windows, o.batch, o, depths or (o.mean_recurrence,))

    history, evals, recurrences = [], [], []
    window_losses: list[float] = []
    pending = None
    compile_s = 0.0
    t_loop = None  # set after the first (compiling) step
    eval_s = 0.0  # periodic evaluations: off the training clock

    def train_clock() -> float:
        return 0.0 if t_loop is None else time.perf_counter() - t_loop - eval_s

    step = 0
    tokens_per_step = o.batch * o.seq_len
    bar = None
    if not o.quiet and sys.stderr.isatty():
        try:
            from tqdm import tqdm
            bar = tqdm(total=o.steps, desc=f"train {o.arch}", unit="step", dynamic_ncols=True)
        except ImportError:
            bar = None
    stop_reason = "steps"
    best_ce, best_step, best_params = math.inf, None, None
    while step < o.steps:
        elapsed = train_clock()
        if t_loop is not None and elapsed >= o.time_budget_s:
            stop_reason = "time budget"
            break
        progress = step / o.steps
        if o.schedule == "time" and o.time_budget_s > 0:
            progress = max(progress, elapsed / o.time_budget_s)
        lr = learning_rate(step, progress, o)
        tokens = jnp.asarray(sample_windows(data_rng, train_ids, o.batch, width))
        extra = ()
        if o.arch == "huginn":
            n, k = sample_recurrence(rec_rng, o.mean_recurrence, o.backprop_depth, o.min_recurrence)
            recurrences.append(n + k)
            extra = (jnp.int32(n), jnp.int32(k), jax.random.fold_in(init_key, step))
        t0 = time.perf_counter()
        params, opt_state, metrics = train_step(params, opt_state, tokens, jnp.float32(lr), *extra)
        if t_loop is None:
            jax.block_until_ready(metrics)
            compile_s = time.perf_counter() - t0
            t_loop = time.perf_counter()
        if pending is not None:  # one step in flight: host timing stays honest, the device stays busy
            prev_step, prev_lr, prev = pending
            m = {k: float(v) for k, v in jax.device_get(prev).items()}
            window_losses.append(m["loss"])
            if prev_step % o.log_every == 0 or prev_step == 1:
                t = train_clock()
                row = dict(step=prev_step, lr=prev_lr, seconds=round(t, 2), **{k: round(v, 5) for k, v in m.items()})
                history.append(row)
                rate = (prev_step - 1) * tokens_per_step / t if t > 0 and prev_step > 1 else 0.0
                msg = (f"step {prev_step:6d}  loss {m['loss']:.4f}  ce {m['ce']:.4f}"
                       + (f"  mtp {m['mtp_ce']:.4f}" if "mtp_ce" in m else "")
                       + f"  gnorm {m['grad_norm']:.2f}  lr {prev_lr:.2e}  {rate:,.0f} tok/s  {t:.0f}s")
                if bar is not None:
                    bar.set_postfix_str(f"loss {m['loss']:.3f} {rate:,.0f} tok/s")
                    bar.write(msg)
                else:
                    log(msg)
        pending = (step + 1, lr, metrics)
        step += 1
        if bar is not None:
            bar.update(1)
        if o.eval_every and step % o.eval_every == 0 and step < o.steps:
            jax.block_until_ready(params)
            t_eval = time.perf_counter()
            ev = evaluate(params, (o.mean_recurrence, *o.periodic_eval_depths) if o.arch == "huginn" else None)
            evals.append(dict(step=step, **{k: v for k, v in ev.items() if k != "per_depth"},
                              **({"ce_per_depth": {r: m["ce"] for r, m in ev["per_depth"].items()}}
                                 if o.arch == "huginn" and o.periodic_eval_depths else {})))
            if o.keep_best and ev["ce"] < best_ce:
                # A copy: the next step donates `params`.
                best_ce, best_step, best_params = ev["ce"], step, jax.tree.map(jnp.copy, params)
            eval_s += time.perf_counter() - t_eval
            log(f"eval step {step}: held-out loss {ev['ce']:.4f} ppl {ev['ppl']:.2f} acc {ev['acc']:.3f}"
                + (f"  mtp loss {ev['mtp_ce']:.4f} acc {ev['mtp_acc']:.3f} agree {ev['mtp_agree']:.3f}"
                   if "mtp_ce" in ev else "")
                + "".join(f"  r={r} {v:.4f}" for r, v in evals[-1].get("ce_per_depth", {}).items()))
    if pending is not None:
        m = {k: float(v) for k, v in jax.device_get(pending[2]).items()}
        window_losses.append(m["loss"])
        history.append(dict(step=pending[0], lr=pending[1], seconds=round(train_clock(), 2),
                            **{k: round(v, 5) for k, v in m.items()}))
    if bar is not None:
        bar.close()
    train_s = train_clock()
    log(f"stopped after {step} steps ({stop_reason}); {train_s:.1f} s training + {compile_s:.1f} s compile "
        f"+ {eval_s:.1f} s periodic evaluation")

    final = evaluate(params, o.eval_depths if o.arch == "huginn" else None)
    selected_step = step
    if best_params is not None and best_ce < final["ce"]:
        log(f"keep-best: the step-{best_step} parameters (held-out loss {best_ce:.4f}) beat the final ones "
            f"({final['ce']:.4f}); saving those")
        params, selected_step = best_params, best_step
        final = evaluate(params, o.eval_depths if o.arch == "huginn" else None)
    evals.append(dict(step=step, final=True, **{k: v for k, v in final.items() if k != "per_depth"}))
    final["windows"] = int(windows.shape[0])
    if o.arch == "qwen35":
        log(f"held-out: loss {final['ce']:.4f} ppl {final['ppl']:.2f} acc {final['acc']:.3f}  "
            f"mtp loss {final['mtp_ce']:.4f} acc {final['mtp_acc']:.3f} agree {final['mtp_agree']:.3f}")
    else:
        for r, m in final["per_depth"].items():
            log(f"held-out r={r:3d}: loss {m['ce']:.4f} ppl {m['ppl']:.2f} acc {m['acc']:.3f}")

    out = Path(o.out)
    save_checkpoint(out, o.arch, params, cfg, config_json, tokenizer_dir, extra_files)
    final_window = min(len(window_losses), max(o.log_every, 1))
    summary = {
        "arch": o.arch, "vocab_size": vocab, "num_params": n_params, "model_sizes": sizes,
        "steps": step, "stop_reason": stop_reason, "selected_step": selected_step, "tokens_seen": step * tokens_per_step,
        "epochs": step * tokens_per_step / train_ids.shape[0],
        "train_seconds": train_s, "compile_seconds": compile_s, "periodic_eval_seconds": eval_s,
        "tokens_per_second": (step - 1) * tokens_per_step / train_s if train_s > 0 and step > 1 else 0.0,
        "final_train_loss": float(np.mean(window_losses[-final_window:])) if window_losses else float("nan"),
        "final_window": final_window, "eval": final,
        "device": _device_name(), "jax_version": jax.__version__,
        "data": {"description": data_description or "token arrays", "train_tokens": int(train_ids.shape[0]),
                 "heldout_tokens": int(heldout_ids.shape[0])},
    }
    if recurrences:
        summary["mean_sampled_recurrence"] = float(np.mean(recurrences))
    summary["weights_bytes"] = (out / "model.safetensors").stat().st_size
    summary["total_seconds"] = time.perf_counter() - t_start
    write_readme(out, o, summary)
    options = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(o).items()}
    log_json = {"options": options, "config": config_json, "summary": summary, "history": history, "evals": evals}
    if o.init_from:  # provenance survives the source folder being overwritten by this run's output
        log_json["init_from"] = earlier_run
    (out / "train_log.json").write_text(json.dumps(log_json, indent=1) + "\n")
    summary["checkpoint_bytes"] = folder_bytes(out)
    if summary["checkpoint_bytes"] > MAX_CHECKPOINT_BYTES:
        log(f"WARNING: {out} is {summary['checkpoint_bytes'] / 2**20:.2f} MiB (> 20 MiB)")
    log(f"wrote {out} ({summary['checkpoint_bytes'] / 2**20:.2f} MiB) in {summary['total_seconds']:.1f} s total")
    return summary
