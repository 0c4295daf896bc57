"""JAX's persistent compilation cache, on by default: a second process (the next `specdec-jax` command, a restarted
notebook) loads the programs an earlier one compiled instead of compiling them again (PERFORMANCE.md: a fresh
process's first tiny-model call 10.3 -> 1.7 s, the 9B shape's 24.1 -> 3.3 s, on the GPU; 3.9-6.3 -> 1.0-1.3 s on
the CPU; Pallas programs included).

Where: $SPECDEC_COMPILATION_CACHE if it names a folder, else $XDG_CACHE_HOME/specdec_jax/xla (~/.cache/...).
Off: SPECDEC_COMPILATION_CACHE=0 (or "off"). A cache folder the user set for JAX itself (jax_compilation_cache_dir,
JAX_COMPILATION_CACHE_DIR) is left as it is.
"""

from __future__ import annotations

import os

import jax

ENV = "SPECDEC_COMPILATION_CACHE"
OFF = ("0", "off", "false", "no", "")
MIN_COMPILE_SECONDS = 0.5  # programs that compile faster than this are not worth a file


def default_folder() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "specdec_jax", "xla")


def enable() -> str | None:
    """Point JAX's persistent compilation cache at our folder unless the user chose one or turned it off; returns
    the folder in use (None: off)."""
    chosen = jax.config.jax_compilation_cache_dir
    if chosen:
        return chosen
    setting = os.environ.get(ENV)
    if setting is not None and setting.strip().lower() in OFF:
        return None
    folder = setting if setting else default_folder()
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:  # a read-only home: run without the cache rather than fail
        return None
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return folder
