"""The small-T recurrent kernel (decode, verification) and the replay commit at one GDN layer's shape:
time per call inside a jitted loop of dependent calls, for each `preload` and `block_v` setting, and a
bit-for-bit check that every variant computes the same states (and that the replay reproduces the
recurrence's state). Also: a float32 matrix product [M, D] x [D, F] at M = 1 and M = 9 under each matmul
precision, to see what a float32 verification pays for its GEMMs.

    python scripts/tune_recurrent.py --out "$OUT"                 # GPU (Qwen3.5-9B layer shape)
    python scripts/tune_recurrent.py --small --out /tmp/t         # CPU smoke run (interpret mode)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specdec_jax.harness import median_time, result_header, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--lengths", default="1,9,17")
    ap.add_argument("--block-vs", default="8")
    ap.add_argument("--preloads", default="False,True", help="preload settings, comma-separated")
    ap.add_argument("--num-warps", default="1", help="warps per program, comma-separated (each with every block_v)")
    ap.add_argument("--stack", type=int, default=24,
                    help="also time the replay of this many layers in one launch (the commit's form; 0: skip)")
    ap.add_argument("--chain", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    from pallas_kernels.gated_delta import pallas_ops

    interpret = jax.default_backend() != "gpu"
    b, h, hv, kd, vd = (1, 2, 4, 32, 32) if args.small else (1, 16, 32, 128, 128)
    chain = 2 if args.small else args.chain
    repeats = 1 if args.small else args.repeats
    rows, checks = [], []
    key = iter(jax.random.split(jax.random.PRNGKey(0), 64))
    s0 = jax.random.normal(next(key), (b, hv, kd, vd), jnp.float32) * 0.1
    for t in [int(x) for x in args.lengths.split(",")]:
        q = jax.random.normal(next(key), (b, t, h, kd), jnp.bfloat16)
        k = jax.random.normal(next(key), (b, t, h, kd), jnp.bfloat16)
        v = jax.random.normal(next(key), (b, t, hv, vd), jnp.bfloat16)
        g = -jax.random.uniform(next(key), (b, t, hv), jnp.float32, 0.01, 2.0)
        beta = jax.nn.sigmoid(jax.random.normal(next(key), (b, t, hv), jnp.float32))
        n = jnp.full((b,), max(1, (t + 1) // 2), jnp.int32)
        states = {}
        configs = [(preload, block_v, warps) for preload in [x.strip() == "True" for x in args.preloads.split(",")]
                   for block_v in [int(x) for x in args.block_vs.split(",")]
                   for warps in [int(x) for x in args.num_warps.split(",")]]
        stack = max(args.stack, 0)
        tiled = [jnp.tile(x, (stack,) + (1,) * (x.ndim - 1)) for x in (k, v, g, beta, s0)] if stack else None
        n_stack = jnp.full((b * stack,), max(1, (t + 1) // 2), jnp.int32)
        for preload, block_v, warps in configs:
            kw = dict(use_qk_l2norm=True, interpret=interpret, block_v=block_v, preload=preload, num_warps=warps)

            def verify(s, kw=kw):
                res = pallas_ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s,
                                                                  return_all_states=True, **kw)
                return res.final_state, res.all_states, res.o

            def replay(s, kw=kw):
                return pallas_ops.replay_state(s, k, v, g, beta, n, **kw)

            final, all_states, o = jax.jit(verify)(s0)
            rep = jax.jit(replay)(s0)
            states[preload, block_v, warps] = (np.asarray(all_states), np.asarray(o))
            checks.append({"T": t, "preload": preload, "block_v": block_v, "num_warps": warps,
                           "replay_equals_recurrence": bool(np.array_equal(np.asarray(rep),
                                                                           np.asarray(all_states)[:, int(n[0]) - 1]))})
            for name, fn in (("verify (state out)", lambda s, kw=kw: pallas_ops.fused_recurrent_gated_delta_rule(
                    q, k, v, g, beta, initial_state=s, use_qk_l2norm=True, **{x: kw[x] for x in kw
                                                                              if x != "use_qk_l2norm"}).final_state),
                             ("replay", replay)):
                loop = jax.jit(lambda s, fn=fn: jax.lax.fori_loop(0, chain, lambda _, x: fn(x) * 0.5, s))
                us = median_time(lambda: loop(s0), repeats) / chain * 1e6
                rows.append({"op": name, "T": t, "preload": preload, "block_v": block_v, "num_warps": warps,
                             "us": us})
                print(rows[-1], flush=True)
            if stack:  # every layer's replay in one launch, the layers as batch rows (the commit's form)
                kt, vt, gt, bt, st = tiled
                loop = jax.jit(lambda s, kw=kw: jax.lax.fori_loop(0, chain, lambda _, x: pallas_ops.replay_state(
                    x, kt, vt, gt, bt, n_stack, **kw) * 0.5, s))
                us = median_time(lambda: loop(st), repeats) / chain * 1e6
                rows.append({"op": f"replay, {stack} layers in one launch", "T": t, "preload": preload,
                             "block_v": block_v, "num_warps": warps, "us": us})
                print(rows[-1], flush=True)
        ref_cfg = (False, 8, 1) if (False, 8, 1) in states else configs[0]  # the decode kernel's, else the first
        ref = states[ref_cfg]
        for cfg, got in states.items():
            checks.append({"T": t, "variant": str(cfg), f"states_equal_to_{ref_cfg}": bool(np.array_equal(got[0], ref[0])),
                           "o_equal": bool(np.array_equal(got[1], ref[1]))})
    gemm = []
    d, f = (64, 128) if args.small else (4096, 12288)
    w = jax.random.normal(next(key), (f, d), jnp.float32) * d ** -0.5
    for m in (1, 9):
        x = jax.random.normal(next(key), (m, d), jnp.float32)
        for prec in ("highest", "high", "default"):
            fn = jax.jit(lambda x, w, prec=prec: jax.lax.fori_loop(
                0, chain, lambda _, y: jnp.dot(y, w.T, precision=prec)[:, :d] * 0.01 + y, x))
            us = median_time(lambda: fn(x, w), repeats) / chain * 1e6
            gemm.append({"M": m, "precision": prec, "us": us, "TB_s": f * d * 4 / (us * 1e-6) / 1e12})
            print(gemm[-1], flush=True)
    header = result_header("tune_recurrent")
    md = [f"# Small-T recurrent kernel and replay commit, one GDN layer (B={b}, H={h}, HV={hv}, K={kd}, V={vd}, bf16)",
          "", f"{header['device']} · jax {header['jax']} · commit {header['git_commit']} · {header['date']}", "",
          f"`{header['command']}`", "", f"Per call, in a jitted loop of {chain} dependent calls (median of {repeats}).",
          "", "| op | T | preload | block_v | warps | µs |", "|---|---|---|---|---|---|"]
    md += [f"| {r['op']} | {r['T']} | {r['preload']} | {r['block_v']} | {r['num_warps']} | {r['us']:.2f} |"
           for r in rows]
    md += ["", "Bit-for-bit checks (replay vs the recurrence's state after n = (T+1)//2; every variant's states and "
               "outputs vs (preload, block_v, warps) = (False, 8, 1), the decode kernel's, or else the first setting run (preload "
               "True at 8 / 1 gave (False, 8, 1)'s states at T = 1, 9, 17: tune_recurrent.md): a replay may take another setting only where "
               "its states are equal to the decode kernel's):", ""]
    md += [f"- {c}" for c in checks]
    md += ["", f"float32 product [M, {d}] x [{d}, {f}] (weights read: {f * d * 4 / 1e6:.0f} MB):", "",
           "| M | precision | µs | weight TB/s |", "|---|---|---|---|"]
    md += [f"| {r['M']} | {r['precision']} | {r['us']:.1f} | {r['TB_s']:.2f} |" for r in gemm]
    write_results(args.out, "tune_recurrent" + ("_small" if args.small else ""),
                  {**header, "rows": rows, "checks": checks, "gemm_fp32": gemm}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
