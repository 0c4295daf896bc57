"""Self-drafts at the Qwen3.5-9B shape at their measured acceptance: measured GPU step costs x measured acceptance.

The 9B shape has random weights, so its drafts are never accepted for real; the forced-acceptance curve
(`bench_spec.py --forced-acceptance`, H200) measures each self-draft's step time at a given gamma, which barely
depends on how many drafts are kept. Acceptance does not depend on the hardware: `acceptance_study.py` measures
it on the shipped checkpoint (CPU, greedy). This script joins the two files, configuration by configuration
(same method, gamma, mlp_keep; with or without a token shortlist), and writes

    speedup = (1 + accepted drafts per step) x AR seconds per token / step seconds

with the AR time of the curve's own run (paired there). A projection, not an end-to-end run: the report says so.

    python scripts/project_selfdraft.py --curve benchmarks/results/spec_cost_curve_qwen35_9b_random_selfdraft.json \
        --acceptance benchmarks/results/acceptance_tiny-qwen35-code_selfdraft.json --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specdec_jax.harness import result_header, write_results  # noqa: E402
from scripts.bench_spec import parse_curve_method  # noqa: E402

SELF_DRAFTS = ("layer-skip", "residual-reuse", "partial-mlp")


def config_key(method: str, gamma: int, options: dict) -> tuple:
    """What must match between a curve row and an acceptance row: method, gamma, MLP share, shortlist or not."""
    from specdec_jax.drafters.self_draft import DEFAULT_MLP_KEEP
    keep = float(options.get("mlp_keep", DEFAULT_MLP_KEEP)) if method == "partial-mlp" else None
    return method, int(gamma), keep, bool(options.get("shortlist_size"))


def acceptance_options(shape: str) -> tuple[int | None, dict]:
    """An acceptance row's 'shape' ('4' or 'gamma=2 mlp_keep=0.75 ...') -> (gamma, other options)."""
    if shape.isdigit():
        return int(shape), {}
    opts = dict(item.split("=", 1) for item in shape.split())
    gamma = opts.pop("gamma", None)
    return (int(gamma) if gamma is not None else None), {k: float(v) if "." in v else int(v) for k, v in opts.items()}


def project(curve: dict, acceptance: dict) -> list[dict]:
    accepted = {}
    for row in acceptance["rows"]:
        if row["method"] in SELF_DRAFTS:
            gamma, opts = acceptance_options(str(row["shape"]))
            if gamma is not None:
                accepted[config_key(row["method"], gamma, opts)] = (row["mean_accepted"], opts)
    ar_s = curve["ar_s_per_token"]
    steps = {}
    for row in curve["rows"]:
        steps.setdefault((row["method"], row["gamma"]), []).append(row["seconds_per_step"])
    out = []
    for (label, gamma), secs in steps.items():
        method, opts = parse_curve_method(label)
        if method not in SELF_DRAFTS:
            continue
        key = config_key(method, gamma, opts)
        if key not in accepted:
            continue
        mean_accepted, acc_opts = accepted[key]
        step_s = sum(secs) / len(secs)
        out.append({"method": method, "curve_method": label, "gamma": gamma, "mlp_keep": key[2],
                    "shortlist_9b": opts.get("shortlist_size", 0), "shortlist_tiny": acc_opts.get("shortlist_size", 0),
                    "accepted_per_step": mean_accepted, "tokens_per_step": 1 + mean_accepted,
                    "step_seconds": step_s, "step_over_ar_token": step_s / ar_s,
                    "projected_speedup": (1 + mean_accepted) * ar_s / step_s})
    return sorted(out, key=lambda r: (SELF_DRAFTS.index(r["method"]), r["shortlist_9b"] > 0, r["gamma"]))


def markdown(result: dict) -> str:
    h = result
    md = ["# Self-drafts at the Qwen3.5-9B shape, projected at their measured acceptance", "",
          f"{h['device']} (this script) · jax {h['jax']} · commit {h['commit']} · {h['date']}", "",
          f"`{h['command']}`", "",
          f"Step costs: `{h['curve_file']}` ({h['curve_device']}, commit {h['curve_commit']}: AR "
          f"{1 / h['ar_s_per_token']:.1f} tok/s in that run). Acceptance: `{h['acceptance_file']}` (the shipped "
          f"checkpoint, greedy; commit {h['acceptance_commit']}). A projection, not an end-to-end run: the 9B "
          "shape has random weights. `speedup = (1 + accepted) x AR token time / step time`. The 9B shortlist is "
          "a synthetic 32768 of 248320 tokens (13%), the tiny one the checkpoint's 2048 of 8192 (25%).", "",
          "| method | gamma | mlp_keep | shortlist (9B / tiny) | accepted / step | step ÷ AR token | projected speedup |",
          "|---|---|---|---|---|---|---|"]
    for r in h["rows"]:
        keep = "" if r["mlp_keep"] is None else f"{r['mlp_keep']:g}"
        short = f"{r['shortlist_9b']} / {r['shortlist_tiny']}" if r["shortlist_9b"] else "—"
        md.append(f"| {r['method']} | {r['gamma']} | {keep} | {short} | {r['accepted_per_step']:.2f} | "
                  f"{r['step_over_ar_token']:.2f} | **{r['projected_speedup']:.2f}×** |")
    return "\n".join(md) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--curve", default="benchmarks/results/spec_cost_curve_qwen35_9b_random_selfdraft.json")
    ap.add_argument("--acceptance", default="benchmarks/results/acceptance_tiny-qwen35-code_selfdraft.json")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    curve, acceptance = (json.load(open(p, encoding="utf-8")) for p in (args.curve, args.acceptance))
    header = result_header("project_selfdraft")
    result = {**header, "commit": header["git_commit"], "curve_file": os.path.basename(args.curve),
              "curve_device": curve["device"], "curve_commit": curve["commit"],
              "acceptance_file": os.path.basename(args.acceptance),
              "acceptance_commit": acceptance.get("git_commit", "?"), "ar_s_per_token": curve["ar_s_per_token"],
              "rows": project(curve, acceptance)}
    if not result["rows"]:
        raise SystemExit("project_selfdraft.py: no configuration appears in both files")
    write_results(args.out, "selfdraft_projection_qwen35_9b", result, markdown(result))
    return result


if __name__ == "__main__":
    main()
