"""How to multiply a few rows by a large float32 weight: the forms of y = x @ w.T timed side by side.

    python scripts/bench_matmul_forms.py --out DIR                                   (H200: the 9B shapes)
    python scripts/bench_matmul_forms.py --shapes 256x512 --rows 1,3 --out /tmp/x    (CPU smoke)

x [rows, in], w [out, in] (the Hugging Face orientation), float32. A 9B verification at matmul precision "highest"
costs 2.26x an AR step because XLA's GEMM reads a [9, 4096] x [4096, 12288] product's weight at 1.74 TB/s against
3.42 for one row (profile_spec_step_qwen35_9b_random_float32_highest.md). Forms:

- dot:        lax.dot_general at precision HIGHEST (IEEE float32; what the library runs today)
- reduce_om:  broadcast-multiply and a float32 row reduction, output-major ([out, rows]: the rows of one weight row
              are reduced next to each other, so it is read from memory once), then transposed
- reduce_mo:  the same, row-major ([rows, out])
- tf32x3, bf16x6, bf16x3: dot_general with that DotAlgorithmPreset (tensor cores, several passes: not IEEE)

Each form runs in one jitted loop of dependent calls (harness.chain_lowered), all compiled at once and timed in
turn. Reported: µs per product, the weight's GB/s, the largest error against a float64 product (relative to the
largest |y|), whether the form's bits equal `dot`'s, and whether row 0 of a multi-row product has the bits of a
1-row product of the same form (row independence).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specdec_jax.harness import chain_lowered, compile_timed, result_header, time_chain, write_results  # noqa: E402

PRESETS = {"tf32x3": "TF32_TF32_F32_X3", "bf16x6": "BF16_BF16_F32_X6", "bf16x3": "BF16_BF16_F32_X3"}
FORMS = ("dot", "reduce_om", "reduce_mo") + tuple(PRESETS)


def product(form: str):
    """y [rows, out] float32 = x [rows, in] @ w [out, in].T in the named form."""
    dims = (((1,), (1,)), ((), ()))
    if form == "dot":
        return lambda x, w: lax.dot_general(x, w, dims, precision=lax.Precision.HIGHEST,
                                            preferred_element_type=jnp.float32)
    if form == "reduce_om":
        return lambda x, w: jnp.sum(x[None, :, :] * w[:, None, :], axis=-1).T
    if form == "reduce_mo":
        return lambda x, w: jnp.sum(x[:, None, :] * w[None, :, :], axis=-1)
    preset = getattr(lax.DotAlgorithmPreset, PRESETS[form])
    return lambda x, w: lax.dot_general(x, w, dims, precision=preset, preferred_element_type=jnp.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x12288,12288x4096,4096x248320", help="IN x OUT, comma-separated")
    ap.add_argument("--rows", default="1,8,9,16")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    forms = args.forms.split(",")
    unknown = sorted(set(forms) - set(FORMS))
    if unknown or min(rows_list) < 1:
        raise SystemExit(f"bench_matmul_forms.py: --forms must be among {FORMS} (got {unknown}); --rows >= 1")
    header = result_header("matmul_forms")
    rng = np.random.default_rng(0)
    rows_out, t_start = [], time.perf_counter()
    for in_dim, out_dim in shapes:
        w_host = rng.standard_normal((out_dim, in_dim), dtype=np.float32) * in_dim ** -0.5
        w = jnp.asarray(w_host)
        xs = {m: jnp.asarray(rng.standard_normal((m, in_dim), dtype=np.float32)) for m in rows_list}
        lowered, errors = {}, {}
        for form in forms:
            for m in rows_list:
                try:
                    # the loop reads the product's sum: reading one element let XLA compute only that element
                    summed = lambda x, w, f=product(form): jnp.sum(f(x, w))
                    lowered[form, m] = chain_lowered(summed, (xs[m], w), 0, args.chain)
                except Exception as e:  # noqa: BLE001 -- a preset the backend lacks is a row, not a crash
                    errors[form, m] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        compiled, compile_s = compile_timed(lowered)
        once = {}
        for (form, m) in lowered:
            try:
                once[form, m] = np.asarray(jax.jit(product(form))(xs[m], w))
            except Exception as e:  # noqa: BLE001
                errors[form, m] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        w64 = w_host.astype(np.float64)
        for m in rows_list:
            ref = np.asarray(xs[m], np.float64) @ w64.T
            scale = float(np.max(np.abs(ref)))
            for form in forms:
                row = {"in": in_dim, "out": out_dim, "rows": m, "form": form}
                if (form, m) in errors or (form, m) not in compiled:
                    row["error"] = errors.get((form, m), "not compiled")
                    rows_out.append(row)
                    continue
                try:
                    sec = time_chain(compiled[form, m], (xs[m], w), args.chain, args.repeats)
                except Exception as e:  # noqa: BLE001 -- e.g. out of memory: a row, not a crash
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    rows_out.append(row)
                    continue
                y = once[form, m]
                row.update(us=sec * 1e6, weight_gb_s=out_dim * in_dim * 4 / sec / 1e9,
                           rel_err=float(np.max(np.abs(y - ref))) / scale,
                           bits_equal_dot=bool(("dot", m) in once and np.array_equal(y, once["dot", m])),
                           row_independent=bool((form, 1) in once and np.array_equal(y[:1], once[form, 1])),
                           compile_s=compile_s[str((form, m))])
                rows_out.append(row)
                print(row, flush=True)
        del w, w64
        report(args, header, rows_out, t_start)  # after each shape, so a later failure keeps what ran


def report(args, header, rows_out, t_start):
    result = {**header, "chain": args.chain, "repeats": args.repeats, "rows": rows_out,
              "seconds": time.perf_counter() - t_start}
    md = ["# Few rows times a large float32 weight: the forms side by side", "",
          f"{header['device']} · jax {header['jax']} · commit {header['git_commit']} · {header['date']}", "",
          f"`{header['command']}`", "",
          f"x [rows, in] float32 times w [out, in] float32; each form in one jitted loop of {args.chain} dependent "
          f"calls (each reading the product's sum), median of {args.repeats}; error: max |y - y64| / max |y64| "
          f"against a float64 product; `= dot`: "
          f"the bits of precision HIGHEST's dot; `row-indep.`: row 0 has the bits of the same form's 1-row product.",
          "", "| in x out | rows | form | µs | weight GB/s | rel. error | = dot | row-indep. |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows_out:
        if "error" in r:
            md.append(f"| {r['in']}x{r['out']} | {r['rows']} | {r['form']} | {r['error']} | | | | |")
            continue
        md.append(f"| {r['in']}x{r['out']} | {r['rows']} | {r['form']} | {r['us']:.1f} | {r['weight_gb_s']:.0f} | "
                  f"{r['rel_err']:.1e} | {'yes' if r['bits_equal_dot'] else 'no'} | "
                  f"{'yes' if r['row_independent'] else 'no'} |")
    write_results(args.out, f"matmul_forms{args.tag}", result, "\n".join(md) + "\n", echo=False)
    print("\n".join(md[-len(rows_out):]), flush=True)


if __name__ == "__main__":
    main()
