"""Compare the GPU kernels XLA chose for AR's decode loop and the speculative loop, within and across processes.

Exact greedy generation relies on AR and verification computing every row with the same kernels. Each argument is
an XLA dump folder (`--xla_dump_to=DIR --xla_dump_hlo_as_text`, one per process) holding the optimized HLO of
`jit__decode_loop` and `jit__spec_loop`. For every Triton GEMM and block-level fusion the fused computation is
normalised (names and metadata dropped) and paired with its launch configuration (tiles, warps, stages). Reported:
fusions whose computation appears in both loops with different configurations (within a process), and fusions whose
configuration differs between processes.

    python scripts/compare_hlo_dumps.py DUMP_DIR [DUMP_DIR ...]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys

KINDS = ("__triton_nested_gemm_fusion", "__triton")
LOOPS = ("jit__decode_loop", "jit__spec_loop")


def computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines."""
    out, name, body = {}, None, []
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if head and line.rstrip().endswith("{"):
            name, body = head.group(1), []
        elif line.startswith("}") and name:
            out[name], name = body, None
        elif name:
            body.append(line)
    return out


def normalised(lines: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(instructions without names, metadata or backend configs; the backend configs in order). A nested fusion's
    tiles (the contraction's block) are configuration, not computation."""
    code, configs = [], []
    for line in lines:
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        config = re.search(r", backend_config=(\{.*\})\s*$", line)
        if config:
            configs.append(config.group(1))
            line = line[:config.start()]
        code.append(re.sub(r"%[\w.\-]+", "%_", line).strip())
    return tuple(code), tuple(configs)


def _without_scheduling(config: str) -> str:
    """A backend config without the fields the command-buffer schedule sets (stream ids, waits): not arithmetic."""
    try:
        data = json.loads(config)
    except ValueError:
        return config
    for key in ("operation_queue_id", "wait_on_operation_queues", "force_earliest_schedule"):
        data.pop(key, None)
    return json.dumps(data, sort_keys=True)


def fusion_configs(path: str) -> collections.Counter:
    """Counter of (kind, shape, normalised computation incl. nested ones, configuration incl. nested ones) for every
    Triton fusion and every cuBLAS call (kind `__cublas...`, shape its result and operand shapes, configuration its
    GEMM backend config with the algorithm cuBLAS was given)."""
    text = open(path, encoding="utf-8").read()
    comps = computations(text)
    found = collections.Counter()
    for line in text.splitlines():
        cublas = re.search(r'custom_call_target="(__cublas[^"]*)"', line)
        if cublas:
            head = re.sub(r", metadata=\{[^}]*\}", "", line)
            shapes = re.search(r" = (.+?) custom-call\((.*?)\), custom_call_target", head)
            config = re.search(r", backend_config=(\{.*\})\s*$", head)
            operands = " ".join(re.findall(r"\w+\[[\d,]*\](?:\{[\d,]*\})?", shapes.group(2))) if shapes else ""
            result = re.sub(r"^\((.+?), s8\[\d+\]\{0\}\)$", r"\1", shapes.group(1)) if shapes else "?"  # no workspace
            found[(cublas.group(1), f"{result} <- ({operands.strip()})", (),
                   _without_scheduling(config.group(1)) if config else "")] += 1
            continue
        kind = re.search(r'"kind":"(__triton[a-z_]*)"', line)
        if not kind or kind.group(1) not in KINDS or " fusion(" not in line:
            continue
        shape = re.search(r" = (.+?) fusion\(", line).group(1)
        body = comps.get(re.search(r"calls=%([\w.\-]+)", line).group(1), [])
        parts = [normalised(body)] + [normalised(comps.get(c, [])) for l in body
                                      for c in re.findall(r"calls=%([\w.\-]+)", l)]
        config = re.search(r'"block_level_fusion_config":(\{.*?\}),"kind"', line)
        own = json.dumps(json.loads(config.group(1)), sort_keys=True) if config else ""
        found[(kind.group(1), shape, sum((code for code, _ in parts), ()),
               own + "".join(_without_scheduling(c) for _, cs in parts for c in cs))] += 1
    return found


def by_computation(found: collections.Counter) -> dict:
    """(kind, shape, computation) -> set of configurations."""
    out = collections.defaultdict(set)
    for (kind, shape, comp, config) in found:
        out[kind, shape, comp].add(config)
    return out


def loop_file(folder: str, loop: str) -> str:
    files = sorted(glob.glob(os.path.join(folder, f"*{loop}*after_optimizations.txt")))
    files = [f for f in files if "buffer-assignment" not in f and "memory-usage" not in f and "live-range" not in f]
    if not files:
        raise SystemExit(f"compare_hlo_dumps: no optimized HLO of {loop} in {folder} (dump with --xla_dump_hlo_as_text "
                         f"and a module filter that keeps {', '.join(LOOPS)})")
    return files[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dumps", nargs="+", help="XLA dump folders, one per process")
    args = ap.parse_args()
    per_process = {}
    for folder in args.dumps:
        if not os.path.isdir(folder):
            raise SystemExit(f"compare_hlo_dumps: {folder} is not a folder")
        per_process[folder] = {loop: by_computation(fusion_configs(loop_file(folder, loop))) for loop in LOOPS}
    problems = 0
    for folder, loops in per_process.items():
        ar, spec = loops["jit__decode_loop"], loops["jit__spec_loop"]
        shared = set(ar) & set(spec)
        differing = [k for k in shared if ar[k] != spec[k]]
        problems += len(differing)
        print(f"{folder}: {len(ar)} / {len(spec)} GEMM / fusion computations in AR / spec, {len(shared)} shared, "
              f"{len(differing)} shared with different configurations")
        for kind, shape, _ in differing:
            print(f"  {kind} {shape}: AR {[c[:400] for c in sorted(ar[kind, shape, _])]} spec {[c[:400] for c in sorted(spec[kind, shape, _])]}")
        # the same (kind, shape) computed by different code in the two loops: autotuned apart, so free to differ
        by_shape = collections.defaultdict(lambda: (set(), set()))
        for side, table in ((0, ar), (1, spec)):
            for (kind, shape, comp), configs in table.items():
                by_shape[kind, shape][side].update((hash(comp), c) for c in configs)
        for (kind, shape), (in_ar, in_spec) in sorted(by_shape.items()):
            if in_ar and in_spec and in_ar != in_spec:
                codes_ar, codes_spec = {h for h, _ in in_ar}, {h for h, _ in in_spec}
                if codes_ar != codes_spec:
                    problems += 1
                    print(f"  {kind} {shape}: computed by different code in AR ({len(codes_ar)}) and spec "
                          f"({len(codes_spec)}); configs AR {sorted(c[:300] for _, c in in_ar)} "
                          f"spec {sorted(c[:300] for _, c in in_spec)}")
        kinds = collections.Counter(k for k, _, _ in list(ar) + list(spec))
        print(f"  kinds: {dict(kinds)}")
    folders = list(per_process)
    for loop in LOOPS:
        base = per_process[folders[0]][loop]
        for other in folders[1:]:
            theirs = per_process[other][loop]
            for key in set(base) & set(theirs):
                if base[key] != theirs[key]:
                    problems += 1
                    print(f"{loop} {key[0]} {key[1]}: {folders[0]} {sorted(base[key])} vs {other} {sorted(theirs[key])}")
            only = [(side, k) for side, a, b in ((folders[0], base, theirs), (other, theirs, base)) for k in set(a) - set(b)]
            if only:  # fusion decisions that differ between processes (a GEMM fused in one, not in the other)
                problems += len(only)
                print(f"{loop}: {len(only)} computations in one process only ({folders[0]} vs {other}): "
                      + "; ".join(f"{side}: {k[0]} {k[1]}" for side, k in sorted(only, key=str)[:12]))
    print("no configuration differs" if not problems else f"{problems} differences")
    return 0


if __name__ == "__main__":
    sys.exit(main())
