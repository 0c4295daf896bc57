"""Bad input gets one clear error (what, where, what was expected) before any compute."""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

import specdec_jax as sj
from specdec_jax.errors import CheckpointError, InputError
from tests import qwen_helpers as H


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    ref = H.build_reference(H.tiny_text_config(ratio=2), seed=11)
    path = str(tmp_path_factory.mktemp("ok"))
    H.save_reference(ref, path)
    return path


@pytest.fixture(scope="module")
def model(folder):
    return sj.load(folder, dtype="float32")


def _copy(folder, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    return dst


def _rewrite(dst, edit):
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_names_key_and_file(folder, tmp_path):
    dst = _copy(folder, tmp_path)
    key = "model.layers.1.linear_attn.A_log"
    _rewrite(dst, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=rf"'{key}'.*model\.safetensors"):
        sj.load(dst)


def test_wrong_shape_names_key_expected_and_got(folder, tmp_path):
    dst = _copy(folder, tmp_path)
    key = "model.layers.3.self_attn.k_proj.weight"

    def edit(t):
        t[key] = t[key][:-1].contiguous()
    _rewrite(dst, edit)
    with pytest.raises(CheckpointError, match=rf"'{key}'.*shape \(31, 32\).*expected \(32, 32\)"):
        sj.load(dst)


def test_unknown_model_type_lists_supported(folder, tmp_path):
    dst = _copy(folder, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"] = "llama"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unknown model_type 'llama'.*qwen3_5.*huginn_raven"):
        sj.load(dst)


@pytest.mark.parametrize("edit, pattern", [
    (lambda c: c.update(attention_bias=True), "attention_bias=true is not supported"),
    (lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     r"rope_type 'dynamic' is not supported; supported: default, linear, llama3, yarn"),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
     "rope_type 'yarn' needs factor, original_max_position_embeddings"),
])
def test_config_fields_that_would_change_the_model_are_refused(folder, tmp_path, edit, pattern):
    """A field the model does not implement is an error, never silently ignored."""
    dst = _copy(folder, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=pattern):
        sj.load(dst)


