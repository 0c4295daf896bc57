"""Shape buckets and ragged batches (decoding/buckets.py, decoding/prefill.py): a padded, chunked prefill leaves the
state an unpadded one leaves; programs are reused across prompt lengths and new-token counts within a bucket; a
ragged batch's rows equal their own batch-1 runs (float32), and speculation equals AR within the call."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.decoding import buckets
from specdec_jax.decoding.prefill import chunked_prefill
from specdec_jax.models.qwen35 import model as qwen35
from tests import qwen_helpers as H


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ref = H.build_reference(H.tiny_text_config(ratio=2, vocab=61), seed=23)
    folder = str(tmp_path_factory.mktemp("buckets"))
    H.save_reference(ref, folder)
    return sj.load(folder, dtype="float32")


def _prompts(lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]


def test_cache_bucket_ladder():
    assert [buckets.cache_bucket(n) for n in (1, 256, 257, 1024, 1025, 4097, 40000, 65537, 70000)] == \
        [256, 256, 1024, 1024, 4096, 8192, 65536, 65536 + 16384, 65536 + 16384]
    assert [buckets.prefill_chunk(n) for n in (10, 256, 257, 512, 513, 600, 5000)] == [256, 256, 512, 512, 1024, 1024, 1024]
    assert [buckets.prefill_chunk(n, 1, 256) for n in (10, 200)] == [256, 256]  # the smallest chunk: a 256-slot cache
    assert [buckets.prefill_chunk(n, 1, 1024) for n in (10, 300, 700)] == [512, 512, 1024]  # two chunks a bucket
    assert buckets.prompt_buffer(300, 256) == 512
    assert buckets.cache_length(300, 16, 10 ** 6) == 1024 and buckets.cache_length(300, 17, 10 ** 6) == 300
    assert buckets.cache_length(300, 1, 512) == 512 and buckets.prefill_chunk(5, 17) == 16


# Jitted, as generate runs them: one program per (rows, buffer width) serves every prompt length below (op by op, each
# of the forward's ops compiled again for every length and the chunk loop for every call: ~10 s a length on 2 cores).
@functools.partial(jax.jit, static_argnames=("cfg", "chunk", "max_len"))
def _chunked_prefill_jit(params, ids, lens, *, cfg, chunk, max_len):
    state = qwen35.init_state(cfg, ids.shape[0], max_len, jnp.float32)

    def run(st, piece, n_valid):
        logits, st, _ = qwen35.forward(params, cfg, st, piece, logits_for="last", prefill_lens=n_valid)
        return logits[:, 0], st, None

    return chunked_prefill(run, state, ids, lens, chunk)[:2]


@functools.partial(jax.jit, static_argnames=("cfg", "max_len"))
def _unpadded_forward(params, ids, *, cfg, max_len):
    logits, state, _ = qwen35.forward(params, cfg, qwen35.init_state(cfg, 1, max_len, jnp.float32), ids,
                                      logits_for="last")
    return logits, state


def _chunked_state(model, rows, chunk, width, max_len=96):
    ids, lens = buckets.pad_prompts(rows, width, pad_id=5)
    return _chunked_prefill_jit(model.params, jnp.asarray(ids), jnp.asarray(lens), cfg=model.config, chunk=chunk,
                                max_len=max_len)


@pytest.mark.parametrize("length", [1, 17, 40])  # one token; one past a chunk; several chunks
def test_padded_chunked_prefill_is_the_unpadded_state(model, length):
    """One prompt, prefilled in chunks of 16 from buffers of 48 and 80 tokens: the same bits (the padding changes
    nothing), and the state and last logits of one unpadded forward (fp32 tolerance: other matrix shapes)."""
    cfg = model.config
    row = _prompts([length], cfg.vocab_size, seed=length)
    logits_a, state_a = _chunked_state(model, row, 16, 48)
    logits_b, state_b = _chunked_state(model, row, 16, 80)
    for a, b in zip(jax.tree.leaves((logits_a, state_a)), jax.tree.leaves((logits_b, state_b))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    logits_u, state_u = _unpadded_forward(model.params, jnp.asarray(row[0])[None], cfg=cfg, max_len=96)
    # fp32 tolerance for a whole model (DESIGN.md: 1e-4): chunks and one forward round differently (jax 0.11.2's CPU
    # build differed by 1.7e-5 in a logit at 40 tokens)
    np.testing.assert_allclose(np.asarray(logits_a), np.asarray(logits_u[:, 0]), rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_u)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-4, atol=1e-4)
    assert int(state_a.length[0]) == length


def test_ragged_rows_prefill_as_alone(model):
    """Rows of 3, 16 and 35 tokens prefilled together (chunks of 16): each row's state is its batch-1 state."""
    rows = _prompts([3, 16, 35], model.config.vocab_size, seed=3)
    logits, state = _chunked_state(model, rows, 16, 48)
    for b, row in enumerate(rows):
        logits_1, state_1 = _chunked_state(model, [row], 16, 48)
        np.testing.assert_allclose(np.asarray(logits[b]), np.asarray(logits_1[0]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(state.recurrent[:, b]), np.asarray(state_1.recurrent[:, 0]),
                                   rtol=1e-5, atol=1e-5)
        assert int(state.length[b]) == len(row)


@pytest.mark.parametrize("method,options", [("ar", {}), ("ngram", {"gamma": 3, "temperature": 0.8, "seed": 5})])
def test_programs_are_reused_within_a_bucket(model, method, options):
    """Other prompt lengths and new-token counts in the same bucket compile nothing (EOS on: the count is traced).
    Two rows and EOS 3: these programs serve test_streamed_chunks_concatenate_to_generate's generate too (the same
    options)."""
    eos = [3]
    first = sj.generate(model, _prompts([11, 6], 61, seed=1), 9, method=method, eos_token_id=eos, **options)
    again = sj.generate(model, _prompts([29, 3], 61, seed=2), 14, method=method, eos_token_id=eos, **options)
    assert again.stats["compiled_programs"] == 0 and again.stats["compile_seconds"] == 0.0, again.stats
    assert first.tokens.shape == (2, 9) and again.tokens.shape == (2, 14)


def test_ar_and_speculative_methods_share_the_prefill_program(model):
    """A bucket's prefill is one program for AR and every speculative method (`prefill.prefill_buffer`): after AR, a
    method on the same bucket compiles its begin and its loop only, and gives AR's tokens."""
    rows = _prompts([7, 13], 61, seed=6)
    ar = sj.generate(model, rows, 8, eos_token_id=False)
    spec = sj.generate(model, rows, 8, method="ngram", gamma=5, eos_token_id=False)
    assert spec.stats["compiled_programs"] == 2, spec.stats
    np.testing.assert_array_equal(spec.tokens, ar.tokens)


@pytest.mark.parametrize("method,options", [("ar", {}), ("ngram", {"gamma": 3})])  # trees: the stream test's batch
def test_ragged_batch_rows_equal_their_own_runs(model, method, options):
    """A ragged batch (fp32, greedy): every row's tokens are its batch-1 tokens, and AR's."""
    rows = _prompts([5, 19, 12], 61, seed=4)
    batch = sj.generate(model, rows, 12, method=method, eos_token_id=False, **options)
    assert batch.tokens.shape == (3, 12)
    for b, row in enumerate(rows):
        alone = sj.generate(model, [row], 12, method=method, eos_token_id=False, **options)
        ar = sj.generate(model, [row], 12, eos_token_id=False)
        np.testing.assert_array_equal(batch.tokens[b], alone.tokens[0])
        np.testing.assert_array_equal(alone.tokens[0], ar.tokens[0])


def test_a_2d_array_and_its_rows_as_a_list_agree(model):
    # 3 rows at gamma 3: the programs test_ragged_batch_rows_equal_their_own_runs[ngram] compiles (the suite's time)
    ids = np.stack(_prompts([9, 9, 9], 61, seed=5))
    a = sj.generate(model, ids, 6, method="ngram", gamma=3, eos_token_id=False)
    b = sj.generate(model, list(ids), 6, method="ngram", gamma=3, eos_token_id=False)
    np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.mark.parametrize("prompts,needle", [
    ([np.arange(4), np.zeros(0, np.int32)], "prompts[1] is empty"),
    ([np.arange(4), np.asarray([1, 99])], "prompts[1][1] = 99 is outside the vocabulary"),
    ([np.arange(4), np.asarray([1.5, 2.0])], "prompts[1] must hold integers"),
    ([], "input_ids is empty"),
])
def test_bad_prompt_lists_are_one_error_before_any_compute(model, monkeypatch, prompts, needle):
    from specdec_jax.decoding import autoregressive
    monkeypatch.setattr(autoregressive, "generate_autoregressive", lambda *a, **k: pytest.fail("ran before the error"))
    with pytest.raises(sj.InputError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        sj.generate(model, prompts, 4)


def test_stats_keys_are_the_same_for_every_family_and_kind(model):
    """Every generation reports model.STATS_KEYS (speculative methods add their step statistics); the looped family's
    AR and speculation: test_looped_spec.py::test_looped_continuation_equals_a_fresh_run_on_the_whole_text."""
    from specdec_jax.results import STATS_KEYS
    ids = _prompts([6], 61, seed=6)
    runs = [sj.generate(model, ids, 5), sj.generate(model, ids, 5, method="ngram", gamma=3)]
    for res in runs:
        assert set(STATS_KEYS) <= set(res.stats), sorted(set(STATS_KEYS) - set(res.stats))
    for res in runs[1::2]:
        assert {"verify_steps", "mean_accepted", "tokens_per_step", "accepted_counts"} <= set(res.stats)


@pytest.mark.parametrize("method,options", [  # greedy n-gram streams through the sampled one's loop (a static flag)
    ("ar", {}), ("ngram", {"gamma": 3, "temperature": 0.8, "seed": 5}),
    ("ngram-tree", {"tree": [2, 1], "temperature": 0.8, "seed": 6}),
])
def test_streamed_chunks_concatenate_to_generate(model, method, options):
    """sj.stream in chunks of 2 steps, ragged rows, an EOS id: the pieces concatenated are generate's tokens (sampling
    included: the same keys), and a chunked loop yields more than one piece."""
    rows = _prompts([5, 13], 61, seed=7)
    whole = sj.generate(model, rows, 14, method=method, eos_token_id=[3], **options)
    pieces = list(sj.stream(model, rows, 14, chunk_steps=2, method=method, eos_token_id=[3], **options))
    assert all(p.shape[0] == 2 for p in pieces)
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), whole.tokens)
    assert len(pieces) > 1
    if method == "ngram-tree":  # tree sampling through the public API: another seed, other tokens (same programs)
        other = sj.generate(model, rows, 14, method=method, eos_token_id=[3], **dict(options, seed=options["seed"] + 1))
        assert whole.stats["method"] == "tree-ngram" and not np.array_equal(other.tokens, whole.tokens)


def test_stream_refuses_bad_input_at_the_call(model):
    with pytest.raises(sj.InputError, match="chunk_steps must be >= 1"):
        sj.stream(model, _prompts([4], 61), 4, chunk_steps=0)
    with pytest.raises(sj.InputError, match="prompts\\[0\\] is empty"):
        sj.stream(model, [np.zeros(0, np.int32)], 4)
