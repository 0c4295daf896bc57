"""The forced-acceptance mode behind `benchmarks/bench_spec.py --forced-acceptance` (a benchmark of step cost
against tokens per step): the accepted count follows the seeded schedule, the real acceptance still runs,
generate() cannot reach it, and the script refuses bad flags with one clear error."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.decoding import speculative as sp
from specdec_jax.decoding.sampling import SamplingConfig
from specdec_jax.drafters.ngram import NgramDrafter
from specdec_jax.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "checkpoints" / "tiny-qwen35-code"


def test_forced_acceptance_follows_the_schedule():
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 6, 11))
    key = jax.random.PRNGKey(1)
    real = jnp.asarray([2, 0, 5])
    for p, want in ((1.0, [5, 5, 5]), (0.0, [0, 0, 0])):
        n, tok = sp.forced_acceptance(real, logits, jnp.float32(p), key)
        np.testing.assert_array_equal(np.asarray(n), want)
        np.testing.assert_array_equal(np.asarray(tok), np.argmax(np.asarray(logits)[np.arange(3), want], axis=-1))
    # Intermediate p: leading successes of seeded Bernoulli draws, so the mean is sum_{i<=G} p^i - 1.
    keys = jax.random.split(jax.random.PRNGKey(2), 4000)
    n = jax.vmap(lambda k: sp.forced_acceptance(real, logits, jnp.float32(0.6), k)[0])(keys)
    expected = sum(0.6 ** i for i in range(1, 6))
    assert abs(float(n.mean()) - expected) < 0.05


def test_forced_loop_runs_and_counts_tokens_per_step():
    model = sj.load(TINY, dtype="float32")
    cfg, params = model.config, model.params
    prompt = jnp.asarray([[1542, 12, 290, 1239, 11, 2023]], jnp.int32)
    static_p = dict(cfg=cfg, max_len=64, sampling=SamplingConfig(), eos_ids=(), state_dtype=jnp.float32, gamma=4,
                    max_new_tokens=41, drafter=NgramDrafter(), impl="auto")
    static_l = dict(cfg=cfg, sampling=SamplingConfig(), eos_ids=(), gamma=4, max_new_tokens=41, drafter=NgramDrafter(),
                    rollback="replay", impl="auto")
    key = jax.random.PRNGKey(0)
    state, dstate = sp._spec_prefill(params, prompt, key, **static_p)
    _, state, _ = sp._spec_loop(params, state, dstate, key, jnp.float32(1.0), **static_l)
    accepted = np.asarray(state.accepted)[:int(state.steps), 0]
    assert (accepted == 4).all() and int(state.steps) == 8  # 40 tokens after the first, 5 per step


def test_generate_cannot_reach_forced_acceptance():
    model = sj.load(TINY, dtype="float32")
    with pytest.raises(InputError, match="unknown options"):
        sj.generate(model, np.asarray([[1, 2, 3]]), 4, method="ngram", accept_p=0.5)


@pytest.mark.parametrize("flags, needle", [
    (["--forced-acceptance", "1.5"], "must lie in [0, 1]"),
    (["--forced-acceptance", "x"], "comma list of probabilities"),
    (["--forced-acceptance", "0.5", "--curve-method", "ar"], "needs a chain speculative method"),
    (["--forced-acceptance", "0.5", "--rollbacks", "undo"], "--rollbacks: unknown"),
    (["--forced-acceptance", "0.5", "--curve-method", "layer-skip:shortlist_size"], "options are key=value"),
])
def test_bad_forced_acceptance_flags_are_one_clear_error(flags, needle, monkeypatch, capsys):
    """argparse's one-line error and exit code 2, before any model is built."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import bench_spec
    monkeypatch.setattr(bench_spec, "random_9b_model", lambda *a, **k: pytest.fail("built a model"))
    monkeypatch.setattr(sys, "argv", ["bench_spec.py", "--random-9b", "--tiny", *flags])
    with pytest.raises(SystemExit) as exit_info:
        bench_spec.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "--" in err


def test_curve_methods_take_options_and_a_random_model_gets_a_synthetic_shortlist():
    sys.path.insert(0, str(ROOT))
    from benchmarks import bench_spec
    assert bench_spec.parse_curve_method("partial-mlp:mlp_keep=0.75:shortlist_size=64") == (
        "partial-mlp", {"mlp_keep": 0.75, "shortlist_size": 64})
    model = bench_spec.with_synthetic_shortlist(bench_spec.random_9b_model(True), ["ngram", "layer-skip:shortlist_size=64"])
    drafter = bench_spec.curve_drafter(model, "partial-mlp:mlp_keep=0.75:shortlist_size=64")
    assert (drafter.method, drafter.mlp_keep, drafter.shortlist_size) == ("partial-mlp", 0.75, 64)
    np.testing.assert_array_equal(model.params["draft"]["shortlist"], np.arange(64))
    with pytest.raises(InputError, match="unknown options"):
        bench_spec.curve_drafter(model, "ngram:mlp_keep=0.5")


def test_e2e_methods_take_a_gamma_options_and_a_rollback():
    sys.path.insert(0, str(ROOT))
    from benchmarks import bench_spec
    parse = bench_spec.parse_e2e_method
    assert parse("mtp") == ("mtp", None, {}, None)
    assert parse("ngram:8/snapshot") == ("ngram", 8, {}, "snapshot")
    assert parse("mtp:3:unroll_drafts=False") == ("mtp", 3, {"unroll_drafts": False}, None)
    assert parse("mtp-shortlist:shortlist_size=64/replay") == ("mtp-shortlist", None, {"shortlist_size": 64}, "replay")
    with pytest.raises(ValueError, match="gamma must be an integer"):
        parse("mtp:three")
