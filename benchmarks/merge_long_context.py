"""Join the halves of a long-context table run in separate device commands into one result.

    python benchmarks/merge_long_context.py OUT/long_context_qwen35_9b_part1.json OUT/long_context_qwen35_9b_part2.json \
        --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_long_context import markdown  # noqa: E402
from specdec_jax.bench.harness import write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--stem", default="long_context_qwen35_9b")
    args = ap.parse_args()
    parts = [json.load(open(p)) for p in args.parts]
    commits = {p["git_commit"] for p in parts}
    devices = {p["device"] for p in parts}
    if len(commits) != 1 or len(devices) != 1:
        raise SystemExit(f"parts differ: commits {commits}, devices {devices}")
    result = dict(parts[0], benchmark=args.stem, command="python benchmarks/bench_long_context.py",
                  parts=[p["command"] for p in parts], dates=[p["date"] for p in parts],
                  rows=sorted((r for p in parts for r in p["rows"]), key=lambda r: r["prompt_len"]))
    write_results(args.out, args.stem, result, markdown(result))


if __name__ == "__main__":
    main()
