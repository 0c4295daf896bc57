"""The few-row float32 product (`pallas_kernels.small_gemm`) against XLA's GEMM at precision "highest", per weight
shape of a Qwen3.5 model, per row count and per launch setting: time, weight bandwidth and error.

Each product runs inside one jitted fori_loop of --chain dependent calls (no dispatch overhead); operands are jit
arguments; weights random float32 (never zeros). The settings' error is against the XLA product. Writes
tune_small_gemm<tag>.json / .md.

    python scripts/tune_small_gemm.py --out "$OUT"                       # GPU, the Qwen3.5-9B shapes
    python scripts/tune_small_gemm.py --tiny --chain 2 --repeats 1 --out /tmp/t   # CPU smoke (interpret mode)
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

from pallas_kernels.small_gemm import reference, small_gemm, supports  # noqa: E402
from specdec_jax.harness import chain_lowered, compile_all, result_header, time_chain, write_results  # noqa: E402

# (block_n, block_k, num_warps, num_stages); the first is the kernel's default.
SETTINGS = ((64, 128, 4, 3), (32, 128, 4, 3), (128, 128, 4, 3), (64, 64, 4, 4), (64, 256, 4, 2), (128, 64, 8, 4),
            (32, 256, 2, 3), (128, 128, 8, 2))


def weight_shapes(tiny: bool) -> dict[str, tuple[int, int]]:
    """{name: (N, K)} of the products of one Qwen3.5 decode step (the random shapes of bench_spec)."""
    from scripts.bench_spec import qwen35_shape_config
    cfg = qwen35_shape_config("tiny" if tiny else "9b")
    d = cfg.hidden_size
    k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    kd, vd = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return {
        "GDN in_proj": (2 * k_heads * kd + 2 * v_heads * vd + 2 * v_heads, d),
        "GDN out_proj": (d, v_heads * vd),
        "attention qkv": (2 * cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim, d),
        "attention o_proj": (d, cfg.num_attention_heads * cfg.head_dim),
        "MLP gate_up": (2 * cfg.intermediate_size, d),
        "MLP down": (d, cfg.intermediate_size),
        "LM head": (cfg.vocab_size, d),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, kernels in interpret mode (CPU smoke run)")
    ap.add_argument("--rows", default="8,9,16")
    ap.add_argument("--chain", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")
    interpret = args.tiny or jax.default_backend() != "gpu"
    shapes = weight_shapes(args.tiny)
    rows_list = [int(r) for r in args.rows.split(",")]
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 2 * len(shapes) + 8))
    weights = {name: jax.random.normal(next(keys), nk, jnp.float32) * nk[1] ** -0.5 for name, nk in shapes.items()}
    xs = {m: jax.random.normal(next(keys), (m, max(k for _, k in shapes.values())), jnp.float32) for m in rows_list}

    lowered, inputs, errors = {}, {}, {}
    for name, (n, k) in shapes.items():
        for m in rows_list:
            x = xs[m][:, :k]
            fns = {"xla dot": reference}
            for bn, bk, warps, stages in SETTINGS:
                if supports(m, n, k, bn, bk):
                    fns[f"pallas {bn}x{bk} w{warps} s{stages}"] = functools.partial(
                        small_gemm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, interpret=interpret)
            want = np.asarray(reference(x, weights[name]))
            for label, fn in fns.items():
                if label != "xla dot":
                    got = np.asarray(jax.jit(fn)(x, weights[name]))
                    errors[name, m, label] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                lowered[name, m, label] = chain_lowered(fn, (x, weights[name]), 0, args.chain)
                inputs[name, m, label] = (x, weights[name])
    compiled = compile_all(lowered)
    header = result_header("tune_small_gemm")
    rows = []
    for key, exe in compiled.items():
        name, m, label = key
        n, k = shapes[name]
        sec = time_chain(exe, inputs[key], args.chain, args.repeats)
        rows.append({"weight": name, "n": n, "k": k, "rows": m, "variant": label, "us": sec * 1e6,
                     "weight_tb_s": n * k * 4 / sec / 1e12, "rel_error": errors.get(key, 0.0)})
        print(rows[-1], flush=True)
    best = {}
    for r in rows:
        cur = best.get((r["weight"], r["rows"]))
        if r["variant"] != "xla dot" and (cur is None or r["us"] < cur["us"]):
            best[r["weight"], r["rows"]] = r
    md = ["# Few-row float32 products at precision \"highest\": Pallas kernel against XLA's GEMM", "",
          f"{header['device']} · jax {header['jax']} · commit {header['git_commit']} · {header['date']}", "",
          f"`{header['command']}`", "",
          f"Each product in a jitted loop of {args.chain} dependent calls (median of {args.repeats}); random float32 "
          "weights [N, K]; `TB/s`: weight bytes per second; error: max |kernel - XLA| / max |XLA|.", "",
          "| weight | N × K | rows | variant | µs | TB/s | vs XLA | rel. error |", "|---|---|---|---|---|---|---|---|"]
    xla = {(r["weight"], r["rows"]): r["us"] for r in rows if r["variant"] == "xla dot"}
    for r in rows:
        mark = " **best**" if best.get((r["weight"], r["rows"])) is r else ""
        md.append(f"| {r['weight']} | {r['n']} × {r['k']} | {r['rows']} | {r['variant']}{mark} | {r['us']:.1f} | "
                  f"{r['weight_tb_s']:.2f} | {xla[r['weight'], r['rows']] / r['us']:.2f}× | {r['rel_error']:.1e} |")
    total, count = {}, {}
    for r in rows:
        total[r["rows"], r["variant"]] = total.get((r["rows"], r["variant"]), 0.0) + r["us"]
        count[r["rows"], r["variant"]] = count.get((r["rows"], r["variant"]), 0) + 1
    total = {key: us for key, us in total.items() if count[key] == len(shapes)}  # settings that tile every shape
    md += ["", "Sum over the step's weight shapes (each once; settings that tile every shape):", "", "| rows | variant | µs |", "|---|---|---|"]
    md += [f"| {m} | {v} | {us:.1f} |" for (m, v), us in sorted(total.items(), key=lambda kv: (kv[0][0], kv[1]))]
    write_results(args.out, f"tune_small_gemm{args.tag}", {**header, "shapes": shapes, "rows": rows},
                  "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
