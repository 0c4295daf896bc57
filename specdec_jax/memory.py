"""Device memory: what a generation's decode state needs, what the device has free, the peak a call reached.

JAX's GPU allocator reserves a pool up front (75 % of the card by default); `memory_stats` reports the pool
(bytes_limit), what live arrays hold (bytes_in_use) and the most they ever held (peak_bytes_in_use). Devices that
report nothing (the CPU) are not checked.
"""

from __future__ import annotations

import jax

from .errors import InputError

GIB = 1024 ** 3
# Headroom a generation needs beside its decode state (at the 9B shape AR peaked at 0.25 GiB over weights + KV from
# 4K to 128K tokens on an H100: long_context_qwen35_9b.json), with room for larger batches and vocabularies.
WORKSPACE_BYTES = 2 * GIB


def _stats() -> dict | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001: a backend without memory statistics
        return None
    return stats if stats and "bytes_limit" in stats else None


def peak_bytes() -> int | None:
    """The most device memory live arrays have held in this process (None where the device does not say)."""
    stats = _stats()
    return None if stats is None else int(stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0)))


def tree_bytes(tree) -> int:
    """Bytes of a pytree of arrays or shape structs."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def check_fits(state_shapes, what: str, devices: int = 1) -> None:
    """One InputError, before any compute, when a decode state of these shapes (and WORKSPACE_BYTES beside it) does
    not fit the memory the device has free. `what` names the state (rows, cache length); devices: how many devices
    the state is split over (a tensor-parallel mesh)."""
    stats = _stats()
    if stats is None:
        return
    need = tree_bytes(state_shapes) // max(int(devices), 1)
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if need + WORKSPACE_BYTES > free:
        raise InputError(f"{what} needs {need / GIB:.2f} GiB of device memory (+ {WORKSPACE_BYTES / GIB:.0f} GiB of "
                         f"workspace); the device has {free / GIB:.2f} GiB free of {int(stats['bytes_limit']) / GIB:.2f}"
                         " GiB: use a shorter prompt, fewer new tokens or fewer rows")
