"""The exact path in bfloat16: speculative output equals AR's bit for bit, because every decode-time forward of
a generation runs at one row count (AR steps and verifications alike).

On the shipped checkpoints, greedy bf16: every chain method (Qwen3.5) and every lossless looped method (Huginn)
equals AR at the same decode row count; a recorder asserts that no decode-time forward runs at another row
count; the options that cannot be exact are one clear error.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.decoding import compiled
from specdec_jax.decoding.decode_shape import choose_decode_rows, pad_rows
from specdec_jax.errors import InputError

QWEN = "checkpoints/tiny-qwen35-code"
HUGINN = "checkpoints/tiny-huginn-code"
NEW = 24
# Held-out-style prompts (the checkpoints never saw these lines); ids come from each tokenizer.
TEXTS = ['import os\n\n\ndef walk_tree(root):\n    """Yield every file below root."""\n    for',
         'class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n']


@functools.cache
def _model(folder: str):
    return sj.load(folder, dtype="bfloat16")


@functools.cache
def _prompts(folder: str) -> tuple:
    """The prompts cut to one length (their last tokens): one compilation serves both."""
    from specdec_jax.text import load_tokenizer
    tok = load_tokenizer(folder)
    ids = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    n = min(map(len, ids))
    return tuple(np.asarray([i[-n:]]) for i in ids)


@functools.cache
def _ar(folder: str, i: int, rows: int) -> np.ndarray:
    return sj.generate(_model(folder), _prompts(folder)[i], NEW, eos_token_id=False, decode_rows=rows).tokens


# mtp-shortlist is left out here: its verification is mtp's program (only the draft head's vocabulary differs), and
# its float32 equality is test_drafters.py's. layer-skip and residual-reuse are left out too (the suite's time on 2
# cores, issue 47): their verification is the chain loop's program, which the methods here run in bf16, and their
# equality to AR with their drafter states rolled back is test_self_draft.py's; partial-mlp stays as the self-draft
# in bf16. On the GPU every chain method runs in bf16 (benchmarks/bench_workload.py --parts exact: 20 of 20 each,
# ragged batches and continuations included: exact_tiny_qwen_continue.json).
# Gamma 8 (9 decode rows, an AR reference of its own) is left out too: in bf16 it runs on the GPU (the long-context
# benchmark's gamma-8 drafts, equal to AR at every length), in float32 in test_speculative.py.
# ngram-table is left out too: its verification is ngram's program (neither drafter reads the hidden states), and its
# float32 equality is test_drafters.py's.
@pytest.mark.parametrize("method,options", [("ngram", {}), ("mtp", {}), ("mtp", {"rollback": "snapshot"}),
                                            ("partial-mlp", {})],
                         ids=["ngram", "mtp", "mtp-snapshot", "partial-mlp"])
def test_qwen_chain_methods_equal_ar_in_bfloat16(method, options):
    model = _model(QWEN)
    for i, ids in enumerate(_prompts(QWEN)):
        out = sj.generate(model, ids, NEW, method=method, eos_token_id=False, **options)
        assert out.stats["exact"] and out.stats["decode_rows"] == choose_decode_rows(options.get("gamma", 4), None,
                                                                                     "qwen3_5")
        np.testing.assert_array_equal(out.tokens, _ar(QWEN, i, out.stats["decode_rows"]), err_msg=f"prompt {i}")


# mature-spec is left out (the suite's time): it verifies with self-spec's program, drafting with other reads (its
# float32 equality: test_looped_spec.py); on the GPU all three run in bf16 (exact_tiny_huginn_continue.json).
@pytest.mark.parametrize("method", ["self-spec", "das-wave"])
def test_looped_methods_equal_ar_in_bfloat16(method):
    model = _model(HUGINN)
    for i, ids in enumerate(_prompts(HUGINN)):
        out = sj.generate(model, ids, NEW, method=method, eos_token_id=False)
        assert out.stats["exact"]
        np.testing.assert_array_equal(out.tokens, _ar(HUGINN, i, choose_decode_rows(0, None, "looped")),
                                      err_msg=f"prompt {i}")


def test_gdn_on_the_live_rows_leaves_every_valid_row_unchanged():
    """A decode-shape forward whose GDN recurrence runs on the first `live_rows` rows only (AR: 1, verification:
    gamma + 1): the valid rows' logits, the GDN and conv states and the K/V cache up to the new length are the
    full-rows forward's bit for bit (bf16, ragged valid counts)."""
    import jax
    import jax.numpy as jnp
    from specdec_jax.models.qwen35 import model as qwen35
    model = _model(QWEN)
    cfg, params = model.config, model.params
    rng = np.random.default_rng(0)
    state = qwen35.init_state(cfg, 2, 40, model.dtype)
    _, state = qwen35.forward_jit(params, cfg, state, jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 16))))
    ids, n = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 8))), jnp.asarray([1, 3], jnp.int32)
    run = jax.jit(lambda p, s, t, n, live: qwen35.forward(p, cfg, s, t, n_valid=n, live_rows=live)[:2],
                  static_argnames="live")
    want_logits, want = run(params, state, ids, n, live=None)
    logits, got = run(params, state, ids, n, live=3)
    for row, valid in enumerate(np.asarray(n)):
        np.testing.assert_array_equal(np.asarray(logits[row, :valid]), np.asarray(want_logits[row, :valid]))
    for a, b in zip((*got.recurrent, *got.conv), (*want.recurrent, *want.conv)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(got.keys + got.values, want.keys + want.values):
        np.testing.assert_array_equal(np.asarray(a[:, :19]), np.asarray(b[:, :19]))  # 16 + 3 positions
    assert not np.array_equal(np.asarray(logits[1, 3:]), np.asarray(want_logits[1, 3:]))  # padding rows differ


def test_pad_rows_repeats_the_last_id():
    ids = np.asarray([[3, 4], [5, 6]])
    np.testing.assert_array_equal(np.asarray(pad_rows(ids, 4)), [[3, 4, 4, 4], [5, 6, 6, 6]])
    with pytest.raises(ValueError, match="do not fit"):
        pad_rows(ids, 1)


@pytest.mark.parametrize("folder,method,options,match", [
    (QWEN, "ngram", {"rollback": "pseudo", "exact": True}, "pseudo-values"),
    (QWEN, "ngram", {"gamma": 70, "exact": True}, r"gamma=70 needs gamma \+ 1 <= 64 rows"),
    (QWEN, "ngram-tree", {"exact": True}, "tree verification is not bit-exact"),
    (QWEN, "ngram", {"decode_rows": 4, "gamma": 4}, r"decode_rows=4 must lie in \[gamma \+ 1 = 5, 64\]"),
    (QWEN, "ar", {"decode_rows": 65}, r"decode_rows=65 must lie in"),
    (QWEN, "ngram", {"exact": False, "decode_rows": 8}, "needs exact=True"),
    (QWEN, "ar", {"exact": "yes"}, "exact must be True or False"),
    (QWEN, "ar", {"decode_rows": 8.0}, "decode_rows must be an integer"),
    (HUGINN, "parallel-sampler", {"exact": True}, "not lossless"),
    (HUGINN, "ar", {"cache_mode": "compressed", "exact": True}, "compressed cache"),
    (HUGINN, "das-wave", {"decode_rows": 8}, r"decode_rows=8 must lie in \[gamma \+ 1 = 17"),
])
def test_options_that_cannot_be_exact_are_one_clear_error(folder, method, options, match):
    with pytest.raises(InputError, match=match):
        sj.generate(_model(folder), _prompts(folder)[0], 4, method=method, **options)


# That exact defaults to True where it applies (every chain case above) and to False where it cannot (pseudo rollback:
# stats exact False, verification at gamma + 1 rows) is test_drafters.py::test_greedy_equals_ar's (float32, the
# programs it compiles anyway; the choice does not depend on the dtype), trees' and the sampler's refusals of
# exact=True above.


class _Lowered(Exception):
    """Raised once a generation's decode loop has been traced (nothing needs to compile or run)."""


def test_every_decode_forward_runs_at_the_decode_shape(monkeypatch):
    """A recorder on the model forwards while generations are traced (not compiled): after the prompt, AR
    steps and verifications (chain: n-gram; looped: das-wave) all run at decode_rows rows; the fast path
    (exact=False) verifies at gamma + 1."""
    import jax
    from specdec_jax.decoding import autoregressive, looped_spec, speculative
    from specdec_jax.models.looped import model as looped
    from specdec_jax.models.qwen35 import model as qwen35
    calls = []

    def recording(fn, name):
        def wrapped(params, cfg, state, ids, *args, **kwargs):
            if kwargs.get("prefill_lens") is None:  # a padded prefill chunk is the prompt's, not a decode forward
                calls.append((name, ids.shape[1], kwargs.get("num_steps", kwargs.get("live_rows"))))
            return fn(params, cfg, state, ids, *args, **kwargs)
        return wrapped

    loops = (autoregressive._decode_loop, speculative._spec_loop, looped_spec._loop)

    def lower_only(jitted, static, *args, options=None):  # stands in for compiled(): trace, stop after the loop
        traced = jitted.trace(*args, **static)  # the forwards run while tracing; lowering to HLO would add nothing
        if jitted in loops:
            raise _Lowered
        return traced, 0.0  # never run (the loop stops the generation first); its out_info shapes the loop

    monkeypatch.setattr(qwen35, "forward", recording(qwen35.forward, "qwen"))
    monkeypatch.setattr(looped, "forward", recording(looped.forward, "looped"))
    monkeypatch.setattr(looped, "decode_forward", recording(looped.decode_forward, "looped_decode"))
    for module in (autoregressive, speculative, looped_spec):
        monkeypatch.setattr(module, "compiled", lower_only)
    jax.clear_caches()  # every program traces again, through the recorder

    def traced(model, ids, method, **options):
        calls.clear()
        with pytest.raises(_Lowered):
            sj.generate(model, ids, 6, method=method, eos_token_id=False, **options)
        return calls

    qwen, huginn = _model(QWEN), _model(HUGINN)
    q_ids, h_ids = _prompts(QWEN)[0][:, :7], _prompts(HUGINN)[0][:, :7]  # 7: not a decode row count
    R = huginn.config.mean_recurrence
    for method, live in (("ar", 1), ("ngram", 5), ("mtp", 5)):  # default gammas: n-gram 4, MTP 4
        decode = {(t, rows) for name, t, rows in traced(qwen, q_ids, method) if name == "qwen" and t != 7}
        # AR steps and verifications at 8 rows; the GDN recurrence on the rows that can be valid only
        assert {t for t, _ in decode} == {8}, f"{method}: decode forwards at {decode}"
        assert {rows for _, rows in decode} == {live}, f"{method}: GDN rows {decode}"
    assert {t for _, t, _ in traced(qwen, q_ids, "ngram", exact=False)} - {7} == {5}, "fast path: gamma + 1"
    for method in ("ar", "self-spec", "das-wave"):
        calls_ = traced(huginn, h_ids, method)
        full_depth = {t for name, t, steps in calls_ if name == "looped" and steps == R} - {7}
        decode = {t for name, t, _ in calls_ if name == "looped_decode"}
        assert not full_depth and decode == {17}, f"{method}: full-depth forwards at {full_depth}, decode {decode}"
