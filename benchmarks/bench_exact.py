"""Exactness in the dtype users run: speculative output against AR, token for token, and what the exact path costs.

    python benchmarks/bench_exact.py --part tiny    # both shipped checkpoints, held-out prompts
    python benchmarks/bench_exact.py --part 9b      # Qwen3.5-9B shape, random weights with damped residual writes
    python benchmarks/bench_exact.py --part 9b --tiny-shape --max-new-tokens 16   # CPU smoke run

tiny: for every chain method of the shipped Qwen3.5 checkpoint and every lossless looped method of the
shipped Huginn checkpoint, greedy generation on each held-out prompt with exact=True (the default: every
decode forward at one padded row count) and exact=False (AR at one row, verification at gamma + 1 rows);
each speculative output is compared with AR of the same setting. Decode tok/s are reported beside it.

9b: AR with and without the decode shape, timed alternately (decode tok/s, median of --repeats), then
greedy outputs of n-gram drafts and of forced drafts (AR's own continuation, each draft replaced by a
wrong token with probability --miss, so steps accept a varying number of drafts) compared with AR, in
both settings. Results: benchmarks/results/exact_<part>.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import specdec_jax.decoding.compiled as compiled  # noqa: E402
from specdec_jax.bench.harness import (alternate, cut_prompts, decode_tokens_per_second,  # noqa: E402
                                  own_reference_rows, result_header, write_results)
from specdec_jax.drafters.stateless import StatelessDrafter  # noqa: E402

QWEN_METHODS = ("ngram", "ngram:8", "ngram-table", "mtp", "mtp-shortlist", "layer-skip", "residual-reuse", "partial-mlp")
LOOPED_METHODS = ("self-spec", "mature-spec", "das-wave")


@dataclasses.dataclass(frozen=True)
class ForcedDrafter(StatelessDrafter):
    """Drafts a reference continuation (params["forced_reference"] [B, N]: AR's output), each draft replaced
    by a wrong token with probability `miss`. Benchmark-only: it makes steps accept a known mix of counts."""

    prompt_len: int
    miss: float = 0.2
    name = "forced"

    def propose(self, params, cfg, drafter_state, history, hist_len, gamma: int, key, **_):
        ref = params["forced_reference"]  # [B, N]
        padded = jnp.concatenate([ref, jnp.repeat(ref[:, -1:], gamma, axis=1)], axis=1)
        start = hist_len - self.prompt_len  # tokens emitted so far: the next one is ref[start]
        drafts = jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, gamma))(padded, start)
        wrong = jax.random.uniform(key, drafts.shape) < self.miss
        return jnp.where(wrong, (drafts + 1) % cfg.vocab_size, drafts).astype(jnp.int32), None, drafter_state


def _method(spec: str) -> tuple[str, dict]:
    name, _, gamma = spec.partition(":")
    return name, ({"gamma": int(gamma)} if gamma else {})


def tiny_part(args, header, save) -> dict:
    import specdec_jax as sj
    from specdec_jax.text import load_tokenizer
    prompts_text = json.load(open(args.prompts))
    out = {**header, "max_new_tokens": args.max_new_tokens, "prompts": args.prompts, "models": {}}
    folders = {"qwen": (args.qwen, QWEN_METHODS), "huginn": (args.huginn, LOOPED_METHODS)}
    for folder, methods in (folders[m] for m in args.models.split(",")):
        model = sj.load(folder, dtype="bfloat16")
        tok = load_tokenizer(folder)
        available = set(sj.supported_methods(model))
        # --methods: any of the model's methods, with a gamma (`ngram:16`); by default the list above
        methods = [m for m in (args.methods or methods) if _method(m)[0] in available]
        # The first --num-prompts prompts of at least --prompt-len tokens, cut to their last --prompt-len: one
        # prompt shape, so every setting compiles once.
        encoded = [tok.encode(t, add_special_tokens=False) for t in prompts_text]
        prompts = [np.asarray([e]) for e in cut_prompts(encoded, args.prompt_len, args.num_prompts)]
        modes = [m == "exact" for m in args.modes.split(",")]
        name = os.path.basename(os.path.normpath(folder))

        def run(ids, spec, exact, **extra):
            if spec is None:
                return sj.generate(model, ids, args.max_new_tokens, eos_token_id=False, exact=exact, **extra)
            method, opts = _method(spec)
            return sj.generate(model, ids, args.max_new_tokens, method=method, eos_token_id=False, exact=exact,
                               **opts)

        # Every setting compiles first, 8 at a time (XLA compiles release the GIL); the timed runs reuse them.
        jobs = [(spec, exact) for exact in modes for spec in [None] + methods]
        compiled.MAX_ENTRIES = max(compiled.MAX_ENTRIES, 4 * len(jobs))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=8) as pool:
            compile_s = dict(zip(jobs, pool.map(lambda j: run(prompts[0], *j).stats["compile_seconds"], jobs)))
        print(f"{name}: compiled {len(jobs)} settings in {time.perf_counter() - t0:.0f} s", flush=True)
        rows = [{"prompt_tokens": int(ids.shape[1])} for ids in prompts]
        for exact in modes:
            mode = "exact" if exact else "fast"
            for spec in [None] + methods:
                for row, ids in zip(rows, prompts):
                    ar = run(ids, None, exact)  # paired: AR right before each run
                    ar_tps = ar.stats["decode_tokens_per_second"]
                    if spec is None:
                        row[f"ar/{mode}"] = {"tps": ar_tps, "compile_s": compile_s[None, exact]}
                        continue
                    r = run(ids, spec, exact)
                    rows_used = r.stats["decode_rows"] if exact else ar.stats["decode_rows"]
                    own_rows = own_reference_rows(r.stats, ar.stats)
                    ref = ar if own_rows is None else run(ids, None, True, decode_rows=own_rows)
                    tps = decode_tokens_per_second(r.stats)
                    row[f"{spec}/{mode}"] = {"equal_to_ar": bool((r.tokens == ref.tokens).all()),
                                             "tps": tps, "speedup": tps / ar_tps,
                                             "mean_accepted": r.stats["mean_accepted"],
                                             "decode_rows": rows_used, "compile_s": compile_s[spec, exact]}
                out["models"][name] = {"rows": rows, "summary": _summary(rows)}
                key = f"{spec or 'ar'}/{mode}"
                print(json.dumps({key: out["models"][name]["summary"].get(key)}), flush=True)
                save(out)  # as it goes: a time limit keeps what was measured
    return out


def _summary(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if "/" in k]
    summary = {}
    for k in keys:
        vals = [r[k] for r in rows]
        s = {"median_tps": float(np.median([v["tps"] for v in vals])),
             "max_compile_s": float(max(v["compile_s"] for v in vals))}
        if "equal_to_ar" in vals[0]:
            s["equal_to_ar"] = int(sum(v["equal_to_ar"] for v in vals))
            s["median_speedup"] = float(np.median([v["speedup"] for v in vals]))
            s["mean_accepted"] = float(np.mean([v["mean_accepted"] for v in vals]))
        summary[k] = s
    return summary


def nine_b_part(args, header) -> dict:
    from benchmarks.bench_spec import random_9b_model
    from specdec_jax.decoding.autoregressive import ar_ops, generate_autoregressive
    from specdec_jax.decoding.decode_shape import choose_decode_rows
    from specdec_jax.decoding.sampling import SamplingConfig
    from specdec_jax.decoding.speculative import generate_speculative
    from specdec_jax.drafters.ngram import NgramDrafter
    from specdec_jax.models.family import QWEN35
    model = random_9b_model(args.tiny_shape, dtype=args.dtype, damp=args.damp)
    cfg, params = model.config, model.params
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, (1, args.prompt_len)) for _ in range(args.num_prompts)]
    N, gamma = args.max_new_tokens, args.gamma
    rows = choose_decode_rows(gamma, None, "qwen3_5")
    max_len = args.prompt_len + N + rows
    common = dict(max_len=max_len, sampling=SamplingConfig(), seed=0, eos_ids=(), state_dtype=model.dtype)

    def ar(ids, exact):
        return generate_autoregressive(ar_ops(QWEN35, rows if exact else 0), params, cfg, ids, N, **common,
                                       compiler_options=compiled.compiler_options("qwen3_5"))

    def spec(ids, drafter, exact, ref=None):
        p = params if ref is None else dict(params, forced_reference=jnp.asarray(ref))
        return generate_speculative(p, cfg, ids, N, drafter=drafter, gamma=gamma, rollback="replay",
                                    decode_rows=rows if exact else 0, **common)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:  # compile both AR loops at once
        first = dict(zip((True, False), pool.map(lambda e: ar(prompts[0], e), (True, False))))
    print(f"AR compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    out = {**header, "model": "qwen35_9b_random" + ("_tiny_shape" if args.tiny_shape else ""), "damp": args.damp,
           "dtype": args.dtype, "precision": args.precision,
           "gamma": gamma, "decode_rows": rows, "max_new_tokens": N, "prompt_len": args.prompt_len,
           "miss": args.miss, "compile_seconds": {f"ar/{'exact' if e else 'fast'}": r.stats["compile_seconds"]
                                                  for e, r in first.items()}}
    sweep = [r for r in (int(x) for x in args.ar_rows.split(",") if x) if r != rows]

    def ar_rows(ids, r):
        return generate_autoregressive(ar_ops(QWEN35, r), params, cfg, ids, N, **common,
                                       compiler_options=compiled.compiler_options("qwen3_5"))

    with ThreadPoolExecutor(max_workers=max(len(sweep), 1)) as pool:
        list(pool.map(lambda r: ar_rows(prompts[0], r), sweep))
    tok_s = lambda result: result.stats["decode_tokens_per_second"]  # noqa: E731
    times = alternate({True: lambda: tok_s(ar(prompts[0], True)), False: lambda: tok_s(ar(prompts[0], False)),
                       **{r: (lambda r=r: tok_s(ar_rows(prompts[0], r))) for r in sweep}}, args.repeats)
    out["ar_tok_s"] = {"exact": float(np.median(times[True])), "fast": float(np.median(times[False]))}
    out["ar_exact_time_ratio"] = out["ar_tok_s"]["fast"] / out["ar_tok_s"]["exact"]
    out["ar_tok_s_by_rows"] = {1: out["ar_tok_s"]["fast"], rows: out["ar_tok_s"]["exact"],
                               **{r: float(np.median(times[r])) for r in sweep}}
    print(json.dumps(out["ar_tok_s_by_rows"]), flush=True)
    out["rows"] = []
    for i, ids in enumerate(prompts):
        refs = {e: ar(ids, e).tokens for e in (True, False)}
        jobs = [(d, e) for d in ("ngram", "forced") for e in (True, False)]

        def run(job):
            d, e = job
            drafter = NgramDrafter() if d == "ngram" else ForcedDrafter(prompt_len=ids.shape[1], miss=args.miss)
            return spec(ids, drafter, e, None if d == "ngram" else refs[e])

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            results = dict(zip(jobs, pool.map(run, jobs)))
        row = {"prompt": i, "seconds": time.perf_counter() - t0}
        for (d, e), r in results.items():
            a = refs[e][0]
            b = r.tokens[0]
            diff = np.nonzero(a != b)[0]
            row[f"{d}/{'exact' if e else 'fast'}"] = {
                "equal_to_ar": bool(diff.size == 0), "first_difference": int(diff[0]) if diff.size else None,
                "tokens_per_step": r.stats["tokens_per_step"], "compile_s": r.stats["compile_seconds"]}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    return out


def markdown(result, args) -> str:
    dtype = result.get("dtype", "bfloat16") + (f" at matmul precision {result['precision']!r}"
                                               if result.get("precision") else "")
    md = [f"# Exactness in {dtype}: speculative output against AR ({args.part})", "",
          f"{result['device']} · jax {result['jax']} · commit {result['git_commit']}", "", f"`{result['command']}`", ""]
    if args.part == "tiny":
        md += [f"Greedy, bfloat16, held-out prompts ({args.prompts}: the first {args.num_prompts} of at least "
               f"{args.prompt_len} tokens, cut to their last {args.prompt_len}) x {result['max_new_tokens']} new "
               f"tokens, EOS off. Compile seconds: the first prompt's run (later runs reuse it). An exact run is "
               f"compared with exact AR at its own decode row count (max(default, gamma + 1)). exact: every decode forward (AR step and "
               f"verification) at one padded row count; fast: AR at 1 row, verification at gamma + 1 rows. Each "
               f"speculative run is compared with AR of the same setting; decode tok/s median over prompts.", ""]
        for name, m in result["models"].items():
            n = len(m["rows"])
            md += [f"## {name}", "", "| method | setting | equal to AR | median decode tok/s | median speedup | "
                   "mean accepted drafts / step | max compile s |", "|---|---|---|---|---|---|---|"]
            for k, s in m["summary"].items():
                method, mode = k.split("/")
                eq = f"{s['equal_to_ar']} of {n}" if "equal_to_ar" in s else "—"
                sp = f"{s['median_speedup']:.2f}×" if "median_speedup" in s else "—"
                acc = f"{s['mean_accepted']:.2f}" if "mean_accepted" in s else "—"
                md.append(f"| {method} | {mode} | {eq} | {s['median_tps']:.0f} | {sp} | {acc} | {s['max_compile_s']:.1f} |")
            md.append("")
    else:
        a = result["ar_tok_s"]
        md += [f"Random weights ({dtype}), every residual write scaled by {result['damp']}; gamma {result['gamma']}, "
               f"decode rows {result['decode_rows']}, {result['max_new_tokens']} new tokens, prompts of "
               f"{result['prompt_len']} random tokens.", "",
               f"AR decode: exact (at {result['decode_rows']} rows) {a['exact']:.1f} tok/s, fast (1 row) "
               f"{a['fast']:.1f} tok/s: the exact path costs {result['ar_exact_time_ratio']:.3f}× the time per token "
               f"(median of {args.repeats}, alternating).", "",
               "| decode rows | AR decode tok/s | time per token vs 1 row |", "|---|---|---|"]
        for r, tps in sorted(result["ar_tok_s_by_rows"].items(), key=lambda kv: int(kv[0])):
            md.append(f"| {r} | {tps:.1f} | {a['fast'] / tps:.3f}× |")
        md += ["",
               "| prompt | drafts | setting | equal to AR | first difference | tokens / step |", "|---|---|---|---|---|---|"]
        for r in result["rows"]:
            for k, v in r.items():
                if "/" not in k:
                    continue
                d, mode = k.split("/")
                fd = "—" if v["first_difference"] is None else str(v["first_difference"])
                md.append(f"| {r['prompt']} | {d} | {mode} | {'yes' if v['equal_to_ar'] else 'no'} | {fd} | "
                          f"{v['tokens_per_step']:.2f} |")
    return "\n".join(md) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("tiny", "9b"), required=True)
    ap.add_argument("--qwen", default="checkpoints/tiny-qwen35-code")
    ap.add_argument("--huginn", default="checkpoints/tiny-huginn-code")
    ap.add_argument("--prompts", default="benchmarks/prompts/heldout_stdlib.json")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64, help="tiny: last tokens of each prompt; 9b: prompt length")
    ap.add_argument("--models", default="qwen,huginn", help="tiny: which shipped checkpoints (qwen, huginn)")
    ap.add_argument("--methods", type=lambda t: t.split(","), default=None,
                    help="tiny: these methods (comma list of name[:gamma]; default QWEN_METHODS and LOOPED_METHODS)")
    ap.add_argument("--modes", default="exact,fast", help="tiny: the exact path, the fast one (exact=False), or both")
    ap.add_argument("--ar-rows", default="8,16", help="9b: decode row counts at which AR is also timed")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tiny-shape", action="store_true", help="9b: a tiny shape (CPU smoke run)")
    ap.add_argument("--damp", type=float, default=0.02)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="9b: the weights' dtype")
    ap.add_argument("--precision", default=None, choices=(None, "highest"),
                    help="9b: jax_default_matmul_precision for the whole run")
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--miss", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not 0.0 <= args.miss <= 1.0:
        ap.error(f"--miss must lie in [0, 1]; got {args.miss}")
    if args.part == "tiny" and (args.dtype != "bfloat16" or args.precision):
        ap.error("--dtype and --precision apply to --part 9b (the tiny part runs the shipped checkpoints in bfloat16)")
    if args.precision:
        jax.config.update("jax_default_matmul_precision", args.precision)
    header = result_header("bench_exact")
    if args.part == "tiny":
        stem = "exact_tiny"
        result = tiny_part(args, header, lambda r: write_results(args.out, stem + args.tag, r, markdown(r, args),
                                                                 echo=False))
    else:
        result = nine_b_part(args, header)
        stem = "exact_qwen35_9b_random" + ("_tiny_shape" if args.tiny_shape else "") \
            + ("" if args.dtype == "bfloat16" else f"_{args.dtype}") + (f"_{args.precision}" if args.precision else "")
    write_results(args.out, stem + args.tag, result, markdown(result, args))


if __name__ == "__main__":
    main()
