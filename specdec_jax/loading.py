"""safetensors -> parameter pytrees. Only safetensors are read (never pickles).

`TensorSource` opens `model.safetensors` or a sharded `model.safetensors.index.json`, knows which
file holds each key, and reads shapes from the headers without loading data, so a whole
checkpoint is validated (each file's header against its size, every key present, every shape right) before
the first tensor is read.
Tensors are then read one at a time and moved to the device, so the host never holds two copies
of a large checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Bytes per element of the safetensors dtypes; a dtype not listed here (sub-byte formats) skips the size check.
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1,
                "F8_E5M2FNUZ": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8,
                "U64": 8, "F64": 8, "C64": 8}


def check_safetensors(path: str) -> None:
    """One CheckpointError naming `path` when its header is unreadable or promises more bytes than the file
    holds (a truncated download or copy); reads the header only."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"'{path}' is truncated or corrupt ({why}); copy or download it again")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise bad(f"its header claims {n} bytes; the file holds {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"its header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    data = size - 8 - n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            count = math.prod(int(d) for d in info["shape"])
            dtype = info["dtype"]
        except (TypeError, KeyError, ValueError):
            raise bad(f"tensor '{key}' has no valid dtype, shape and data_offsets") from None
        if not 0 <= begin <= end <= data:
            raise bad(f"tensor '{key}' lies at bytes [{begin}, {end}) of {data} bytes of tensor data")
        if dtype in _DTYPE_BYTES and end - begin != count * _DTYPE_BYTES[dtype]:
            raise bad(f"tensor '{key}' ({dtype}, shape {list(info['shape'])}) needs {count * _DTYPE_BYTES[dtype]} "
                      f"bytes; its offsets span {end - begin}")


@contextlib.contextmanager
def open_safetensors(path: str, framework: str = "numpy"):
    """safe_open, with the library's own errors (a file damaged past its header) as one CheckpointError."""
    try:
        with safe_open(path, framework=framework) as f:
            yield f
    except SafetensorError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"could not read '{path}' (truncated or corrupt?): {first}") from None


class TensorSource:
    """Key -> (file, shape) map over the safetensors files of one checkpoint folder."""

    def __init__(self, folder: str):
        self.folder = folder
        index_path = os.path.join(folder, INDEX_FILE)
        single_path = os.path.join(folder, SINGLE_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f).get("weight_map")
            except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
                raise CheckpointError(f"'{index_path}' is not a JSON object: {e}") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"'{index_path}' has no 'weight_map' object")
            self.file_of = {k: os.path.join(folder, v) for k, v in weight_map.items()}
            self.description = index_path
        elif os.path.isfile(single_path):
            check_safetensors(single_path)
            with open_safetensors(single_path) as f:
                self.file_of = {k: single_path for k in f.keys()}
            self.description = single_path
        else:
            raise CheckpointError(
                f"no weights in '{folder}': expected {SINGLE_FILE} or {INDEX_FILE} (safetensors only)")
        for path in sorted(set(self.file_of.values())):
            if not os.path.isfile(path):
                raise CheckpointError(f"shard '{path}' named in {self.description} does not exist")
            if path != single_path:
                check_safetensors(path)
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def keys(self) -> list[str]:
        return list(self.file_of)

    def __contains__(self, key: str) -> bool:
        return key in self.file_of

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of every tensor, read from the file headers only."""
        if self._shapes is None:
            shapes = {}
            by_file: dict[str, list[str]] = {}
            for k, p in self.file_of.items():
                by_file.setdefault(p, []).append(k)
            for path, keys in by_file.items():
                with open_safetensors(path) as f:
                    present = set(f.keys())
                    for k in keys:
                        if k not in present:
                            raise CheckpointError(f"tensor '{k}' is listed in {self.description} "
                                                  f"but missing from '{path}'")
                        shapes[k] = tuple(f.get_slice(k).get_shape())
            self._shapes = shapes
        return self._shapes

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Every expected key present with its shape; raises naming the key, file and shapes."""
        for key, shape in expected.items():
            if key not in self.file_of:
                raise CheckpointError(f"tensor '{key}' is missing from {self.description}")
            got = self.shapes[key]
            if tuple(got) != tuple(shape):
                raise CheckpointError(f"tensor '{key}' in '{self.file_of[key]}' has shape {tuple(got)}; "
                                      f"expected {tuple(shape)}")

    def read(self, key: str, dtype) -> jax.Array:
        """One tensor as a device array of `dtype` (bf16 files are read through the flax backend)."""
        with open_safetensors(self.file_of[key], framework="flax") as f:
            x = f.get_tensor(key)
        return jnp.asarray(x, dtype=dtype)

    def read_many(self, keys: Iterable[str], dtype) -> list[jax.Array]:
        return [self.read(k, dtype) for k in keys]


def build_tree(spec: Mapping[tuple, Any], read: Callable[[Any], jax.Array]) -> dict:
    """Nested dict from {path tuple: leaf spec}; `read(leaf_spec)` produces each leaf in turn."""
    tree: dict = {}
    for path, leaf_spec in spec.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = read(leaf_spec)
    return _lists_from_int_keys(tree)


def _lists_from_int_keys(node):
    if not isinstance(node, dict):
        return node
    node = {k: _lists_from_int_keys(v) for k, v in node.items()}
    if node and all(isinstance(k, int) for k in node):
        return [node[i] for i in range(len(node))]
    return node


def flatten_tree(tree, prefix: tuple = ()) -> dict[tuple, Any]:
    """Inverse of build_tree: {path tuple: leaf} (lists indexed by int)."""
    out: dict[tuple, Any] = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else None
    if items is None:
        out[prefix] = tree
        return out
    for k, v in items:
        if v is None:
            continue
        out.update(flatten_tree(v, prefix + (k,)))
    return out


def save_safetensors(tensors: Mapping[str, Any], path: str, metadata: Mapping[str, str] | None = None) -> None:
    """Write {key: array} as safetensors (bf16 included) through the library's flax backend."""
    from safetensors.flax import save_file
    save_file({k: jnp.asarray(v) for k, v in tensors.items()}, path, metadata=dict(metadata or {"format": "pt"}))


def resolve_dtype(dtype) -> Any:
    names = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32,
             "float16": jnp.float16, "fp16": jnp.float16}
    if isinstance(dtype, str):
        if dtype not in names:
            raise CheckpointError(f"dtype {dtype!r} is not supported; use one of {sorted(names)}")
        return names[dtype]
    return jnp.dtype(dtype).type if dtype is not None else jnp.bfloat16


def as_numpy(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))
