"""MTP, MTP-shortlist and model n-gram table drafters: exact greedy output, exact sampling, tables."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.decoding.sampling import SamplingConfig
from specdec_jax.decoding.speculative import generate_speculative
from specdec_jax.drafters.mtp import MtpDrafter
from specdec_jax.drafters.table import build_tables, save_draft_tables, table_lookup
from specdec_jax.errors import InputError
from specdec_jax.bench.profiling import while_loops
from tests import qwen_helpers as H
from tests import stats_helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "checkpoints", "tiny-qwen35-code")


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """Random tiny Qwen3.5 with an MTP head and draft tables built from its own samples."""
    ref = H.build_reference(H.tiny_text_config(ratio=2, vocab=53), seed=31)
    folder = str(tmp_path_factory.mktemp("mtp"))
    H.save_reference(ref, folder, mtp_layers=1, seed=31)
    model = sj.load(folder, dtype="float32")
    samples = sj.generate(model, np.arange(8)[None] % 53, 64, temperature=1.0, eos_token_id=False).tokens
    save_draft_tables(build_tables(list(samples), model.vocab_size, 24), os.path.join(folder, "draft_tables.safetensors"),
                      {"test": "1"})
    return sj.load(folder, dtype="float32")


# Each drafter at least once (a rollback restores the target's state whatever drafted: every rollback with every gamma
# is test_speculative.py's; MTP with snapshot rollback: test_exact.py's bf16 mtp-snapshot; MTP at gamma 8, 9 decode
# rows: test_mtp_on_trained_checkpoint_is_exact_and_accepts).
@pytest.mark.parametrize("method, gamma, rollback", [
    ("mtp", 1, "replay"), ("mtp-shortlist", 4, "replay"), ("ngram-table", 4, "pseudo")])
def test_greedy_equals_ar(mtp_model, method, gamma, rollback):
    ids = np.random.default_rng(gamma).integers(0, mtp_model.vocab_size, size=(4, 9))
    ar = sj.generate(mtp_model, ids, 24, eos_token_id=False).tokens
    res = sj.generate(mtp_model, ids, 24, method=method, gamma=gamma, rollback=rollback, eos_token_id=False)
    np.testing.assert_array_equal(res.tokens, ar)
    # The path exact's default took (once test_exact.py's own test): the exact path where the rollback allows it, at
    # max(8, gamma + 1) rows; not under pseudo-values (exact only in exact arithmetic), which verify at gamma + 1.
    assert res.stats["exact"] == (rollback != "pseudo")
    assert res.stats["decode_rows"] == (gamma + 1 if rollback == "pseudo" else max(8, gamma + 1))


def test_mtp_chain_unrolled_or_scanned_drafts_alike(mtp_model):
    """unroll only changes how the chain is compiled: the same drafts and the same provisional head cache."""
    import dataclasses
    import functools

    import jax
    cfg, params = mtp_model.config, mtp_model.params
    prompt = jnp.asarray(np.random.default_rng(5).integers(0, mtp_model.vocab_size, (2, 7)), jnp.int32)
    hidden = jnp.asarray(np.random.default_rng(6).standard_normal((2, 7, cfg.hidden_size)), jnp.float32)
    # jitted, as inside a generation (op by op, each of the head's ops would compile on its own)
    init = jax.jit(functools.partial(MtpDrafter().init, cfg=cfg, max_len=16))
    state = init(params, prompt=prompt, hidden=hidden, first_token=prompt[:, 0])
    history = jnp.concatenate([prompt, jnp.zeros((2, 9), jnp.int32)], axis=1)
    out = {}
    for unroll in (True, False):
        drafter = dataclasses.replace(MtpDrafter(), unroll=unroll)
        propose = jax.jit(functools.partial(drafter.propose, cfg=cfg, gamma=4))
        out[unroll] = propose(params, state=state, history=history, hist_len=jnp.full((2,), 7), key=jax.random.PRNGKey(0))
        loops = while_loops(propose.lower(params, state=state, history=history, hist_len=jnp.full((2,), 7), key=jax.random.PRNGKey(0)).compile().as_text())
        assert bool(loops) != unroll, loops  # the chain is a loop only when rolled
    np.testing.assert_array_equal(out[True][0], out[False][0])
    for name in ("k", "v"):
        np.testing.assert_allclose(out[True][2][name], out[False][2][name], atol=1e-5)
    with pytest.raises(InputError, match=r"unroll_drafts must be True or False; got 'yes'"):
        sj.generate(mtp_model, np.ones((1, 3), np.int32), 4, method="mtp", unroll_drafts="yes")
    # vocabulary 53: no power-of-two blocks for the output head, so the decode blocks are refused before any compute
    with pytest.raises(InputError, match=r"kernels='blocks': this MTP head does not fit the decode-block kernels"):
        sj.generate(mtp_model, np.ones((1, 3), np.int32), 4, method="mtp", kernels="blocks")


def test_mtp_on_trained_checkpoint_is_exact_and_accepts(gamma=8):
    # gamma 8 (a verification past the 8 default decode rows); the default gamma's exactness on the shipped checkpoint
    # is test_exact.py's (bf16) and test_greedy_equals_ar's (float32, several gammas and rollbacks). A ragged batch of
    # 17 rows, past buckets.SMALL_BATCH: its cache is the length it needs, shorter than its prompt buffer of whole
    # chunks, which the head's prefill still fits (the 20-prompt GPU check found that it did not).
    model = sj.load(TINY, dtype="float32")
    text = 'import os\n\n\ndef walk_tree(root):\n    """Yield every file below root."""\n    for dirpath, _, files in os.walk('
    base = np.asarray(model.tokenizer.encode(text, add_special_tokens=False))
    ids = [base[: len(base) - i % 5] for i in range(17)]  # 34 tokens at most: chunks of 48, a cache of 34 + 24 + 9
    # slots, a buffer of 96: the buffer runs past the cache by more than a decode block's rows
    ar = sj.generate(model, ids, 24, eos_token_id=False).tokens
    res = sj.generate(model, ids, 24, method="mtp", gamma=gamma, eos_token_id=False)
    np.testing.assert_array_equal(res.tokens, ar)
    assert res.stats["decode_rows"] == gamma + 1 and res.stats["exact"]
    assert res.stats["mean_accepted"] > 0.5  # the trained head predicts the token after next


def test_mtp_sampling_preserves_distribution(tmp_path):
    from tests.stats_helpers import assert_first_tokens_match
    ref = H.build_reference(H.tiny_text_config(ratio=1, vocab=6, layers=2,
                                               layer_types=["linear_attention", "full_attention"]), seed=8)
    H.save_reference(ref, str(tmp_path), mtp_layers=1, seed=8)
    model = sj.load(tmp_path, dtype="float32")
    n, V = 20_000, 6
    ids = np.tile(np.asarray([[1, 2, 3, 4]]), (n, 1))
    ar = stats_helpers.ar_samples(model, ids, 3, temperature=1.0)
    spec = generate_speculative(model.params, model.config, ids, 3, drafter=MtpDrafter(), gamma=2, max_len=9,
                                sampling=SamplingConfig(1.0), seed=2, eos_ids=(), state_dtype=jnp.float32)
    assert 0.2 < spec.stats["mean_accepted"] < 2.0  # both the accept and the reject paths ran
    assert_first_tokens_match(ar, spec.tokens, V)


@pytest.mark.parametrize("search", ["compare_all", "scan_unrolled", "scan", "sort"])
def test_table_search_methods_find_the_same_continuations(mtp_model, search):
    """Every search method finds the same entries: the same drafts (accepted counts) and AR's output."""
    # 4 rows, gamma 4, pseudo-values: AR's programs and the default search's (compare_all) are
    # test_greedy_equals_ar[ngram-table-4-pseudo]'s, so each search compiles its loop only (the suite's time)
    ids = np.random.default_rng(3).integers(0, mtp_model.vocab_size, size=(4, 9))
    ar = sj.generate(mtp_model, ids, 24, eos_token_id=False).tokens
    base = sj.generate(mtp_model, ids, 24, method="ngram-table", gamma=4, rollback="pseudo", eos_token_id=False)
    res = sj.generate(mtp_model, ids, 24, method="ngram-table", gamma=4, rollback="pseudo", search=search,
                      eos_token_id=False)
    np.testing.assert_array_equal(res.tokens, ar)
    assert res.stats["mean_accepted"] == base.stats["mean_accepted"]
    tables = {k: v for k, v in mtp_model.params["draft"].items()}
    ctx = np.asarray(tables["table_ctx"])
    for a, b in [tuple(ctx[0]), tuple(ctx[len(ctx) // 2]), tuple(ctx[-1]), (0, 52)]:
        np.testing.assert_array_equal(table_lookup(tables, jnp.int32(a), jnp.int32(b), search),
                                      table_lookup(tables, jnp.int32(a), jnp.int32(b), "scan"))


def test_table_search_option_is_checked(mtp_model):
    with pytest.raises(InputError, match=r"search must be one of \['compare_all'.*got 'binary'"):
        sj.generate(mtp_model, np.ones((1, 3), np.int32), 4, method="ngram-table", search="binary")


def test_table_build_and_lookup():
    seqs = [np.asarray([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10]), np.asarray([1, 2, 3, 4, 5, 6, 7, 8])]
    tables = {k: jnp.asarray(v) for k, v in build_tables(seqs, 12, 4).items()}
    np.testing.assert_array_equal(table_lookup(tables, jnp.int32(5), jnp.int32(6)), [7, 8, 9, 10])
    np.testing.assert_array_equal(table_lookup(tables, jnp.int32(2), jnp.int32(3)), [4, 5, 6, 7])
    # unseen bigram -> the unigram continuation of its last token; unseen token -> repeated
    np.testing.assert_array_equal(table_lookup(tables, jnp.int32(0), jnp.int32(6)), [7, 8, 9, 10])
    np.testing.assert_array_equal(table_lookup(tables, jnp.int32(0), jnp.int32(11)), [11, 11, 11, 11])
    assert set(np.asarray(tables["shortlist"]).tolist()) <= set(range(5, 11))


def test_methods_need_their_weights(tmp_path):
    ref = H.build_reference(H.tiny_text_config(ratio=1), seed=2)
    H.save_reference(ref, str(tmp_path))  # no mtp.*, no draft tables
    model = sj.load(tmp_path, dtype="float32")
    assert sj.supported_methods(model) == ("ar", "ngram", "layer-skip", "residual-reuse", "partial-mlp", "ngram-tree")
    with pytest.raises(InputError, match=r"method 'mtp' is not supported.*needs the MTP head"):
        sj.generate(model, np.ones((1, 3), np.int32), 4, method="mtp")
    with pytest.raises(InputError, match=r"'ngram-table'.*draft_tables.safetensors"):
        sj.generate(model, np.ones((1, 3), np.int32), 4, method="ngram-table")


def test_shipped_checkpoint_matches_transformers():
    """The shipped tiny Qwen3.5 loads in transformers too, and both give the same greedy tokens."""
    import torch
    from transformers import Qwen3_5ForCausalLM
    ref = Qwen3_5ForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    model = sj.load(TINY, dtype="float32")
    ids = np.asarray([[1542, 12, 290, 1239, 11, 2023, 198, 220, 220, 220, 422]]) % model.vocab_size
    np.testing.assert_array_equal(sj.generate(model, ids, 24, eos_token_id=False).tokens,
                                  H.reference_greedy(ref, ids, 24))
