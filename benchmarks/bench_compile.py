"""Compile time of one `generate()` call per method, as a new user waits for it, beside the speed it then runs at.

    python benchmarks/bench_compile.py --model checkpoints/tiny-qwen35-code --out benchmarks/results
    python benchmarks/bench_compile.py --random-9b --out benchmarks/results      # the Qwen3.5-9B shape, random weights

Every method the model supports, at its default options, one after another in this process: the library's and
JAX's compile caches are cleared before each, so its first call compiles everything it runs (prefill, loop), and
`compile_seconds` is what that call reports; a second call with the same shapes then gives the decode tok/s. Greedy,
EOS off, one held-out prompt (random tokens for --random-9b). Methods past --time-budget-s are skipped and listed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from specdec_jax.bench.harness import result_header, write_results  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint folder")
    src.add_argument("--random-9b", action="store_true", help="random bf16 weights at the Qwen3.5-9B shape")
    ap.add_argument("--tiny", action="store_true", help="with --random-9b: the small shape of the same layout (smoke)")
    ap.add_argument("--methods", default="", help="comma list (default: every method the model supports)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--time-budget-s", type=float, default=400.0, help="no method starts after this many seconds")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if args.prompt_len < 1 or args.max_new_tokens < 1:
        ap.error(f"--prompt-len and --max-new-tokens must be >= 1, got {args.prompt_len} and {args.max_new_tokens}")
    if args.tiny and not args.random_9b:
        ap.error("--tiny goes with --random-9b")
    from specdec_jax import methods
    known = {m.name for m in methods.REGISTRY}
    if unknown := [m for m in args.methods.split(",") if m and m not in known]:
        ap.error(f"--methods: no method named {unknown} (known: {', '.join(sorted(known))})")
    return args


def _prompt(args, model) -> np.ndarray:
    if args.random_9b:
        return np.random.default_rng(0).integers(0, model.vocab_size, size=(1, args.prompt_len))
    from transformers import AutoTokenizer

    from benchmarks.bench_spec import load_prompts
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [p for p in load_prompts("heldout", tok, 10 ** 4) if len(p) >= args.prompt_len]
    if not prompts:
        raise SystemExit(f"no held-out prompt has {args.prompt_len} tokens (--prompt-len)")
    return np.asarray([prompts[0][-args.prompt_len:]])


def write(args, header, name, rows, skipped) -> list[str]:
    """The JSON + Markdown of the rows so far (rewritten after each method: a run cut short keeps what it measured)."""
    md = [f"# Compile time of one generate() call per method ({name})", "",
          f"{header['device']} · jax {header['jax']} · commit {header['git_commit']} · {header['date']}", "",
          f"`{header['command']}`", "",
          f"Each method at its defaults, one after another in one process, with the library's and JAX's compile caches "
          f"cleared before each: its first call ({args.prompt_len}-token prompt, {args.max_new_tokens} new tokens, greedy) "
          f"compiles its prefill and decode programs; a second call gives the decode speed.", "",
          "| method | compile s (first call) | first call s | decode tok/s (second call) |", "|---|---|---|---|"]
    md += [f"| {r['method']} | {r['compile_seconds']:.1f} | {r['first_call_seconds']:.1f} | "
           f"{r['decode_tokens_per_second']:.0f} |" for r in rows]
    if skipped:
        md += ["", f"Not run (past --time-budget-s {args.time_budget_s:g}): {', '.join(skipped)}."]
    write_results(args.out, f"compile_{name}{args.tag}", {**header, "model": name, "rows": rows, "skipped": skipped},
                  "\n".join(md) + "\n")
    return md


def main(argv=None) -> int:
    args = parse_args(argv)
    import specdec_jax as sj
    from specdec_jax.decoding import compiled

    t_start = time.perf_counter()
    if args.random_9b:
        from benchmarks.bench_spec import random_9b_model
        model, name = random_9b_model(args.tiny), ("qwen35_tiny_random" if args.tiny else "qwen35_9b_random")
    else:
        model, name = sj.load(args.model), os.path.basename(os.path.normpath(args.model))
    supported = list(sj.supported_methods(model))
    wanted = [m for m in args.methods.split(",") if m] or supported
    unknown = [m for m in wanted if m not in supported]
    if unknown:
        raise SystemExit(f"--methods: {unknown} not supported by {name} (supported: {', '.join(supported)})")
    ids = _prompt(args, model)
    header = result_header("bench_compile")
    rows, skipped = [], []
    for method in wanted:
        if time.perf_counter() - t_start > args.time_budget_s:
            skipped.append(method)
            continue
        compiled.clear()
        jax.clear_caches()
        t0 = time.perf_counter()
        first = sj.generate(model, ids, args.max_new_tokens, method=method, eos_token_id=False)
        wall = time.perf_counter() - t0
        second = sj.generate(model, ids, args.max_new_tokens, method=method, eos_token_id=False)
        s = second.stats
        rows.append({"method": method, "compile_seconds": float(first.stats["compile_seconds"]),
                     "first_call_seconds": wall,
                     "decode_tokens_per_second": float(s.get("decode_tokens_per_second")
                                                       or s["new_tokens"] / s["decode_seconds"]),
                     "recompiled_on_second_call": float(s["compile_seconds"]) > 0.0})
        print(rows[-1], flush=True)
        write(args, header, name, rows, skipped)
    md = write(args, header, name, rows, skipped)
    print("\n".join(md[8:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
