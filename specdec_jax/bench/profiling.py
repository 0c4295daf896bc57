"""Device traces read for benchmarks: where a jitted call's device time goes, kernel by kernel.

`device_kernel_profile` traces one call (jax.profiler) and returns its device time by kernel family, the idle
stretches between kernels (`busy_and_idle`; waits on the host, `wait_sites`, `wait_windows`, and what the host did
then, `host_during`), the host's CUDA API time (`host_api_time`) and the call's edges, from the call to its first
kernel and from its last kernel to the return (`call_edges`). `kernel_profile_markdown` renders profiles.
A tool beside `harness` (layer 5): nothing in the library depends on it.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping

# Stream lines of a device plane carry the kernels; the derived lines (XLA Modules / Ops, Steps) repeat them.
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Launch Stats", "TensorFlow Name Scope", "Source code")


def kernel_family(name: str) -> str:
    """A kernel's name without its instance number (`loop_add_fusion_12` -> `loop_add_fusion`), cut to 90
    characters: one row per kind of kernel in a profile."""
    import re
    base = re.sub(r"([._]\d+)+$", "", name)
    return base if len(base) <= 90 else base[:87] + "..."


WAIT_GAP_NS = 10_000  # a device idle stretch this long is a wait on the host (a sync, or an empty launch queue)
HOST_API_KINDS = {"launch": "LaunchKernel", "sync": "Synchronize", "copy": "Memcpy"}  # by substring of the name


def busy_and_idle(intervals) -> tuple[float, list[float]]:
    """Kernel intervals [(start, end)] (any order, overlaps allowed) -> (busy: length of their union, the idle
    stretches between the first start and the last end)."""
    busy, end, idle = 0.0, None, []
    for a, b in sorted(intervals):
        if end is not None and a > end:
            idle.append(a - end)
        if end is None or b > end:
            busy += b - (a if end is None else max(a, end))
            end = b
    return busy, idle


def wait_sites(events, min_gap: float = WAIT_GAP_NS) -> list[tuple[str, str, int, float]]:
    """Kernel events [(start, end, name)] -> where the device waited: [(kernel before, kernel after, count, idle)]
    for every idle stretch of at least `min_gap` between the first start and the last end, grouped by the pair of
    kernel names around it (the one that ended last before it, the one that starts it), largest total first."""
    sites, end, last = {}, None, None
    for a, b, name in sorted(events):
        if end is not None and a - end >= min_gap:
            site = sites.setdefault((last, name), [0, 0.0])
            site[0] += 1
            site[1] += a - end
        if end is None or b > end:
            end, last = b, name
    return sorted(((x, y, c, t) for (x, y), (c, t) in sites.items()), key=lambda r: -r[3])


def wait_windows(events, min_gap: float = WAIT_GAP_NS) -> list[tuple[float, float]]:
    """Kernel events [(start, end, name)] -> the device's idle stretches of at least `min_gap` [(from, to)]."""
    windows, end = [], None
    for a, b, _ in sorted(events):
        if end is not None and a - end >= min_gap:
            windows.append((end, a))
        if end is None or b > end:
            end = b
    return windows


def host_during(windows, host_events) -> list[tuple[str, int, float]]:
    """What the host was doing while the device waited: host events [(start, end, name)] overlapping the idle
    windows [(from, to)], as [(name, events, overlap ns)], largest overlap first. Nested events (a call and the
    calls inside it) each count, so the rows say where the host was, not a partition of its time."""
    rows = {}
    windows = sorted(windows)
    for a, b, name in host_events:
        for lo, hi in windows:  # few windows per run: a plain scan
            overlap = min(b, hi) - max(a, lo)
            if overlap > 0:
                row = rows.setdefault(name, [0, 0.0])
                row[0] += 1
                row[1] += overlap
    return sorted(((n, c, t) for n, (c, t) in rows.items()), key=lambda r: -r[2])


CALL_ANNOTATION = "specdec_profiled_call"  # the host trace event around the call a kernel profile times


def call_edges(kernels, host_events, call_name: str = CALL_ANNOTATION):
    """A call's edges, where the device cannot be busy with it: kernel events [(start, end, name)] and host events
    [(start, end, name)], one of them the call's annotation `call_name` -> ((from, to) lead-in: the annotation's
    start to the first kernel's start, (from, to) tail: the last kernel's end to the annotation's end), or None
    without the annotation or any kernel. What a call costs beyond its steps shows here, not between kernels."""
    calls = [(a, b) for a, b, name in host_events if name == call_name]
    if not calls or not kernels:
        return None
    start, end = calls[0]
    first = min(a for a, _, _ in kernels)
    last = max(b for _, b, _ in kernels)
    return (start, max(start, first)), (min(end, last), end)


def host_api_time(events) -> dict:
    """{kind: [count, ns]} of host-side CUDA API calls [(name, duration ns)] by HOST_API_KINDS: kernel launches,
    synchronizations, copies."""
    out = {kind: [0, 0.0] for kind in HOST_API_KINDS}
    for name, dur in events:
        for kind, part in HOST_API_KINDS.items():
            if part in name:
                out[kind][0] += 1
                out[kind][1] += dur
    return out


