"""A per-process cache of compiled generation functions.

`generate()` compiles its prefill and decode loop ahead of time (so compile time is reported apart from
run time). Without a cache every call would compile again; with it, a second call with the same static
settings, argument shapes and shardings (params, prompt, state) reuses the executables. The implementation switches
read at trace time (SPECDEC_GDN_IMPLEMENTATION, SPECDEC_MATVEC) are part of the key.
"""

from __future__ import annotations

import collections
import os
import time

import jax

MAX_ENTRIES = 32
_ENV_KEYS = ("SPECDEC_GDN_IMPLEMENTATION", "SPECDEC_MATVEC")
_cache: collections.OrderedDict = collections.OrderedDict()


def _signature(args) -> tuple:
    """Tree structure, shapes, dtypes and shardings: a program compiled for parameters split over a mesh is not
    the one for a single device (nor for another mesh)."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None)) for x in leaves)


def compiled(jitted, static: dict, *args):
    """(executable, seconds spent compiling: 0.0 when cached) of `jitted` for static keyword arguments
    `static` and positional arguments `args` (arrays or ShapeDtypeStructs)."""
    key = (jitted, tuple(sorted(static.items())), _signature(args),
           tuple(os.environ.get(k, "") for k in _ENV_KEYS), jax.default_backend())
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key], 0.0
    t0 = time.perf_counter()
    executable = jitted.lower(*args, **static).compile()
    seconds = time.perf_counter() - t0
    _cache[key] = executable
    while len(_cache) > MAX_ENTRIES:
        _cache.popitem(last=False)
    return executable, seconds


def output_structs(executable):
    """The outputs of a compiled program as ShapeDtypeStructs with their shardings: what the next program of a
    generation is compiled for (jax.eval_shape cannot know where GSPMD places an output)."""
    return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding), executable.out_info)


def clear() -> None:
    _cache.clear()
