"""The library's import structure: layers that import only downward, no import cycles, no module reaching
into another's underscore names. Read from the source (ast), so it costs no compilation.

Layers, lowest first (a module may import its own layer and those below):
  0  pallas_kernels.*; specdec_jax.errors, options, results        kernels, errors, option checks, result types
  1  specdec_jax.loading, text, shipped, compile_cache, sharding,  files: safetensors, tokenizers, the shipped
     memory                                                      checkpoints, the compilation cache; where
                                                                 parameters and states live on a mesh; device memory
  2  specdec_jax.models.*                                          the model families (models.qwen35, models.looped:
                                                                 config, parameters, forward) and their common
                                                                 interface (models.family)
  3  specdec_jax.decoding.*, specdec_jax.drafters.*                AR / speculative loops, acceptance, drafters
  4  specdec_jax.api, methods, training                            the public calls, the method registry, training
                                                                 (and the corpus it trains on)
  5  specdec_jax.bench.*, cli, __main__, specdec_jax (pkg)         tools on top; bench.harness: the benchmark
                                                                 plumbing bench.bench and benchmarks/ share;
                                                                 bench.profiling: device traces read
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec_jax", "pallas_kernels")
LAYERS = [
    ("pallas_kernels", "specdec_jax.errors", "specdec_jax.options", "specdec_jax.results"),
    ("specdec_jax.loading", "specdec_jax.text", "specdec_jax.shipped", "specdec_jax.compile_cache",
     "specdec_jax.sharding", "specdec_jax.memory"),
    ("specdec_jax.models",),
    ("specdec_jax.decoding", "specdec_jax.drafters"),
    ("specdec_jax.api", "specdec_jax.methods", "specdec_jax.training"),
    # harness: timing, pairing, statistics, result headers and writers for benchmarks (bench.py and benchmarks/);
    # a tool, so nothing in the library below may depend on it.
    ("specdec_jax.bench", "specdec_jax.cli", "specdec_jax.__main__",
     "specdec_jax"),
]


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str):
    """(imported project module, names taken from it or None, line) for every import in `name`, at any depth."""
    base = name if _is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = base
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                target = f"{pkg}.{node.module}" if node.module else pkg
            else:
                target = node.module or ""
            if target.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:
                    yield sub, None, node.lineno
                else:
                    yield target, a.name, node.lineno


def _layer(name: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if name == p or name.startswith(p + "."):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    assert best is not None, f"{name} has no layer: add it to LAYERS"
    return best[0]


def test_every_module_has_a_layer():
    for name in MODULES:
        _layer(name)


def test_imports_only_go_down():
    bad = [f"{name}:{line} imports {target} (layer {_layer(target)} > {_layer(name)})"
           for name in MODULES for target, _, line in _imports(name)
           if target in MODULES and _layer(target) > _layer(name)]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = {name: {t for t, _, _ in _imports(name) if t in MODULES and t != name} for name in MODULES}
    # A package's __init__ is imported on the way to any of its modules: not a dependency of theirs.
    graph = {n: {t for t in ts if not (_is_package(t) and n.startswith(t + "."))} for n, ts in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for t in sorted(graph[n]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "\n".join(cycles)


def test_no_module_uses_another_modules_underscore_names():
    bad = []
    for name in MODULES:
        tree = ast.parse(MODULES[name].read_text())
        bound = set()  # local names bound to project modules
        for target, attr, line in _imports(name):
            if attr and attr.startswith("_") and not attr.startswith("__") and target != name:
                bad.append(f"{name}:{line} imports {target}.{attr}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) or isinstance(node, ast.Import):
                for a in node.names:
                    bound.add((a.asname or a.name).split(".")[0])
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                # only names bound by imports of project modules count
                bad.append(f"{name}:{node.lineno} uses {node.value.id}.{node.attr}")
    bad = [b for b in bad if not _external(b)]
    assert not bad, "\n".join(bad)


def _external(entry: str) -> bool:
    """Attribute uses on names imported from outside the project (jax, numpy, ...) are not ours to judge."""
    name, _, rest = entry.partition(":")
    if " uses " not in rest:
        return False
    var = rest.split(" uses ")[1].split(".")[0]
    tree = ast.parse(MODULES[name].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (a.asname or a.name).split(".")[0] == var:
                    return a.name.split(".")[0] not in PACKAGES
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if (a.asname or a.name) == var:
                    return not node.level and (node.module or "").split(".")[0] not in PACKAGES
    return True


@pytest.mark.parametrize("limit", [500])
def test_no_file_is_far_over_the_size_budget(limit):
    """Library files stay within 500 lines (the largest, training/corpus.py, is about 460: the Qwen3.5 model was
    split into the model and its parameter layout, models/qwen35/params.py, when tensor parallelism took it past
    600)."""
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    over = {n: s for n, s in sizes.items() if s > limit}
    assert not over, over