def device_kernel_profile(run: Callable[[], object], per: float, top: int = 30) -> dict:
    """Where the device time of one `run()` goes, kernel by kernel, from a jax.profiler trace of that call.

    Returns per `per` units (steps, tokens): `wall_us`, `busy_us` (the union of kernel intervals: device
    time), `gap_us` (wall - busy: launch and host overhead), `kernels` (launches), and `rows`: the `top`
    kernel families by time, each {"kernel", "count", "us"} per unit, plus `other_us` for the rest.
    Where the device sat idle between its first and last kernel: `idle_us`, split into `wait_us` / `waits` (stretches
    of at least WAIT_GAP_NS: the device waited on the host, e.g. a loop predicate read back) and `short_idle_us`
    (between back-to-back kernels: launch latency, or a host that issues kernels slower than they run).
    `host_api`: {kind: {"count", "us"}} of host-side CUDA API calls (launch, sync, copy) per unit, where the trace
    records them (under tracing a launch costs the host more than it does untraced).
    `wait_sites`: the 8 largest of those waits' sites, {"before", "after", "count", "us"} per unit (the kernels
    around each wait, full names: which op the device waited before).
    `host_during_waits`: the 12 host events (the runtime's trace annotations, API calls) that overlap those waits
    most, {"host", "count", "us"} per unit: what the host did while the device waited.
    `lead_in_us` / `tail_us` (per call, not per unit; where the trace has the call's annotation and kernels): from
    the call to its first kernel and from its last kernel to the call's return, with `host_during_lead_in` /
    `host_during_tail`, the host events overlapping them (`call_edges`): a call's fixed cost at its edges.
    `lines` names the trace lines read (for a trace whose layout differs). Empty rows on a machine
    without a device tracer (CPU): the numbers then only say so."""
    import glob
    import tempfile

    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            t0 = time.perf_counter()
            with jax.profiler.TraceAnnotation(CALL_ANNOTATION):
                jax.block_until_ready(run())
            wall = time.perf_counter() - t0
        files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        data = ProfileData.from_file(files[0]) if files else None
    intervals, named, families, lines, host_events = [], [], {}, [], []
    for plane in (data.planes if data is not None else ()):
        if plane.name.startswith("/host:"):
            for line in plane.lines:
                for ev in line.events:
                    start, dur = float(ev.start_ns), float(ev.duration_ns)
                    host_events.append((start, start + dur, ev.name))
            continue
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name in _DERIVED_LINES:
                continue
            lines.append(f"{plane.name}/{line.name}")
            for ev in line.events:
                start, dur = float(ev.start_ns), float(ev.duration_ns)
                intervals.append((start, start + dur))
                named.append((start, start + dur, ev.name))
                fam = families.setdefault(kernel_family(ev.name), [0, 0.0])
                fam[0] += 1
                fam[1] += dur
    busy, idle = busy_and_idle(intervals)
    waits = [g for g in idle if g >= WAIT_GAP_NS]
    scale = 1e-3 / per  # ns -> us per unit
    edges = call_edges(named, host_events)
    edge_fields = {}
    if edges is not None:  # per call, not per unit: a call's fixed cost
        for label, (lo, hi) in zip(("lead_in", "tail"), edges):
            edge_fields[f"{label}_us"] = (hi - lo) * 1e-3
            edge_fields[f"host_during_{label}"] = [
                {"host": n, "count": c, "us": t * 1e-3} for n, c, t in host_during([(lo, hi)], host_events)
                if n != CALL_ANNOTATION][:12]
    ranked = sorted(families.items(), key=lambda kv: -kv[1][1])
    rows = [{"kernel": k, "count": c / per, "us": ns * scale} for k, (c, ns) in ranked[:top]]
    return {"wall_us": wall * 1e6 / per, "busy_us": busy * scale, "gap_us": wall * 1e6 / per - busy * scale,
            "kernels": len(intervals) / per, "rows": rows,
            "idle_us": sum(idle) * scale, "wait_us": sum(waits) * scale, "waits": len(waits) / per,
            "short_idle_us": (sum(idle) - sum(waits)) * scale,
            "host_api": {k: {"count": c / per, "us": ns * scale}
                         for k, (c, ns) in host_api_time([(n, b - a) for a, b, n in host_events]).items()},
            "host_during_waits": [{"host": n, "count": c / per, "us": t * scale}
                                  for n, c, t in host_during(wait_windows(named), host_events)[:12]],
            "wait_sites": [{"before": x, "after": y, "count": c / per, "us": t * scale}
                           for x, y, c, t in wait_sites(named)[:8]],
            "other_us": sum(ns for _, (_, ns) in ranked[top:]) * scale, "lines": sorted(set(lines)), **edge_fields}


