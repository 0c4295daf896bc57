"""Self-speculative decoding for looped models (decoding/looped_spec.py), CPU fp32.

Exactness: greedy self-spec, mature-spec and das-wave equal full-depth AR on the official fixtures
(reference.npz `greedy_r8`; Huginn's official self-speculative `spec_d2_la4_r8` equals it) and on the
shipped trained checkpoint (batch 2, ragged). Plumbing: Deep K/V draft logits equal a forward over a
hand-built cache; das-wave with k = R and a window of 1 is AR step by step. Compiles dominate the
runtime, so every configuration here is compiled once.
"""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.decoding import looped_spec as ls
from specdec_jax.decoding.sampling import SamplingConfig
from specdec_jax.errors import InputError
from specdec_jax.decoding import looped_ar
from specdec_jax.models.looped import model as looped

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "looped"
TRAINED = ROOT / "checkpoints" / "tiny-huginn-code"


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def fixtures():
    out = {}
    for name in ("huginn_tiny", "raven_llama_tiny"):
        ref = np.load(FIXTURES / name / "reference.npz")
        out[name] = (looped.load_looped(FIXTURES / name, "float32"), ref["greedy_prompt"], ref["greedy_r8"])
    return out


def check_stats(stats, n_new, batch=1):
    for key in ("verify_steps", "mean_accepted", "tokens_per_step", "accepted_counts", "tokens_per_second",
                "decode_seconds", "prefill_seconds", "compile_seconds", "decode_tokens_per_second",
                "core_applications_per_token"):
        assert key in stats
    assert stats["new_tokens"] == n_new * batch
    counts = np.asarray(stats["accepted_counts"])
    assert counts.shape == (batch, stats["verify_steps"])
    emitted = np.where(counts >= 0, counts + 1, 0).sum(axis=1)
    # blocks emit accepted drafts + the target token; the first token comes from the prefill
    assert (emitted >= n_new - 1).all()


# --------------------------------------------------------------------------- greedy == AR (fixtures)

HUGINN_CASES = [
    ("self-spec", dict(draft_steps=2, gamma=4)),  # the official spec_d2_la4_r8 semantics
    ("mature-spec", dict(draft_steps=2, gamma=4)),  # Deep K/V
    ("mature-spec", dict(draft_steps=1, gamma=3, read_k="aligned", read_v="deep")),  # Deep V
    ("das-wave", dict(gamma=4, k=2)),
]


@pytest.mark.parametrize("method,options", HUGINN_CASES, ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}{v}" for k, v in v.items()))
def test_huginn_fixture_greedy_equals_ar(fixtures, method, options):
    model, prompt, expected = fixtures["huginn_tiny"]
    n_new = expected.shape[1] - prompt.shape[1]
    result = ls.generate_looped_spec(model, prompt, n_new, method, num_steps=8, eos_ids=(), **options)
    np.testing.assert_array_equal(result.tokens, expected[:, prompt.shape[1]:])
    check_stats(result.stats, n_new)
    assert result.stats["gamma"] == options["gamma"] and result.stats["method"] == method
    if method == "self-spec":  # the official generate_speculative(draft_steps=2, lookahead_for_draft=4)
        official = np.load(FIXTURES / "huginn_tiny" / "reference.npz")["spec_d2_la4_r8"]
        np.testing.assert_array_equal(result.tokens, official[:, prompt.shape[1]:])


