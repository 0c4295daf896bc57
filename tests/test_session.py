"""Continuation (decoding/session.py): generate(..., state=result.state) continues a generation without prefilling
its history again. float32: the continued greedy tokens are a fresh run's on the whole text, and the states agree,
the drafter's too (an MTP head's cache, a self-draft's model state, carried from the earlier call); the same calls
give the same bits; bad states are one InputError before any compute."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.decoding.session import Session
from tests import qwen_helpers as H


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ref = H.build_reference(H.tiny_text_config(ratio=2, vocab=61), seed=29)
    folder = str(tmp_path_factory.mktemp("session"))
    H.save_reference(ref, folder, mtp_layers=1)
    return sj.load(folder, dtype="float32")


def _rows(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 61, n).astype(np.int32) for n in lengths]


@pytest.mark.parametrize("first,then", [("ar", "ngram"), ("ngram", "ar"), ("ngram", "ngram"), ("mtp", "mtp"),
                                        ("layer-skip", "layer-skip")])
def test_continuation_equals_a_fresh_run_on_the_whole_text(model, first, then):
    prompts, new = _rows([11, 4], 1), _rows([6, 0], 2)  # row 1 adds nothing: it just goes on
    r1 = sj.generate(model, prompts, 9, method=first, eos_token_id=False)
    r2 = sj.generate(model, new, 8, method=then, eos_token_id=False, state=r1.state)
    whole = [np.concatenate([p, t, n]) for p, t, n in zip(prompts, r1.tokens, new)]
    fresh = sj.generate(model, whole, 8, eos_token_id=False, method="ar" if first == then == "ngram" else then)
    np.testing.assert_array_equal(r2.tokens, fresh.tokens)
    np.testing.assert_array_equal(r2.tokens, sj.generate(model, whole, 8, eos_token_id=False).tokens)
    a, b = r2.state, fresh.state
    np.testing.assert_array_equal(np.asarray(a.model.length), np.asarray(b.model.length))
    np.testing.assert_allclose(np.asarray(a.model.recurrent), np.asarray(b.model.recurrent), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a.pending), np.asarray(b.pending))
    for row in range(2):
        np.testing.assert_array_equal(a.tokens(row), b.tokens(row))
    if then in ("mtp", "layer-skip"):  # the drafter continued its own state: as if it had drafted the whole text
        assert a.drafter_kind == b.drafter_kind is not None
        _assert_drafter_states_agree(a, b)


def _assert_drafter_states_agree(a: Session, b: Session):
    """Two sessions' drafter states hold the same entries at every committed position (to 1e-4: the target's
    hidden states, which the MTP head reads, differ by float32 rounding between a chunked prefill and decoding)."""
    da, db = a.drafter, b.drafter
    if "k" in da:  # the MTP head: entries for every position but the pending token's, like the target's cache
        np.testing.assert_array_equal(np.asarray(da["length"]), np.asarray(a.model.length))
        pairs = [(da["k"], db["k"], da["length"]), (da["v"], db["v"], da["length"])]
    else:  # a self-draft's model: every token through the pending one
        np.testing.assert_array_equal(np.asarray(da["model"].length), np.asarray(a.model.length) + 1)
        np.testing.assert_allclose(np.asarray(da["model"].recurrent), np.asarray(db["model"].recurrent),
                                   rtol=1e-4, atol=1e-4)
        pairs = [(x, y, da["model"].length) for x, y in zip(da["model"].keys + da["model"].values,
                                                            db["model"].keys + db["model"].values)]
    for x, y, length in pairs:
        for row, n in enumerate(np.asarray(length)):
            np.testing.assert_allclose(np.asarray(x)[row, :n], np.asarray(y)[row, :n], rtol=1e-4, atol=1e-4)


def test_the_same_calls_give_the_same_bits(model):
    # 2 rows: the programs test_continuation_equals_a_fresh_run_on_the_whole_text[ngram-ar] compiles (the suite's time)
    r1 = sj.generate(model, _rows([7, 3], 3), 6, method="ngram", eos_token_id=False)
    runs = [sj.generate(model, _rows([5, 2], 4), 6, eos_token_id=False, state=r1.state) for _ in range(2)]
    np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
    np.testing.assert_array_equal(np.asarray(runs[0].state.model.recurrent), np.asarray(runs[1].state.model.recurrent))


def test_a_row_past_its_eos_is_rebuilt_when_continued(model):
    """An AR batch runs every row until the last one stops, so a row that met its EOS earlier ran on: it is not
    resumable, and continuing it re-prefills its history (the result is still a fresh run's)."""
    prompts = _rows([8, 8], 5)
    probe = sj.generate(model, prompts, 12, eos_token_id=False)
    eos = int(probe.tokens[0, 2])  # row 0 stops at its third token, row 1 (if it differs there) runs on
    r1 = sj.generate(model, prompts, 12, eos_token_id=[eos])
    counts = [int(np.argmax(t == eos)) + 1 if (t == eos).any() else 12 for t in r1.tokens]
    assert counts[0] == 3 < counts[1] and not r1.state.resumable[0] and r1.state.resumable[1]
    new = _rows([3, 3], 6)
    r2 = sj.generate(model, new, 5, eos_token_id=False, state=r1.state)
    whole = [np.concatenate([p, t[:c], n]) for p, t, c, n in zip(prompts, r1.tokens, counts, new)]
    np.testing.assert_array_equal(r2.tokens, sj.generate(model, whole, 5, eos_token_id=False).tokens)


def test_streaming_continues_too(model):
    # 2 rows: the generations are test_continuation_equals_a_fresh_run_on_the_whole_text[ar-ngram]'s programs
    r1 = sj.generate(model, _rows([6, 4], 7), 5, eos_token_id=False)
    pieces = list(sj.stream(model, _rows([2, 3], 8), 7, chunk_steps=2, method="ngram", eos_token_id=False,
                            state=r1.state))
    whole = sj.generate(model, _rows([2, 3], 8), 7, method="ngram", eos_token_id=False, state=r1.state)
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), whole.tokens)


def test_bad_states_are_one_error_before_any_compute(model, tmp_path, monkeypatch):
    r1 = sj.generate(model, _rows([4, 5], 9), 3, eos_token_id=False)
    state = r1.state
    assert isinstance(state, Session)
    from specdec_jax.decoding import autoregressive
    monkeypatch.setattr(autoregressive, "generate_autoregressive", lambda *a, **k: pytest.fail("ran before the error"))
    with pytest.raises(sj.InputError, match="state has 2 rows; got 1 new prompts"):
        sj.generate(model, _rows([2], 1), 3, state=state)
    with pytest.raises(sj.InputError, match="state must be the .state of an earlier generate"):
        sj.generate(model, _rows([2, 2], 1), 3, state={"model": None})
    bf16 = sj.load(model.path, dtype="bfloat16")
    with pytest.raises(sj.InputError, match="state holds float32 values; this model runs in bfloat16"):
        sj.generate(bf16, _rows([2, 2], 1), 3, state=state)
    other = H.build_reference(H.tiny_text_config(ratio=2, vocab=67), seed=3)
    H.save_reference(other, str(tmp_path))
    with pytest.raises(sj.InputError, match="state comes from another model"):
        sj.generate(sj.load(str(tmp_path), dtype="float32"), _rows([2, 2], 1), 3, state=state)
    ctx = model.config.max_position_embeddings
    with pytest.raises(sj.InputError, match="exceeds the model's context length"):
        sj.generate(model, [np.zeros(ctx, np.int32), np.zeros(1, np.int32)], 3, state=state)
