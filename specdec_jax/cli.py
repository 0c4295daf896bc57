"""Command line: `specdec-jax generate --model DIR --prompt TEXT [...]` and
`specdec-jax bench --model DIR --methods ar,ngram --prompts heldout|FILE --out DIR [...]`
(or `python -m specdec_jax ...`).

generate: loads a checkpoint folder and its tokenizer, generates, prints the prompt and its continuation,
then a table (method, tokens/s, new tokens, verify steps, mean accepted tokens, compile seconds);
`--compare-ar` adds a plain autoregressive run and the speedup. `generate --help` lists the methods and
their options.
bench: paired runs of several methods on the same prompts (specdec_jax/bench/bench.py) with a progress bar;
writes bench.json, bench.md and bench.png to --out and prints the Markdown report.
--model also takes the shipped checkpoints' names: tiny-qwen (the default), tiny-huginn.
Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time

from . import shipped
from .text import unescape

EXIT_USAGE = 2
DEFAULT_MODEL = shipped.DEFAULT_ALIAS
DEFAULT_PROMPT = 'def fibonacci(n):\\n    """Return the n-th Fibonacci number."""\\n'
DEFAULT_BENCH_OUT = "specdec_bench_out"  # under the working folder, never the repository's committed results
MODEL_HELP = (f"checkpoint folder with config.json, safetensors and a tokenizer, or a shipped checkpoint: "
              f"{shipped.describe()} (default {DEFAULT_MODEL})")
# CLI flags that set a method option of the same name (the option must apply to the method).
FLAG_OPTIONS = {"gamma": "--gamma", "skip_layers": "--skip-layers", "mlp_keep": "--mlp-keep",
                "shortlist_size": "--shortlist-size", "num_steps": "--num-steps", "exact": "--no-exact"}
SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
                  "max_new_tokens": "--max-new-tokens", "method": "--method"}


class UsageError(Exception):
    """A bad command line or input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    epilog_fn = None  # builds the epilog when help is printed (it imports the method registry)

    def error(self, message):  # argparse prints usage + message on two or more lines; we want one
        raise UsageError(message)

    def format_help(self):
        if self.epilog_fn is not None:
            self.epilog = self.epilog_fn()
        return super().format_help()


