"""Fine-tune a Qwen3.5 checkpoint's MTP head for chained drafting, the model itself fixed.

  python scripts/train_mtp_head.py --model checkpoints/tiny-qwen35-code --corpus build/corpus \\
      --out /tmp/tiny-qwen35-code-chain --depth 3 --time-budget-s 240

A draft chain feeds the head its own output hidden state from the second draft on, while joint training
(`train_tiny.py`) only ever feeds it the model's. Here the head runs chained `--depth` times from every position
at once, with the attention a draft chain sees (`models.qwen35.mtp_head.mtp_chain_train`), and each depth is trained toward
the model's own distribution for its token (`--distill`; the rest against the true token). Only the head's
parameters change: the output folder is a copy of --model whose model.safetensors differs in the `mtp.*`
tensors alone (checked before writing), plus `mtp_head_log.json` and a section in its README. Held-out
evaluation before training, every --eval-every steps and at the end (per depth: agreement with the model's
top-1, and the leading agreements a greedy step would accept); the best evaluation by accepted drafts is kept.

The corpus must be tokenized with the model's tokenizer (`build_corpus.py --tokenizer MODEL`): checked first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import specdec_jax as sj  # noqa: E402
from specdec_jax import training  # noqa: E402
from specdec_jax.loading import save_safetensors  # noqa: E402
from specdec_jax.models.qwen35 import model as qwen35  # noqa: E402

LOG_NAME = "mtp_head_log.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO / "checkpoints" / "tiny-qwen35-code",
                   help="a Qwen3.5 checkpoint folder with an MTP head")
    p.add_argument("--corpus", type=Path, default=REPO / "build" / "corpus",
                   help="build_corpus.py output (train.npy, heldout.npy, tokenizer/) in the model's tokenizer")
    p.add_argument("--out", type=Path, required=True, help="the new checkpoint folder (must not be --model)")
    p.add_argument("--depth", type=int, default=3, help="chained forwards trained per position (a draft chain's gamma)")
    p.add_argument("--distill", type=float, default=1.0,
                   help="share of each depth's loss taken against the model's distribution (the rest: true token)")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--time-budget-s", type=float, default=240.0, help="training seconds, compilation excluded")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512, help="chain origins per window")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=200, help="0 = before and after training only")
    p.add_argument("--eval-max-tokens", type=int, default=262_144, help="0 = the whole held-out split")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = p.parse_args(argv)
    for name in ("depth", "steps", "batch", "seq_len", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.distill <= 1.0:
        p.error(f"--distill must be in [0, 1], got {args.distill}")
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there (expected a Qwen3.5 checkpoint folder)")
    if args.out.resolve() == args.model.resolve():
        p.error(f"--out {args.out} is the --model folder: write the fine-tuned head to a new folder")
    missing = [n for n in ("train.npy", "heldout.npy", "tokenizer/tokenizer.json") if not (args.corpus / n).is_file()]
    if missing:
        p.error(f"--corpus {args.corpus}: missing {', '.join(missing)} (build it with "
                f"scripts/build_corpus.py --out {args.corpus} --tokenizer {args.model})")
    if (args.corpus / "tokenizer" / "tokenizer.json").read_bytes() != (args.model / "tokenizer.json").read_bytes():
        p.error(f"--corpus {args.corpus} was tokenized with another tokenizer than --model {args.model}'s "
                f"(rebuild it with scripts/build_corpus.py --tokenizer {args.model})")
    return args


def _commit() -> str:
    if os.environ.get("BENCH_GIT_COMMIT"):
        return os.environ["BENCH_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def head_tensors(model_file: Path, params: dict, cfg) -> dict:
    """The checkpoint's tensors with the `mtp.*` ones taken from `params` (bf16); every other tensor is the
    file's own, and must equal what `params` holds (so the model itself is unchanged, bit for bit)."""
    from safetensors import safe_open
    with safe_open(str(model_file), framework="flax") as f:
        on_disk = {k: f.get_tensor(k) for k in f.keys()}
    ours = qwen35.hf_tensors(training.cast({k: v for k, v in params.items() if k != "draft"}, jnp.bfloat16), cfg)
    if set(ours) != set(on_disk):
        raise ValueError(f"{model_file}: tensor names differ from the loaded model's "
                         f"(only in the file: {sorted(set(on_disk) - set(ours))[:5]}, "
                         f"only loaded: {sorted(set(ours) - set(on_disk))[:5]})")
    out = {}
    for key, value in on_disk.items():
        if key.startswith("mtp."):
            out[key] = ours[key]
        elif not np.array_equal(np.asarray(ours[key]), np.asarray(value)):
            raise ValueError(f"{model_file}: {key} changed in training; only the mtp.* tensors may")
        else:
            out[key] = value
    return out


