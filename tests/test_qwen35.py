"""Qwen3.5 model vs transformers (the PyTorch reference), fp32 on CPU; state threading; loading."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

import specdec_jax as sj
from pallas_kernels import gated_delta
from specdec_jax.models.qwen35 import model as qwen35
from tests import qwen_helpers as H

VARIANTS = {
    "ratio1_untied": dict(ratio=1),
    "ratio2_tied": dict(ratio=2, tied=True),
    "ratio3_multimodal": dict(ratio=3, multimodal=True),
    "moe": dict(moe=True, ratio=2),
    "moe_multimodal_tied": dict(moe=True, ratio=1, tied=True, multimodal=True),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    kw = dict(VARIANTS[request.param])
    multimodal = kw.pop("multimodal", False)
    cfg = H.tiny_text_config(**kw, seed=len(request.param))
    ref = H.build_reference(cfg, seed=len(request.param))
    folder = str(tmp_path_factory.mktemp(request.param))
    H.save_reference(ref, folder, multimodal=multimodal, mtp_layers=1)
    return request.param, ref, sj.load(folder, dtype="float32")


def test_forward_logits_match_transformers(checkpoint):
    name, ref, model = checkpoint
    ids = np.random.default_rng(1).integers(0, model.vocab_size, size=(2, 70))  # crosses a 64-chunk
    err = H.rel_err(sj.forward_logits(model, ids), H.reference_logits(ref, ids))
    assert err <= 1e-4, f"{name}: relative error {err:.2e}"


# Greedy decoding against transformers on three of the variants (the suite's time): the tied head and the multimodal
# layout change only what is loaded, which every variant's forward logits check above; the decode path is the same.
GREEDY_VARIANTS = ("ratio1_untied", "ratio3_multimodal", "moe")


@pytest.mark.parametrize("checkpoint", GREEDY_VARIANTS, indirect=True)
def test_greedy_generate_matches_transformers(checkpoint):
    name, ref, model = checkpoint
    ids = np.random.default_rng(2).integers(0, model.vocab_size, size=(1, 9))
    ours = sj.generate(model, ids, 32, method="ar", eos_token_id=False)
    np.testing.assert_array_equal(ours.tokens, H.reference_greedy(ref, ids, 32), err_msg=name)
    assert ours.stats["new_tokens"] == 32 and ours.stats["tokens_per_second"] > 0


def test_loaded_layout(checkpoint):
    name, _, model = checkpoint
    cfg = model.config
    assert "mtp" in model.params and len(model.params["mtp"]["layers"]) == 1
    assert ("lm_head" in model.params) == (not cfg.tie_word_embeddings)
    assert len(model.params["layers"]) == cfg.num_hidden_layers


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    cfg = H.tiny_text_config(ratio=2, layers=4)
    ref = H.build_reference(cfg, seed=7)
    folder = str(tmp_path_factory.mktemp("small"))
    H.save_reference(ref, folder)
    return folder, sj.load(folder, dtype="float32")


def _run(model, state, ids):
    """Jitted forward on a copy of `state` (the jitted call donates its state argument)."""
    return qwen35.forward_jit(model.params, model.config, jax.tree.map(jnp.copy, state), jnp.asarray(ids))


def _assert_states_close(a, b, tol=1e-5):
    for name in ("keys", "values", "conv", "recurrent"):
        for x, y in zip(getattr(a, name), getattr(b, name)):
            assert H.rel_err(x, y) <= tol, name
    np.testing.assert_array_equal(a.length, b.length)


def test_state_threading_prefill_then_forward(small_model):
    _, model = small_model
    ids = np.random.default_rng(3).integers(0, model.vocab_size, size=(2, 77))
    for split in (1, 64, 76):
        fresh = qwen35.init_state(model.config, 2, 80, jnp.float32)
        full_logits, full_state = _run(model, fresh, ids)
        la, sa = _run(model, qwen35.init_state(model.config, 2, 80, jnp.float32), ids[:, :split])
        lb, sb = _run(model, sa, ids[:, split:])
        assert H.rel_err(jnp.concatenate([la, lb], axis=1), full_logits) <= 1e-5, split
        _assert_states_close(sb, full_state)


def test_decode_step_equals_forward_t1(small_model):
    _, model = small_model
    cfg = model.config
    ids = np.random.default_rng(4).integers(0, model.vocab_size, size=(3, 12))
    _, state = _run(model, qwen35.init_state(cfg, 3, 16, jnp.float32), ids)
    token = jnp.asarray([5, 17, 3], jnp.int32)
    want, want_state = _run(model, state, token[:, None])
    got, got_state = qwen35.decode_step(model.params, cfg, jax.tree.map(jnp.copy, state), token)
    assert H.rel_err(got, want[:, 0]) <= 1e-5
    _assert_states_close(got_state, want_state, 1e-5)
    last, _ = qwen35.prefill(model.params, cfg, qwen35.init_state(cfg, 3, 16, jnp.float32), jnp.asarray(ids))
    full, _ = _run(model, qwen35.init_state(cfg, 3, 16, jnp.float32), ids)
    assert H.rel_err(last, full[:, -1]) <= 1e-5


def test_every_layers_conv_window_in_one_op_equals_each_layers_window():
    """qwen35.stacked_conv_windows_at (the commit's conv states, every GDN layer in one op): layer l, row b holds
    its window's rows n[b] .. n[b] + W - 2, for ragged counts from none kept to all."""
    rng = np.random.default_rng(11)
    n_layers, batch, width, t, channels = 3, 4, 3, 5, 6
    windows = [jnp.asarray(rng.standard_normal((batch, width + t, channels)), jnp.bfloat16) for _ in range(n_layers)]
    n = jnp.asarray([0, 2, 5, 1], jnp.int32)
    got = np.asarray(jax.jit(qwen35.stacked_conv_windows_at, static_argnums=2)(windows, n, width))
    assert got.shape == (n_layers, batch, width, channels)
    for layer, window in enumerate(windows):
        for row, kept in enumerate(np.asarray(n)):
            np.testing.assert_array_equal(got[layer, row], np.asarray(window[row, kept:kept + width]),
                                          err_msg=f"layer {layer}, row {row}")


def test_new_token_count_stops_at_each_rows_eos(small_model):
    """Each row stops at its EOS (its tokens those of the run without one, then EOS); stats['new_tokens'] counts what
    each row generated (through its EOS), not the padding after it; AR and speculative decoding report the same count
    for the same output."""
    _, model = small_model
    ids = np.random.default_rng(6).integers(0, model.vocab_size, size=(3, 6))
    free = sj.generate(model, ids, 12, eos_token_id=False).tokens
    eos = int(free[1, 2])  # row 1 stops at index 2 at the latest
    rows = [int(np.argmax(r == eos)) + 1 if (r == eos).any() else 12 for r in free]
    for method in ("ar", "ngram"):
        out = sj.generate(model, ids, 12, method=method, eos_token_id=eos)
        assert out.stats["new_tokens"] == sum(rows), method
        for r, n in zip(range(3), rows):  # each row: the free run's tokens through its EOS, then EOS
            np.testing.assert_array_equal(out.tokens[r, :n], free[r, :n], err_msg=f"{method} row {r}")
            assert np.all(out.tokens[r, n - 1:] == eos) or n == 12


def test_sampling_is_reproducible_and_varies_with_seed(small_model):
    _, model = small_model
    ids = np.zeros((1, 4), np.int64)
    a = sj.generate(model, ids, 16, temperature=1.0, seed=1, eos_token_id=False).tokens
    b = sj.generate(model, ids, 16, temperature=1.0, seed=1, eos_token_id=False).tokens
    c = sj.generate(model, ids, 16, temperature=1.0, seed=2, eos_token_id=False).tokens
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_per_expert_checkpoint_layout(tmp_path, monkeypatch):
    """MoE experts stored one tensor per expert load into the same fused parameters; an expert tensor of another
    shape is one error before any tensor is read."""
    cfg = H.tiny_text_config(moe=True, ratio=1)
    ref = H.build_reference(cfg, seed=3)
    fused_dir, split_dir = tmp_path / "fused", tmp_path / "split"
    H.save_reference(ref, str(fused_dir))
    shutil.copytree(fused_dir, split_dir)
    tensors = load_file(str(split_dir / "model.safetensors"))
    I = cfg.moe_intermediate_size
    for key in [k for k in tensors if k.endswith("mlp.experts.gate_up_proj")]:
        base = key[: -len("gate_up_proj")]
        gate_up, down = tensors.pop(key), tensors.pop(base + "down_proj")
        for e in range(gate_up.shape[0]):
            tensors[f"{base}{e}.gate_proj.weight"] = gate_up[e, :I].contiguous()
            tensors[f"{base}{e}.up_proj.weight"] = gate_up[e, I:].contiguous()
            tensors[f"{base}{e}.down_proj.weight"] = down[e].contiguous()
    save_file(tensors, str(split_dir / "model.safetensors"), metadata={"format": "pt"})
    a, b = sj.load(fused_dir, dtype="float32"), sj.load(split_dir, dtype="float32")
    ids = np.arange(12)[None] % cfg.vocab_size
    np.testing.assert_array_equal(np.asarray(sj.forward_logits(a, ids)), np.asarray(sj.forward_logits(b, ids)))
    # one expert's tensor of another shape: one error naming it, before any tensor is read
    bad = "model.layers.1.mlp.experts.1.up_proj.weight"
    tensors[bad] = tensors[bad][:-1].contiguous()
    save_file(tensors, str(split_dir / "model.safetensors"), metadata={"format": "pt"})
    from specdec_jax import loading
    monkeypatch.setattr(loading.TensorSource, "read", lambda *a, **k: pytest.fail("a tensor was read"))
    with pytest.raises(sj.CheckpointError, match=r"experts\.1\.up_proj\.weight.*expected"):
        sj.load(split_dir, dtype="float32")


def test_sharded_checkpoint(tmp_path, small_model):
    folder, model = small_model
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, str(tmp_path / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(os.path.join(folder, "config.json"), tmp_path / "config.json")
    sharded = sj.load(tmp_path, dtype="float32")
    ids = np.arange(10)[None]
    np.testing.assert_array_equal(np.asarray(sj.forward_logits(sharded, ids)),
                                  np.asarray(sj.forward_logits(model, ids)))


def test_bfloat16_load_runs(small_model):
    folder, model = small_model
    bf = sj.load(folder)  # default bfloat16
    assert bf.params["embed"].dtype == jnp.bfloat16
    ids = np.arange(20)[None] % bf.vocab_size
    err = H.rel_err(sj.forward_logits(bf, ids), sj.forward_logits(model, ids))
    assert err <= 0.1  # random tiny weights: bf16 rounding only, no reference mismatch
    # (bf16 generation: test_experts' and test_exact's bf16 speculation-against-AR tests)


def test_hf_tensors_round_trip(small_model):
    """hf_tensors (used to save trained checkpoints) is the exact inverse of loading."""
    folder, model = small_model
    on_disk = load_file(os.path.join(folder, "model.safetensors"))
    ours = qwen35.hf_tensors(model.params, model.config)
    assert set(ours) == set(on_disk)
    for k, v in ours.items():
        np.testing.assert_array_equal(np.asarray(v), on_disk[k].numpy(), err_msg=k)


@pytest.mark.parametrize("impl, shapes", [("pallas", ("decode", "plain")), ("reference", ("decode",))])
def test_replay_stash_commits_the_states_of_the_stacking_commit(small_model, impl, shapes, monkeypatch):
    """gated_delta.REPLAY_STASH on: a replay-rollback verification hands its commit every GDN layer's inputs already
    stacked by its step kernels (extras["replay_inputs"]); the committed state is the stacking commit's, bit for bit,
    for kept counts from one to all, on the decode shape (padded rows, live rows) and off it. (Interpret mode fills
    what a kernel leaves unwritten with NaN, so a read of a row no layer wrote would show.)"""
    _, model = small_model
    cfg = model.config
    monkeypatch.setattr(gated_delta, "PACKED_FORM", False)  # the plain form's stash switch (the packed form always stashes)
    ids = jnp.asarray(np.random.default_rng(21).integers(0, model.vocab_size, size=(1, 12)))
    state = qwen35.forward(model.params, cfg, qwen35.init_state(cfg, 1, 40, jnp.float32), ids[:, :7], impl=impl)[1]
    kept = {}
    for flag in ("0", "1"):
        monkeypatch.setattr(gated_delta, "REPLAY_STASH", flag == "1")
        for shape in shapes:
            options = dict(n_valid=jnp.full((1,), 8, jnp.int32), live_rows=5) if shape == "decode" else {}
            rows = 8 if shape == "decode" else 5

            def verify_commit(params, st, x, n, options=options):  # a new function per setting: traced anew
                _, verified, extras = qwen35.forward(params, cfg, st, x, impl=impl, collect="replay", **options)
                assert ("replay_inputs" in extras) == (flag == "1"), extras.keys()
                return qwen35.commit(st, verified, extras, n, impl=impl)

            run = jax.jit(verify_commit)
            x = jnp.pad(ids[:, 7:12], ((0, 0), (0, rows - 5)))  # 5 tokens (the decode shape: 3 padding rows)
            for n in (1, 5):
                kept[flag, shape, n] = run(model.params, state, x, jnp.asarray([n], jnp.int32))
    for shape in shapes:
        for n in (1, 5):
            for name in ("conv", "recurrent", "length"):
                np.testing.assert_array_equal(np.asarray(getattr(kept["1", shape, n], name)),
                                              np.asarray(getattr(kept["0", shape, n], name)), err_msg=f"{shape} {n}")


def test_pallas_kernels_inside_the_model(small_model):
    """The model's implementation flag routes GDN through the Pallas kernels (interpret mode on CPU):
    prefill (chunk kernel, T > 64), decode (recurrent kernel) and speculative commit agree with the XLA path."""
    from specdec_jax.decoding.sampling import SamplingConfig
    from specdec_jax.decoding.speculative import generate_speculative
    from specdec_jax.drafters.ngram import NgramDrafter
    _, model = small_model
    cfg = model.config
    ids = jnp.asarray(np.random.default_rng(12).integers(0, model.vocab_size, size=(1, 70)))
    fresh = lambda: qwen35.init_state(cfg, 1, 80, jnp.float32)
    forward = jax.jit(qwen35.forward, static_argnames=("cfg", "impl"))  # jitted, as the model runs (and fast)
    want, want_state, _ = forward(model.params, cfg, fresh(), ids, impl="reference")
    got, got_state, _ = forward(model.params, cfg, fresh(), ids, impl="pallas")
    assert H.rel_err(got, want) <= 1e-5
    tok = ids[:, :1]
    a, _, _ = forward(model.params, cfg, want_state, tok, impl="reference")
    b, _, _ = forward(model.params, cfg, got_state, tok, impl="pallas")
    assert H.rel_err(b, a) <= 1e-5
    prompt = np.tile(np.asarray(ids[:, :6]), (1, 3))
    spec = lambda impl: generate_speculative(model.params, cfg, prompt, 8, drafter=NgramDrafter(), gamma=3,
                                             max_len=40, sampling=SamplingConfig(), seed=0, eos_ids=(),
                                             state_dtype=jnp.float32, impl=impl).tokens
    np.testing.assert_array_equal(spec("pallas"), sj.generate(model, prompt, 8, eos_token_id=False).tokens)


ROPE_VARIANTS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_beta_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 24, "beta_fast": 16,
                         "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.5},
    "linear": {"rope_type": "linear", "factor": 3.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("name", list(ROPE_VARIANTS))
def test_rope_scaling_matches_transformers(tmp_path, name):
    """Frequency-scaled RoPE (YaRN with its attention temperature, linear) as transformers applies it;
    every layer full attention with the whole head rotated, so the rotation decides the logits."""
    rope = {"rope_theta": 10000.0, "partial_rotary_factor": 1.0, **ROPE_VARIANTS[name]}
    cfg = H.tiny_text_config(layers=2, layer_types=["full_attention"] * 2, rope_parameters=rope,
                             max_position_embeddings=64)
    ref = H.build_reference(cfg, seed=5)
    model = sj.load(H.save_reference(ref, str(tmp_path)), dtype="float32")
    assert model.config.rope_scaling_dict["rope_type"] == rope["rope_type"]
    ids = np.random.default_rng(3).integers(0, model.vocab_size, size=(1, 48))
    assert H.rel_err(sj.forward_logits(model, ids), H.reference_logits(ref, ids)) <= 1e-4
    plain = sj.load(H.save_reference(H.build_reference(H.tiny_text_config(
        layers=2, layer_types=["full_attention"] * 2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                       "partial_rotary_factor": 1.0}), seed=5),
        str(tmp_path / "plain")), dtype="float32")
    assert H.rel_err(sj.forward_logits(plain, ids), H.reference_logits(ref, ids)) > 1e-3  # the scaling matters
    np.testing.assert_array_equal(sj.generate(model, ids[:, :9], 12, eos_token_id=False).tokens,
                                  H.reference_greedy(ref, ids[:, :9], 12))


def test_legacy_rope_scaling_key(tmp_path):
    """Configs written before transformers 5 keep the rope dict under `rope_scaling`."""
    rope = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
    ref = H.build_reference(H.tiny_text_config(layers=2, layer_types=["linear_attention", "full_attention"],
                                               rope_parameters=rope), seed=6)
    folder = H.save_reference(ref, str(tmp_path))
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["rope_scaling"] = config.pop("rope_parameters")
    with open(path, "w") as f:
        json.dump(config, f)
    model = sj.load(folder, dtype="float32")
    assert (model.config.rope_theta, model.config.partial_rotary_factor) == (1e6, 0.5)
    ids = np.random.default_rng(4).integers(0, model.vocab_size, size=(1, 20))
    assert H.rel_err(sj.forward_logits(model, ids), H.reference_logits(ref, ids)) <= 1e-4


def test_generation_config_eos_ids(tmp_path, small_model):
    """generate() stops where transformers' generate would: generation_config.json's EOS ids win."""
    src, model = small_model
    folder = shutil.copytree(src, tmp_path / "ckpt")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert sj.load(folder, dtype="float32").config.eos_token_id == (5, 7)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert sj.load(folder, dtype="float32").config.eos_token_id == model.config.eos_token_id


def test_packed_form_in_the_model_decode_and_verification_agree_bit_for_bit(tmp_path, monkeypatch):
    """With the step recurrence in its packed form (Pallas, interpret mode; K = V = 16, which its kernel takes):
    three decode-shape AR steps and one verification of the same three tokens give the same logits and store the same
    keys, gates and pseudo-values for the replay commit, bit for bit (what makes the committed states equal: on the
    GPU the pseudo-value replay reproduces the recurrence's state bit for bit, kernel README; XLA's CPU compiler may
    contract that update differently, so here the states are compared to rounding); and the form's logits are the
    plain form's (gated_delta.PACKED_FORM off) within float32 rounding."""
    cfg = H.tiny_text_config(ratio=2, layers=4, linear_key_head_dim=16, linear_value_head_dim=16)
    H.save_reference(H.build_reference(cfg, seed=9), str(tmp_path))
    model = sj.load(str(tmp_path), dtype="float32")
    cfg, params = model.config, model.params
    assert qwen35.packed_form(cfg, "pallas") is not None and qwen35.packed_form(cfg, "reference") is None
    ids = jnp.asarray(np.random.default_rng(5).integers(0, model.vocab_size, size=(1, 10)))
    state = qwen35.forward(params, cfg, qwen35.init_state(cfg, 1, 24, jnp.float32), ids[:, :7], impl="pallas")[1]
    rows, one = 4, jnp.ones((1,), jnp.int32)

    def run(packed: str):
        monkeypatch.setattr(gated_delta, "PACKED_FORM", packed == "1")

        def forward_commit(p, s, x, n, live):  # a decode-shape forward of `live` tokens, then the commit of n
            logits, verified, extras = qwen35.forward(p, cfg, s, x, impl="pallas", collect="replay",
                                                      n_valid=jnp.full((1,), live, jnp.int32), live_rows=live)
            assert ("replay_inputs" in extras) == (packed == "1")
            return logits[:, :live], qwen35.commit(s, verified, extras, n, impl="pallas"), extras.get("replay_inputs")

        run = jax.jit(forward_commit, static_argnames="live")
        ar, st = [], state
        for i in range(7, 10):
            logits, st, stash = run(params, st, jnp.pad(ids[:, i:i + 1], ((0, 0), (0, rows - 1))), one, live=1)
            ar.append((logits, stash))
        spec = run(params, state, jnp.pad(ids[:, 7:10], ((0, 0), (0, rows - 3))), 3 * one, live=3)
        return ar, st, spec

    ar, ar_state, (spec_logits, committed, spec_stash) = run("1")
    for t, (logits, stash) in enumerate(ar):
        np.testing.assert_array_equal(np.asarray(spec_logits[:, t]), np.asarray(logits[:, 0]), err_msg=f"logits {t}")
        for name, got, want in zip("kgu", spec_stash, stash):
            np.testing.assert_array_equal(np.asarray(got[:, :, t]), np.asarray(want[:, :, 0]), err_msg=f"{name} {t}")
    np.testing.assert_array_equal(np.asarray(committed.conv), np.asarray(ar_state.conv))
    assert H.rel_err(committed.recurrent, ar_state.recurrent) <= 1e-6
    plain_logits = jnp.concatenate([logits for logits, _ in run("0")[0]], axis=1)
    assert H.rel_err(jnp.concatenate([logits for logits, _ in ar], axis=1), plain_logits) <= 1e-5