def methods_help() -> str:
    """Each family's methods with the options each takes, then what each option means (from methods.py)."""
    import textwrap

    from . import methods

    def item(indent: int, name: str, text: str) -> str:
        return textwrap.fill(text, 100, initial_indent=f"{' ' * indent}{name:<17}",
                             subsequent_indent=" " * (indent + 17))
    families = {"qwen3_5": "Qwen3.5", "looped": "looped (Huginn / Raven)"}
    lines = [textwrap.fill("methods and their options (set with --option key=value, repeatable; --gamma, "
                           "--skip-layers, --mlp-keep, --shortlist-size, --num-steps and --no-exact set the option "
                           "of the same name):", 100)]
    for family, title in families.items():
        lines.append(f"  {title}:")
        for name in methods.family_methods(family):
            spec = methods.spec_for(family, name)
            needs = f" [needs {spec.needs}]" if spec.needs else ""
            lines.append(item(4, name, ", ".join(methods.accepted_options(spec)) + needs))
    lines.append(item(4, "every method", ", ".join(methods.GENERATE_OPTIONS)))
    lines.append("options:")
    lines += [item(2, name, text) for name, text in methods.OPTION_HELP.items()]
    lines.append(textwrap.fill("values: integers, decimals, true/false, none, comma-separated lists (tree=4,2,1), "
                               "else text (rollback=snapshot)", 100))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdec-jax", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{generate,bench}")
    sub.required = True
    g = sub.add_parser("generate", help="generate a continuation of a prompt",
                       description="Generate a continuation of a prompt and print it with a timing table.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.epilog_fn = methods_help
    g.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    g.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text; \\n and \\t escapes are interpreted")
    g.add_argument("--method", default="ar", help="decoding method (default ar; the methods and their options are "
                                                   "listed below)")
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
    g.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a method option (repeatable), e.g. --option rollback=snapshot --option tree=4,2,1; "
                        "the list is below")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="parameter dtype (default bfloat16 on GPU/TPU, float32 on CPU)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress lines on stderr while loading and compiling (default: when stderr is a terminal)")

    b = sub.add_parser("bench", help="benchmark decoding methods on the same prompts (paired with ar)",
                       description="Paired benchmark: per prompt, every method runs once untimed, then --repeats "
                                   "timed rounds with the methods alternating; ar is always the baseline. Writes "
                                   "bench.json, bench.md and bench.png to --out.")
    b.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
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
    b.add_argument("--out", default=None,
                   help=f"report folder (default ./{DEFAULT_BENCH_OUT}/bench-<model name>, under the working folder)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _check_numbers(args) -> None:
    from .options import range_text
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be {range_text(1)}; got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be a finite number {range_text(0)}; got {args.temperature}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be {range_text(0)} (0 = off); got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be {range_text(0, 1, lo_open=True)}; got {args.top_p}")
    if args.num_steps is not None and args.num_steps < 1:
        raise UsageError(f"--num-steps must be {range_text(1)}; got {args.num_steps}")


def _resolve_model(text: str) -> str:
    """--model as a folder: a path, or a shipped checkpoint's name (CheckpointError saying where it looked)."""
    folder = shipped.resolve(os.path.expanduser(text))
    if not os.path.isdir(folder):
        raise UsageError(f"model folder '{folder}' does not exist" if not os.path.exists(folder)
                         else f"--model '{folder}' is not a folder")
    return folder


def parse_value(text: str, as_list: bool = False):
    """An --option value: int, float, true/false, none, a comma-separated list of those, else the text itself."""
    if as_list or "," in text:
        return tuple(parse_value(part) for part in text.split(",") if part.strip())
    text = text.strip()
    words = {"true": True, "false": False, "none": None}
    if text.lower() in words:
        return words[text.lower()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def method_options(args, family: str) -> dict:
    """The method's options from its flags and --option key=value; one UsageError for an option the method does
    not take (with a close match), a malformed or repeated one."""
    from . import methods
    spec = methods.spec_for(family, args.method)
    if spec is None:
        names = methods.family_methods(family)
        hint = methods.did_you_mean(args.method, names)
        known = " (a method of another family)" if args.method in methods.known() else ""
        raise UsageError(f"unknown method '{args.method}' for this {family} model{known}{hint}; "
                         f"supported: {', '.join(names)}")
    accepted = methods.accepted_options(spec)
    flags = {"gamma": args.gamma, "mlp_keep": args.mlp_keep, "shortlist_size": args.shortlist_size,
             "num_steps": args.num_steps, "exact": False if args.no_exact else None}
    if args.skip_layers is not None:
        try:
            flags["skip_layers"] = tuple(int(x) for x in args.skip_layers.split(",") if x.strip())
        except ValueError:
            raise UsageError(f"--skip-layers takes comma-separated layer indices; got {args.skip_layers!r}") from None
    options = {}
    for key, value in flags.items():
        if value is None:
            continue
        if key not in accepted:
            raise UsageError(f"{FLAG_OPTIONS[key]} does not apply to method '{args.method}' of this {family} model; "
                             f"its options: {', '.join(accepted) or 'none'}")
        options[key] = value
    for item in args.option:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise UsageError(f"--option takes key=value; got {item!r}")
        if key in SAMPLING_FLAGS:
            raise UsageError(f"--option {key}: use {SAMPLING_FLAGS[key]}")
        if key not in accepted + methods.GENERATE_OPTIONS:
            hint = methods.did_you_mean(key, accepted + methods.GENERATE_OPTIONS)
            raise UsageError(f"unknown option '{key}' for method '{args.method}'{hint}; its options: "
                             f"{', '.join(accepted + methods.GENERATE_OPTIONS)}")
        if key in options:
            what = FLAG_OPTIONS[key] if key in flags and flags[key] is not None else "--option"
            raise UsageError(f"option '{key}' is set twice ({what} and --option {item})")
        options[key] = parse_value(text, as_list=key in methods.LIST_OPTIONS)
    return options


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
            get("verify_steps", "{:d}"), get("mean_accepted", "{:.2f}"), get("compile_seconds", "{:.1f}")]


def _table(rows: list[list[str]]) -> str:
    header = ["method", "tokens/s", "new tokens", "verify steps", "mean accepted", "compile s"]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header)] + [fmt(r) for r in rows])


def _progress_printer(setting):
    """print-like function for progress lines on stderr (setting None: when stderr is a terminal)."""
    on = sys.stderr.isatty() if setting is None else setting
    start = time.perf_counter()

    def say(message: str) -> None:
        if on:
            print(f"[{time.perf_counter() - start:5.1f} s] {message}", file=sys.stderr, flush=True)
    return say


