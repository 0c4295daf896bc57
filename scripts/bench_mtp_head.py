"""The MTP head's few-row forward as XLA runs it (`models/mtp.mtp_forward`, ~30 launches) against the decode-block
kernels (`mtp_forward_blocks`, pallas_kernels/decode_block): time per draft step (forward + greedy choice, each
step's token, hidden state and cache fed to the next, as the drafter chains them) at T = 1 (a chained draft) and
T = gamma + 1 (the update after verification), at one or more cache fills, under several decode-block forms
(warps per program, attention splits over the cache, the fc input gathered by its product or padded by XLA), and how
far the two forms' logits are apart.

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


def form_env(name: str) -> dict:
    """The environment of a blocks form 'wA,L/sS/gG' ({} for 'xla')."""
    if name == "xla":
        return {}
    parts = dict((p[0], p[1:]) for p in name.split("/"))
    if not {"w", "s", "g"} <= set(parts) <= {"w", "s", "g", "b", "f"}:
        raise SystemExit(f"--forms: each form is 'wATTENTION,LINEAR/sSPLITS/gGATHER[/bSLOTS][/fFUSE]'; got {name!r}")
    return {decode_block.WARPS_ENV: parts["w"], decode_block.SPLITS_ENV: parts["s"],
            decode_block.GATHER_ENV: parts["g"], decode_block.SLOTS_ENV: parts.get("b"),
            decode_block.FUSE_ENV: parts.get("f")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="checkpoints/tiny-qwen35-code")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: float32, short chains")
    ap.add_argument("--rows", default="1,4,5", help="positions per forward, comma-separated")
    ap.add_argument("--cache-fill", default="200", help="cache entries before the timed forwards, comma-separated")
    ap.add_argument("--forms", default="w8,4/s1/g1", help="decode-block forms to try, separated by ':'; each "
                    "'wATTENTION,LINEAR/sSPLITS/gGATHER[/bSLOTS][/fFUSE]' (decode_block.WARPS_ENV, SPLITS_ENV, "
                    "GATHER_ENV, SLOTS_ENV, FUSE_ENV)")
    ap.add_argument("--chain", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    dtype = "float32" if args.tiny or jax.default_backend() == "cpu" else "bfloat16"
    model = sj.load(args.model, dtype=dtype)
    cfg, params = model.config, model.params
    chain, repeats = (2, 1) if args.tiny else (args.chain, args.repeats)
    rng = np.random.default_rng(0)
    fills = [int(x) for x in args.cache_fill.split(",")]
    forms = {"xla": lambda p, h, i, k, v, pos: mtp_head.mtp_forward(p, cfg, h[:, :i.shape[1]], i, k, v, pos),
             "blocks": lambda p, h, i, k, v, pos: mtp_head.mtp_forward_blocks(p, cfg, h, i, k, v, pos)}
    lowered, inputs, diffs = {}, {}, []
    for fill in fills:
        k, v = mtp_head.init_mtp_cache(cfg, 1, fill + 64, params["embed"].dtype, round_to=decode_block.CACHE_MULTIPLE)
        ids = jnp.asarray(rng.integers(0, model.vocab_size, (1, fill)), jnp.int32)
        hidden = jnp.asarray(rng.standard_normal((1, fill, cfg.hidden_size)), params["embed"].dtype)
        prompt_forward = jax.jit(lambda p, h, i, k, v: mtp_head.mtp_forward(p, cfg, h, i, k, v, jnp.arange(fill)[None]))
        _, _, k, v = prompt_forward(params, hidden, ids, k, v)
        for t in [int(x) for x in args.rows.split(",")]:
            pos = jnp.arange(fill, fill + t, dtype=jnp.int32)[None]
            # the hidden state as a chained forward hands it on: padded to the kernels' rows (read up to T)
            h0 = jnp.asarray(rng.standard_normal((1, max(16, t), cfg.hidden_size)), params["embed"].dtype)
            i0 = jnp.asarray(rng.integers(0, model.vocab_size, (1, t)), jnp.int32)
            outs = {name: jax.jit(fn)(params, h0, i0, k, v, pos) for name, fn in forms.items()}
            lx, lb = (np.asarray(outs[n][0], np.float32) for n in ("xla", "blocks"))
            diffs.append({"fill": fill, "T": t, "logits_max_abs_diff": float(np.max(np.abs(lx - lb))),
                          "logits_max_abs": float(np.max(np.abs(lx))),
                          "argmax_equal": float(np.mean(lx.argmax(-1) == lb.argmax(-1))),
                          "cache_max_abs_diff": float(max(np.max(np.abs(np.asarray(outs["xla"][j], np.float32)
                                                                        - np.asarray(outs["blocks"][j], np.float32)))
                                                         for j in (2, 3)))})
            print(diffs[-1], flush=True)
            for name in ["xla"] + args.forms.split(":"):
                fn = forms["xla" if name == "xla" else "blocks"]

                def step(carry, p, pos, fn=fn):  # the drafter's chain: token, hidden state and cache fed forward
                    i, h, k, v = carry
                    logits, hout, k, v = fn(p, h, i, k, v, pos)
                    hout = jnp.pad(hout, ((0, 0), (0, h.shape[1] - hout.shape[1]), (0, 0)))  # (xla: T rows)
                    return jnp.argmax(logits, axis=-1).astype(jnp.int32), hout, k, v
                with env_setting(**form_env(name)):
                    lowered[name, fill, t] = carried_lowered(step, (i0, h0, k, v), (params, pos), chain)
                inputs[name, fill, t] = ((i0, h0, k, v), (params, pos))
    compiled, compile_s = compile_timed(lowered)
    rows = []
    for (name, fill, t), c in compiled.items():
        us = time_chain(c, inputs[name, fill, t], chain, repeats) * 1e6
        rows.append({"form": name, "fill": fill, "T": t, "us_per_forward": us,
                     "compile_s": compile_s[str((name, fill, t))]})
        print(rows[-1], flush=True)
    header = result_header("bench_mtp_head")
    by = {(r["form"], r["fill"], r["T"]): r["us_per_forward"] for r in rows}
    cols = sorted({(r["fill"], r["T"]) for r in rows})
    md = [f"# MTP head forward: XLA against the decode-block kernels ({os.path.basename(args.model)}, {dtype})", "",
          f"{header['device']} · jax {header['jax']} · commit {header['git_commit']} · {header['date']}", "",
          f"`{header['command']}`", "",
          f"Per forward plus the greedy choice, in a jitted loop of {chain} dependent forwards (token, hidden state "
          f"and cache carried) after a cache of `fill` entries; median of {repeats}.", "",
          "Blocks rows: `wA,L/sS/gG` = warps per program (attention, products), attention splits over the cache (at "
          "most one per attention block), the fc input gathered by its product (g1) or padded by XLA (g0), cache slots "
          "per attention block (b; default by head dim), the output projection inside the attention (f1) or a product "
          "of its own (f0, the default). Ratio: XLA's time over the form's.", "",
          "| form | " + " | ".join(f"fill {f}, T = {t}: µs (ratio)" for f, t in cols) + " |",
          "|---|" + "---|" * len(cols)]
    for name in dict.fromkeys(r["form"] for r in rows):
        md.append(f"| {name} | " + " | ".join(f"{by[name, f, t]:.1f} ({by['xla', f, t] / by[name, f, t]:.2f})"
                                               for f, t in cols) + " |")
    md += ["", "The two forms on the same inputs (one forward; blocks at the default settings):", "",
           "| fill | T | logits max abs diff | largest logit | argmax equal | cache max abs diff |",
           "|---|---|---|---|---|---|"]
    md += [f"| {d['fill']} | {d['T']} | {d['logits_max_abs_diff']:.3g} | {d['logits_max_abs']:.3g} | "
           f"{d['argmax_equal']:.2f} | {d['cache_max_abs_diff']:.3g} |" for d in diffs]
    write_results(args.out, "mtp_head_" + os.path.basename(args.model.rstrip("/")) + ("_smoke" if args.tiny else ""),
                  {**header, "dtype": dtype, "chain": chain, "rows": rows, "diffs": diffs}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