def _row(metrics: dict, depth: int) -> str:
    agree = " / ".join(f"{metrics[f'mtp{k}_agree']:.3f}" for k in range(1, depth + 1))
    return f"agreement at depth 1..{depth} {agree}, accepted {metrics['mtp_accepted']:.3f} of {depth}"


def write_readme_section(folder: Path, log: dict) -> None:
    o, d = log["options"], log["options"]["depth"]
    before, after = log["baseline"], log["final"]
    lines = ["", "## MTP head fine-tuned for chained drafting", "",
             f"After the training above, the MTP head alone was trained further with the model fixed "
             f"(`scripts/train_mtp_head.py`, commit {log['commit'][:7]}): the head chained {d} times from every "
             f"position as a draft chain runs it (from the second draft on it consumes its own output hidden "
             f"state), each depth toward the model's own distribution"
             + (" (the whole loss)" if o["distill"] == 1 else f" ({o['distill']:g} of the loss; the rest against "
                                                               f"the true token)")
             + f". {log['steps']} steps x batch {o['batch']} x {o['seq_len']} origins, "
             f"{log['train_seconds']:.0f} s on {log['device']} (jax {log['jax_version']}); the evaluation with the "
             f"most accepted drafts was kept (step {log['selected_step']}). The model's tensors are unchanged; "
             f"log: `{LOG_NAME}`.", "",
             f"Held-out ({log['windows']} windows), the model's top-1 agreed with at each chained depth, and the "
             f"leading agreements a greedy step at gamma {d} would accept (the chain fed the true tokens):", "",
             "| head | " + " | ".join(f"depth {k}" for k in range(1, d + 1)) + " | accepted |",
             "|---|" + "---|" * (d + 1)]
    for name, m in (("before", before), ("after", after)):
        lines.append(f"| {name} | " + " | ".join(f"{m[f'mtp{k}_agree']:.3f}" for k in range(1, d + 1))
                     + f" | {m['mtp_accepted']:.3f} |")
    lines += ["", "```", log["command"], "```", ""]
    readme = folder / "README.md"
    text = readme.read_text() if readme.is_file() else f"# {folder.name}\n"
    marker = "\n## MTP head fine-tuned for chained drafting\n"
    if marker in text:  # a folder fine-tuned again: the section describes the last run
        text = text[:text.index(marker)]
    readme.write_text(text.rstrip("\n") + "\n" + "\n".join(lines))


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    model = sj.load(args.model, dtype="float32")
    cfg, params = model.config, model.params
    if "mtp" not in params:
        raise SystemExit(f"--model {args.model}: the checkpoint has no MTP head (mtp_num_hidden_layers is 0)")
    train_ids, heldout_ids = np.load(args.corpus / "train.npy"), np.load(args.corpus / "heldout.npy")
    if int(max(train_ids.max(), heldout_ids.max())) >= cfg.vocab_size:
        raise SystemExit(f"--corpus {args.corpus}: token ids reach {int(max(train_ids.max(), heldout_ids.max()))}, "
                         f"past the model's vocabulary of {cfg.vocab_size}")
    width = args.seq_len + args.depth + 1
    windows = training.eval_windows(heldout_ids, width, args.eval_max_tokens)
    trunk = {k: v for k, v in params.items() if k not in ("mtp", "draft")}
    head = params["mtp"]
    compute_dtype = jnp.dtype(args.compute_dtype)

    def loss_fn(head, tokens, trunk):
        return training.mtp_chain_loss(head, trunk, cfg, tokens, depth=args.depth, distill=args.distill,
                                       compute_dtype=compute_dtype)

    tx = training.make_optimizer(args.weight_decay, args.grad_clip)
    opt_state = tx.init(head)
    train_step = training.make_train_step(loss_fn, tx)
    schedule = SimpleNamespace(lr=args.lr, warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio)

    def evaluate(head):
        return training.evaluate_mtp_chain(dict(trunk, mtp=head), cfg, windows, args.batch, args.depth,
                                           compute_dtype)

    print(f"{args.model}: head {training.count_params(head):,} parameters; train {train_ids.shape[0]:,} tokens, "
          f"held-out {windows.shape[0]} x {width}; depth {args.depth}, distill {args.distill:g}", flush=True)
    baseline = evaluate(head)
    print(f"before: {_row(baseline, args.depth)}", flush=True)
    evals = [dict(step=0, **baseline)]
    best, best_step, best_head = baseline["mtp_accepted"], 0, jax.tree.map(jnp.copy, head)
    rng = np.random.default_rng(args.seed)
    history, step, t_loop, eval_s, compile_s = [], 0, None, 0.0, 0.0
    clock = lambda: 0.0 if t_loop is None else time.perf_counter() - t_loop - eval_s  # noqa: E731
    while step < args.steps and (t_loop is None or clock() < args.time_budget_s):
        progress = max(step / args.steps, clock() / args.time_budget_s)
        lr = training.learning_rate(step, progress, schedule)
        tokens = jnp.asarray(training.sample_windows(rng, train_ids, args.batch, width))
        t0 = time.perf_counter()
        head, opt_state, metrics = train_step(head, opt_state, tokens, jnp.float32(lr), trunk)
        step += 1
        if t_loop is None:
            jax.block_until_ready(metrics)
            compile_s, t_loop = time.perf_counter() - t0, time.perf_counter()
        if step % args.log_every == 0 or step == 1:
            m = {k: round(float(v), 5) for k, v in jax.device_get(metrics).items()}
            history.append(dict(step=step, lr=lr, seconds=round(clock(), 2), **m))
            print(f"step {step:6d}  loss {m['loss']:.4f}  accepted {m['mtp_accepted']:.3f}  lr {lr:.2e}  "
                  f"{clock():.0f}s", flush=True)
        if args.eval_every and step % args.eval_every == 0:
            t_eval = time.perf_counter()
            ev = evaluate(head)
            evals.append(dict(step=step, **ev))
            if ev["mtp_accepted"] > best:
                best, best_step, best_head = ev["mtp_accepted"], step, jax.tree.map(jnp.copy, head)
            eval_s += time.perf_counter() - t_eval
            print(f"eval step {step}: {_row(ev, args.depth)}", flush=True)
    train_s = clock()
    final = evaluate(head)
    evals.append(dict(step=step, final=True, **final))
    if final["mtp_accepted"] >= best:
        best, best_step, best_head = final["mtp_accepted"], step, head
    final = next(e for e in evals if e["step"] == best_step)
    final = {k: v for k, v in final.items() if k not in ("step", "final")}
    print(f"after (step {best_step}): {_row(final, args.depth)}", flush=True)

    tensors = head_tensors(args.model / "model.safetensors", dict(params, mtp=best_head), cfg)
    args.out.mkdir(parents=True, exist_ok=True)
    for src in args.model.iterdir():
        if src.is_file() and src.name != "model.safetensors":
            shutil.copy(src, args.out / src.name)
    save_safetensors(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    command = "python scripts/train_mtp_head.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    device = jax.devices()[0]
    log = {"options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "command": command, "commit": _commit(), "device": getattr(device, "device_kind", device.platform),
           "jax_version": jax.__version__, "windows": int(windows.shape[0]), "steps": step,
           "selected_step": best_step, "train_seconds": train_s, "compile_seconds": compile_s,
           "eval_seconds": eval_s, "total_seconds": time.perf_counter() - t_start,
           "tokens_per_second": step * args.batch * args.seq_len / train_s if train_s > 0 else 0.0,
           "baseline": baseline, "final": final, "evals": evals, "history": history}
    (args.out / LOG_NAME).write_text(json.dumps(log, indent=1, default=float) + "\n")
    write_readme_section(args.out, log)
    size = training.folder_bytes(args.out)
    if size > training.MAX_CHECKPOINT_BYTES:
        print(f"warning: {args.out} holds {size:,} bytes, over the {training.MAX_CHECKPOINT_BYTES:,} budget",
              flush=True)
    print(f"wrote {args.out} ({size:,} bytes) in {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0 if math.isfinite(final["mtp_accepted"]) else 1


if __name__ == "__main__":
    sys.exit(main())
