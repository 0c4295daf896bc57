"""Parameters reach every jitted decode and benchmark function as arguments, never as closed-over constants:
closed over, a 7 GB model becomes XLA constants that the compiler folds for minutes (seen at the Huginn-0125
shape). Checked on tiny models by reading the programs: no constant larger than LIMIT elements."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import specdec_jax as sj

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 256  # elements: the tiny models' smallest weight (a norm) has 256; index constants are far smaller
_STABLEHLO_CONSTANT = re.compile(r"stablehlo\.constant [^\n]*: tensor<((?:\d+x)*)\w+>")


def _largest_stablehlo_constant(text: str) -> int:
    return max([int(np.prod([int(d) for d in dims.split("x") if d])) for dims in _STABLEHLO_CONSTANT.findall(text)]
               + [0])


@pytest.fixture(autouse=True)
def embed_every_constant():
    """Since jax 0.12 a closed-over array larger than `jax_embedded_constants_max_bytes` (1 KiB) is hoisted into an
    extra argument of the executable instead of an HLO constant, so the programs' text would no longer show it. Raised
    here, every closed-over array is embedded as under jax 0.11 (the GPU image's), where it is what makes XLA fold
    constants for minutes; the check reads the same programs under either version."""
    if not hasattr(jax.config, "jax_embedded_constants_max_bytes"):  # jax 0.11: always embedded
        yield
        return
    before = jax.config.jax_embedded_constants_max_bytes
    jax.config.update("jax_embedded_constants_max_bytes", 2 ** 40)
    try:
        yield
    finally:
        jax.config.update("jax_embedded_constants_max_bytes", before)


class _Lowered(Exception):
    """Raised once a generation's loop has been lowered (nothing needs to compile or run)."""


def test_generation_programs_take_parameters_as_arguments(monkeypatch):
    """Each generation's prefill and loop as lowered for compiled() (a closed-over weight is a constant of the
    lowered program, before XLA folds anything; not compiling them saves ~7 s on 2 cores)."""
    from specdec_jax.decoding import autoregressive, looped_spec, speculative
    loops = (autoregressive._decode_loop, speculative._spec_loop, looped_spec._loop)
    programs = []

    def lower_only(jitted, static, *args, options=None):  # stands in for compiled(): lower, stop after the loop
        lowered = jitted.lower(*args, **static)
        programs.append((jitted, lowered.as_text()))
        if jitted in loops:
            raise _Lowered
        return lowered, 0.0  # never run (the loop stops the generation first); its out_info shapes the loop

    for module in (autoregressive, speculative, looped_spec):
        monkeypatch.setattr(module, "compiled", lower_only)
    ids = np.asarray([[1542, 12, 290, 1239]])
    qwen = sj.load(ROOT / "checkpoints" / "tiny-qwen35-code", dtype="float32")
    with pytest.raises(_Lowered):
        sj.generate(qwen, ids, 6, method="ngram", gamma=2)  # the chain loop every drafter shares, with its prefill
    huginn = sj.load(ROOT / "checkpoints" / "tiny-huginn-code", dtype="float32")
    with pytest.raises(_Lowered):
        sj.generate(huginn, ids, 6, method="das-wave", num_steps=2, gamma=3)  # looped prefill and loop
    assert len(programs) >= 4
    for fn, text in programs:
        assert _largest_stablehlo_constant(text) < LIMIT, f"{fn.__name__} embeds a large constant"
    # The check can fail: a function that closes over a weight embeds it.
    w = qwen.params["layers"][0]["mlp"]["down_proj"]
    closed = jax.jit(lambda x: x @ w.T).lower(np.ones((1, w.shape[1]), np.float32))
    assert _largest_stablehlo_constant(closed.as_text()) >= LIMIT


def test_looped_benchmark_round_functions_take_parameters_as_arguments(monkeypatch):
    """benchmarks/bench_looped_spec.py's per-round timings (the run that stalled in constant folding)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import bench_looped_spec
    real_jit, largest = jax.jit, []

    def recording_jit(fn, *a, **kw):
        jitted, checked = real_jit(fn, *a, **kw), []

        def call(*args, **kwargs):
            if not checked:  # the first call's program (the timings repeat the same shapes)
                largest.append(_largest_stablehlo_constant(jitted.lower(*args, **kwargs).as_text()))
                checked.append(True)
            return jitted(*args, **kwargs)
        return call

    monkeypatch.setattr(jax, "jit", recording_jit)
    args = bench_looped_spec.parse_args(["--tiny", "--costs", "--skip-e2e", "--cost-gammas", "3", "--cost-ks", "1",
                                         "--cost-ds", "2", "--cost-repeats", "1"])
    bench_looped_spec.round_costs(args)
    assert len(largest) >= 5 and max(largest) < LIMIT, largest