def test_looped_spec_programs_compile_with_the_familys_options(fixtures, monkeypatch):
    """Exactness on the GPU needs AR's loop and this loop compiled with the same XLA options
    (compiled.EXACT_GPU_OPTIONS): the options the family asks for reach compiled() for every program compiled here.
    compiled() is then called without them, at test_huginn_fixture_greedy_equals_ar[self-spec]'s settings: its
    programs serve (compiling both again with options costs ~5 s on 2 cores); that compiled() compiles with the options
    it is given is test_speculative.py::test_compiled_programs_are_cached_per_compiler_options's."""
    model, prompt, expected = fixtures["huginn_tiny"]
    asked, seen = [], []
    options = {"xla_allow_excess_precision": False}  # valid on any backend
    monkeypatch.setattr(ls, "compiler_options", lambda family: asked.append(family) or dict(options))
    real = ls.compiled
    monkeypatch.setattr(ls, "compiled",
                        lambda *a, **kw: seen.append(kw.get("options")) or real(*a, **dict(kw, options=None)))
    n_new = expected.shape[1] - prompt.shape[1]
    result = ls.generate_looped_spec(model, prompt, n_new, "self-spec", num_steps=8, eos_ids=(), draft_steps=2,
                                     gamma=4)
    np.testing.assert_array_equal(result.tokens, expected[:, prompt.shape[1]:])
    assert asked == ["looped"] and seen == [options] * 3  # the prefill, the begin and the loop


@pytest.mark.parametrize("method,options", [("self-spec", dict(draft_steps=3, gamma=3)),
                                            ("das-wave", dict(gamma=5, k=1, read_k="aligned", carry=False))])
def test_raven_fixture_greedy_equals_ar(fixtures, method, options):
    """Greedy continuation 98 x 10, 307, 307 with EOS = 307: the row stops at its first 307 and pads
    with it, which is again the reference."""
    model, prompt, expected = fixtures["raven_llama_tiny"]
    n_new = expected.shape[1] - prompt.shape[1]
    eos = (307,) if method == "self-spec" else ()
    result = ls.generate_looped_spec(model, prompt, n_new, method, num_steps=8, eos_ids=eos, **options)
    np.testing.assert_array_equal(result.tokens, expected[:, prompt.shape[1]:])
    if eos:
        assert result.stats["new_tokens"] == 11
    else:
        check_stats(result.stats, n_new)


def test_das_wave_with_full_updates_and_window_one_is_ar_step_by_step(fixtures):
    """k = R updates of a single slot reading aligned slots is the AR computation of the next token:
    every proposal is the AR token (accepted), and each block adds the verifier's bonus token."""
    model, prompt, expected = fixtures["huginn_tiny"]
    result = ls.generate_looped_spec(model, prompt, 10, "das-wave", num_steps=8, eos_ids=(), gamma=1, window_init=1,
                                     k=8, read_k="aligned", read_v="aligned")
    np.testing.assert_array_equal(result.tokens, expected[:, 10:])
    counts = result.stats["accepted_counts"][0]
    assert counts == [1] * len(counts) and len(counts) == 5  # 1 first token + 5 blocks x 2 tokens - 1
    assert result.stats["tokens_per_step"] == 2.0 and result.stats["rounds"] == 5
    assert result.stats["core_applications_per_token"] == (5 * 8 + 5 * 8) / 9  # k = R per round + verifier


# ---------------------------------------------------------------------- read-depth plumbing

@functools.partial(jax.jit, static_argnames=("cfg", "draft_steps", "read_k", "read_v"))
def _draft(params, cache, ids, *, cfg, draft_steps, read_k, read_v):
    return ls.draft_forward(params, cfg, cache, ids, draft_steps=draft_steps, read_k=read_k, read_v=read_v)


@functools.partial(jax.jit, static_argnames=("cfg", "num_steps"))
def _aligned(params, cache, ids, *, cfg, num_steps):
    return looped.forward(params, cfg, cache, ids, num_steps=num_steps, logits_for="last")[0][:, 0]