def generate_command(args) -> int:
    _check_numbers(args)
    say = _progress_printer(args.progress)
    folder = _resolve_model(args.model)
    prompt = unescape(args.prompt)
    if not prompt:
        raise UsageError("--prompt is empty")
    # the family decides which options apply: checked before any weight is read
    from .models.qwen35.config import read_config
    family = read_config(folder).family
    if args.num_steps is not None and family != "looped":
        raise UsageError(f"--num-steps applies to looped models only; '{folder}' is a {family} model")
    options = method_options(args, family)

    say(f"loading {folder} ...")
    import jax
    import numpy as np
    import specdec_jax as sj

    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    model = sj.load(folder, dtype=dtype)
    tokenizer = model.tokenizer
    if tokenizer is None:
        from .text import load_tokenizer
        tokenizer = load_tokenizer(folder)  # raises: no tokenizer in the folder
    methods = tuple(sj.supported_methods(model))
    if args.method not in methods:
        from .methods import requirement
        need = requirement(args.method, family)
        raise UsageError(f"method '{args.method}' is not supported by this {family} model"
                         + (f": it needs {need}" if need else "") + f"; supported: {', '.join(methods)}")

    ids = tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise UsageError("the prompt encodes to no tokens")
    ids = np.asarray([ids], np.int64)
    sampling = dict(temperature=args.temperature, seed=args.seed, top_k=args.top_k, top_p=args.top_p)

    eos_ids = set(model.config.eos_token_id)

    def run(method, opts, show=False):
        """The result, and the compile seconds of the method's first call; show: print the prompt, then the
        continuation as it streams (`sj.stream`)."""
        say(f"compiling and running {method} ({args.max_new_tokens} new tokens) ...")
        if show:
            out = _print_streamed(sj.stream(model, ids, args.max_new_tokens, method=method, **sampling, **opts),
                                  prompt, tokenizer, eos_ids)
        else:
            out = sj.generate(model, ids, args.max_new_tokens, method=method, **sampling, **opts)
        compile_s = out.stats.get("compile_seconds")
        if args.compare_ar:
            # With --compare-ar each method runs a second time for the timing: first executions pay one-time
            # costs (allocation, thread pools) that would bias the comparison.
            out = sj.generate(model, ids, args.max_new_tokens, method=method, **sampling, **opts)
        return out, compile_s

    result, compile_s = run(args.method, options, show=True)
    say("done")
    rows = [_row(dict(result.stats, method=result.stats.get("method", args.method), compile_seconds=compile_s))]
    notes = [f"model: {folder} ({model.family}, {dtype}); prompt {ids.shape[1]} tokens"]
    if args.compare_ar:
        if args.method == "ar":
            notes.append("--compare-ar: the method is already ar")
        else:
            ar_options = {k: v for k, v in options.items() if k in ("num_steps", "exact")}
            if result.stats.get("exact"):  # exact output is AR's at the same decode row count
                ar_options["decode_rows"] = result.stats["decode_rows"]
            base, base_compile = run("ar", ar_options)
            say("done")
            rows.append(_row(dict(base.stats, method="ar", compile_seconds=base_compile)))
            speedup = result.stats["tokens_per_second"] / max(base.stats["tokens_per_second"], 1e-9)
            notes.append(f"speedup over ar: {speedup:.2f}x")
            if args.temperature == 0:
                same = np.array_equal(result.tokens, base.tokens)
                notes.append(f"greedy output identical to ar: {'yes' if same else 'NO'}")
    print(_table(rows))
    for n in notes:
        print(n)
    return 0


def _print_streamed(pieces, prompt: str, tokenizer, eos_ids: set):
    """Print the prompt, then its continuation as the pieces of `sj.stream` arrive (text held back while it ends
    in an incomplete character); returns the generation's result."""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    got, shown = [], ""
    while True:
        try:
            piece = next(pieces)
        except StopIteration as stop:
            result = stop.value
            break
        got.extend(int(t) for t in piece[0])
        text = tokenizer.decode(_trim_at_eos(got, eos_ids), skip_special_tokens=True).rstrip("\ufffd")
        if text.startswith(shown) and len(text) > len(shown):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    final = tokenizer.decode(_trim_at_eos(result.tokens[0], eos_ids), skip_special_tokens=True)
    sys.stdout.write((final[len(shown):] if final.startswith(shown) else "") + "\n\n")
    return result


def _parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise UsageError(f"--methods names no method; got {text!r}")
    return list(dict.fromkeys(methods))


def bench_command(args) -> int:
    from .options import range_text
    for name, value, low in (("--max-new-tokens", args.max_new_tokens, 2), ("--num-prompts", args.num_prompts, 1),
                             ("--max-prompt-tokens", args.max_prompt_tokens, 1), ("--repeats", args.repeats, 1)):
        if value < low:
            raise UsageError(f"{name} must be {range_text(low)}; got {value}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be a finite number {range_text(0)}; got {args.temperature}")
    if args.gamma is not None and not 1 <= args.gamma <= args.max_new_tokens:
        raise UsageError(f"--gamma must be {range_text(1, args.max_new_tokens)} (at most --max-new-tokens); "
                         f"got {args.gamma}")
    methods = _parse_methods(args.methods)
    folder = _resolve_model(args.model)
    out = args.out or os.path.join(DEFAULT_BENCH_OUT, f"bench-{os.path.basename(os.path.normpath(folder))}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out '{out}' exists and is not a folder")

    from .bench import bench
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
