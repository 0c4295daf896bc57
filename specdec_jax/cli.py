"""Command line: `python -m specdec_jax generate --model DIR --prompt TEXT [...]` and
`python -m specdec_jax bench --model DIR --methods ar,ngram --prompts heldout|FILE --out DIR [...]`.

generate: loads a checkpoint folder and its tokenizer, generates, prints the prompt and its continuation,
then a table (method, tokens/s, new tokens, verify steps, mean accepted tokens); `--compare-ar`
adds a plain autoregressive run and the speedup.
bench: paired runs of several methods on the same prompts (specdec_jax/bench.py) with a progress bar;
writes bench.json, bench.md and bench.png to --out and prints the Markdown report.
Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from pathlib import Path

from .text import unescape

EXIT_USAGE = 2
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-qwen35-code"
DEFAULT_PROMPT = 'def fibonacci(n):\\n    """Return the n-th Fibonacci number."""\\n'


class UsageError(Exception):
    """A bad command line or input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message on two or more lines; we want one
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m specdec_jax", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{generate,bench}")
    sub.required = True
    g = sub.add_parser("generate", help="generate a continuation of a prompt")
    g.add_argument("--model", default=str(DEFAULT_MODEL),
                   help=f"checkpoint folder with config.json, safetensors and a tokenizer (default {DEFAULT_MODEL})")
    g.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text; \\n and \\t escapes are interpreted")
    g.add_argument("--method", default="ar", help="decoding method (default ar; the model lists what it supports)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-steps", type=int, default=None, help="looped models: recurrence depth")
    g.add_argument("--compare-ar", action="store_true", help="also run plain autoregressive decoding")
    g.add_argument("--no-exact", action="store_true",
                   help="AR steps at one row and verification at gamma + 1 rows (faster on small models; in "
                        "bfloat16 the output may then differ from AR's)")
    g.add_argument("--gamma", type=int, default=None,
                   help="draft length of speculative methods (default 4; self-drafts 2; das-wave and "
                        "parallel-sampler 16)")
    g.add_argument("--skip-layers", default=None,
                   help="layer-skip / residual-reuse: comma-separated layer indices the draft skips (default: the "
                        "middle quarter)")
    g.add_argument("--mlp-keep", type=float, default=None,
                   help="partial-mlp: share of each MLP's channels the draft keeps, in (0, 1] (default 0.75)")
    g.add_argument("--shortlist-size", type=int, default=None,
                   help="mtp-shortlist and self-drafts: draft among the first N tokens of the checkpoint's token "
                        "shortlist (draft_tables.safetensors)")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="parameter dtype (default bfloat16 on GPU/TPU, float32 on CPU)")

    b = sub.add_parser("bench", help="benchmark decoding methods on the same prompts (paired with ar)",
                       description="Paired benchmark: per prompt, every method runs once untimed, then --repeats "
                                   "timed rounds with the methods alternating; ar is always the baseline. Writes "
                                   "bench.json, bench.md and bench.png to --out.")
    b.add_argument("--model", default=str(DEFAULT_MODEL),
                   help=f"checkpoint folder with config.json, safetensors and a tokenizer (default {DEFAULT_MODEL})")
    b.add_argument("--methods", default="ar,ngram",
                   help="comma-separated methods (default ar,ngram; ar is always run as the baseline)")
    b.add_argument("--prompts", default="heldout",
                   help="'heldout' (held-out stdlib modules) or a file: a .json list of strings, or text with one "
                        "prompt per line (\\n escapes interpreted)")
    b.add_argument("--num-prompts", type=int, default=16, help="use the first N prompts (default 16)")
    b.add_argument("--max-prompt-tokens", type=int, default=256,
                   help="left-truncate longer prompts to their last N tokens (default 256)")
    b.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per run (default 128)")
    b.add_argument("--gamma", type=int, default=None,
                   help="draft length of the speculative methods (default: each method's own; 4, das-wave 16)")
    b.add_argument("--repeats", type=int, default=1, help="timed rounds per prompt (default 1)")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="parameter dtype (default bfloat16 on GPU/TPU, float32 on CPU)")
    b.add_argument("--out", default=None, help="report folder (default benchmarks/results/bench-<model name>)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _check_numbers(args) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1; got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be a finite number >= 0; got {args.temperature}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = off); got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1]; got {args.top_p}")
    if args.num_steps is not None and args.num_steps < 1:
        raise UsageError(f"--num-steps must be >= 1; got {args.num_steps}")