def test_deep_reads_equal_hand_fed_depth_r_prefix(fixtures):
    """A draft at depth d reading Deep K/V (Deep V) equals an aligned d-step forward over a cache whose
    slots hold, by hand, the prefix's depth-R K/V -- and, for an earlier draft's provisional position,
    that draft's own deepest (slot d - 1) K/V."""
    model = fixtures["huginn_tiny"][0]
    cfg, params = model.config, model.params
    ids = jnp.asarray(np.load(FIXTURES / "huginn_tiny" / "reference.npz")["input_ids"])
    R, d, P = 4, 2, 10
    cache = looped.init_cache(cfg, 2, 16, R, "full", jnp.float32)
    _, cache, _ = looped.forward_jit(params, cfg, cache, ids[:, :P], R)
    tok1, tok2 = ids[:, P:P + 1], ids[:, P + 1:P + 2]
    every = lambda a, s: jnp.stack([a[s]] * R)  # noqa: E731  every step slot <- slot s

    deep1, c1 = _draft(params, cache, tok1, cfg=cfg, draft_steps=d, read_k="deep", read_v="deep")
    hand = cache.replace(core_k=every(cache.core_k, R - 1), core_v=every(cache.core_v, R - 1))
    assert rel(deep1, _aligned(params, hand, tok1, cfg=cfg, num_steps=d)) < 1e-6
    assert rel(_aligned(params, cache, tok1, cfg=cfg, num_steps=d), deep1) > 1e-3  # the read depth matters here
    mature_v, _ = _draft(params, cache, tok1, cfg=cfg, draft_steps=d, read_k="aligned", read_v="deep")
    hand_v = cache.replace(core_v=every(cache.core_v, R - 1))
    assert rel(mature_v, _aligned(params, hand_v, tok1, cfg=cfg, num_steps=d)) < 1e-6

    # The second draft reads the verified prefix at depth R and the first draft at its depth d.
    deep2, c2 = _draft(params, c1, tok2, cfg=cfg, draft_steps=d, read_k="deep", read_v="deep")
    prefix = (jnp.arange(16) < P)[None, None, :, None, None]  # [L, B, S, N, hd] broadcast
    hand2 = c1.replace(core_k=jnp.stack([jnp.where(prefix, cache.core_k[R - 1], c1.core_k[d - 1])] * R),
                       core_v=jnp.stack([jnp.where(prefix, cache.core_v[R - 1], c1.core_v[d - 1])] * R))
    assert rel(deep2, _aligned(params, hand2, tok2, cfg=cfg, num_steps=d)) < 1e-6
    np.testing.assert_array_equal(c2.length, [P + 2, P + 2])
    np.testing.assert_array_equal(c2.core_k[:, :, :, :P], cache.core_k[:, :, :, :P])  # prefix untouched

    # das-wave's per-query (gathered) prefix reads equal core_step when every window slot has one depth.
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, cfg.n_embd))
    e = jax.random.normal(jax.random.PRNGKey(1), (2, 3, cfg.n_embd)) * 5
    cos, sin = looped.rope_tables(cfg, cache.length[:, None] + jnp.arange(3)[None])
    depth = jnp.full((2, 3), 2, jnp.int32)
    got = jax.jit(lambda: ls.window_update(params, cfg, cache, x, e, depth, cos, sin, "aligned", "deep")[0])()
    want = jax.jit(lambda: looped.core_step(params, cfg, cache, x, e, 2, cos, sin, 2, R - 1)[0])()
    assert rel(got, want) < 1e-5


def test_shift_left_moves_carried_slots():
    a = jnp.arange(2 * 5).reshape(2, 5)
    np.testing.assert_array_equal(ls._shift_left(a, jnp.asarray([2, 0])), [[2, 3, 4, 0, 0], [5, 6, 7, 8, 9]])
    np.testing.assert_array_equal(ls._shift_left(a, jnp.asarray([5, 7])), np.zeros((2, 5)))


# ----------------------------------------------------------------- trained checkpoint, batch 2

@pytest.fixture(scope="module")
def trained():
    model = looped.load_looped(TRAINED, "float32")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(TRAINED / "tokenizer.json"))
    texts = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
             'class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n']
    encoded = [tok.encode(t).ids[-16:] for t in texts]
    assert min(len(e) for e in encoded) == 16
    prompts = np.asarray(encoded, np.int32)
    ar = looped_ar.generate(model, prompts, 20, 8, eos_ids=())
    return model, prompts, ar.tokens


