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
    def run(arrays):
        def body(_, eps):
            a = list(arrays)
            a[feed] = a[feed] + (eps * 0.0).astype(a[feed].dtype)
            first = jax.tree.leaves(fn(*a))[0]
            return first.reshape(-1)[0].astype(jnp.float32)
        return jax.lax.fori_loop(0, chain, body, jnp.zeros((), jnp.float32))

    looped = jax.jit(run)
    return median_time(lambda: looped(tuple(args)), repeats) / chain


def write_results(out_dir: str, stem: str, result: dict, markdown: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(markdown)
    print(markdown)
