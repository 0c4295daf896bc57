"""Merge the per-process results of `check_repeatability.py` (one JSON per process, e.g. suite parts repeat-procs and
strict-xla) into one JSON + Markdown: per process its XLA options, how many prompts' speculative outputs equal AR's and
where they first differ; with the `compare_hlo_dumps.py` log of the same processes appended when given.

    python scripts/merge_repeatability.py --name repeatability_qwen35_9b_random_procs --hlo-log DIR/compare_hlo.log \
        --out benchmarks/results DIR/repeatability_qwen35_9b_random_p*.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specdec_jax.harness import write_results  # noqa: E402


def process_summary(result: dict) -> dict:
    spec = [r for r in result["rows"] if r["program"] != "ar"]
    return {"options": result.get("env", {}).get("SPECDEC_XLA_OPTIONS", "(library default)"),
            "git_commit": result["git_commit"], "prompts": len({r["prompt"] for r in spec}),
            "prompts_equal": sum(r["equal_to_first_ar"] == r["runs"] for r in spec),
            "repeatable": all(r["distinct_outputs"] == 1 for r in result["rows"]),
            "first_differences": {r["prompt"]: r["first_differences"][0] for r in spec if r["first_differences"]}}


def hlo_lines(log: str) -> list[str]:
    """The per-process lines of a compare_hlo_dumps log (AR and spec computations, shared, differing) and its total."""
    lines = open(log, encoding="utf-8").read().splitlines()
    keep = [re.sub(r"^.*/(hlo_\w+):", r"\1:", line) for line in lines if re.match(r"^\S*hlo_\w+: ", line)]
    return keep + [line for line in lines[-1:] if "differ" in line]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="check_repeatability JSON files, one per process")
    ap.add_argument("--name", required=True, help="result file name (without extension)")
    ap.add_argument("--hlo-log", help="compare_hlo_dumps.py output for the same processes")
    ap.add_argument("--note", default="", help="a sentence on how the processes ran")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    results = [json.load(open(path, encoding="utf-8")) for path in args.results]
    if any(r.get("benchmark") != "check_repeatability" for r in results):
        raise SystemExit("merge_repeatability.py: every input must be a check_repeatability.py result")
    first = results[0]
    processes = [process_summary(r) for r in results]
    unequal = sum(p["prompts_equal"] < p["prompts"] for p in processes)
    out = {k: first[k] for k in ("device", "platform", "jax", "jaxlib", "python", "model", "damp", "gamma",
                                 "decode_rows", "max_new_tokens", "prompt_len", "repeats")}
    out.update(benchmark="merge_repeatability", git_commit=first["git_commit"], commands=[r["command"] for r in results],
               processes=processes, processes_unequal=unequal, hlo_comparison=hlo_lines(args.hlo_log) if args.hlo_log else [])
    md = [f"# Exact greedy generation across processes ({first['model']})", "",
          f"{first['device']} · jax {first['jax']} · commit {first['git_commit']}", "",
          f"`{results[0]['command']}` (one per process)", "",
          f"Random weights (bfloat16, residual writes x{first['damp']}), {first['prompt_len']}-token random prompts, "
          f"{first['max_new_tokens']} new tokens, greedy, exact path (decode rows {first['decode_rows']}); n-gram drafts "
          f"at gamma {first['gamma']}, replay rollback; each prompt {first['repeats']} times per program in each "
          f"process. {args.note}".rstrip(), "",
          f"**{len(processes) - unequal} of {len(processes)} processes gave every speculative output equal to AR's**; "
          f"every program repeated its own output within its process: "
          f"{'yes' if all(p['repeatable'] for p in processes) else 'no'}.", "",
          "| process | XLA options (SPECDEC_XLA_OPTIONS) | prompts equal to AR | first differing token (prompt: token) |",
          "|---|---|---|---|"]
    md += [f"| {i + 1} | {p['options']} | {p['prompts_equal']} of {p['prompts']} | "
           f"{', '.join(f'{k}: {v}' for k, v in p['first_differences'].items()) or '—'} |"
           for i, p in enumerate(processes)]
    if out["hlo_comparison"]:
        md += ["", "AR's and the speculative loop's GEMM and Triton fusion computations in each process "
               "(`scripts/compare_hlo_dumps.py`; configurations that differ between processes are expected):", "",
               "```", *out["hlo_comparison"], "```"]
    write_results(args.out, args.name, out, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
