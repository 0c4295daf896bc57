"""Tensor parallelism (load(path, mesh=...), sharding.py) on four fake CPU devices.

The multi-device cases run in one subprocess (tests/tensor_parallel_worker.py): JAX must start with
XLA_FLAGS=--xla_force_host_platform_device_count=4, and this process's JAX is already running. The subprocess
gets this session's XLA CPU flags and compile cache (conftest.py) and prints its results as JSON.

Checked: greedy outputs of the shipped checkpoint in float32, AR's on a 2-device mesh and MTP's on 4 devices (where KV
heads are copied), equal the single-device output token for token (AR's, which greedy n-gram and MTP equal on one
device). MTP's run covers the chain loop every drafter shares and the forwards at AR's decode rows on 4 devices, so AR
and n-gram are not run there too (tensor_parallel_worker.METHODS); parameters and
decode state are split over the mesh (the shipped model has 2 KV heads: on 4 devices each holds a copy of one, as
vLLM replicates them); a head count that neither divides nor is divided by the mesh, a mesh without a "tp" axis and
a looped model are each one InputError, raised before any tensor is read; a random MoE model's experts are split
over the mesh and its logits match one device's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "tensor_parallel_worker.py")
DEVICES = 4


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}")
    cache = jax.config.jax_compilation_cache_dir
    if cache:
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    run = subprocess.run([sys.executable, WORKER], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_worker_sees_four_devices(results):
    assert results["devices"] == DEVICES


@pytest.mark.parametrize("n, method", [(2, "ar"), (4, "mtp")])
def test_mesh_outputs_equal_single_device(results, n, method):
    # One device's greedy output, AR's, is every method's reference: greedy n-gram and MTP equal it token for token
    # there (the exact path: test_exact.py, test_drafters.py), so the worker runs only AR on one device.
    assert results[str(n)]["tokens"][method] == results["single"]["ar"]


def test_parameters_are_split_by_role(results):
    for n in (2, 4):
        p = results[str(n)]["params"]
        # Vocabulary rows, grouped fused rows (heads, gate/up columns), projection inputs (o, down).
        for name, axis in (("embed", 0), ("qkv_proj", 0), ("in_proj", 0), ("gate_up_proj", 0), ("mtp_qkv_proj", 0),
                           ("o_proj", 1), ("down_proj", 1)):
            leaf = p[name]
            assert not leaf["replicated"], (n, name)
            assert all(s[axis] == leaf["shape"][axis] // n for s in leaf["shard_shapes"]), (n, name, leaf)
        assert p["final_norm"]["replicated"]
    # 2 devices: 2 KV heads split; 4 devices: each holds its q heads and one KV head copy (qkv rows: 4 q heads
    # of (q ; gate) 2 * 64 rows, 2 KV heads of 64 rows each for k and v, 256 model dims).
    assert results["2"]["params"]["qkv_proj"]["shape"] == [4 * 128 + 2 * 2 * 64, 256]
    assert results["4"]["params"]["qkv_proj"]["shape"] == [4 * 128 + 4 * 2 * 64, 256]


def test_decode_state_is_split_over_heads(results):
    for n in (2, 4):
        s = results[str(n)]["state"]
        assert s["recurrent"]["spec"] == "P(None, None, 'tp')"  # [n_gdn, B, HV, K, V]
        assert all(sh[2] == 8 // n for sh in s["recurrent"]["shard_shapes"])  # 8 GDN value heads
        assert all(sh[2] == 1 for sh in s["keys"]["shard_shapes"])  # one KV head (or head copy) per device
        assert s["conv"]["spec"] == "P(None, None, None, 'tp')"  # [n_gdn, B, W - 1, channels]
        assert all(sh[3] == s["conv"]["shape"][3] // n for sh in s["conv"]["shard_shapes"])
        assert s["length"]["replicated"]
    assert results["2"]["state"]["keys"]["shape"][2] == 2
    assert results["4"]["state"]["keys"]["shape"][2] == 4  # 2 KV heads, each copied onto 2 devices
    same_01, same_23, same_02 = results["4"]["kv_copies"]
    assert same_01 and same_23 and not same_02


def test_refused_meshes_are_one_input_error(results):
    bad = results["refused"]["bad_heads"]
    # The folder holds only config.json: a CheckpointError about missing weights would mean tensors were sought.
    assert bad["type"] == "InputError", bad
    for part in ("num_key_value_heads=3", "linear_num_key_heads=3", "'tp' of size 2", "config.json"):
        assert part in bad["message"], bad
    assert "num_attention_heads" not in bad["message"]  # 6 heads split over 2
    no_tp = results["refused"]["no_tp_axis"]
    assert no_tp["type"] == "InputError" and "'tp'" in no_tp["message"] and "('data',)" in no_tp["message"], no_tp
    looped = results["refused"]["looped"]
    assert looped["type"] == "InputError" and "looped" in looped["message"], looped


def test_moe_experts_split_over_the_mesh(results):
    moe = results["moe"]
    assert moe["experts"]["shard_shapes"] == [[2, 32, 32]] * 4  # 8 experts, 2 per device
    assert moe["shared"]["shard_shapes"] == [[12, 32]] * 4  # shared expert: 24 gate + 24 up columns, 6 + 6 each
    assert moe["rel"] < 1e-4 and moe["argmax_equal"], moe
