"""Training of the tiny shipped checkpoints (Qwen3.5 hybrid + MTP head, Huginn looped model).

One jitted train step (parameters and optimizer state donated), fp32 master weights cast to the
compute dtype (bf16) inside the loss, optax AdamW (decoupled weight decay on matrices only) after
global-norm clipping, linear warmup then cosine decay, data windows sampled on the host with a
seeded numpy generator. `scripts/train_tiny.py` is the command line around `run_training`.

Qwen3.5: loss = CE(next token) + mtp_weight * CE(token after next, from the MTP head fed with the
target's final-normed hidden state and the true next token); the MTP loss also trains the trunk.

Huginn (the recipe of Geiping et al. 2025): each step draws a recurrence count
p = Poisson(LogNormal(log(mean) - sigma^2/2, sigma = 0.5)) + 1, runs max(p - s, 0) recurrences
without gradient and the last min(p, s) with it (s = backprop depth; truncated backprop), from a
zero initial state.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from .config import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35Config
from .loading import build_tree, save_safetensors
from .models import looped, mtp, qwen35

ARCHS = ("qwen35", "huginn")
DEFAULT_OUT = {"qwen35": "checkpoints/tiny-qwen35-code", "huginn": "checkpoints/tiny-huginn-code"}
MAX_CHECKPOINT_BYTES = 20 * 1024 * 1024


@dataclasses.dataclass
class TrainOptions:
    """Everything a run depends on (recorded in train_log.json)."""

    arch: str = "qwen35"
    out: str = "checkpoints/tiny-qwen35-code"
    steps: int = 4000
    batch: int = 64
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    schedule: str = "time"  # "time": cosine progress = max(step fraction, time fraction); "steps"
    time_budget_s: float = 480.0  # training-loop seconds, compilation excluded
    log_every: int = 50
    eval_every: int = 500
    eval_max_tokens: int = 0  # 0 = the whole held-out split
    keep_best: bool = False  # save the parameters of the best periodic held-out evaluation (early stopping)
    seed: int = 0
    compute_dtype: str = "bfloat16"
    # model sizes (shared)
    hidden: int = 256
    heads: int = 4
    intermediate: int = 768
    # qwen35
    layers: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    linear_key_heads: int = 4
    linear_value_heads: int = 8
    linear_head_dim: int = 32
    rope_theta: float = 10_000.0
    mtp_weight: float = 0.3
    # huginn
    prelude: int = 2
    core: int = 2
    coda: int = 2
    mean_recurrence: int = 16
    backprop_depth: int = 4
    eval_depths: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    command: str = ""
    quiet: bool = False


# ------------------------------------------------------------------------------------------ configs

def qwen35_config(vocab_size: int, o: TrainOptions, eos_token_id: int = 0) -> Qwen35Config:
    """Qwen3.5 text config: GDN and full attention 3:1 (layer i is full iff (i + 1) % 4 == 0), tied head."""
    layer_types = tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(o.layers))
    return Qwen35Config(
        vocab_size=vocab_size, hidden_size=o.hidden, num_hidden_layers=o.layers, num_attention_heads=o.heads,
        num_key_value_heads=o.kv_heads, head_dim=o.head_dim, intermediate_size=o.intermediate,
        layer_types=layer_types, linear_num_key_heads=o.linear_key_heads,
        linear_num_value_heads=o.linear_value_heads, linear_key_head_dim=o.linear_head_dim,
        linear_value_head_dim=o.linear_head_dim, rope_theta=o.rope_theta, tie_word_embeddings=True,
        mtp_num_hidden_layers=1, eos_token_id=(eos_token_id,), model_type="qwen3_5_text")


def qwen35_config_json(cfg: Qwen35Config) -> dict:
    d = cfg.to_hf_dict()
    d.update(mtp_num_hidden_layers=cfg.mtp_num_hidden_layers, bos_token_id=d.get("eos_token_id"), pad_token_id=1,
             dtype="bfloat16")
    return d


def huginn_config_dict(vocab_size: int, o: TrainOptions, eos_token_id: int = 0) -> dict:
    """Official `RavenConfig`-style config.json (the fields of tests/fixtures/looped/huginn_tiny)."""
    D = o.hidden
    depth = o.prelude + o.core * o.mean_recurrence + o.coda
    std = math.sqrt(2 / (5 * D))
    return {
        "n_embd": D, "n_heads": o.heads, "n_layers": o.prelude + o.core + o.coda,
        "block_size": max(4096, o.seq_len),
        "vocab_size": vocab_size, "padded_vocab_size": vocab_size, "padding_multiple": 64,
        "tie_embeddings": True, "intermediate_size": o.intermediate, "bias": False,
        "architecture_class_name": "RecurrentGPT", "block_class_name": "SandwichBlock",
        "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-6, "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU",
        "init_strategy": "takase", "init_orthogonal": False, "state_init": "zero", "injection_type": "linear",
        "n_layers_in_recurrent_block": o.core, "mean_recurrence": o.mean_recurrence,
        "sampling_scheme": "poisson-lognormal-filling", "mean_backprop_depth": o.backprop_depth,
        "n_layers_in_prelude": o.prelude, "n_layers_in_coda": o.coda, "qk_bias": True,
        "activation_checkpoint_impl": "per-iteration", "rope_base": 50000, "test_time_noise": 0,
        "test_time_noise_type": "fixed", "num_key_value_heads": o.heads, "head_dim": D // o.heads,
        "effective_expected_depth": depth,
        "init_values": {"std": std, "out_proj": std / math.sqrt(2 * depth), "embedding": std,
                        "embed_scale": math.sqrt(D)},
        "tie_word_embeddings": True, "architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
        "bos_token_id": eos_token_id, "eos_token_id": eos_token_id, "pad_token_id": 1, "torch_dtype": "bfloat16",
    }


def huginn_config(vocab_size: int, o: TrainOptions) -> looped.LoopedConfig:
    cfg = looped.looped_config_from_dict(huginn_config_dict(vocab_size, o), "huginn_config_dict")
    return dataclasses.replace(cfg, variant="huginn")


# ------------------------------------------------------------------------------------------- params

def init_qwen35_params(cfg: Qwen35Config, key: jax.Array, mtp_layers: int = 1, std: float = 0.02) -> dict:
    """fp32 parameters (GPT-style init): matrices ~ N(0, std), output projections std / sqrt(2 L),
    zero-centred norms 0, GDN gated norm 1, A_log = log U(1, 16), dt_bias = 1 (transformers' init),
    depthwise conv ~ U(+-1/sqrt(kernel))."""
    if cfg.is_moe:
        raise ValueError("init_qwen35_params: dense configs only")
    specs = qwen35.param_specs(cfg, {"model.embed_tokens.weight"}, "init_qwen35_params")
    out_std = std / math.sqrt(2 * cfg.num_hidden_layers)
    keys = dict(zip(specs, jax.random.split(key, len(specs) + 1)))

    def init(path):
        shape = mtp.leaf_shape(specs[path])
        name, k = path[-1], keys[path]
        if name == "A_log":
            return jnp.log(jax.random.uniform(k, shape, jnp.float32, 1.0, 16.0))
        if name == "dt_bias":
            return jnp.ones(shape, jnp.float32)
        if name == "conv":
            bound = 1.0 / math.sqrt(shape[-1])
            return jax.random.uniform(k, shape, jnp.float32, -bound, bound)
        if len(shape) == 1:  # the GDN output norm multiplies by w; every other norm by (1 + w)
            gated = len(path) > 2 and path[-2] == "mixer" and cfg.layer_types[path[1]] == LINEAR_ATTENTION
            return jnp.ones(shape, jnp.float32) if gated else jnp.zeros(shape, jnp.float32)
        s = out_std if name in ("o_proj", "out_proj", "down_proj") else std
        return jax.random.normal(k, shape, jnp.float32) * s

    params = build_tree({path: path for path in specs}, init)
    if mtp_layers:
        params["mtp"] = mtp.init_mtp_params(cfg, jax.random.fold_in(key, 1), jnp.float32, num_layers=mtp_layers,
                                            std=std)
    return params


def init_huginn_params(cfg: looped.LoopedConfig, key: jax.Array) -> dict:
    """fp32 parameters with the official "takase" init: std sqrt(2 / 5D) for matrices and the embedding,
    output projections std / sqrt(2 * effective depth), norms 1, qk_bias 0."""
    shapes = looped.expected_shapes(cfg)
    std = math.sqrt(2 / (5 * cfg.n_embd))
    depth = cfg.n_layers_in_prelude + cfg.n_layers_in_recurrent_block * cfg.mean_recurrence + cfg.n_layers_in_coda
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))

    def init(k):
        shape = shapes[k]
        if k.endswith("qk_bias"):
            return jnp.zeros(shape, jnp.float32)
        if len(shape) == 1:
            return jnp.ones(shape, jnp.float32)
        s = std / math.sqrt(2 * depth) if k.endswith(("attn.proj.weight", "mlp.proj.weight")) else std
        return jax.random.normal(keys[k], shape, jnp.float32) * s

    return build_tree({looped.param_path(k): k for k in shapes}, init)


def count_params(params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


def cast(params, dtype):
    return jax.tree.map(lambda x: x.astype(dtype), params)


# ------------------------------------------------------------------------------------------- losses

def _ce_rows(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row mean cross-entropy and top-1 accuracy [B]; logits [B, T, V] float32, labels [B, T]."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    acc = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return jnp.mean(ce, axis=-1), jnp.mean(acc, axis=-1)


def qwen35_outputs(params: dict, cfg: Qwen35Config, tokens: jax.Array, *, compute_dtype) -> dict[str, jax.Array]:
    """tokens [B, T + 2] -> per-row metrics [B]: ce, acc (next token) and, with an MTP head, mtp_ce, mtp_acc
    (token after next, from the target's hidden state and the true next token). GDN runs the
    differentiable chunked jnp reference."""
    p = cast(params, compute_dtype)
    B, W = tokens.shape
    T = W - 2
    state = qwen35.init_state(cfg, B, T, compute_dtype)
    logits, _, extras = qwen35.forward(p, cfg, state, tokens[:, :T], impl="reference", collect=True)
    ce, acc = _ce_rows(logits, tokens[:, 1:T + 1])
    out = {"ce": ce, "acc": acc}
    if "mtp" in params:
        mtp_logits, _ = mtp.mtp_forward_train(p, cfg, extras["hidden"], tokens[:, 1:T + 1])
        out["mtp_ce"], out["mtp_acc"] = _ce_rows(mtp_logits, tokens[:, 2:T + 2])
    return out


def qwen35_loss(params: dict, cfg: Qwen35Config, tokens: jax.Array, *, mtp_weight: float, compute_dtype):
    """tokens [B, T + 2] -> (CE + mtp_weight * MTP CE, mean metrics)."""
    metrics = {k: jnp.mean(v) for k, v in qwen35_outputs(params, cfg, tokens, compute_dtype=compute_dtype).items()}
    loss = metrics["ce"] + mtp_weight * metrics["mtp_ce"] if "mtp_ce" in metrics else metrics["ce"]
    return loss, metrics


def huginn_loss(params: dict, cfg: looped.LoopedConfig, tokens: jax.Array, n_no_grad: jax.Array,
                n_grad: jax.Array, *, backprop_depth: int, compute_dtype):
    """tokens [B, T + 1]; n_no_grad, n_grad: int32 scalars (traced: one compile for every draw).

    The no-grad recurrences run in a while loop on stop-gradient inputs; the last `n_grad`
    (<= backprop_depth) run in a scan of backprop_depth steps whose first
    backprop_depth - n_grad are skipped (identity), so shapes never change.
    """
    p = cast(params, compute_dtype)
    B, W = tokens.shape
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    T = W - 1
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    cos, sin = looped.rope_tables(cfg, positions)
    length = jnp.zeros((B,), jnp.int32)
    e = looped.embed(p, cfg, ids)
    e, _, _ = looped.run_blocks(p.get("prelude", []), cfg, e, cos, sin, None, None, length)
    x = jnp.zeros_like(e)  # zero initial state
    p_sg, e_sg = lax.stop_gradient(p), lax.stop_gradient(e)

    def no_grad_step(i, x):
        return looped.core_step(p_sg, cfg, None, x, e_sg, i, cos, sin)[0]

    x = lax.stop_gradient(lax.fori_loop(0, n_no_grad, no_grad_step, x))
    skip = backprop_depth - n_grad

    def grad_step(x, j):
        y = looped.core_step(p, cfg, None, x, e, n_no_grad + j - skip, cos, sin)[0]
        return jnp.where(j >= skip, y, x), None

    x, _ = lax.scan(grad_step, x, jnp.arange(backprop_depth, dtype=jnp.int32))
    logits, _, _, _ = looped.coda_head(p, cfg, None, x, cos, sin, "all")
    ce, acc = (jnp.mean(v) for v in _ce_rows(logits, labels))
    return ce, {"ce": ce, "acc": acc}


def sample_recurrence(rng: np.random.Generator, mean_recurrence: int, backprop_depth: int) -> tuple[int, int]:
    """(no-grad steps, grad steps), the official poisson-lognormal-filling draw (total mean ~ mean + 1)."""
    s = backprop_depth
    t = max(mean_recurrence - s, 0)
    sigma = 0.5
    mu = math.log(t + s) - sigma ** 2 / 2
    p = int(rng.poisson(rng.lognormal(mu, sigma))) + 1
    return max(p - s, 0), min(s, p)


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


# --------------------------------------------------------------------------------------------- data

def sample_windows(rng: np.random.Generator, data: np.ndarray, batch: int, width: int) -> np.ndarray:
    """[batch, width] int32 windows at uniform random offsets of the flat token array."""
    starts = rng.integers(0, data.shape[0] - width + 1, size=batch)
    return data[starts[:, None] + np.arange(width)[None, :]].astype(np.int32)


def eval_windows(data: np.ndarray, width: int, max_tokens: int = 0) -> np.ndarray:
    """Non-overlapping [N, width] int32 windows covering the held-out split (optionally capped)."""
    n = data.shape[0] // width
    if max_tokens:
        n = min(n, max(1, max_tokens // width))
    if n == 0:
        raise ValueError(f"held-out split has {data.shape[0]} tokens: fewer than one window of {width}")
    return data[: n * width].reshape(n, width).astype(np.int32)


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
        out[f"ce@{d}"], out[f"acc@{d}"] = _ce_rows(extras["exit_logits"][d], tokens[:, 1:])
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


def evaluate_huginn(params, cfg, windows, batch, o: TrainOptions, depths) -> dict[str, Any]:
    """{"per_depth": {r: {ce, acc, ppl}}, plus ce/acc/ppl at the mean recurrence (else the deepest r)}."""
    depths = tuple(sorted({int(r) for r in depths}))
    m = _mean_metrics(functools.partial(_huginn_eval_batch, params, cfg=cfg, depths=depths,
                                        compute_dtype=jnp.dtype(o.compute_dtype)), windows, batch)
    per_depth = {r: {"ce": m[f"ce@{r}"], "acc": m[f"acc@{r}"], "ppl": math.exp(m[f"ce@{r}"])} for r in depths}
    main = per_depth.get(o.mean_recurrence) or per_depth[depths[-1]]
    return {"per_depth": per_depth, **main}


# -------------------------------------------------------------------------------------------- saving

def folder_bytes(folder: str | os.PathLike) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def save_checkpoint(out: str | os.PathLike, arch: str, params: dict, cfg, config_json: dict,
                    tokenizer_dir: str | os.PathLike | None) -> None:
    """config.json, model.safetensors (bf16, HF / official key names) and the tokenizer files."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bf16 = cast(params, jnp.bfloat16)
    tensors = qwen35.hf_tensors(bf16, cfg) if arch == "qwen35" else looped.official_tensors(bf16, cfg)
    save_safetensors(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copy(src, out / name)


def _fmt(x: float) -> str:
    return f"{x:.4f}"


def _shown_path(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def write_readme(out: Path, o: TrainOptions, summary: dict) -> None:
    s = summary
    lines = [
        f"# {out.name}",
        "",
        f"Tiny {'Qwen3.5 hybrid (Gated DeltaNet + gated full attention 3:1) with a 1-layer MTP head' if o.arch == 'qwen35' else 'Huginn-style looped (recurrent-depth) model'}, "
        "trained from scratch by `scripts/train_tiny.py` on Python standard-library source code. "
        "A test / demo checkpoint for specdec_jax, not a useful language model.",
        "",
        "## Data",
        "",
        f"- corpus: {s['data']['description']}",
        f"- train tokens: {s['data']['train_tokens']:,}; held-out tokens: {s['data']['heldout_tokens']:,} "
        f"(held-out modules never seen by the tokenizer or the model)",
        f"- tokenizer: byte-level BPE, vocab {s['vocab_size']}, `<|endoftext|>` = 0 (EOS after every file)",
        "",
        "## Model",
        "",
        f"- parameters: {s['num_params']:,} (model.safetensors {s['weights_bytes'] / 2**20:.2f} MiB, bf16)",
        f"- config: {json.dumps(s['model_sizes'])}",
        "",
        "## Training",
        "",
        f"- steps: {s['steps']} x batch {o.batch} x seq {o.seq_len} = {s['tokens_seen']:,} tokens "
        f"({s['epochs']:.1f} epochs of the train split)",
        f"- optimizer: AdamW (b1 0.9, b2 0.95, weight decay {o.weight_decay} on matrices), grad clip {o.grad_clip}, "
        f"peak lr {o.lr}, {o.warmup_steps} warmup steps, cosine to {o.min_lr_ratio} x peak "
        f"({'over max(step, wall-time) progress' if o.schedule == 'time' else 'over steps'}); "
        f"{o.compute_dtype} compute, fp32 master weights; seed {o.seed}",
    ]
    if o.arch == "qwen35":
        lines.append(f"- loss: next-token CE + {o.mtp_weight} x MTP next-next-token CE (joint)")
    else:
        lines.append(f"- recurrence per step ~ Poisson-LogNormal(mean {o.mean_recurrence}) + 1, truncated backprop "
                     f"through the last {o.backprop_depth}, zero initial state "
                     f"(mean sampled recurrence {s.get('mean_sampled_recurrence', float('nan')):.2f})")
    lines += [
        f"- wall time: {s['train_seconds']:.1f} s training ({s['compile_seconds']:.1f} s compile), "
        f"{s['total_seconds']:.1f} s total; {s['tokens_per_second']:,.0f} tokens/s",
        f"- device: {s['device']} (jax {s['jax_version']})",
        f"- final training loss (mean of the last {s['final_window']} steps): {_fmt(s['final_train_loss'])}",
        "",
        "## Held-out evaluation",
        "",
        f"- {s['eval']['windows']} windows of {o.seq_len} tokens",
    ]
    if s["selected_step"] != s["steps"]:
        lines.append(f"- saved parameters are from step {s['selected_step']} (best periodic held-out loss, "
                     f"--keep-best): the held-out split also served for this model selection")
    ev = s["eval"]
    if o.arch == "qwen35":
        lines += [f"- next-token loss {_fmt(ev['ce'])}, perplexity {ev['ppl']:.2f}, top-1 accuracy {ev['acc']:.3f}"]
        if "mtp_ce" in ev:
            lines += [f"- MTP head (token after next): loss {_fmt(ev['mtp_ce'])}, top-1 accuracy {ev['mtp_acc']:.3f}"]
    else:
        lines += ["", "| recurrences r | loss | perplexity | top-1 acc |", "|---|---|---|---|"]
        for r, m in ev["per_depth"].items():
            lines.append(f"| {r} | {_fmt(m['ce'])} | {m['ppl']:.2f} | {m['acc']:.3f} |")
    lines += [
        "",
        "## Reproduce",
        "",
        "```",
        o.command or "(called from Python)",
        "```",
        "",
        "```",
        f"python -m specdec_jax generate --model {_shown_path(o.out)} --prompt 'def add(a, b):\\n'",
        "```",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


# ------------------------------------------------------------------------------------------- driver

def _device_name() -> str:
    d = jax.devices()[0]
    return f"{getattr(d, 'device_kind', d.platform)} x{jax.device_count()} ({d.platform})"


def run_training(o: TrainOptions, train_ids: np.ndarray, heldout_ids: np.ndarray, *,
                 tokenizer_dir: str | os.PathLike | None = None, vocab_size: int | None = None,
                 data_description: str = "", eos_token_id: int = 0) -> dict:
    """Train, evaluate on the held-out split, write the checkpoint folder `o.out`; returns the summary."""
    if o.arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}; got {o.arch!r}")
    t_start = time.perf_counter()
    log = (lambda *a: None) if o.quiet else (lambda *a: print(*a, flush=True))
    vocab = int(vocab_size if vocab_size is not None else int(train_ids.max()) + 1)
    compute_dtype = jnp.dtype(o.compute_dtype)
    key = jax.random.PRNGKey(o.seed)
    data_rng = np.random.default_rng(o.seed)
    rec_rng = np.random.default_rng(o.seed + 1)
    if o.arch == "qwen35":
        cfg = qwen35_config(vocab, o, eos_token_id)
        params = init_qwen35_params(cfg, key)
        width = o.seq_len + 2
        def loss_fn(params, tokens):
            return qwen35_loss(params, cfg, tokens, mtp_weight=o.mtp_weight, compute_dtype=compute_dtype)
        config_json = qwen35_config_json(cfg)
        sizes = {k: config_json[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "intermediate_size",
                                               "linear_num_key_heads", "linear_num_value_heads",
                                               "linear_key_head_dim", "vocab_size", "mtp_num_hidden_layers")}
    else:
        cfg = huginn_config(vocab, o)
        params = init_huginn_params(cfg, key)
        width = o.seq_len + 1
        def loss_fn(params, tokens, n_no_grad, n_grad):
            return huginn_loss(params, cfg, tokens, n_no_grad, n_grad, backprop_depth=o.backprop_depth,
                               compute_dtype=compute_dtype)
        config_json = huginn_config_dict(vocab, o, eos_token_id)
        sizes = {k: config_json[k] for k in ("n_embd", "n_heads", "n_layers_in_prelude",
                                               "n_layers_in_recurrent_block", "n_layers_in_coda",
                                               "intermediate_size", "vocab_size", "mean_recurrence",
                                               "mean_backprop_depth")}
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
            n, k = sample_recurrence(rec_rng, o.mean_recurrence, o.backprop_depth)
            recurrences.append(n + k)
            extra = (jnp.int32(n), jnp.int32(k))
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
            ev = evaluate(params)
            evals.append(dict(step=step, **{k: v for k, v in ev.items() if k != "per_depth"}))
            if o.keep_best and ev["ce"] < best_ce:
                # A copy: the next step donates `params`.
                best_ce, best_step, best_params = ev["ce"], step, jax.tree.map(jnp.copy, params)
            eval_s += time.perf_counter() - t_eval
            log(f"eval step {step}: held-out loss {ev['ce']:.4f} ppl {ev['ppl']:.2f} acc {ev['acc']:.3f}"
                + (f"  mtp loss {ev['mtp_ce']:.4f} acc {ev['mtp_acc']:.3f}" if "mtp_ce" in ev else ""))
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
            f"mtp loss {final['mtp_ce']:.4f} acc {final['mtp_acc']:.3f}")
    else:
        for r, m in final["per_depth"].items():
            log(f"held-out r={r:3d}: loss {m['ce']:.4f} ppl {m['ppl']:.2f} acc {m['acc']:.3f}")

    out = Path(o.out)
    save_checkpoint(out, o.arch, params, cfg, config_json, tokenizer_dir)
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
    (out / "train_log.json").write_text(json.dumps(
        {"options": options, "config": config_json, "summary": summary, "history": history, "evals": evals},
        indent=1) + "\n")
    summary["checkpoint_bytes"] = folder_bytes(out)
    if summary["checkpoint_bytes"] > MAX_CHECKPOINT_BYTES:
        log(f"WARNING: {out} is {summary['checkpoint_bytes'] / 2**20:.2f} MiB (> 20 MiB)")
    log(f"wrote {out} ({summary['checkpoint_bytes'] / 2**20:.2f} MiB) in {summary['total_seconds']:.1f} s total")
    return summary