def kernel_profile_markdown(profiles: Mapping[str, dict], unit: str = "step") -> list[str]:
    """Markdown lines: one summary table over `profiles` ({label: device_kernel_profile(...)}), then each
    profile's kernel families."""
    md = [f"| setting | wall µs / {unit} | device busy µs | gap µs | idle µs: waits ≥ {WAIT_GAP_NS / 1e3:g} µs (count) "
          f"/ between kernels | host launch API µs (calls) | host sync µs | kernels / {unit} |",
          "|---|---|---|---|---|---|---|---|"]
    for label, p in profiles.items():
        host = p.get("host_api", {})
        launch, sync = host.get("launch", {"count": 0, "us": 0.0}), host.get("sync", {"count": 0, "us": 0.0})
        md.append(f"| {label} | {p['wall_us']:.1f} | {p['busy_us']:.1f} | {p['gap_us']:.1f} | "
                  f"{p.get('wait_us', 0.0):.1f} ({p.get('waits', 0.0):.2f}) / {p.get('short_idle_us', 0.0):.1f} | "
                  f"{launch['us']:.1f} ({launch['count']:.1f}) | {sync['us']:.1f} | {p['kernels']:.1f} |")
    for label, p in profiles.items():
        md += ["", f"**{label}** (per {unit})", "", "| kernel | count | µs |", "|---|---|---|"]
        md += [f"| `{r['kernel']}` | {r['count']:.2f} | {r['us']:.1f} |" for r in p["rows"]]
        md.append(f"| (the rest) | | {p['other_us']:.1f} |")
        if p.get("wait_sites"):
            md += ["", f"Where the device waited ≥ {WAIT_GAP_NS / 1e3:g} µs (the kernels around each wait, per {unit}):", "",
                   "| kernel before | kernel after | count | µs |", "|---|---|---|---|"]
            md += [f"| `{w['before']}` | `{w['after']}` | {w['count']:.2f} | {w['us']:.1f} |" for w in p["wait_sites"]]
        if p.get("host_during_waits"):
            md += ["", f"What the host did during those waits (trace events overlapping them, nested ones each counted; "
                   f"per {unit}):", "", "| host event | count | µs in waits |", "|---|---|---|"]
            md += [f"| `{h['host'][:90]}` | {h['count']:.2f} | {h['us']:.1f} |" for h in p["host_during_waits"]]
        if "lead_in_us" in p:
            md += ["", f"The call's edges (per call, not per {unit}): {p['lead_in_us']:.1f} µs from the call to its first "
                   f"kernel, {p['tail_us']:.1f} µs from its last kernel to the call's return. What the host did then "
                   f"(nested events each counted):", "", "| edge | host event | count | µs |", "|---|---|---|---|"]
            md += [f"| {edge} | `{h['host'][:90]}` | {h['count']} | {h['us']:.1f} |"
                   for edge in ("lead_in", "tail") for h in p[f"host_during_{edge}"]]
    return md


# Instructions that only route values (no launch of their own) in an optimized HLO module.
_ROUTING_OPS = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all"})


def hlo_computations(hlo_text: str) -> dict[str, list[tuple[str, str, str]]]:
    """An HLO module's text -> {computation name: [(instruction, opcode, rest of the line)]}; the entry is 'ENTRY'."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)  # unindented: a computation's header
        if head:
            current = comps.setdefault("ENTRY" if head.group(1) else head.group(2), [])
            continue
        if line.startswith("}"):
            current = None
            continue
        inst = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", line)
        if current is not None and inst:
            op = re.search(r"(?:^|[\s)}\]])([a-z][a-z0-9\-]*)\(", inst.group(2))
            current.append((inst.group(1), op.group(1) if op else "?", inst.group(2)))
    return comps


def while_loops(hlo_text: str) -> dict[str, dict]:
    """Every while loop of an optimized module: {'while NAME in COMPUTATION (body B)': {'known_trip_count': n or None,
    'body': {what: count}}}, what the body launches (instructions that only route values left out; a call into a
    `command_buffer` computation counts as 'command_buffer', a custom call by its target). On the GPU, XLA's runtime
    drives a loop without a known trip count from the host: it reads the predicate back before every step."""
    comps = hlo_computations(hlo_text)
    out = {}
    for comp_name, insts in comps.items():
        for name, op, rest in insts:
            if op != "while":
                continue
            body = re.search(r"body=%?([\w.\-]+)", rest)
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
            body_name = body.group(1) if body else "?"
            counts: dict[str, int] = {}
            for _, bop, brest in comps.get(body_name, []):
                if bop in _ROUTING_OPS:
                    continue
                target = re.search(r"(?:to_apply|calls)=%?([\w.\-]+)", brest)
                custom = re.search(r'custom_call_target="([^"]+)"', brest)
                what = ("command_buffer" if target and target.group(1).startswith("command_buffer") else
                        f"custom-call {custom.group(1)}" if custom else bop)
                counts[what] = counts.get(what, 0) + 1
            out[f"while {name} in {comp_name} (body {body_name})"] = {
                "known_trip_count": int(trip.group(1)) if trip else None, "body": counts}
    return out