def _known_methods() -> set[str]:
    """Every method some model family supports (the method registry)."""
    from . import methods
    return methods.known()


def _load_tokenizer(folder: str):
    from .text import load_tokenizer  # lazy: transformers; CheckpointError is a SpecdecError: one line, exit 2
    return load_tokenizer(folder)


def _trim_at_eos(tokens, eos_ids) -> list[int]:
    out = []
    for t in tokens:
        out.append(int(t))
        if int(t) in eos_ids:
            break
    return out


def _row(stats: dict) -> list[str]:
    def get(key, fmt):
        v = stats.get(key)
        return "-" if v is None else fmt.format(v)
    return [str(stats.get("method", "?")), get("tokens_per_second", "{:,.1f}"), get("new_tokens", "{:d}"),
            get("verify_steps", "{:d}"), get("mean_accepted", "{:.2f}")]


def _table(rows: list[list[str]]) -> str:
    header = ["method", "tokens/s", "new tokens", "verify steps", "mean accepted"]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header)] + [fmt(r) for r in rows])


def generate_command(args) -> int:
    _check_numbers(args)
    folder = os.path.expanduser(args.model)
    if not os.path.isdir(folder):
        raise UsageError(f"model folder '{folder}' does not exist" if not os.path.exists(folder)
                         else f"--model '{folder}' is not a folder")
    prompt = unescape(args.prompt)
    if not prompt:
        raise UsageError("--prompt is empty")

    import jax
    import numpy as np
    import specdec_jax as sj

    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    tokenizer = _load_tokenizer(folder)
    model = sj.load(folder, dtype=dtype)
    methods = tuple(sj.supported_methods(model))
    if args.method not in methods:
        family = model.family
        if args.method in _known_methods():
            raise UsageError(f"method '{args.method}' is not supported by this {family} model; "
                             f"supported: {', '.join(methods)}")
        raise UsageError(f"unknown method '{args.method}'; supported for this {family} model: {', '.join(methods)}")
    options = {}
    if args.num_steps is not None:
        if model.family != "looped":
            raise UsageError(f"--num-steps applies to looped models only; '{folder}' is a {model.family} model")
        options["num_steps"] = args.num_steps

    ids = tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise UsageError("the prompt encodes to no tokens")
    ids = np.asarray([ids], np.int64)
    sampling = dict(temperature=args.temperature, seed=args.seed, top_k=args.top_k, top_p=args.top_p)
    if args.gamma is not None and args.method != "ar":
        options["gamma"] = args.gamma
    if args.no_exact:
        options["exact"] = False
    if args.skip_layers is not None:
        try:
            options["skip_layers"] = tuple(int(x) for x in args.skip_layers.split(",") if x.strip())
        except ValueError:
            raise UsageError(f"--skip-layers takes comma-separated layer indices; got {args.skip_layers!r}") from None
    if args.mlp_keep is not None:
        options["mlp_keep"] = args.mlp_keep
    if args.shortlist_size is not None:
        options["shortlist_size"] = args.shortlist_size

    def run(method, opts):
        # With --compare-ar each method first runs once untimed: first executions pay one-time
        # costs (allocation, thread pools) that would bias the comparison.
        for _ in range(2 if args.compare_ar else 1):
            out = sj.generate(model, ids, args.max_new_tokens, method=method, **sampling, **opts)
        return out

    result = run(args.method, options)
    eos_ids = set(model.config.eos_token_id)
    new = _trim_at_eos(result.tokens[0], eos_ids)
    text = tokenizer.decode(new, skip_special_tokens=True)
    print(prompt + text)
    print()
    rows = [_row(dict(result.stats, method=result.stats.get("method", args.method)))]
    notes = [f"model: {folder} ({model.family}, {dtype}); prompt {ids.shape[1]} tokens"]
    if args.compare_ar:
        if args.method == "ar":
            notes.append("--compare-ar: the method is already ar")
        else:
            ar_options = {k: v for k, v in options.items() if k in ("num_steps", "exact")}
            if result.stats.get("exact"):  # exact output is AR's at the same decode row count
                ar_options["decode_rows"] = result.stats["decode_rows"]
            base = run("ar", ar_options)
            rows.append(_row(dict(base.stats, method="ar")))
            speedup = result.stats["tokens_per_second"] / max(base.stats["tokens_per_second"], 1e-9)
            notes.append(f"speedup over ar: {speedup:.2f}x")
            if args.temperature == 0:
                same = np.array_equal(result.tokens, base.tokens)
                notes.append(f"greedy output identical to ar: {'yes' if same else 'NO'}")
    print(_table(rows))
    for n in notes:
        print(n)
    return 0


