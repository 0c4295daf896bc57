"""Shared benchmark plumbing: result headers (device, versions, commit, command), timing, writing."""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp


def result_header(name: str) -> dict:
    """Device, jax/jaxlib versions, git commit, exact command, date (shared with the CLI's bench)."""
    from specdec_jax.bench import result_header as header
    return header(name)


def median_time(fn, repeats: int, warmup: int = 3) -> float:
    """Median wall time (s) of fn() with device sync, after warm-up (compile excluded)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def chained_time(fn, x0, chain: int, repeats: int = 5) -> float:
    """Seconds per fn application, measured inside one jitted fori_loop of `chain` dependent calls
    (each input depends on the previous output), so dispatch overhead is excluded."""
    def body(_, x):
        y = fn(x)
        return x + (1e-3 * jnp.mean(y.astype(jnp.float32))).astype(x.dtype)

    looped = jax.jit(lambda x: jax.lax.fori_loop(0, chain, body, x))
    return median_time(lambda: looped(x0), repeats) / chain


def chain_seconds(fn, args: tuple, feed: int, chain: int, repeats: int) -> float:
    """Seconds per call of fn(*args), measured in one jitted fori_loop of `chain` calls: args[feed]
    gets a (numerically nil) dependence on one element of the previous call's first output, so XLA
    can neither hoist, merge nor reorder the calls, and no output is read in full. The arrays are
    jit arguments, not closed-over constants (which XLA could fold at compile time)."""
    return time_chain(chain_lowered(fn, args, feed, chain).compile(), args, chain, repeats)


def write_results(out_dir: str, stem: str, result: dict, markdown: str, echo: bool = True) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(markdown)
    if echo:
        print(markdown)


def chain_lowered(fn, args: tuple, feed: int, chain: int):
    """The lowered loop of `chain` dependent fn(*args) calls behind `chain_seconds` (lower it under the
    settings to compare, compile several on a thread pool with `compile_all`, time with `time_chain`)."""
    def run(arrays):
        def body(_, eps):
            a = list(arrays)
            a[feed] = a[feed] + (eps * 0.0).astype(a[feed].dtype)
            first = jax.tree.leaves(fn(*a))[0]
            return first.reshape(-1)[0].astype(jnp.float32)
        return jax.lax.fori_loop(0, chain, body, jnp.zeros((), jnp.float32))

    return jax.jit(run).lower(tuple(args))


def carried_lowered(fn, carry, consts: tuple, chain: int):
    """The lowered loop carry <- fn(carry, *consts), `chain` times, returning the final carry (so nothing
    fn computes into the carry is dead code). Time it with `time_chain(compiled, (carry, consts), ...)`."""
    def run(arrays):
        carry, consts = arrays
        return jax.lax.fori_loop(0, chain, lambda _, c: fn(c, *consts), carry)

    return jax.jit(run).lower((carry, tuple(consts)))


def compile_all(lowered: dict, workers: int = 12) -> dict:
    """{name: compiled} from {name: lowered}, compiled in parallel (XLA releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(lowered, pool.map(lambda lo: lo.compile(), lowered.values())))


def time_chain(compiled, args: tuple, chain: int, repeats: int) -> float:
    """Seconds per call of a loop from `chain_lowered`, compiled."""
    return median_time(lambda: compiled(tuple(args)), repeats) / chain


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


def finish_plot(fig, ax, path: str, xlabel: str, ylabel: str, title: str) -> None:
    """Labels, grid and legend of a benchmark plot, then save it as a PNG."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