@pytest.mark.parametrize("method,options", [
    ("self-spec", dict(draft_steps=2, gamma=4)),
    ("mature-spec", dict(draft_steps=1, gamma=6)),
    ("das-wave", dict(gamma=6, k=2, rounds="fill")),  # rounds traced per row (ragged carried windows)
])
def test_trained_checkpoint_batch2_greedy_equals_ar(trained, method, options):
    model, prompts, expected = trained
    result = ls.generate_looped_spec(model, prompts, 20, method, num_steps=8, eos_ids=(), **options)
    np.testing.assert_array_equal(result.tokens, expected)
    check_stats(result.stats, 20, batch=2)
    counts = np.asarray(result.stats["accepted_counts"])
    assert (counts[counts >= 0] <= options["gamma"]).all()
    assert result.stats["mean_accepted"] > 0.5  # a trained model drafts for itself


def test_parallel_sampler_runs_and_reports(trained):
    model, prompts, expected = trained
    result = ls.generate_looped_spec(model, prompts, 20, "parallel-sampler", num_steps=8, eos_ids=(), gamma=6)
    tokens = result.tokens
    assert tokens.shape == (2, 20) and ((tokens >= 0) & (tokens < model.vocab_size)).all()
    stats = result.stats
    # The wavefront gains one position per round, so a row commits at most one token per round on average.
    assert stats["verify_steps"] == 0 and stats["rounds"] >= 2 * 19 and stats["new_tokens"] == 40
    assert stats["inner_steps"] == 4 and stats["epsilon"] == 0.03 and stats["ema"] == 0.1
    assert tokens[:, 0].tolist() == expected[:, 0].tolist()  # the first token comes from the prefill


# ------------------------------------------------------------------------------------ sampling

def test_sampling_full_depth_drafts_are_accepted_and_seeded(fixtures):
    """Drafting at d = R with aligned reads samples from q = p, so every draft is accepted."""
    model, prompt, _ = fixtures["huginn_tiny"]
    sampling = SamplingConfig(temperature=1.0, top_k=20)
    run = functools.partial(ls.generate_looped_spec, model, prompt, 9, "self-spec", num_steps=4, eos_ids=(),
                            sampling=sampling, draft_steps=4, gamma=2)
    a, b = run(seed=3), run(seed=3)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.stats["accepted_counts"] == [[2, 2, 2]]  # 1 + 3 x 3 >= 9 tokens
    assert ((a.tokens >= 0) & (a.tokens < model.vocab_size)).all()
    assert not np.array_equal(run(seed=4).tokens, a.tokens)


# ---------------------------------------------------------------------------------- bad input

def test_bad_options_raise_before_compute(fixtures):
    model, prompt, _ = fixtures["huginn_tiny"]
    gen = functools.partial(ls.generate_looped_spec, model, prompt, 4, num_steps=8)
    with pytest.raises(InputError, match="unknown looped speculative method 'medusa'"):
        gen("medusa")
    with pytest.raises(InputError, match=r"unknown options \['k'\]"):
        gen("self-spec", k=2)
    with pytest.raises(InputError, match="draft_steps.*cannot exceed num_steps=8"):
        gen("mature-spec", draft_steps=9)
    with pytest.raises(InputError, match="read_v must be one of"):
        gen("mature-spec", read_v="mature")
    with pytest.raises(InputError, match="window_init"):
        gen("das-wave", gamma=4, window_init=5)
    with pytest.raises(InputError, match="rounds.*window must be full"):
        gen("das-wave", gamma=6, rounds=2)
    with pytest.raises(InputError, match="carry must be a bool"):
        gen("das-wave", carry="yes")
    with pytest.raises(InputError, match="gamma must be >= 1"):
        gen("das-wave", gamma=0)
    with pytest.raises(InputError, match=r"ema must be in \[0, 1\)"):
        gen("parallel-sampler", ema=1.0)
    with pytest.raises(InputError, match="epsilon"):
        gen("parallel-sampler", epsilon=-0.1)
    with pytest.raises(InputError, match="num_steps"):
        gen("self-spec", num_steps=0)
    with pytest.raises(InputError, match="max_len"):
        gen("das-wave", gamma=8, max_len=12)
    with pytest.raises(InputError, match="max_new_tokens"):
        ls.generate_looped_spec(model, prompt, 0, "self-spec", num_steps=8)
    with pytest.raises(InputError, match="outside the vocabulary"):
        ls.generate_looped_spec(model, [[1, 10_000]], 4, "self-spec", num_steps=8)
    plan = ls.make_plan("das-wave", 32)
    assert (plan.gamma, plan.k, plan.window_init, plan.rounds, plan.read_k, plan.read_v, plan.carry) == (
        16, 2, 2, 15, "deep", "deep", True)
    assert ls.make_plan("das-wave", 32, rounds="fill").describe()["rounds"] == "fill"
    assert ls.make_plan("self-spec", 32).draft_steps == 4 and ls.make_plan("self-spec", 4).draft_steps == 1
    assert ls.LOOPED_SPEC_METHODS == ("self-spec", "mature-spec", "das-wave", "parallel-sampler")


