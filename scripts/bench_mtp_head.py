"""The MTP head's few-row forward as XLA runs it (`models/mtp.mtp_forward`, ~30 launches) against the decode-block
kernels (`mtp_forward_blocks`, pallas_kernels/decode_block): time per draft step (forward + greedy choice, each
step's token, hidden state and cache fed to the next, as the drafter chains them) at T = 1 (a chained draft) and
T = gamma + 1 (the update after verification), and how far the two forms' logits are apart.

    python scripts/bench_mtp_head.py --out "$OUT"                  # GPU, the shipped checkpoint in bf16
    python scripts/bench_mtp_head.py --tiny --out /tmp/t           # CPU smoke run (interpret mode, float32)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import specdec_jax as sj  # noqa: E402
from pallas_kernels import decode_block  # noqa: E402
from specdec_jax.harness import (carried_lowered, compile_timed, env_setting, result_header, time_chain,  # noqa: E402
                                 write_results)
from specdec_jax.models import mtp as mtp_head  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="checkpoints/tiny-qwen35-code")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: float32, short chains")
    ap.add_argument("--rows", default="1,4,5", help="positions per forward, comma-separated")
    ap.add_argument("--cache-fill", type=int, default=200, help="cache entries before the timed forwards")
    ap.add_argument("--warps", default="4,4", help="decode-block warps per program to try, 'ATTENTION,LINEAR' "
                    "settings separated by ':' (decode_block.WARPS_ENV)")
    ap.add_argument("--chain", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    dtype = "float32" if args.tiny or jax.default_backend() == "cpu" else "bfloat16"
    model = sj.load(args.model, dtype=dtype)
    cfg, params = model.config, model.params
    chain, repeats = (2, 1) if args.tiny else (args.chain, args.repeats)
    rng = np.random.default_rng(0)
    fill = args.cache_fill
    k, v = mtp_head.init_mtp_cache(cfg, 1, fill + 64, params["embed"].dtype, round_to=decode_block.BLOCK_S)
    ids = jnp.asarray(rng.integers(0, model.vocab_size, (1, fill)), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((1, fill, cfg.hidden_size)), params["embed"].dtype)
    _, _, k, v = jax.jit(lambda p, h, i, k, v: mtp_head.mtp_forward(p, cfg, h, i, k, v, jnp.arange(fill)[None]))(
        params, hidden, ids, k, v)
    forms = {"xla": lambda p, h, i, k, v, pos: mtp_head.mtp_forward(p, cfg, h, i, k, v, pos),
             "blocks": lambda p, h, i, k, v, pos: mtp_head.mtp_forward_blocks(p, cfg, h, i, k, v, pos)}
    lowered, inputs, diffs = {}, {}, []
    for t in [int(x) for x in args.rows.split(",")]:
        pos = jnp.arange(fill, fill + t, dtype=jnp.int32)[None]
        h0 = jnp.asarray(rng.standard_normal((1, t, cfg.hidden_size)), params["embed"].dtype)
        i0 = jnp.asarray(rng.integers(0, model.vocab_size, (1, t)), jnp.int32)
        outs = {name: jax.jit(fn)(params, h0, i0, k, v, pos) for name, fn in forms.items()}
        lx, lb = (np.asarray(outs[n][0], np.float32) for n in ("xla", "blocks"))
        diffs.append({"T": t, "logits_max_abs_diff": float(np.max(np.abs(lx - lb))),
                      "logits_max_abs": float(np.max(np.abs(lx))),
                      "argmax_equal": float(np.mean(lx.argmax(-1) == lb.argmax(-1))),
                      "cache_max_abs_diff": float(max(np.max(np.abs(np.asarray(outs["xla"][j], np.float32)
                                                                    - np.asarray(outs["blocks"][j], np.float32)))
                                                     for j in (2, 3)))})
        print(diffs[-1], flush=True)
        variants = [("xla", None)] + [(f"blocks w{w}", w) for w in args.warps.split(":")]
        for name, setting in variants:
            fn = forms["xla" if setting is None else "blocks"]

            def step(carry, p, pos, fn=fn):  # the drafter's chain: token, hidden state and cache fed forward
                i, h, k, v = carry
                logits, hout, k, v = fn(p, h, i, k, v, pos)
                return jnp.argmax(logits, axis=-1).astype(jnp.int32), hout, k, v
            with env_setting(**{decode_block.WARPS_ENV: setting}):
                lowered[name, t] = carried_lowered(step, (i0, h0, k, v), (params, pos), chain)
            inputs[name, t] = ((i0, h0, k, v), (params, pos))
    compiled, compile_s = compile_timed(lowered)
    rows = []
    for (name, t), c in compiled.items():
        us = time_chain(c, inputs[name, t], chain, repeats) * 1e6
        rows.append({"form": name, "T": t, "us_per_forward": us, "compile_s": compile_s[str((name, t))]})
        print(rows[-1], flush=True)
    header = result_header("bench_mtp_head")
    by = {(r["form"], r["T"]): r["us_per_forward"] for r in rows}
    md = [f"# MTP head forward: XLA against the decode-block kernels ({os.path.basename(args.model)}, {dtype})", "",
          f"{header['device']} · jax {header['jax']} · commit {header['git_commit']} · {header['date']}", "",
          f"`{header['command']}`", "",
          f"Per forward plus the greedy choice, in a jitted loop of {chain} dependent forwards (token, hidden state "
          f"and cache carried), {fill} cache entries before them; median of {repeats}.", "",
          "Blocks rows: warps per program (attention, linear). Ratio: XLA's time over the blocks'.", "",
          "| form | " + " | ".join(f"T = {t} µs (ratio)" for t in sorted({r["T"] for r in rows})) + " |",
          "|---|" + "---|" * len({r["T"] for r in rows})]
    for name in dict.fromkeys(r["form"] for r in rows):
        md.append(f"| {name} | " + " | ".join(f"{by[name, t]:.1f} ({by['xla', t] / by[name, t]:.2f})"
                                               for t in sorted({r["T"] for r in rows})) + " |")
    md += ["", "The two forms on the same inputs (one forward):", "",
           "| T | logits max abs diff | largest logit | argmax equal | cache max abs diff |", "|---|---|---|---|---|"]
    md += [f"| {d['T']} | {d['logits_max_abs_diff']:.3g} | {d['logits_max_abs']:.3g} | {d['argmax_equal']:.2f} | "
           f"{d['cache_max_abs_diff']:.3g} |" for d in diffs]
    write_results(args.out, "mtp_head_" + os.path.basename(args.model.rstrip("/")) + ("_smoke" if args.tiny else ""),
                  {**header, "dtype": dtype, "chain": chain, "rows": rows, "diffs": diffs}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