def test_missing_folder_and_weights(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        sj.load(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        sj.load(tmp_path)


def test_no_weights_file(folder, tmp_path):
    dst = _copy(folder, tmp_path)
    os.remove(dst / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors.*safetensors only"):
        sj.load(dst)


def test_bad_dtype(folder):
    with pytest.raises(CheckpointError, match="dtype 'float8'"):
        sj.load(folder, dtype="float8")


@pytest.mark.parametrize("ids, pattern", [
    (np.zeros((1, 0), np.int32), "empty"),
    (np.array([[1, 2, 500]]), r"input_ids\[0, 2\] = 500 is outside the vocabulary \[0, 97\)"),
    (np.array([[1, -1]]), r"input_ids\[0, 1\] = -1"),
    (np.array([1, 2, 3]), "2-D"),
    (np.array([[0.5, 1.0]]), "integers"),
])
def test_bad_token_ids(model, ids, pattern):
    with pytest.raises(InputError, match=pattern):
        sj.generate(model, ids, 4)
    with pytest.raises(InputError, match=pattern):
        sj.forward_logits(model, ids)


def test_prompt_longer_than_cache(model):
    with pytest.raises(InputError, match=r"prompt \(10 tokens\) \+ max_new_tokens \(8\) = 18 exceeds .*max_len=12"):
        sj.generate(model, np.ones((1, 10), np.int32), 8, max_len=12, exact=False)
    # The exact path (the default) writes decode_rows positions past the last token.
    with pytest.raises(InputError, match=r"prompt \(10 tokens\) \+ max_new_tokens \(8\) \+ decode_rows \(8\) = 26 "
                                         r"exceeds .*max_len=18"):
        sj.generate(model, np.ones((1, 10), np.int32), 8, max_len=18)


def test_bad_generation_options(model):
    ids = np.ones((1, 3), np.int32)
    with pytest.raises(InputError, match="method 'medusa' is not supported.*supported: ar"):
        sj.generate(model, ids, 4, method="medusa")
    with pytest.raises(InputError, match="max_new_tokens"):
        sj.generate(model, ids, 0)
    with pytest.raises(InputError, match="temperature"):
        sj.generate(model, ids, 4, temperature=-1.0)
    with pytest.raises(InputError, match="top_p"):
        sj.generate(model, ids, 4, temperature=1.0, top_p=0.0)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer; got 2.5"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
    ({"temperature": "hot"}, "temperature must be a number; got 'hot'"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0; got nan"),
    ({"top_k": 1.5}, "top_k must be an integer"),
    ({"top_k": -3}, r"top_k must be >= 0 \(0 = off\); got -3"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]; got 1.5"),
    ({"top_p": 0.0, "temperature": 1.0}, r"top_p must be in \(0, 1\]; got 0.0"),
    ({"seed": -1}, r"seed must be in \[0, 4294967295\]"),
    ({"seed": 2 ** 32}, "a 32-bit PRNG seed"),
    ({"temperature": float("inf")}, "temperature must be a finite number >= 0; got inf"),
    ({"max_new_tokens": 10 ** 6, "exact": False}, r"max_new_tokens \(1000000\) = 1000003 exceeds the model's context "
                                                  r"length \(max_position_embeddings=32768\)"),
    ({"max_new_tokens": 10 ** 6}, r"max_new_tokens \(1000000\) \+ decode_rows \(8\) = 1000011 exceeds the model's "
                                  r"context length \(max_position_embeddings=32768\)"),
    ({"method": "ngram", "gamma": 10 ** 6, "exact": False},
     r"gamma \(1000000\) = 1000007 exceeds the model's context length"),
    ({"method": "ngram-tree", "max_new_tokens": 40000}, "exceeds the model's context length"),
    ({"max_len": "long"}, "max_len must be an integer"),
    ({"eos_token_id": 500}, r"eos_token_id must be .* token ids in \[0, 97\); got 500"),
    ({"eos_token_id": "</s>"}, "eos_token_id must be"),
    ({"method": "ngram", "gamma": 2.0}, "gamma must be an integer; got 2.0"),
    ({"method": "ngram", "gamma": -1}, r"gamma must be >= 1 \(the draft length\); got -1"),
    ({"method": "ngram", "gamma": 0}, r"gamma must be >= 1 \(the draft length\); got 0"),
    ({"method": "ngram", "gama": 3}, r"unknown options \['gama'\] \(did you mean 'gamma'\?\)"),
    ({"method": "ngarm"}, r"method 'ngarm' is not supported for this qwen3_5 model \(did you mean 'ngram'\?\)"),
    ({"method": "ngram", "max_n": "3"}, "max_n must be an integer"),
    ({"method": "ngram", "min_n": 4, "max_n": 3}, "min_n <= max_n"),
    ({"method": "ngram-tree", "tree": 4}, "tree must be a non-empty list of branching factors"),
    ({"method": "ngram-tree", "tree": (2, 0)}, "tree must be a non-empty list"),
    ({"method": "ngram-tree", "tree": (2, 1.5)}, "tree must be a non-empty list"),
])
def test_typed_generation_options(model, kwargs, pattern):
    """Wrongly typed or out-of-range options get one InputError naming the option, not a TypeError deep inside."""
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(InputError, match=pattern):
        sj.generate(model, np.ones((1, 3), np.int32), **kwargs)


# ---------------------------------------------------------------------------------- damaged safetensors

@pytest.mark.parametrize("keep, pattern", [
    (5, r"5 bytes, shorter than the 8-byte header length"),
    (100, r"its header claims \d+ bytes; the file holds 100"),
    (-10, r"tensor '.*' lies at bytes \[\d+, \d+\) of \d+ bytes of tensor data"),
])
def test_truncated_safetensors_is_one_checkpoint_error(folder, tmp_path, keep, pattern):
    """A cut-off download is found from the header and the file size, before a tensor is read."""
    dst = _copy(folder, tmp_path)
    path = dst / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(keep if keep > 0 else size + keep)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors' is truncated or corrupt \({pattern}\)"):
        sj.load(dst)


def _write_raw_safetensors(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("header, data, pattern", [
    (b"{not json", b"", "its header is not JSON"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(8), r"needs 16 bytes; its offsets span 8"),
    ({"w": {"dtype": "F32", "shape": [2]}}, bytes(8), "no valid dtype, shape and data_offsets"),
    # passes the header check (a dtype it does not size) but not the library: its own error, as one line
    ({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), r"could not read .*unknown variant"),
])
def test_corrupt_safetensors_header_is_one_checkpoint_error(folder, tmp_path, header, data, pattern):
    dst = _copy(folder, tmp_path)
    path = dst / "model.safetensors"
    if isinstance(header, bytes):
        path.write_bytes(struct.pack("<Q", len(header)) + header)
    else:
        _write_raw_safetensors(path, header, data)
    with pytest.raises(CheckpointError, match=pattern) as info:
        sj.load(dst)
    assert "model.safetensors" in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------------------- gamma and exactness

def test_gamma_past_the_exact_rows_is_refused_unless_exact_false(model):
    """exact=True is the default's promise: a gamma it cannot keep is an error naming the way out, never a silent
    switch to the inexact path (that run itself is test_speculative's test_rollback_default_and_limits)."""
    ids = np.ones((1, 3), np.int32)
    for options in ({}, {"exact": True}, {"rollback": "replay"}):
        with pytest.raises(InputError, match=r"gamma=1000 needs gamma \+ 1 <= 64 rows for the exact path; pass "
                                             r"exact=False to run it inexactly \(rollback='pseudo'\)"):
            sj.generate(model, ids, 4, method="ngram", gamma=1000, **options)


def test_looped_gamma_past_the_exact_rows_is_refused_unless_exact_false():
    from specdec_jax.decoding.looped_plan import make_plan
    with pytest.raises(InputError, match=r"gamma=64 needs gamma \+ 1 <= 64 rows for the exact path; pass exact=False "
                                         r"to run it inexactly$"):
        make_plan("das-wave", 4, gamma=64)
    assert make_plan("das-wave", 4, gamma=64, exact=False).decode_rows == 0
    assert make_plan("das-wave", 4, gamma=63).decode_rows == 64
    with pytest.raises(InputError, match=r"gamma must be >= 1; got 0"):
        make_plan("self-spec", 4, gamma=0)


# ---------------------------------------------------------------------------------- one range text per option

def test_each_option_has_one_range_text(model):
    """The API and the CLI word a bound the same way (options.range_text), so a user meets one rule per option."""
    from specdec_jax import cli
    from specdec_jax.options import float_option, int_option, range_text
    assert range_text(0, 1, lo_open=True) == "in (0, 1]" and range_text(0.0, 1.0, hi_open=True) == "in [0, 1)"
    assert range_text(1) == ">= 1" and range_text(0, 64) == "in [0, 64]"
    ids = np.ones((1, 3), np.int32)
    cases = {"top_p": ({"top_p": 0.0, "temperature": 1.0}, ["--top-p", "0"], "in (0, 1]"),
             "temperature": ({"temperature": -1.0}, ["--temperature", "-1"], "a finite number >= 0"),
             "top_k": ({"top_k": -1}, ["--top-k", "-1"], ">= 0 (0 = off)"),
             "max_new_tokens": ({"max_new_tokens": 0}, ["--max-new-tokens", "0"], ">= 1")}
    for name, (kwargs, argv, text) in cases.items():
        with pytest.raises(InputError) as info:
            sj.generate(model, ids, **{"max_new_tokens": 4, **kwargs})
        assert f"{name} must be {text}; got" in str(info.value)
        with pytest.raises(cli.UsageError) as info:
            cli._check_numbers(cli.build_parser().parse_args(["generate", *argv]))
        assert f"--{name.replace('_', '-')} must be {text}; got" in str(info.value)
    from specdec_jax.decoding.looped_plan import make_plan
    with pytest.raises(InputError, match=r"^ema must be in \[0, 1\) \(0 = no smoothing\); got 1.0$"):
        make_plan("parallel-sampler", 4, ema=1.0)
    with pytest.raises(InputError, match=r"^epsilon must be a finite number >= 0; got inf$"):
        float_option({"epsilon": float("inf")}, "epsilon", None, 0.0)
    with pytest.raises(InputError, match=r"^k must be in \[1, 4\]; got 5$"):
        int_option({"k": 5}, "k", None, 1, 4)
