"""Speculative decoding on Qwen3.5: exactness (greedy == AR), state equality, exact sampling."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.decoding import acceptance
from specdec_jax.decoding.sampling import SamplingConfig
from specdec_jax.decoding.speculative import generate_speculative
from specdec_jax.drafters.ngram import NgramDrafter, ngram_lookup
from specdec_jax.models.qwen35 import model as qwen35
from tests import qwen_helpers as H
from tests import stats_helpers
from tests.stats_helpers import assert_first_tokens_match


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ref = H.build_reference(H.tiny_text_config(ratio=2, vocab=61), seed=21)
    folder = str(tmp_path_factory.mktemp("spec"))
    H.save_reference(ref, folder)
    return sj.load(folder, dtype="float32")


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """Test drafter: proposes a known continuation, wrong wherever (position % miss_every == row)
    so acceptance lengths vary per step and per row (ragged batches)."""

    reference: tuple  # per row: prompt + continuation token ids
    miss_every: int
    vocab: int
    name = "oracle"

    def init(self, params, cfg, prompt, max_len, **_):
        return ()

    def update(self, drafter_state, **_):
        return drafter_state

    def propose(self, params, cfg, drafter_state, history, hist_len, gamma, key, **_):
        ref = jnp.asarray(self.reference, jnp.int32)  # [B, L]
        pos = hist_len[:, None] + jnp.arange(gamma)[None, :]  # [B, gamma]
        tok = jnp.take_along_axis(ref, jnp.clip(pos, 0, ref.shape[1] - 1), axis=1)
        rows = jnp.arange(ref.shape[0])[:, None]
        miss = (pos % self.miss_every) == (rows % self.miss_every)
        return jnp.where(miss, (tok + 1) % self.vocab, tok), None, drafter_state


def _spec(model, ids, n, drafter, gamma, rollback="replay", sampling=SamplingConfig(), seed=0, return_state=False,
          eos_ids=()):
    return generate_speculative(model.params, model.config, ids, n, drafter=drafter, gamma=gamma,
                                max_len=ids.shape[1] + n + gamma, sampling=sampling, seed=seed, eos_ids=eos_ids,
                                state_dtype=jnp.float32, rollback=rollback, return_state=return_state)


# Snapshot rollback at gamma 8 only (CI time): test_state_after_generation_equals_ar_state runs it at gamma 4. Two rows
# (their drafts miss at other positions: ragged acceptance), as the other tests here: one AR program for them all.
@pytest.mark.parametrize("gamma, rollback", [(1, "replay"), (1, "pseudo"), (8, "replay"), (8, "pseudo"), (8, "snapshot")])
def test_greedy_equals_ar_with_mostly_hitting_drafts(model, gamma, rollback):
    ids = np.random.default_rng(gamma).integers(0, model.vocab_size, size=(2, 7))
    ar = sj.generate(model, ids, 30, eos_token_id=False).tokens
    reference = tuple(map(tuple, np.concatenate([ids, ar], axis=1).tolist()))
    drafter = OracleDrafter(reference, miss_every=5, vocab=model.vocab_size)
    res = _spec(model, ids, 30, drafter, gamma, rollback)
    np.testing.assert_array_equal(res.tokens, ar)
    assert res.stats["mean_accepted"] > 0.5 * min(gamma, 3)  # drafts really were accepted
    assert res.stats["verify_steps"] < 30


# gammas 1 and 8: test_greedy_equals_ar_with_mostly_hitting_drafts; gamma 4: test_exact.py (bf16) and test_session.py
@pytest.mark.parametrize("gamma", [2])
def test_ngram_greedy_equals_ar(model, gamma):
    rng = np.random.default_rng(3)
    repetitive = np.tile(rng.integers(0, model.vocab_size, size=5), 5)[None]
    random = rng.integers(0, model.vocab_size, size=(1, 25))
    ids = np.concatenate([repetitive, random], axis=0)  # drafts hit (row 0) and miss (row 1)
    ar = sj.generate(model, ids, 24, eos_token_id=False).tokens
    res = sj.generate(model, ids, 24, method="ngram", gamma=gamma, eos_token_id=False)
    np.testing.assert_array_equal(res.tokens, ar)
    assert res.stats["rollback"] == "replay"  # the default (test_rollback_default_and_limits: its limits)


def test_state_after_generation_equals_ar_state(model):
    ids = np.random.default_rng(9).integers(0, model.vocab_size, size=(2, 6))
    ar = sj.generate(model, ids, 20, eos_token_id=False).tokens
    reference = tuple(map(tuple, np.concatenate([ids, ar], axis=1).tolist()))
    for rollback in ("replay", "pseudo", "snapshot"):
        res = _spec(model, ids, 20, OracleDrafter(reference, 4, model.vocab_size), 4, rollback, return_state=True)
        state = res.stats["state"]
        for row in range(2):
            n_out = int(state.n_out[row])
            tokens = np.asarray(state.out)[row, : n_out - 1]  # every emitted token but the anchor was processed
            seq = np.concatenate([ids[row], tokens])[None]
            fresh = qwen35.init_state(model.config, 1, state.model.max_len, jnp.float32)
            _, want = qwen35.forward_jit(model.params, model.config, fresh, jnp.asarray(seq))
            got = state.model.batch_rows(slice(row, row + 1))
            np.testing.assert_array_equal(got.length, want.length)
            L = seq.shape[1]
            for a, b in zip(got.recurrent, want.recurrent):
                assert H.rel_err(a, b) <= 1e-5, rollback
            for a, b in zip(got.conv, want.conv):  # equal up to fp32 rounding of earlier layers
                assert H.rel_err(a, b) <= 1e-5
            # K/V of the attention layer come after three GDN layers computed in a different order
            # (verify chunks + commit vs one pass): fp32 rounding measured 1e-6..1.2e-5 here, a wrong
            # commit or stale slot gives O(1).
            for a, b in zip(got.keys + got.values, want.keys + want.values):
                assert H.rel_err(a[:, :L], b[:, :L]) <= 3e-5


def test_eos_stops_speculative_generation(model):
    ids = np.random.default_rng(4).integers(0, model.vocab_size, size=(1, 6))
    free = sj.generate(model, ids, 16, eos_token_id=False).tokens[0]
    eos = int(free[5])
    ar = sj.generate(model, ids, 16, eos_token_id=eos).tokens
    reference = (tuple(np.concatenate([ids[0], free]).tolist()),)
    res = _spec(model, ids, 16, OracleDrafter(reference, 7, model.vocab_size), 4, eos_ids=(eos,))
    np.testing.assert_array_equal(res.tokens, ar)


def test_ngram_lookup_proposals():
    h = jnp.asarray([5, 6, 7, 9, 5, 6, 7, 8, 1, 5, 6, 7, 0, 0, 0, 0], jnp.int32)
    # suffix "5 6 7" (length 12) last occurred at 4 -> propose 8 1 5 6
    np.testing.assert_array_equal(ngram_lookup(h, jnp.int32(12), 4, 3), [8, 1, 5, 6])
    # suffix "9" (length 4) never occurred earlier -> no match: the anchor repeated
    np.testing.assert_array_equal(ngram_lookup(h, jnp.int32(4), 3, 3), [9, 9, 9])
    # suffix "6 7" at length 7 matched at 1 -> 9 5 6, then the known text ends: continue with its last token
    np.testing.assert_array_equal(ngram_lookup(h, jnp.int32(7), 5, 2), [9, 5, 6, 7, 7])


# ------------------------------------------------------------------------------------- sampling

def test_acceptance_rule_exact_distribution():
    """One draft position, enumerated: P(first emitted = x) = p(x) for every q, and the bonus path."""
    p = jnp.asarray([[0.5, 0.2, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]], jnp.float32)  # target at draft, bonus
    q = jnp.asarray([0.1, 0.6, 0.1, 0.2], jnp.float32)
    # Exact: accept d with min(1, p/q); else residual. Total probability of emitting x first:
    accept_p = jnp.minimum(1.0, p[0] / q)
    residual = jnp.maximum(p[0] - q, 0) / jnp.sum(jnp.maximum(p[0] - q, 0))
    exact_first = q * accept_p + (1 - jnp.sum(q * accept_p)) * residual
    np.testing.assert_allclose(exact_first, p[0], atol=1e-6)
    n = 200_000
    keys = jax.random.split(jax.random.PRNGKey(0), n)

    def one(key):
        kd, ka = jax.random.split(key)
        d = jax.random.categorical(kd, jnp.log(q))
        n_acc, nxt = acceptance.sampling_accept(d[None, None], q[None, None], p[None], ka)
        return jnp.where(n_acc[0] == 1, d, nxt[0]), n_acc[0], nxt[0]

    first, n_acc, nxt = jax.vmap(one)(keys)
    counts = np.bincount(np.asarray(first), minlength=4)
    np.testing.assert_allclose(counts / n, p[0], atol=4e-3)
    # After an accepted draft, the bonus token follows the next target distribution.
    bonus = np.bincount(np.asarray(nxt)[np.asarray(n_acc) == 1], minlength=4)
    np.testing.assert_allclose(bonus / bonus.sum(), p[1], atol=6e-3)


@dataclasses.dataclass(frozen=True)
class RandomDrafter:
    """Test drafter that samples drafts from a fixed distribution q and reports it."""

    logits: tuple
    name = "random"

    def init(self, params, cfg, prompt, max_len, **_):
        return ()

    def update(self, drafter_state, **_):
        return drafter_state

    def propose(self, params, cfg, drafter_state, history, hist_len, gamma, key, **_):
        B = history.shape[0]
        logq = jax.nn.log_softmax(jnp.asarray(self.logits, jnp.float32))
        drafts = jax.random.categorical(key, logq, shape=(B, gamma)).astype(jnp.int32)
        q = jnp.broadcast_to(jnp.exp(logq), (B, gamma, logq.shape[0]))
        return drafts, q, drafter_state


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    return H.small_vocab_model(str(tmp_path_factory.mktemp("v6")))


@pytest.fixture(scope="module")
def ar_samples(small_vocab_model):
    """AR's first 3 tokens of the 20,000 rows below (seed 1): one draw, which each sampling test compares with (it
    is deterministic, so each test drawing it again would get the same tokens)."""
    ids = np.tile(np.asarray([[1, 2, 3, 1, 2]]), (20_000, 1))
    return ids, stats_helpers.ar_samples(small_vocab_model, ids, 3, temperature=1.0)


@pytest.mark.parametrize("drafter_kind", ["ngram", "random_q"])
def test_speculative_sampling_preserves_distribution(small_vocab_model, ar_samples, drafter_kind):
    model = small_vocab_model
    V = model.vocab_size
    ids, ar = ar_samples
    sampling = SamplingConfig(temperature=1.0)
    drafter = NgramDrafter() if drafter_kind == "ngram" else RandomDrafter((0.5, -1.0, 0.0, 1.0, 0.2, -0.3))
    spec = _spec(model, ids, 3, drafter, 2, sampling=sampling, seed=2)
    assert spec.stats["mean_accepted"] > 0.2  # the rejection path and the accept path both ran
    assert_first_tokens_match(ar, spec.tokens, V)


# spec_step_jit driven by hand (state donated) until done, its tokens AR's: test_self_draft.py's greedy tests.
def test_rollback_default_and_limits(model, monkeypatch):
    """Replay by default (test_ngram_greedy_equals_ar checks it on the programs it compiles); drafts longer than the
    step recurrence verifies are refused unless exact=False, which falls back to pseudo-values unless replay is asked
    for by name, which is one clear error. (The gamma-64 generation is stopped at its call: the rollback it is given
    is what is checked, not its programs.)"""
    from specdec_jax.decoding import speculative

    class Called(Exception):
        """generate_speculative was reached; its message is the rollback it was given."""

    def stop(*args, rollback, **kwargs):
        raise Called(rollback)

    ids = np.random.default_rng(5).integers(0, model.vocab_size, size=(1, 5))
    with pytest.raises(sj.InputError, match=r"gamma=64 needs gamma \+ 1 <= 64 rows .* pass exact=False"):
        sj.generate(model, ids, 3, method="ngram", gamma=64)
    monkeypatch.setattr(speculative, "generate_speculative", stop)
    with pytest.raises(Called, match="^pseudo$"):
        sj.generate(model, ids, 3, method="ngram", gamma=64, exact=False)
    monkeypatch.undo()
    with pytest.raises(sj.SpecdecError, match="replay rollback verifies at most 64 positions"):
        sj.generate(model, ids, 3, method="ngram", gamma=64, rollback="replay", exact=False)


def test_compiler_options_are_the_familys_on_the_gpu_none_elsewhere_and_the_environment_overrides(monkeypatch):
    from specdec_jax.decoding import compiled
    monkeypatch.delenv("SPECDEC_XLA_OPTIONS", raising=False)
    assert compiled.compiler_options("qwen3_5") == {}  # this CPU backend
    monkeypatch.setattr(compiled.jax, "default_backend", lambda: "gpu")
    assert compiled.compiler_options("qwen3_5") == compiled.GPU_COMPILER_OPTIONS["qwen3_5"] != {}
    assert compiled.compiler_options("looped") == compiled.EXACT_GPU_OPTIONS  # exactness options for every family
    assert all(compiled.compiler_options(f).items() >= compiled.EXACT_GPU_OPTIONS.items() for f in ("qwen3_5", "looped"))
    monkeypatch.setenv("SPECDEC_XLA_OPTIONS", "none")
    assert compiled.compiler_options("qwen3_5") == {}
    monkeypatch.setenv("SPECDEC_XLA_OPTIONS", "a=1; b=x=y")
    assert compiled.compiler_options("looped") == {"a": "1", "b": "x=y"}
    monkeypatch.setenv("SPECDEC_XLA_OPTIONS", "bogus")
    with pytest.raises(ValueError, match="SPECDEC_XLA_OPTIONS"):
        compiled.compiler_options("qwen3_5")


def test_compiled_programs_are_cached_per_compiler_options():
    from specdec_jax.decoding import compiled
    f, x = jax.jit(lambda x: x + 1), jnp.ones(3)
    options = {"xla_gpu_graph_min_graph_size": "2"}  # a GPU option: accepted, and inert, on the CPU
    first, _ = compiled.compiled(f, {}, x, options=options)
    again, seconds = compiled.compiled(f, {}, x, options=dict(options))
    plain, _ = compiled.compiled(f, {}, x)
    assert again is first and seconds == 0.0 and plain is not first
    assert np.array_equal(first(x), plain(x))


def test_a_switch_changed_after_a_trace_compiles_the_new_program(monkeypatch):
    """`compiled` keys on the trace-time switches (here SPECDEC_MATVEC); jit's trace cache does not, so a function
    traced under one setting must be traced again under the next, not lowered from its old trace."""
    import os
    from specdec_jax.decoding import compiled
    f = jax.jit(lambda x: x * (2.0 if os.environ.get("SPECDEC_MATVEC") == "reduce" else 1.0))
    x = jnp.ones(3)
    monkeypatch.setenv("SPECDEC_MATVEC", "dot")
    dot, _ = compiled.compiled(f, {}, x)
    monkeypatch.setenv("SPECDEC_MATVEC", "reduce")
    reduce, _ = compiled.compiled(f, {}, x)
    assert np.array_equal(dot(x), x) and np.array_equal(reduce(x), 2 * x)


def _prefilled(model, ids, gamma, n):
    from specdec_jax.decoding import speculative
    key = jax.random.PRNGKey(0)
    state, dstate = speculative._spec_prefill(model.params, jnp.asarray(ids), key, cfg=model.config,
                                              max_len=ids.shape[1] + n + gamma, sampling=SamplingConfig(), eos_ids=(),
                                              state_dtype=jnp.float32, gamma=gamma, max_new_tokens=n,
                                              drafter=NgramDrafter(), impl="auto")
    return state, dstate, key


def test_deferred_commit_and_sure_steps_give_the_same_tokens_and_state_bit_for_bit(model, monkeypatch):
    """The loop carrying each step's GDN commit into the next step (speculative.DEFER_DEFAULT), and with it the sure
    steps run first in a loop of known trip count (speculative.SURE_STEPS: here ceil(19 / 5) = 4 of the steps), emit the same
    tokens and end in the same state, bit for bit, as committing within each step; ragged acceptance over two rows."""
    from specdec_jax.decoding import speculative
    ids = np.random.default_rng(9).integers(0, model.vocab_size, size=(2, 6))
    ar = sj.generate(model, ids, 20, eos_token_id=False).tokens
    reference = tuple(map(tuple, np.concatenate([ids, ar], axis=1).tolist()))
    results = {}
    for defer, sure in (("0", "0"), ("1", "0"), ("1", "1")):
        monkeypatch.setattr(speculative, "DEFER_DEFAULT", defer == "1")
        monkeypatch.setattr(speculative, "SURE_STEPS", sure == "1")
        assert speculative.defer_commit("replay") == (defer == "1") and not speculative.defer_commit("snapshot")
        assert speculative.sure_steps_enabled() == (sure == "1")
        results[defer + sure] = _spec(model, ids, 20, OracleDrafter(reference, 4, model.vocab_size), 4, "replay",
                                      return_state=True)
    np.testing.assert_array_equal(results["10"].tokens, ar)
    assert speculative.sure_steps(20, 5, ()) == 4 < results["11"].stats["verify_steps"]
    assert speculative.sure_steps(20, 5, (7,)) == 0 == speculative.sure_steps(1, 5, ())
    static = dict(cfg=model.config, sampling=SamplingConfig(), eos_ids=(), gamma=4, max_new_tokens=20,
                  drafter=NgramDrafter(), rollback="replay", impl="auto")
    loops = {}
    for sure in (False, True):
        jaxpr = speculative._spec_loop.trace(model.params, *_prefilled(model, ids, 4, 20), sure=sure, **static).jaxpr
        loops[sure] = [e.primitive.name for e in jaxpr.eqns if e.primitive.name in ("scan", "while")]
    assert loops[True] == ["scan"] + loops[False] and loops[False][0] == "while"  # sure steps: a known trip count
    for variant in ("10", "11"):
        assert results[variant].stats["accepted_counts"] == results["00"].stats["accepted_counts"]
        for a, b in zip(jax.tree.leaves(results["00"].stats["state"]), jax.tree.leaves(results[variant].stats["state"])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="deferred under replay rollback only"):
        jax.eval_shape(functools.partial(speculative._spec_loop, cfg=model.config, sampling=SamplingConfig(), eos_ids=(),
                                         gamma=2, max_new_tokens=4, drafter=NgramDrafter(), rollback="snapshot",
                                         impl="auto", defer=True), model.params, *_prefilled(model, ids, 2, 4))
