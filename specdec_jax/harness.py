"""The benchmark harness: what `specdec_jax.bench` and every benchmark under scripts/ share.

Provenance: `result_header` (device, platform, jax / jaxlib / python versions, the full git commit, the exact
command, the date) opens every result, so a number can always be traced to what produced it.

Timing: `median_time` (wall time of a synchronised call, warm-up excluded); for pieces too short to time
alone, loops of dependent calls inside one jit (`chain_lowered` / `carried_lowered`, compiled together by
`compile_all` / `compile_timed`, timed by `time_chain`; `chain_seconds` and `chained_time` in one call).
`env_setting` traces a function under other environment settings (e.g. the GDN implementation).

Pairing: a method and its baseline run in turn on the same input (`alternation`, `alternate`), so drift
(clocks, temperature, other load) hits both alike; `own_reference_rows` says when an exact run needs an AR
reference of its own. Statistics: `decode_tokens_per_second`, `bootstrap_ci`.

Reports: `write_results` writes <stem>.json and <stem>.md side by side; `finish_plot` saves a figure.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


# ----------------------------------------------------------------------------------------------------------
# provenance


def git_commit() -> str:
    """HEAD of the checkout this package lives in (+dirty with uncommitted tracked changes), or 'unknown'."""
    where = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=where)
        commit = out.stdout.strip() if out.returncode == 0 else ""
        if not commit:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=where).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def result_header(name: str, command: str | None = None) -> dict:
    """The fields every result starts with: benchmark name, device, platform, versions, git commit (the
    environment's BENCH_GIT_COMMIT wins: a copy without .git still names its commit), command, date."""
    import jax
    import jaxlib
    dev = jax.devices()[0]
    return {
        "benchmark": name,
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": sys.version.split()[0],
        "git_commit": os.environ.get("BENCH_GIT_COMMIT") or git_commit(),
        "command": command or ("python " + " ".join(shlex.quote(a) for a in sys.argv)),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


# ----------------------------------------------------------------------------------------------------------
# timing


def median_time(fn: Callable, repeats: int, warmup: int = 3) -> float:
    """Median wall time (s) of fn() with device sync, after warm-up (compile excluded)."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def chained_time(fn: Callable, x0, chain: int, repeats: int = 5) -> float:
    """Seconds per fn application, measured inside one jitted fori_loop of `chain` dependent calls
    (each input depends on the previous output), so dispatch overhead is excluded."""
    import jax
    import jax.numpy as jnp

    def body(_, x):
        y = fn(x)
        return x + (1e-3 * jnp.mean(y.astype(jnp.float32))).astype(x.dtype)

    looped = jax.jit(lambda x: jax.lax.fori_loop(0, chain, body, x))
    return median_time(lambda: looped(x0), repeats) / chain


def chain_lowered(fn: Callable, args: tuple, feed: int, chain: int):
    """The lowered loop of `chain` dependent fn(*args) calls: args[feed] gets a (numerically nil) dependence
    on one element of the previous call's first output, so XLA can neither hoist, merge nor reorder the
    calls, and no output is read in full. The arrays are jit arguments, not closed-over constants (which
    XLA could fold at compile time). Lower under the settings to compare, compile with `compile_all`, time
    with `time_chain`."""
    import jax
    import jax.numpy as jnp

    def run(arrays):
        def body(_, eps):
            a = list(arrays)
            a[feed] = a[feed] + (eps * 0.0).astype(a[feed].dtype)
            first = jax.tree.leaves(fn(*a))[0]
            return first.reshape(-1)[0].astype(jnp.float32)
        return jax.lax.fori_loop(0, chain, body, jnp.zeros((), jnp.float32))

    return jax.jit(run).lower(tuple(args))


def carried_lowered(fn: Callable, carry, consts: tuple, chain: int):
    """The lowered loop carry <- fn(carry, *consts), `chain` times, returning the final carry (so nothing
    fn computes into the carry is dead code). Time it with `time_chain(compiled, (carry, consts), ...)`."""
    import jax

    def run(arrays):
        carry, consts = arrays
        return jax.lax.fori_loop(0, chain, lambda _, c: fn(c, *consts), carry)

    return jax.jit(run).lower((carry, tuple(consts)))


def compile_timed(lowered: Mapping, workers: int = 12) -> tuple[dict, dict]:
    """({name: compiled}, {str(name): seconds}) from {name: lowered}, compiled on a thread pool (XLA releases
    the GIL, so the compiles overlap; each one's seconds are its own wall time while the others ran)."""
    from concurrent.futures import ThreadPoolExecutor

    def timed(lo):
        t0 = time.perf_counter()
        return lo.compile(), time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = dict(zip(lowered, pool.map(timed, lowered.values())))
    return {k: v[0] for k, v in done.items()}, {str(k): v[1] for k, v in done.items()}


def compile_all(lowered: Mapping, workers: int = 12) -> dict:
    """{name: compiled} from {name: lowered}, compiled in parallel (see `compile_timed`)."""
    return compile_timed(lowered, workers)[0]


def time_chain(compiled, args: tuple, chain: int, repeats: int) -> float:
    """Seconds per call of a loop from `chain_lowered` / `carried_lowered`, compiled."""
    return median_time(lambda: compiled(tuple(args)), repeats) / chain


def chain_seconds(fn: Callable, args: tuple, feed: int, chain: int, repeats: int) -> float:
    """Seconds per call of fn(*args) in one jitted loop of `chain` dependent calls (`chain_lowered`)."""
    return time_chain(chain_lowered(fn, args, feed, chain).compile(), args, chain, repeats)


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


class env_setting:
    """Context manager: set environment variables (None deletes) for the code inside, e.g. while a
    function is traced under another SPECDEC_GDN_IMPLEMENTATION; restores the old values after."""

    def __init__(self, **values):
        self.values, self.old = values, {}

    def __enter__(self):
        for k, v in self.values.items():
            self.old[k] = os.environ.get(k)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------------------------------------
# pairing


def alternation(names: Sequence, repeats: int, rotate: bool = False) -> Iterator[tuple[int, object]]:
    """(round, name) in run order: every name once per round, `repeats` rounds. rotate: the order shifts by
    one name each round, so no name always runs right after the same other one."""
    names = list(names)
    for r in range(repeats):
        k = r % len(names) if rotate and names else 0
        for name in names[k:] + names[:k]:
            yield r, name


def alternate(runs: Mapping[object, Callable], repeats: int, rotate: bool = False) -> dict[object, list]:
    """{name: [result of each round]}: the runs called in turn (`alternation`), so drift hits all alike."""
    out = {name: [] for name in runs}
    for _, name in alternation(runs, repeats, rotate):
        out[name].append(runs[name]())
    return out


def own_reference_rows(method_stats: Mapping, ar_stats: Mapping) -> int | None:
    """The decode row count at which AR must run again to be the reference of an exact run, or None when the
    paired AR run is its reference: an exact generation equals exact AR at the same decode row count
    (`decoding/decode_shape.py`), and a method may verify at more rows than AR's default."""
    rows = method_stats.get("decode_rows")
    if method_stats.get("exact") and ar_stats.get("exact") and rows != ar_stats.get("decode_rows"):
        return rows
    return None


def cut_prompts(encoded: Sequence[Sequence[int]], length: int, count: int | None = None) -> list:
    """The first `count` (None: all) token lists of at least `length` tokens, each cut to its last `length`:
    one prompt shape, so every setting compiles once."""
    return [e[-length:] for e in encoded if len(e) >= length][:count]


# ----------------------------------------------------------------------------------------------------------
# statistics


def decode_tokens_per_second(stats: Mapping, batch: int = 1) -> float:
    """(new_tokens - batch) / decode_seconds: every method samples each row's first token from the prefill."""
    return max(int(stats["new_tokens"]) - batch, 0) / max(float(stats["decode_seconds"]), 1e-9)


def bootstrap_ci(values, statistic=np.median, *, confidence: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile-bootstrap interval of `statistic` over `values` (resampled with replacement).

    Deterministic for a given seed. One value gives (v, v); no values give (nan, nan).
    `statistic` must accept `axis=1` (numpy reductions do).
    """
    x = np.asarray(values, np.float64).ravel()
    if x.size == 0:
        return (math.nan, math.nan)
    if x.size == 1:
        return (float(x[0]), float(x[0]))
    rng = np.random.default_rng(seed)
    stats = statistic(x[rng.integers(0, x.size, size=(resamples, x.size))], axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(stats, [alpha, 1.0 - alpha])
    return (float(lo), float(hi))


# ----------------------------------------------------------------------------------------------------------
# reports


def jsonable(x):
    """x with NaN / inf as None and numpy scalars as Python numbers (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return jsonable(x.item())
    return x


def write_results(out_dir: str | os.PathLike, stem: str, result: dict, markdown: str,
                  echo: bool = True) -> dict[str, str]:
    """Write <stem>.json (the result; what json cannot write goes through float) and <stem>.md into out_dir
    (created); echo: also print the Markdown. Returns {"json": path, "markdown": path}. Scripts call it after
    every finished piece, so a run cut short keeps what it measured."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, stem + ".json"), "markdown": os.path.join(out_dir, stem + ".md")}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=float)
        f.write("\n")
    with open(paths["markdown"], "w", encoding="utf-8") as f:
        f.write(markdown)
    if echo:
        print(markdown)
    return paths


def finish_plot(fig, ax, path: str | os.PathLike, xlabel: str, ylabel: str, title: str) -> None:
    """Labels, grid and legend of a benchmark plot, then save it as a PNG."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
