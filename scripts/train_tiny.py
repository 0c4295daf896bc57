"""Train a tiny code model (Qwen3.5 hybrid + MTP head, or Huginn looped) and write an HF checkpoint.

  python scripts/train_tiny.py --arch qwen35            # -> checkpoints/tiny-qwen35-code
  python scripts/train_tiny.py --arch huginn            # -> checkpoints/tiny-huginn-code

Data: build/corpus from scripts/build_corpus.py (built first when missing). Training stops at
--steps or when --time-budget-s seconds of training (compilation excluded) have passed; with
--schedule time (default) the cosine decay follows whichever comes first, so a time-limited run
still ends at the low learning rate. The output folder holds config.json, model.safetensors (bf16),
the tokenizer, README.md and train_log.json; it loads with `specdec_jax.load`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Lets the script run from a plain checkout without `pip install -e .`.
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from specdec_jax import training  # noqa: E402


def _depths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"depths must be integers >= 1, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    d = training.TrainOptions()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=training.ARCHS, default="qwen35")
    p.add_argument("--corpus", type=Path, default=REPO / "build" / "corpus", help="build_corpus.py output")
    p.add_argument("--out", type=Path, default=None, help="checkpoint folder (default checkpoints/tiny-<arch>-code)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--schedule", choices=("time", "steps"), default=d.schedule,
                   help="cosine progress: max(step, time) fraction (time) or step fraction only (steps)")
    p.add_argument("--time-budget-s", type=float, default=d.time_budget_s,
                   help="stop training after this many seconds (compilation excluded)")
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="0 = only at the end")
    p.add_argument("--eval-max-tokens", type=int, default=d.eval_max_tokens, help="0 = whole held-out split")
    p.add_argument("--keep-best", action="store_true",
                   help="save the parameters of the best periodic held-out evaluation if they beat the final ones")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--init-from", type=str, default=d.init_from,
                   help="continue from this checkpoint folder (same architecture and sizes) instead of a fresh init")
    p.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default=d.compute_dtype)
    g = p.add_argument_group("model sizes")
    for name in ("hidden", "heads", "intermediate", "layers", "kv_heads", "head_dim", "linear_key_heads",
                 "linear_value_heads", "linear_head_dim", "prelude", "core", "coda"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    g.add_argument("--rope-theta", type=float, default=d.rope_theta, help="qwen35 RoPE base")
    g.add_argument("--mtp-weight", type=float, default=d.mtp_weight, help="qwen35: weight of the MTP loss")
    g.add_argument("--mtp-distill", type=float, default=d.mtp_distill,
                   help="qwen35: share of the MTP loss against the model's own next-next-token distribution")
    g.add_argument("--mean-recurrence", type=int, default=d.mean_recurrence, help="huginn")
    g.add_argument("--backprop-depth", type=int, default=d.backprop_depth, help="huginn")
    g.add_argument("--min-recurrence", type=int, default=d.min_recurrence,
                   help="huginn: sampled recurrences below this are raised to it (1: the official draw)")
    g.add_argument("--init-state-scale", type=float, default=d.init_state_scale,
                   help="huginn: 0 = train from a zero initial state; > 0 = from the official random draw at this scale")
    g.add_argument("--remat-recurrence", action="store_true",
                   help="huginn: recompute each backprop step's activations (memory flat in --backprop-depth)")
    g.add_argument("--eval-depths", type=_depths, default=d.eval_depths, help="huginn, e.g. 1,2,4,8,16,32")
    g.add_argument("--periodic-eval-depths", type=_depths, default=d.periodic_eval_depths,
                   help="huginn: depths each periodic evaluation also reports (besides the mean recurrence), e.g. 4,8,32")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq_len", "log_every", "min_recurrence"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


CORPUS_FILES = ("corpus_manifest.json.gz", "LICENSES.md")  # copied into the checkpoint folder


def describe_corpus(manifest: dict) -> str:
    """One line for the checkpoint README: sources, files, packages, held-out split."""
    sources = manifest.get("sources", ["stdlib"])
    what = (f"Python {manifest.get('python_version', '?')} standard library"
            + (f" and the Python sources of {manifest.get('packages', '?')} installed packages (site-packages), "
               "deduplicated; `corpus_manifest.json.gz` lists every file, `LICENSES.md` their licences"
               if "site-packages" in sources else ""))
    return (f"{what} ({manifest.get('train_files', '?')} train files, {manifest.get('heldout_files', '?')} held-out "
            f"files: 12 stdlib modules plus whole package directories), built by scripts/build_corpus.py")


def ensure_corpus(corpus: Path) -> None:
    if (corpus / "train.npy").is_file() and (corpus / "heldout.npy").is_file() and (corpus / "tokenizer").is_dir():
        return
    print(f"{corpus} is missing: building it with scripts/build_corpus.py", flush=True)
    from scripts import build_corpus
    build_corpus.main(["--out", str(corpus)])


def main(argv=None) -> int:
    args = parse_args(argv)
    ensure_corpus(args.corpus)
    train_ids = np.load(args.corpus / "train.npy")
    heldout_ids = np.load(args.corpus / "heldout.npy")
    manifest = json.loads((args.corpus / "manifest.json").read_text()) if (args.corpus / "manifest.json").is_file() else {}
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(args.corpus / "tokenizer" / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    out = args.out or (REPO / training.DEFAULT_OUT[args.arch])
    fields = {f for f in training.TrainOptions.__dataclass_fields__}
    opts = training.TrainOptions(**{k: v for k, v in vars(args).items() if k in fields and k != "out"})
    opts.out = str(out)
    opts.command = "python scripts/train_tiny.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                       else sys.argv[1:]))
    training.run_training(opts, train_ids, heldout_ids, tokenizer_dir=args.corpus / "tokenizer",
                          vocab_size=tok.get_vocab_size(), data_description=describe_corpus(manifest),
                          eos_token_id=0 if eos is None else eos,
                          extra_files=[args.corpus / n for n in CORPUS_FILES if (args.corpus / n).is_file()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
