"""The benchmark harness: what `specdec_jax.bench` and every runner under benchmarks/ shares.

Provenance: `result_header` (device, platform, jax / jaxlib / python versions, the full git commit, the exact
command, the date) opens every result, so a number can always be traced to what produced it.

Timing: `median_time` (wall time of a synchronised call, warm-up excluded); for pieces too short to time
alone, loops of dependent calls inside one jit (`chain_lowered` / `carried_lowered`, compiled together by
`compile_all` / `compile_timed`, timed by `time_chain`; `chain_seconds` and `chained_time` in one call).
`env_setting` traces a function under other environment settings (e.g. the GDN implementation).

Pairing: a method and its baseline run in turn on the same input (`alternation`, `alternate`), so drift
(clocks, temperature, other load) hits both alike; `own_reference_rows` says when an exact run needs an AR
reference of its own. Statistics: `decode_tokens_per_second`, `bootstrap_ci`.

Forced acceptance through the public API: `register_reference_drafts` registers a chain method whose drafts are a
known continuation (AR's own output) with a fraction 1 - p of the positions altered, so each draft is accepted with
probability p, as the forced-acceptance cost curves assume, while the target still decides every token.

Reports: `write_results` writes <stem>.json and <stem>.md side by side; `finish_plot` saves a figure.
Device traces (kernel by kernel, waits, a call's edges) are read by `specdec_jax.profiling`.
"""

from __future__ import annotations

import dataclasses
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
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SPECDEC_")},  # the library's switches
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


def compile_timed(lowered: Mapping, workers: int = 12, options: dict | None = None) -> tuple[dict, dict]:
    """({name: compiled}, {str(name): seconds}) from {name: lowered}, compiled on a thread pool (XLA releases
    the GIL, so the compiles overlap; each one's seconds are its own wall time while the others ran), with the XLA
    `options` (a generation program: its family's, `compiled.compiler_options`)."""
    from concurrent.futures import ThreadPoolExecutor

    def timed(lo):
        t0 = time.perf_counter()
        return lo.compile(compiler_options=options or None), time.perf_counter() - t0

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


# ----------------------------------------------------------------------------------------------------------
# forced acceptance through the public API


@dataclasses.dataclass(frozen=True)
class ReferenceDrafter:
    """Drafts row b's known continuation (`continuations[b]`, generated after its prompt of `prompt_lens[b]`
    tokens), each position altered (to another token) where `altered[b][i]`: a draft is accepted when it and every
    draft before it in its step are unaltered. Hashable (a static argument of the generation's programs)."""

    continuations: tuple  # B tuples of int
    prompt_lens: tuple  # B ints
    altered: tuple  # B tuples of bool
    name = "reference"

    def init(self, params, cfg, prompt, max_len, **_):
        return ()

    def update(self, drafter_state, **_):
        return drafter_state

    def propose(self, params, cfg, drafter_state, history, hist_len, gamma, key, **_):
        import jax.numpy as jnp
        ref = jnp.asarray(self.continuations, jnp.int32)  # [B, N]
        flip = jnp.asarray(self.altered, bool)
        at = jnp.clip(hist_len[:, None] - jnp.asarray(self.prompt_lens, jnp.int32)[:, None]
                      + jnp.arange(gamma)[None, :], 0, ref.shape[1] - 1)  # [B, gamma]: the next positions to draft
        drafts = jnp.take_along_axis(ref, at, axis=1)
        other = jnp.where(drafts > 0, drafts - 1, drafts + 1)
        return jnp.where(jnp.take_along_axis(flip, at, axis=1), other, drafts), None, drafter_state


def register_reference_drafts(name: str, continuations, prompt_lens, p: float = 1.0, seed: int = 0) -> None:
    """Register (or replace) the Qwen3.5 chain method `name` drafting each row's continuation, each position kept
    with probability p (`ReferenceDrafter`). continuations [B, N] (an exact run's reference: AR at the speculation's
    decode rows), prompt_lens [B]."""
    from specdec_jax import methods
    tokens = np.asarray(continuations, np.int64)
    altered = np.random.default_rng(seed).random(tokens.shape) >= p
    drafter = ReferenceDrafter(tuple(tuple(int(t) for t in row) for row in tokens),
                               tuple(int(n) for n in prompt_lens),
                               tuple(tuple(bool(a) for a in row) for row in altered))
    spec = methods.MethodSpec(name, "qwen3_5", methods.CHAIN, methods.CHAIN_OPTIONS, drafter=lambda m, o: drafter)
    methods.REGISTRY = tuple(s for s in methods.REGISTRY if s.name != name) + (spec,)
