"""Test-session settings.

One persistent XLA compilation cache for the session's pytest-xdist workers: many files compile the same
generation programs (same checkpoint, same shapes), and on 2 CPU cores compiling dominates the suite. A
cached executable is the one XLA compiled for the same program, so nothing a test checks changes.
SPECDEC_TEST_COMPILE_CACHE="" turns it off.

Every program XLA's CPU backend compiles keeps about three memory mappings while JAX's caches hold it, and a
Linux process may hold vm.max_map_count of them (65 530 by default). One xdist worker of the whole suite reached
27 752 in 12 minutes, and the runs that reached the limit crashed inside XLA's compiler (a segfault during
test_training's compile, twice). So after each test module, once a worker holds more than a third of its limit,
the trace and compile caches are dropped (the persistent cache above still serves their programs).

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

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

_DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache",
                        "jax_compilation_cache")
_CACHE = os.environ.get("SPECDEC_TEST_COMPILE_CACHE", _DEFAULT)
if _CACHE:
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _memory_maps() -> tuple[int, int] | None:
    """(mappings this process holds, the most it may hold), or None where /proc does not say."""
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as f:
            held = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return held, int(f.read())
    except (OSError, ValueError):
        return None


@pytest.fixture(autouse=True, scope="module")
def _bounded_compiled_programs():
    """Drop JAX's in-memory caches after a module once the worker holds a third of its memory-map limit."""
    yield
    maps = _memory_maps()
    if maps is not None and maps[0] > maps[1] // 3:
        jax.clear_caches()
        gc.collect()


# ---------------------------------------------------------------------------------- shared fixtures and helpers

TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"] * 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3.5 checkpoint folder: random weights and a small BPE tokenizer trained on TEXTS (test_bench,
    test_cli; test_qwen35 defines its own `checkpoint`, transformers' reference models)."""
    from tokenizers import Tokenizer

    from specdec_jax.training import corpus
    from specdec_jax import training
    root = tmp_path_factory.mktemp("checkpoint")
    tok_dir = corpus.train_tokenizer(TEXTS, root / "tokenizer", vocab_size=300, min_frequency=1)
    vocab = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size()
    o = training.TrainOptions(hidden=32, layers=4, heads=4, kv_heads=2, head_dim=16, linear_key_heads=2,
                              linear_value_heads=4, linear_head_dim=8, intermediate=64)
    cfg = training.qwen35_config(vocab, o)
    params = training.init_qwen35_params(cfg, jax.random.PRNGKey(0), std=0.2)
    folder = root / "model"
    training.save_checkpoint(folder, "qwen35", params, cfg, training.qwen35_config_json(cfg), tok_dir)
    return folder


def one_line_error(rc: int, err: str, *needles: str) -> None:
    """A command-line error: exit code 2 and one line on stderr holding every needle."""
    assert rc == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
