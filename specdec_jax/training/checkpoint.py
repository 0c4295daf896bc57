"""Checkpoint writing: config.json, bf16 model.safetensors under the HF / official key names, the
tokenizer files, and the checkpoint folder's README.md.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax.numpy as jnp

from ..loading import save_safetensors
from ..models.looped import model as looped
from ..models.qwen35 import model as qwen35
from .recipe import TrainOptions, cast

MAX_CHECKPOINT_BYTES = 20 * 1024 * 1024


def folder_bytes(folder: str | os.PathLike) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def save_checkpoint(out: str | os.PathLike, arch: str, params: dict, cfg, config_json: dict,
                    tokenizer_dir: str | os.PathLike | None, extra_files=()) -> None:
    """config.json, model.safetensors (bf16, HF / official key names), the tokenizer files and
    `extra_files` (the corpus manifest and licence note) copied as they are."""
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
    for src in map(Path, extra_files):
        shutil.copy(src, out / src.name)


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
        f"trained {'further (from an earlier checkpoint, see Training)' if getattr(o, 'init_from', '') else 'from scratch'} "
        "by `scripts/train_tiny.py` on Python source code (see Data). "
        "A test / demo checkpoint for specdec_jax, not a useful language model.",
        "",
        "## Data",
        "",
        f"- corpus: {s['data']['description']}",
        f"- train tokens: {s['data']['train_tokens']:,}; held-out tokens: {s['data']['heldout_tokens']:,} "
        f"(held-out files never seen by the tokenizer or the model)",
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
        mtp_loss = "MTP next-next-token CE" if not o.mtp_distill else (
            f"({1 - o.mtp_distill:g} x MTP next-next-token CE + {o.mtp_distill:g} x CE against the model's own "
            "next-next-token distribution, held fixed)")
        lines.append(f"- loss: next-token CE + {o.mtp_weight} x {mtp_loss} (joint)")
    else:
        floor = f", at least {o.min_recurrence}" if getattr(o, "min_recurrence", 1) > 1 else ""
        # The official draw centres on max(mean_recurrence, backprop_depth) (`sample_recurrence`).
        lines.append(f"- recurrence per step ~ Poisson-LogNormal(mean {max(o.mean_recurrence, o.backprop_depth)}) + 1"
                     f"{floor}, truncated backprop through the last {o.backprop_depth}, zero initial state "
                     f"(mean sampled recurrence {s.get('mean_sampled_recurrence', float('nan')):.2f})")
    if getattr(o, "init_from", ""):
        lines.append(f"- continued from the weights of `{_shown_path(o.init_from)}`; how those were trained "
                     "(options and summary) is kept in `train_log.json` under `init_from`; the figures here are "
                     "this run's")
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
            lines += [f"- MTP head (token after next): loss {_fmt(ev['mtp_ce'])}, top-1 accuracy {ev['mtp_acc']:.3f}, "
                      f"top-1 agreement with the model's own prediction {ev['mtp_agree']:.3f}"]
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
