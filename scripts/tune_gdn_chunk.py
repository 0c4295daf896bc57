"""Where the chunk kernel's time goes, and which launch settings are fastest (GPU).

At the Qwen3.5-9B GDN shape (B=1, H=16, HV=32, K=V=128, bf16 q/k/v, fp32 state, q/k L2-normalised
in the kernel), T = --t (8192): times each of the three stages alone (WY, sequential state pass,
parallel output) on the real intermediate tensors, then the whole `chunk_gated_delta_rule` for a
small grid of (block_v, warps, state pipeline stages). Every time is the median over --repeats of
a jitted chain of --chain dependent calls (one element of each output feeds the next call's input,
so XLA can neither reorder nor fold them), divided by the chain length. Random inputs, never zeros.
Writes gdn_chunk_tuning.json / .md to --out.

    python scripts/tune_gdn_chunk.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.gated_delta import chunk_kernel, pallas_ops  # noqa: E402
from pallas_kernels.gated_delta.reference import compensated_cumsum  # noqa: E402
from pallas_kernels.gated_delta._kernel_utils import F32, dot_precisions  # noqa: E402
from specdec_jax.harness import chain_seconds, result_header, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--t", type=int, default=8192)
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run, interpret mode)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    interpret = jax.default_backend() != "gpu"
    b, h, hv, kd, vd, t = (1, 1, 2, 32, 32, 128) if args.small else (1, 16, 32, 128, 128, args.t)
    dt = jnp.bfloat16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, t, h, kd)), dt)
    k = jnp.asarray(rng.standard_normal((b, t, h, kd)), dt)
    v = jnp.asarray(rng.standard_normal((b, t, hv, vd)), dt)
    g = jnp.asarray(-np.log1p(np.exp(rng.standard_normal((b, t, hv)))) * 0.5, F32)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((b, t, hv)))), F32)
    s0 = jnp.asarray(0.1 * rng.standard_normal((b, hv, kd, vd)), F32)
    prec, merge_prec = dot_precisions(True, interpret)
    gam, gam_lo = (x.reshape(b, hv, t) for x in compensated_cumsum(jnp.moveaxis(g, 1, 2).reshape(b, hv, t // 64, 64)))
    beta_t = jnp.moveaxis(beta, 1, 2)
    header = result_header("gdn_chunk_tuning")
    rows = []

    def record(stage, setting, sec):
        rows.append(dict(stage=stage, setting=setting, ms=sec * 1e3))
        print(f"{stage:12s} {setting:40s} {sec * 1e3:8.4f} ms", flush=True)

    # ---- stages alone
    wy = functools.partial(chunk_kernel.wy_call, hv=hv, l2norm=True, wu_dtype=dt, prec=prec, merge_prec=merge_prec,
                           interpret=interpret)
    w, u, r_k = jax.jit(wy)(k, v, gam, gam_lo, beta_t)
    for solver in ("substitution", "merge"):
        for nw in (4, 8):
            try:
                record("wy", f"solver={solver},warps={nw}", chain_seconds(
                    functools.partial(wy, num_warps=nw, solver=solver), (k, v, gam, gam_lo, beta_t), 4, args.chain,
                    args.repeats))
            except Exception as e:  # noqa: BLE001 - a setting the compiler rejects is reported, not fatal
                print(f"wy solver={solver} warps={nw} failed: {type(e).__name__}: {str(e)[:300]}")
    for bv in (32, 64):
        for nw in (4, 8):
            for st in (1, 2, 3):
                fn = functools.partial(chunk_kernel.state_pass_call, vnew_dtype=dt, state_dtype=dt, prec=prec,
                                       block_v=bv, interpret=interpret, num_warps=nw, num_stages=st)
                try:
                    record("state_pass", f"bv={bv},warps={nw},stages={st}",
                           chain_seconds(fn, (k, w, u, gam, gam_lo, r_k, s0), 6, args.chain, args.repeats))
                except Exception as e:  # noqa: BLE001 - a setting the compiler rejects is reported, not fatal
                    print(f"state_pass bv={bv} warps={nw} stages={st} failed: {type(e).__name__}: {str(e)[:300]}")
    hs, vn, _ = jax.jit(functools.partial(chunk_kernel.state_pass_call, vnew_dtype=dt, state_dtype=dt, prec=prec,
                                          block_v=32, interpret=interpret))(k, w, u, gam, gam_lo, r_k, s0)
    for nw in (4, 8):
        fn = functools.partial(chunk_kernel.output_call, out_dtype=dt, scale=kd ** -0.5, state_dtype=dt, prec=prec,
                               interpret=interpret, num_warps=nw)
        record("output", f"warps={nw}", chain_seconds(fn, (q, k, gam, gam_lo, r_k, hs, vn), 2, args.chain, args.repeats))

    # ---- whole op (includes the XLA glue: padding, cumulative gates, transposes)
    for bv, warps, st, solver in ((32, (4, 4, 4), 3, "substitution"), (32, (4, 4, 4), 3, "merge"),
                                  (32, (8, 4, 4), 3, "merge"), (32, (4, 4, 4), 2, "substitution"),
                                  (64, (4, 4, 4), 3, "substitution")):
        fn = functools.partial(pallas_ops.chunk_gated_delta_rule, use_qk_l2norm=True, block_v=bv, num_warps=warps,
                               state_stages=st, wy_solver=solver, interpret=interpret)
        try:
            record("whole", f"bv={bv},warps={warps},stages={st},{solver}",
                   chain_seconds(lambda *a, fn=fn: fn(*a[:5], initial_state=a[5]).final_state,
                                 (q, k, v, g, beta, s0), 5, args.chain, args.repeats))
        except Exception as e:  # noqa: BLE001
            print(f"whole bv={bv} warps={warps} stages={st} {solver} failed: {type(e).__name__}: {str(e)[:300]}")

    # ---- accuracy of the two solvers on these inputs (bf16 kernels vs the fp32 jnp reference)
    from pallas_kernels.gated_delta import reference
    f32 = lambda a: a.astype(F32)
    ref = reference.chunk_gated_delta_rule_reference(f32(q), f32(k), f32(v), g, beta, initial_state=s0,
                                                     use_qk_l2norm=True, scale=kd ** -0.5)
    errors = {}
    for solver in ("substitution", "merge"):
        out = pallas_ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True,
                                                wy_solver=solver, interpret=interpret)
        rel = lambda a, b: float(jnp.linalg.norm(f32(a) - f32(b)) / jnp.linalg.norm(f32(b)))
        errors[solver] = {"o": rel(out.o, ref.o), "state": rel(out.final_state, ref.final_state)}
        print(f"accuracy {solver}: {errors[solver]}", flush=True)

    md = [f"# Chunk kernel stages and launch settings ({header['device']})", "",
          f"jax {header['jax']} · commit {header['git_commit']} · {header['date']}", "", f"`{header['command']}`", "",
          f"B={b}, T={t}, H={h}, HV={hv}, K=V={kd}, bf16 q/k/v, fp32 state; median of {args.repeats} chains of "
          f"{args.chain} dependent calls.", "", "| stage | setting | ms |", "|---|---|---|"]
    md += [f"| {r['stage']} | {r['setting']} | {r['ms']:.4f} |" for r in rows]
    md += ["", "Relative error vs the fp32 jnp reference on the same inputs:", "", "| solver | o | state |", "|---|---|---|"]
    md += [f"| {sv} | {e['o']:.1e} | {e['state']:.1e} |" for sv, e in errors.items()]
    write_results(args.out, "gdn_chunk_tuning", {**header, "shape": dict(B=b, T=t, H=h, HV=hv, K=kd, V=vd),
                                                 "rows": rows, "accuracy": errors}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
