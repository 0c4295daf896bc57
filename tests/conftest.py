"""Test-session settings.

One persistent XLA compilation cache for the session's pytest-xdist workers: many files compile the same
generation programs (same checkpoint, same shapes), and on 2 CPU cores compiling dominates the suite. A
cached executable is the one XLA compiled for the same program, so nothing a test checks changes.
SPECDEC_TEST_COMPILE_CACHE="" turns it off.

XLA's CPU backend compiles at its lowest LLVM optimization level, with the concurrency-optimized scheduler
and parallel codegen splitting off: the suite's programs are small and run briefly, so compiling them is
most of its time. Measured on 2 cores: test_tree_wy's root-path tests 92 s -> 55 s, test_gated_delta's
chunk tests 85 s -> 62 s, the sampling tests 26 s -> 29 s. Floating-point semantics do not change (no
fast-math at any level). SPECDEC_TEST_XLA_FLAGS replaces these flags ("" for XLA's defaults).
"""

import os

_FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_enable_concurrency_optimized_scheduler=false "
                 "--xla_cpu_parallel_codegen_split_count=1")
# Read when the CPU backend starts (first computation), so setting it here, before any test runs, suffices.
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""),
                                                 os.environ.get("SPECDEC_TEST_XLA_FLAGS", _FAST_COMPILE)]))

import jax  # noqa: E402

_DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache",
                        "jax_compilation_cache")
_CACHE = os.environ.get("SPECDEC_TEST_COMPILE_CACHE", _DEFAULT)
if _CACHE:
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