# Self-spec only: AR's bucketed ragged path runs in the continuation test below (ragged new tokens), and its streamed
# loop is the family-agnostic one tests/test_buckets.py streams.
@pytest.mark.parametrize("method,options", [("self-spec", {"num_steps": 4, "gamma": 2})])
def test_a_ragged_batch_is_one_bucketed_generation_and_rows_equal_their_own_runs(method, options):
    """A looped model takes a ragged list as one batch (issue 48): a padded, chunked prefill with the lengths
    traced, so each row's greedy tokens are those of its own batch-1 run (fp32), and other prompt lengths and token
    counts in the same buckets compile nothing."""
    import specdec_jax as sj
    model = sj.load(FIXTURES / "huginn_tiny", dtype="float32")
    rng = np.random.default_rng(11)
    rows = [rng.integers(0, model.vocab_size, n).astype(np.int32) for n in (5, 9, 5)]
    out = sj.generate(model, rows, 6, method=method, eos_token_id=False, **options)
    assert out.tokens.shape == (3, 6) and out.stats["new_tokens"] == 18
    for i, row in enumerate(rows):
        alone = sj.generate(model, [row], 6, method=method, eos_token_id=False, **options)
        np.testing.assert_array_equal(out.tokens[i], alone.tokens[0], err_msg=f"row {i}")
    again = [rng.integers(0, model.vocab_size, n).astype(np.int32) for n in (12, 3, 7)]
    reused = sj.generate(model, again, 9, method=method, eos_token_id=False, **options)
    assert reused.stats["compiled_programs"] == 0, reused.stats


def test_ar_and_self_speculation_share_the_prefill_program():
    """A bucket's prefill is one program for AR and every self-speculative method at the same depth
    (`prefill.prefill_buffer`): after AR, a method on the same bucket compiles its begin and its loop only, and gives
    AR's tokens."""
    import specdec_jax as sj
    model = sj.load(FIXTURES / "huginn_tiny", dtype="float32")
    rows = [np.arange(3, 3 + n, dtype=np.int32) % model.vocab_size for n in (6, 11)]
    ar = sj.generate(model, rows, 5, eos_token_id=False)
    spec = sj.generate(model, rows, 5, method="self-spec", draft_steps=2, gamma=5, eos_token_id=False)
    assert spec.stats["compiled_programs"] == 2, spec.stats
    np.testing.assert_array_equal(spec.tokens, ar.tokens)


