"""Test-session settings.

One persistent XLA compilation cache for the session's pytest-xdist workers: many files compile the same
generation programs (same checkpoint, same shapes), and on 2 CPU cores compiling dominates the suite. A
cached executable is the one XLA compiled for the same program, so nothing a test checks changes.
SPECDEC_TEST_COMPILE_CACHE="" turns it off.
"""

import os

import jax

_DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache",
                        "jax_compilation_cache")
_CACHE = os.environ.get("SPECDEC_TEST_COMPILE_CACHE", _DEFAULT)
if _CACHE:
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
