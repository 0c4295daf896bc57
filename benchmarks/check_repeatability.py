"""Run-to-run repeatability of exact greedy generation at the Qwen3.5-9B shape (random bf16 weights), on the GPU.

The same prompt is generated several times, one call after another in one process, by exact AR and by exact n-gram
speculation with the replay-input stash off and on (gated_delta.REPLAY_STASH False / True) or as the backend sets it
(`--programs`). Each output is
compared with the first AR output of its prompt. A run that differs from another run of the same program is
nondeterminism (a race or an order-dependent reduction), not a difference between AR and speculation.

    python benchmarks/check_repeatability.py --num-prompts 4 --repeats 8 --out benchmarks/results
    python benchmarks/check_repeatability.py --tiny-shape --num-prompts 1 --repeats 2 --max-new-tokens 8 --out /tmp/x
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import specdec_jax.decoding.compiled as compiled  # noqa: E402
from pallas_kernels import gated_delta  # noqa: E402
from benchmarks.bench_spec import random_9b_model  # noqa: E402
from specdec_jax.decoding.autoregressive import ar_ops, generate_autoregressive  # noqa: E402
from specdec_jax.decoding.decode_shape import choose_decode_rows  # noqa: E402
from specdec_jax.decoding.sampling import SamplingConfig  # noqa: E402
from specdec_jax.decoding.speculative import generate_speculative  # noqa: E402
from specdec_jax.drafters.ngram import NgramDrafter  # noqa: E402
from specdec_jax.bench.harness import result_header, write_results  # noqa: E402
from specdec_jax.models.family import QWEN35  # noqa: E402

PROGRAMS = {"ar": "ar", "stash-off": "ngram, stash off", "stash-on": "ngram, stash on", "default": "ngram"}


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    diff = np.nonzero(a != b)[0]
    return int(diff[0]) if diff.size else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--gamma", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--damp", type=float, default=0.02)
    ap.add_argument("--tiny-shape", action="store_true", help="a tiny shape (CPU smoke run)")
    ap.add_argument("--programs", default="ar,stash-off,stash-on",
                    help=f"comma-separated, from {', '.join(PROGRAMS)} (default: the replay-input stash as this backend "
                         f"sets it); the first must be ar")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.num_prompts < 1 or args.repeats < 2:
        ap.error("--num-prompts must be >= 1 and --repeats >= 2 (repeatability needs two runs)")
    programs = [p.strip() for p in args.programs.split(",")]
    if programs[0] != "ar" or not set(programs) <= set(PROGRAMS) or len(set(programs)) != len(programs):
        ap.error(f"--programs must start with ar and name each of {', '.join(PROGRAMS)} at most once; got {args.programs!r}")
    programs = [PROGRAMS[p] for p in programs]
    header = result_header("check_repeatability")
    model = random_9b_model(args.tiny_shape, damp=args.damp)
    cfg, params = model.config, model.params
    rows = choose_decode_rows(args.gamma, None, "qwen3_5")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, (1, args.prompt_len)) for _ in range(args.num_prompts)]
    common = dict(max_len=args.prompt_len + args.max_new_tokens + rows, sampling=SamplingConfig(), seed=0, eos_ids=(),
                  state_dtype=model.dtype)

    def run(program: str, ids) -> np.ndarray:
        if program == "ar":
            result = generate_autoregressive(ar_ops(QWEN35, rows), params, cfg, ids, args.max_new_tokens, **common,
                                             compiler_options=compiled.compiler_options("qwen3_5"))
        else:
            # part of the compile cache key (compiled._switches)
            gated_delta.REPLAY_STASH = program.endswith("on") if "stash" in program else None
            result = generate_speculative(params, cfg, ids, args.max_new_tokens, drafter=NgramDrafter(),
                                          gamma=args.gamma, rollback="replay", decode_rows=rows, **common)
        return np.asarray(result.tokens[0])

    t0 = time.perf_counter()
    outputs = {(p, i): [] for p in programs for i in range(args.num_prompts)}
    for r in range(args.repeats):  # programs interleaved, one call at a time
        for i, ids in enumerate(prompts):
            for p in programs:
                outputs[p, i].append(run(p, ids))
        print(f"repeat {r} done after {time.perf_counter() - t0:.0f} s", flush=True)
    rows_out = []
    for i in range(args.num_prompts):
        reference = outputs["ar", i][0]
        for p in programs:
            runs = outputs[p, i]
            diffs = [first_difference(reference, x) for x in runs]
            distinct = len({x.tobytes() for x in runs})
            rows_out.append({"prompt": i, "program": p, "runs": len(runs), "equal_to_first_ar": sum(d is None for d in diffs),
                             "distinct_outputs": distinct, "first_differences": [d for d in diffs if d is not None]})
    out = {**header, "model": "qwen35_9b_random" + ("_tiny_shape" if args.tiny_shape else ""), "damp": args.damp,
           "gamma": args.gamma, "decode_rows": rows, "max_new_tokens": args.max_new_tokens,
           "prompt_len": args.prompt_len, "repeats": args.repeats, "seconds": time.perf_counter() - t0,
           "rows": rows_out}
    md = [f"# Run-to-run repeatability of exact greedy generation ({out['model']})", "",
          f"{header['device']} · jax {header['jax']} · commit {header['git_commit']}", "", f"`{header['command']}`", "",
          f"Random weights (bfloat16, residual writes x{args.damp}), {args.prompt_len}-token random prompts, "
          f"{args.max_new_tokens} new tokens, greedy, exact path (decode rows {rows}); n-gram drafts at gamma "
          f"{args.gamma}, replay rollback. Each program ran {args.repeats} times per prompt, one call after another "
          f"(programs interleaved). `equal` counts runs whose output equals the prompt's first AR output; `distinct` "
          f"counts different outputs among a program's own runs (1: repeatable).", "",
          "| prompt | program | equal / runs | distinct outputs | first differences |", "|---|---|---|---|---|"]
    md += [f"| {r['prompt']} | {r['program']} | {r['equal_to_first_ar']} / {r['runs']} | {r['distinct_outputs']} | "
           f"{', '.join(map(str, r['first_differences'])) or '—'} |" for r in rows_out]
    write_results(args.out, f"repeatability_{out['model']}{args.tag}", out, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