def test_looped_speculation_streams_in_chunks():
    """Looped self-speculation under sj.stream runs its loop a few blocks a call, the state carried between calls:
    more than one piece, concatenated equal to generate's tokens (a ragged batch)."""
    import specdec_jax as sj
    model = sj.load(FIXTURES / "huginn_tiny", dtype="float32")
    rng = np.random.default_rng(13)
    rows = [rng.integers(0, model.vocab_size, n).astype(np.int32) for n in (5, 9, 5)]  # the test above's programs
    options = dict(method="self-spec", eos_token_id=False, num_steps=4, gamma=2)
    whole = sj.generate(model, rows, 11, **options)
    pieces = list(sj.stream(model, rows, 11, chunk_steps=2, **options))
    assert len(pieces) > 1 and all(p.shape[0] == 3 for p in pieces)
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), whole.tokens)



def test_looped_continuation_equals_a_fresh_run_on_the_whole_text():
    """generate(state=...) on a looped model (issue 48). The ragged self-spec batch of the test above, continued with
    ragged new tokens (one bucketed batch, each row's new tokens after its own cached length): by AR, each
    row's greedy tokens are a fresh AR run's on its whole text (fp32) and its cache agrees with that run's over the
    history; by self-spec, AR's tokens again; the same calls give the same bits. A state continues only at the depth
    and cache mode it was made at, and only for its own rows."""
    import specdec_jax as sj
    model = sj.load(FIXTURES / "huginn_tiny", dtype="float32")
    rng = np.random.default_rng(11)
    rows = [rng.integers(0, model.vocab_size, n).astype(np.int32) for n in (5, 9, 5)]
    spec, ar = {"num_steps": 4, "gamma": 2}, {"num_steps": 4}
    first = sj.generate(model, rows, 6, method="self-spec", eos_token_id=False, **spec)  # the programs of the test above
    new = [rng.integers(0, model.vocab_size, n).astype(np.int32) for n in (7, 3, 7)]  # whole texts of 18 tokens each
    cont = sj.generate(model, new, 5, eos_token_id=False, state=first.state, **ar)
    again = sj.generate(model, new, 5, eos_token_id=False, state=first.state, **ar)
    np.testing.assert_array_equal(cont.tokens, again.tokens)
    np.testing.assert_array_equal(np.asarray(cont.state.model.core_k), np.asarray(again.state.model.core_k))
    by_spec = sj.generate(model, new, 5, method="self-spec", eos_token_id=False, state=first.state, **spec)
    np.testing.assert_array_equal(by_spec.tokens, cont.tokens)
    whole = np.stack([np.concatenate([p, t, n]) for p, t, n in zip(rows, first.tokens, new)])
    fresh = sj.generate(model, whole, 5, eos_token_id=False, **ar)
    np.testing.assert_array_equal(cont.tokens, fresh.tokens)
    from specdec_jax.results import STATS_KEYS  # the same keys as the Qwen family's (test_buckets.py)
    for res in (first, fresh):
        assert set(STATS_KEYS) <= set(res.stats), sorted(set(STATS_KEYS) - set(res.stats))
    assert {"verify_steps", "mean_accepted", "tokens_per_step", "accepted_counts"} <= set(first.stats)
    held = whole.shape[1] + 4  # every token but the pending one
    np.testing.assert_array_equal(np.asarray(cont.state.model.length), [held] * 3)
    np.testing.assert_array_equal(np.asarray(fresh.state.model.length), [held] * 3)
    for i in range(3):
        np.testing.assert_array_equal(cont.state.tokens(i), fresh.state.tokens(i))
    for name in ("prelude_k", "core_v", "coda_k"):
        a, b = (np.asarray(getattr(s.model, name))[..., :held, :, :] for s in (cont.state, fresh.state))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)
    with pytest.raises(InputError, match="state was made at"):
        sj.generate(model, new, 3, eos_token_id=False, num_steps=2, state=first.state)
    with pytest.raises(InputError, match="step slots"):
        sj.generate(model, new, 3, method="self-spec", eos_token_id=False, num_steps=2, state=first.state)
    with pytest.raises(InputError, match="rows"):
        sj.generate(model, new[:2], 3, eos_token_id=False, state=first.state, **ar)
