"""Acceptance of every drafter on a checkpoint: drafts accepted per verification (no timing).

Greedy, float32, on the same held-out prompts (cut to their last --prompt-len tokens) for every
configuration: mean accepted drafts per verify step, tokens per step (accepted + the target's
token), and whether the output equals greedy AR token for token (it must: exact arithmetic path).
Acceptance does not depend on the hardware, so this runs anywhere (CPU is fine); speed comes from
the GPU benchmarks (bench_spec.py, bench_tree.py), which can multiply these acceptance figures by
measured step costs.

    python benchmarks/acceptance_study.py --model checkpoints/tiny-qwen35-code --out benchmarks/results
    python benchmarks/acceptance_study.py --model checkpoints/tiny-huginn-code --out benchmarks/results  # looped

Configurations: 'method:gamma' (chains), 'method:b1,b2,...' (trees) or 'method:key=value,...' (any
options, e.g. 'das-wave:gamma=16,k=2'); ';'-separated. Looped models run at --num-steps (default 32).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from specdec_jax.bench.harness import result_header, write_results  # noqa: E402
from benchmarks.bench_spec import load_prompts  # noqa: E402

DEFAULT_CONFIGS = ("ngram:4;ngram:8;ngram:16;ngram-table:4;ngram-table:8;mtp:2;mtp:4;mtp:8;mtp-shortlist:4;"
                   "mtp-shortlist:8;mtp-tree:2,2,2,1;mtp-tree:4,2,1;mtp-tree:4,4,2;ngram-tree:4,2,1;"
                   "layer-skip:2;layer-skip:4;residual-reuse:4;partial-mlp:4")
DEFAULT_LOOPED_CONFIGS = ("self-spec:gamma=4,draft_steps=4;self-spec:gamma=8,draft_steps=4;"
                          "mature-spec:gamma=8,draft_steps=4;das-wave:gamma=8,k=1;das-wave:gamma=16,k=1;"
                          "das-wave:gamma=16,k=2;das-wave:gamma=32,k=2")


def _value(text: str):
    """An option value from the command line: int, float, bool or the string itself."""
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    if re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?", text):
        return float(text)
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_configs(spec: str) -> list[tuple[str, dict]]:
    """'method:gamma' for chains, 'method:b1,b2,...' for trees, 'method:key=value,...' for any options;
    ';'-separated."""
    out = []
    for item in spec.split(";"):
        method, arg = item.split(":")
        if "=" in arg:
            opts = {k.strip(): _value(v.strip()) for k, v in (kv.split("=") for kv in arg.split(","))}
        elif method.endswith("-tree"):
            opts = {"tree": tuple(int(b) for b in arg.split(","))}
        else:
            opts = {"gamma": int(arg)}
        out.append((method, opts))
    return out


def config_label(opts: dict) -> str:
    if "tree" in opts:
        return ",".join(map(str, opts["tree"]))
    if set(opts) == {"gamma"}:
        return str(opts["gamma"])
    return " ".join(f"{k}={v}" for k, v in opts.items())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="checkpoints/tiny-qwen35-code")
    ap.add_argument("--prompts", default="heldout", help="'heldout' or a .json list / text file of prompts")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--configs", default=None, help="default: every drafter (Qwen3.5) or looped method (looped)")
    ap.add_argument("--num-steps", type=int, default=32, help="looped models: full recurrence depth")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    import specdec_jax as sj
    from transformers import AutoTokenizer

    model = sj.load(args.model, dtype="float32")
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [p[-args.prompt_len:] for p in load_prompts(args.prompts, tok, 10 ** 4) if len(p) >= args.prompt_len]
    prompts = [np.asarray([p]) for p in prompts[:args.num_prompts]]
    name = os.path.basename(os.path.normpath(args.model))
    header = result_header("acceptance_study")
    looped = model.config.family == "looped"
    depth = {"num_steps": args.num_steps} if looped else {}
    configs = args.configs or (DEFAULT_LOOPED_CONFIGS if looped else DEFAULT_CONFIGS)
    ar = [sj.generate(model, ids, args.max_new_tokens, eos_token_id=False, **depth).tokens for ids in prompts]
    available = set(sj.supported_methods(model))
    rows = []
    for method, opts in parse_configs(configs):
        if method not in available:
            print(f"{method}: not supported by this checkpoint, skipped", flush=True)
            continue
        t0 = time.perf_counter()
        accepted, equal = [], []
        for ids, want in zip(prompts, ar):
            res = sj.generate(model, ids, args.max_new_tokens, method=method, eos_token_id=False, **depth, **opts)
            accepted.append(res.stats["mean_accepted"])
            equal.append(bool((res.tokens == want).all()))
        label = config_label(opts)
        rows.append({"method": method, "shape": label, "mean_accepted": float(np.mean(accepted)),
                     "per_prompt": [float(a) for a in accepted], "all_equal_to_ar": all(equal),
                     "seconds": time.perf_counter() - t0})
        print(json.dumps(rows[-1]), flush=True)
    what = f"Looped self-speculation at R = {args.num_steps}" if looped else "Drafter"
    md = [f"# {what} acceptance on {name} (greedy, float32; no timing)", "",
          f"{header['device']} · jax {header['jax']} · commit {header['git_commit']} · {header['date']}", "",
          f"`{header['command']}`", "",
          f"{len(prompts)} held-out prompts of {args.prompt_len} tokens, {args.max_new_tokens} new tokens each.", "",
          "| method | gamma / tree / options | mean accepted drafts per step | tokens per step | per prompt | equal to AR |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['method']} | {r['shape']} | {r['mean_accepted']:.2f} | {r['mean_accepted'] + 1:.2f} | "
           f"{' '.join(f'{a:.2f}' for a in r['per_prompt'])} | {r['all_equal_to_ar']} |" for r in rows]
    write_results(args.out, f"acceptance_{name}{args.tag}", {**header, "model": name, "rows": rows}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
