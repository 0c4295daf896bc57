"""What a jitted decode-loop call costs per argument: the same loop over the same bytes, split into more or fewer arrays.

    python scripts/bench_call_overhead.py --out DIR                       (H200)
    python scripts/bench_call_overhead.py --leaves 8,64 --mib 4 --out /tmp/x   (CPU smoke)

A decode call passes every parameter array and every state array; the 9B model's call passes 307 parameter arrays and
19 state arrays and costs ~2.6 ms beyond its steps (fixed_cost_qwen35_9b_random.md). Here a `lax.while_loop` with no
known trip count (as the speculative loop's) reads one element of each of N parameter arrays (the same total bytes for
every N) and updates a donated state; each N is timed at two trip counts and fitted seconds = fixed + per_step x steps,
all variants alternated in one process. The slope of `fixed` against N is the per-argument cost of a call.
Compiled with the library's Qwen3.5 compiler options (decoding/compiled.compiler_options).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from specdec_jax.decoding.compiled import compiler_options  # noqa: E402
from specdec_jax.harness import alternate, result_header, write_results  # noqa: E402


def loop(params, state, steps):
    """`steps` iterations of: state += sum of one element of each parameter array (a trip count XLA cannot see)."""
    def body(c):
        i, s = c
        touched = sum(p[i % p.shape[0]].astype(jnp.float32) for p in params)
        return i + 1, s * 0.5 + touched

    def cond(c):
        return c[0] < steps[0]

    return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


def fit(steps, seconds):
    a = np.stack([np.ones(len(steps)), np.asarray(steps, float)], axis=1)
    coef, *_ = np.linalg.lstsq(a, np.asarray(seconds, float), rcond=None)
    return float(coef[0]), float(coef[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leaves", default="8,32,128,320", help="parameter array counts, comma-separated")
    ap.add_argument("--mib", type=float, default=256.0, help="total parameter MiB (bf16), split over the arrays")
    ap.add_argument("--state-mib", type=float, default=48.0, help="the donated state's MiB (f32)")
    ap.add_argument("--steps", default="2,16", help="two or more trip counts")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    leaves = [int(n) for n in args.leaves.split(",")]
    steps = [int(s) for s in args.steps.split(",")]
    if len(steps) < 2 or min(leaves) < 1:
        raise SystemExit("bench_call_overhead.py: --steps needs two or more counts, --leaves counts >= 1")
    total = int(args.mib * 2 ** 20 / 2)
    state0 = jnp.asarray(np.random.default_rng(0).standard_normal(int(args.state_mib * 2 ** 18)), jnp.float32)
    options = compiler_options("qwen3_5")
    compiled, inputs = {}, {}
    for n in leaves:
        rng = np.random.default_rng(n)
        params = [jnp.asarray(rng.standard_normal(total // n), jnp.bfloat16) for _ in range(n)]
        lowered = jax.jit(loop, donate_argnums=(1,)).lower(params, state0, jnp.zeros((1,), jnp.int32))
        compiled[n] = lowered.compile(compiler_options=options or None)
        inputs[n] = params
    states = {n: jnp.array(state0) for n in leaves}

    def timed(n, k):
        def run():
            steps_arr = jnp.full((1,), k, jnp.int32)
            jax.block_until_ready(steps_arr)
            t = time.perf_counter()
            states[n] = compiled[n](inputs[n], states[n], steps_arr)
            jax.block_until_ready(states[n])
            return time.perf_counter() - t
        return run

    for n in leaves:  # warm-up
        for k in steps:
            timed(n, k)()
    times = alternate({(n, k): timed(n, k) for n in leaves for k in steps}, args.repeats)
    rows = []
    for n in leaves:
        med = [float(np.median(times[n, k])) for k in steps]
        fixed, per_step = fit(steps, med)
        rows.append({"leaves": n, "fixed_ms": fixed * 1e3, "per_step_ms": per_step * 1e3,
                     "ms_per_call": dict(zip(map(str, steps), [m * 1e3 for m in med]))})
    slope = np.polyfit([r["leaves"] for r in rows], [r["fixed_ms"] for r in rows], 1)[0] * 1e3
    header = result_header("call_overhead")
    result = {**header, "leaves": leaves, "mib": args.mib, "state_mib": args.state_mib, "steps": steps,
              "compiler_options": options, "rows": rows, "fixed_us_per_leaf": float(slope)}
    md = [f"# What a decode-loop call costs per argument array", "",
          f"{header['device']} · jax {header['jax']} · commit {header['git_commit']} · {header['date']}", "",
          f"`{header['command']}`", "",
          f"A while loop with no known trip count reading one element of each of N bf16 parameter arrays ({args.mib:g} "
          f"MiB in all, split evenly) and updating a donated {args.state_mib:g} MiB state; each N timed at "
          f"{args.steps} steps, median of {args.repeats}, all alternated; fit: call = fixed + per step x steps. "
          f"Compiler options: {options or 'XLA defaults'}.", "",
          "| parameter arrays | fixed ms per call | ms per step | " + " | ".join(f"ms at {k} steps" for k in steps) + " |",
          "|---|---|---|" + "---|" * len(steps)]
    for r in rows:
        md.append(f"| {r['leaves']} | {r['fixed_ms']:.3f} | {r['per_step_ms']:.4f} | "
                  + " | ".join(f"{v:.3f}" for v in r["ms_per_call"].values()) + " |")
    md += ["", f"Fixed cost per parameter array (slope of the fit over N): **{slope:.2f} µs**."]
    write_results(args.out, f"call_overhead{args.tag}", result, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