def _parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise UsageError(f"--methods names no method; got {text!r}")
    return list(dict.fromkeys(methods))


def bench_command(args) -> int:
    for name, value, low in (("--max-new-tokens", args.max_new_tokens, 2), ("--num-prompts", args.num_prompts, 1),
                             ("--max-prompt-tokens", args.max_prompt_tokens, 1), ("--repeats", args.repeats, 1)):
        if value < low:
            raise UsageError(f"{name} must be >= {low}; got {value}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be a finite number >= 0; got {args.temperature}")
    if args.gamma is not None and not 0 <= args.gamma <= args.max_new_tokens:
        raise UsageError(f"--gamma must be in [0, --max-new-tokens={args.max_new_tokens}]; got {args.gamma}")
    methods = _parse_methods(args.methods)
    folder = os.path.expanduser(args.model)
    if not os.path.isdir(folder):
        raise UsageError(f"model folder '{folder}' does not exist" if not os.path.exists(folder)
                         else f"--model '{folder}' is not a folder")
    out = args.out or os.path.join("benchmarks", "results", f"bench-{os.path.basename(os.path.normpath(folder))}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out '{out}' exists and is not a folder")

    from . import bench
    options = {m: {"gamma": args.gamma} for m in methods if m != "ar"} if args.gamma is not None else {}
    # run_bench checks the prompts, tokenizer, model and methods before the first generation
    result = bench.run_bench(folder, methods, args.prompts, max_new_tokens=args.max_new_tokens, method_options=options,
                             temperature=args.temperature, seed=args.seed, repeats=args.repeats, dtype=args.dtype,
                             progress=not args.no_progress, num_prompts=args.num_prompts,
                             max_prompt_tokens=args.max_prompt_tokens, command=args.command_line)
    paths = bench.write_report(result, out)
    with open(paths["markdown"], encoding="utf-8") as f:
        print(f.read())
    written = [p for p in (paths["json"], paths["markdown"], paths["png"]) if p]
    print("wrote " + ", ".join(written))
    if result.get("plot_error"):
        print(result["plot_error"], file=sys.stderr)
    return 0


COMMANDS = {"generate": generate_command, "bench": bench_command}


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for bad input, with one line on stderr)."""
    from .errors import SpecdecError
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser.parse_args(argv)
        args.command_line = "python -m specdec_jax " + " ".join(shlex.quote(a) for a in argv)
        return COMMANDS[args.command](args)
    except (UsageError, SpecdecError) as e:
        message = " ".join(str(e).split())  # one line, whatever the message held
        print(f"specdec_jax: error: {message}", file=sys.stderr)
        return EXIT_USAGE
