"""A per-process cache of compiled generation functions.

`generate()` compiles its prefill and decode loop ahead of time (so compile time is reported apart from
run time). Without a cache every call would compile again; with it, a second call with the same static
settings, argument shapes and shardings (params, prompt, state) reuses the executables. The implementation switches
read at trace time (SPECDEC_GDN_IMPLEMENTATION, SPECDEC_MATVEC, and the kernels' module settings tests flip) are part
of the key, and so are the XLA options a family's programs compile with on the GPU (`compiler_options`).

jit's own trace caches key on a function's arguments, not on those switches: a generation function traced before a
switch changed would lower to its old program again. So when the switches differ from the last compile's, jax's
caches are dropped first and the programs trace anew (this cache's executables stay valid: each is keyed on the
switches it was traced under).
"""

from __future__ import annotations

import collections
import os
import time

import jax

from pallas_kernels import decode_block, experts, gated_delta

from ..models.qwen35 import mlp as qwen35_mlp

MAX_ENTRIES = 32
_ENV_KEYS = ("SPECDEC_GDN_IMPLEMENTATION", "SPECDEC_MATVEC")


def _switches() -> tuple:
    """What a traced program depends on besides its arguments: the environment switches and the kernels' settings."""
    return (tuple(os.environ.get(k, "") for k in _ENV_KEYS), gated_delta.REPLAY_STASH, gated_delta.PACKED_FORM,
            decode_block.WARPS, decode_block.SPLITS, decode_block.SLOTS, decode_block.GATHER,
            decode_block.FUSE_OUT_PROJ, experts.GPU_DEFAULT, experts.LAYOUT_COMPARE_MAX_COPIES, experts.SHARED_ROWS_DECODE,
            tuple(sorted(experts.DECODE_BLOCKS.items())), tuple(sorted(experts.PREFILL_BLOCKS.items())),
            qwen35_mlp.TOPK_COMPARE_MAX_ROWS, qwen35_mlp.SHARED_EXPERT_TILE)
_cache: collections.OrderedDict = collections.OrderedDict()
_traced_under: list = [None]  # the switches of the last compile's trace

# XLA options every family's generation programs compile with on the GPU, for exactness. The exact path compiles AR's
# loop and the speculative loop as two programs whose decode forwards must round every row alike. With XLA's defaults
# they did not, differently in each process: the fusion autotuner times native against Triton emitters per fusion and
# picks per program, and split-K GEMMs leave partial sums that each consumer fusion reduces in its own order (at the
# 9B shape the GDN gates and projections were native in one loop and Triton in the other). Measured on an H200 (JAX
# 0.11.2), eight processes four at a time, 4 prompts each, gamma 16: with the defaults 6 of 8 processes gave 1-4
# outputs unlike AR; with these options 8 of 8 gave every output equal, AR's and the speculative loop's GEMM and
# fusion computations identical in each (benchmarks/results/repeatability_qwen35_9b_random_{procs,strict}.md). Cost:
# AR 4.700 -> 4.876 ms per token, a gamma-8 step 4.968 -> 5.032 ms. Each option set back alone: the autotuner and
# excess precision cost nothing at the 9B shape (the tiny checkpoint's step is 6% faster without the autotuner);
# split-K is the cost (9B: AR 3.4%, step 1.3%; tiny: step 8%). Split-K alone back was exact in 8 of 8 processes at
# the 9B shape, but its partial sums are reduced inside each consumer fusion, whose emitter the cost model picks per
# fusion shape (AR's GDN gates see one row, verification's all): equal there, not guaranteed for other shapes, so it
# stays off (docs/exactness.md; docs/LOG.md, 2026-12-02). SPECDEC_XLA_OPTIONS overrides all of this.
EXACT_GPU_OPTIONS = {"xla_gpu_experimental_enable_fusion_autotuner": False,  # one emitter choice, by cost model
                     "xla_gpu_experimental_force_split_k": 1,  # no split-K partial sums
                     "xla_allow_excess_precision": False}  # every bf16 rounding the program asks for, in every fusion

# qwen3_5 adds XLA's command buffers scheduled CONCURRENT (independent kernels of a step may overlap) instead of
# serially. On an H200 (JAX 0.11.2), both loops compiled both ways and timed alternately in one process: at the 9B
# shape AR 4.763 -> 4.633 ms per token and a gamma-8 speculative step 5.022 -> 4.939 ms; on the tiny checkpoint AR
# 0.176 -> 0.163 ms and the step 0.210 -> 0.203 ms. Scheduling does not change any kernel's arithmetic (the processes
# above alternated both schedules: no difference). The update mode SKIP_TEMP measured the same as the default there,
# and XLA's WHILE / CONDITIONAL command buffers (the speculative loop on the device) slower, also re-measured under
# these options (9B step 5.03 -> 5.29 ms, tiny 0.19 -> 0.93 ms; docs/LOG.md, 2026-12-02).
GPU_COMPILER_OPTIONS = {"qwen3_5": {**EXACT_GPU_OPTIONS, "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
                        "looped": dict(EXACT_GPU_OPTIONS)}


def compiler_options(family: str) -> dict:
    """The XLA options `family`'s generation programs compile with on this backend ({} off the GPU).
    SPECDEC_XLA_OPTIONS overrides them everywhere: 'KEY=VALUE;KEY=VALUE', or 'none' for XLA's own defaults."""
    env = os.environ.get("SPECDEC_XLA_OPTIONS")
    if env is not None:
        if env.strip().lower() in ("", "none"):
            return {}
        pairs = [kv for kv in env.split(";") if kv.strip()]
        if not all("=" in kv for kv in pairs):
            raise ValueError(f"SPECDEC_XLA_OPTIONS must be 'KEY=VALUE;KEY=VALUE' or 'none'; got {env!r}")
        return dict(kv.strip().split("=", 1) for kv in pairs)
    return dict(GPU_COMPILER_OPTIONS.get(family, {})) if jax.default_backend() == "gpu" else {}


def _signature(args) -> tuple:
    """Tree structure, shapes, dtypes and shardings: a program compiled for parameters split over a mesh is not
    the one for a single device (nor for another mesh)."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None)) for x in leaves)


def compiled(jitted, static: dict, *args, options: dict | None = None):
    """(executable, seconds spent compiling: 0.0 when cached) of `jitted` for static keyword arguments
    `static` and positional arguments `args` (arrays or ShapeDtypeStructs), compiled with the XLA `options`."""
    switches = _switches()
    key = (jitted, tuple(sorted(static.items())), _signature(args), tuple(sorted((options or {}).items())),
           switches, jax.default_backend())
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key], 0.0
    if _traced_under[0] is not None and _traced_under[0] != switches:
        jax.clear_caches()  # the traces cached under the old switches (module docstring)
    _traced_under[0] = switches
    t0 = time.perf_counter()
    executable = jitted.lower(*args, **static).compile(compiler_options=options or None)
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
