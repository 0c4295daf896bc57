"""The shipped tiny checkpoints by alias: `tiny-qwen`, `tiny-huginn`.

They live in the repository's `checkpoints/`; `pip install .` copies them to `<prefix>/share/specdec_jax/
checkpoints/` (pyproject's [tool.setuptools.data-files]), so an alias resolves from a source tree, an editable
install and a regular one alike, from any working folder.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from pathlib import Path

from .errors import CheckpointError

ALIASES = {"tiny-qwen": "tiny-qwen35-code", "tiny-huginn": "tiny-huginn-code"}
DEFAULT_ALIAS = "tiny-qwen"
DATA_SUBDIR = ("share", "specdec_jax", "checkpoints")  # must match pyproject's data-files targets


def search_roots() -> list[Path]:
    """Folders that may hold the shipped checkpoints, in the order they are tried: the source tree beside the
    package, then the install prefixes' data folders (the environment's, the interpreter's, the user's)."""
    roots = [Path(__file__).resolve().parent.parent / "checkpoints"]
    prefixes = [sysconfig.get_path("data"), sys.prefix, sys.base_prefix, getattr(site, "USER_BASE", None)]
    for prefix in dict.fromkeys(p for p in prefixes if p):
        roots.append(Path(prefix, *DATA_SUBDIR))
    return list(dict.fromkeys(roots))


def resolve(path: str | os.PathLike) -> str:
    """`path` itself when it exists or is no alias; else the alias's folder (one with a config.json), or one
    CheckpointError naming every place looked in."""
    path = os.fspath(path)
    if os.path.exists(path) or path not in ALIASES:
        return path
    folder = ALIASES[path]
    tried = [root / folder for root in search_roots()]
    for candidate in tried:
        if (candidate / "config.json").is_file():
            return str(candidate)
    raise CheckpointError(f"checkpoint '{path}' ({folder}) not found; looked in {', '.join(map(str, tried))} "
                          f"(reinstall specdec_jax, or pass a checkpoint folder)")


def describe() -> str:
    """The aliases, for help texts: "tiny-qwen (tiny-qwen35-code), tiny-huginn (tiny-huginn-code)"."""
    return ", ".join(f"{alias} ({folder})" for alias, folder in ALIASES.items())
