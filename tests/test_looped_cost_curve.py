"""The forced-acceptance mode of looped self-speculation (`looped_spec._loop(accept_p=...)`) behind
benchmarks/bench_looped_curve.py: the accepted count follows the forced schedule, generate() cannot reach it,
and the script's tiny run writes rows with the documented fields. CPU, tiny random model, R = 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.decoding import looped_spec as ls
from specdec_jax.decoding.sampling import SamplingConfig
from specdec_jax.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import bench_looped_curve  # noqa: E402
from benchmarks.bench_looped_spec import random_model, tiny_config  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), jnp.float32)


def test_generate_cannot_reach_forced_acceptance(model):
    with pytest.raises(InputError, match="unknown options"):
        sj.generate(model, np.asarray([[1, 2, 3]]), 4, method="das-wave", num_steps=2, accept_p=1.0)


def test_tiny_script_run_writes_the_documented_rows(tmp_path):
    measured = tmp_path / "tiny_acceptance.json"  # a bench_looped_spec.py-like result to project
    measured.write_text(json.dumps({"e2e": [{"summary": {"method": "das-wave", "tokens_per_step": 2.0,
                                                         "options": {"gamma": 3, "k": 1, "carry": True}}}]}))
    res = bench_looped_curve.main(["--tiny", "--methods", "das-wave", "--ks", "1", "--das-gamma", "3", "--ps",
                                   "0.0,1.0", "--num-steps", "2", "--max-new-tokens", "8", "--workers", "2",
                                   "--tiny-acceptance", str(measured), "--out", str(tmp_path)])
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"looped_cost_curve_tiny.{ext}").exists()
    saved = json.loads((tmp_path / "looped_cost_curve_tiny.json").read_text())
    for field in ("device", "jax", "git_commit", "command"):
        assert saved[field]
    rows = saved["rows"]
    assert [r["p"] for r in rows] == [0.0, 1.0]
    for r in rows:
        for field in ("method", "gamma", "k", "draft_steps", "p", "tokens_per_verify", "core_apps_per_token",
                      "speedup", "ideal"):
            assert field in r
        assert r["method"] == "das-wave" and r["gamma"] == 3 and r["k"] == 1 and r["draft_steps"] is None
        assert r["ideal"] == pytest.approx(2 / r["core_apps_per_token"]) and r["speedup"] > 0
    # the forced schedule: every verification accepts none of the 3 drafts (p 0) or all of them (p 1)
    assert rows[0]["tokens_per_verify"] == 1.0 and rows[1]["tokens_per_verify"] == 4.0
    # p = 0: each token costs one block of 2 rounds (k = 1) + one verification of R = 2 applications.
    assert rows[0]["core_apps_per_token"] == pytest.approx(4.0)
    proj = res["projection"]
    assert len(proj) == 1 and proj[0]["measured_tokens_per_verify"] == 2.0 and proj[0]["in_range"]
    lo, hi = sorted([rows[0]["speedup"], rows[1]["speedup"]])
    assert lo <= proj[0]["speedup"] <= hi


def test_script_programs_take_parameters_as_arguments(model):
    """As tests/test_no_large_constants.py: closed-over weights would become constants XLA folds for minutes
    at the Huginn-0125 shape. Lowering only (no compile)."""
    from tests.test_no_large_constants import LIMIT, _largest_stablehlo_constant
    args = bench_looped_curve.parse_args(["--tiny", "--methods", "das-wave,self-spec", "--ks", "1", "--ds", "1",
                                          "--num-steps", "2"])
    plans = dict(bench_looped_curve.configs(args))
    lowered, _ = bench_looped_curve.lower_all(model, plans, jnp.ones((1, 4), jnp.int32), jax.random.PRNGKey(0), 2,
                                              6, 17)
    assert len(lowered) == 6  # AR prefill + loop, one prefill per (gamma, window), a loop per config
    for name, lo in lowered.items():
        assert _largest_stablehlo_constant(lo.as_text()) < LIMIT, f"{name} embeds a large constant"


def test_das_wave_probabilities_are_its_own_and_checked(capsys):
    """--das-ps applies to das-wave only (default --ps); a probability outside [0, 1] is one error naming the flag."""
    args = bench_looped_curve.parse_args(["--tiny", "--ps", "0.5", "--das-ps", "0.97,1"])
    assert args.ps == [0.5] and args.das_ps == [0.97, 1.0]
    assert bench_looped_curve.parse_args(["--tiny", "--ps", "0.2,0.4"]).das_ps == [0.2, 0.4]
    for flag in ("--ps", "--das-ps"):
        with pytest.raises(SystemExit):
            bench_looped_curve.parse_args(["--tiny", flag, "0.5,1.5"])
        assert f"{flag}: every probability must lie in [0, 1]" in capsys.readouterr().err
