"""Self-drafts (layer-skip, residual-reuse, partial-mlp): greedy output equals AR (float32 here; bfloat16 in
test_exact.py), the drafter's own state is rolled back with the target's, sampling keeps the target's
distribution (12,000 rows: the drafts run per row, so this is the suite's costliest sampling test per row),
bad options are one clear error."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.decoding.sampling import SamplingConfig
from specdec_jax.decoding.speculative import _spec_prefill, generate_speculative, spec_step_jit
from specdec_jax.drafters.self_draft import SelfDrafter, default_skip_layers
from specdec_jax.errors import InputError
from specdec_jax.models.qwen35 import model as qwen35
from specdec_jax.bench.profiling import while_loops
from tests import qwen_helpers as H
from tests import stats_helpers
from tests.stats_helpers import assert_first_tokens_match

QWEN = "checkpoints/tiny-qwen35-code"
PROMPT = 'import os\n\n\ndef walk_tree(root):\n    """Yield every file below root."""\n    for'


@functools.cache
def _shipped():
    from specdec_jax.text import load_tokenizer
    model = sj.load(QWEN, dtype="float32")
    return model, np.asarray([load_tokenizer(QWEN).encode(PROMPT, add_special_tokens=False)])


@functools.cache
def _ar(n: int):
    model, ids = _shipped()
    return sj.generate(model, ids, n, eos_token_id=False).tokens


# The draft chain as a loop (unroll=False): it compiles in about half the time on CPU, and the unrolled chain drafts
# the same tokens (test_a_scanned_draft_chain_drafts_as_the_unrolled_one).
# partial-mlp is left out (the suite's time on 2 cores): its draft model keeps its state as layer-skip's does (a
# forward of its own, rolled back by the same commit); its outputs equal AR's in test_exact.py (bf16) and its sampling
# is test_self_draft_sampling_preserves_distribution's.
@pytest.mark.parametrize("drafter", [SelfDrafter("layer-skip", skip_layers=default_skip_layers(8), unroll=False),
                                     SelfDrafter("residual-reuse", skip_layers=(2, 5), unroll=False)],
                         ids=lambda d: d.method)
def test_greedy_equals_ar_and_the_drafter_state_is_rolled_back(drafter):
    """Driving the step by hand in float32: the emitted tokens are AR's, and after steps with rejections the
    drafter's committed state (GDN, conv, length) and its next-draft logits equal a fresh forward over prompt
    + every emitted token (the anchor included) of the model it catches up with (its draft model;
    residual-reuse: the whole model), so each rollback kept exactly the accepted tokens."""
    model, ids = _shipped()
    cfg, params = model.config, model.params
    gamma, n, key = 4, 24, jax.random.PRNGKey(0)
    max_len = ids.shape[1] + n + gamma + 1
    state, dstate = _spec_prefill(params, jnp.asarray(ids, jnp.int32), key, cfg=cfg, max_len=max_len,
                                  sampling=SamplingConfig(), eos_ids=(), state_dtype=jnp.float32, gamma=gamma,
                                  max_new_tokens=n, drafter=drafter, impl="reference")
    accepted = []
    while not bool(state.done[0]):
        state, dstate, _, n_emit = spec_step_jit(params, cfg, state, dstate, key, drafter=drafter, gamma=gamma,
                                                 sampling=SamplingConfig(), rollback="replay", max_new_tokens=n,
                                                 eos_ids=(), impl="reference")
        accepted.append(int(n_emit[0]) - 1)
    np.testing.assert_array_equal(np.asarray(state.out)[:, :n], _ar(n))
    assert min(accepted) < gamma, accepted  # a rejection happened, so a rollback was checked
    if drafter.method == "layer-skip":  # the shipped model's default skip drafts well enough to be worth it
        assert np.mean(accepted) > 0.5, accepted
    tokens = jnp.asarray(np.asarray(state.history)[:, :int(state.hist_len[0])])  # prompt + emitted, anchor last
    skip = drafter.skip_layers if drafter.method == "layer-skip" else ()
    fresh_forward = jax.jit(lambda p, s, t: qwen35.forward(p, cfg, s, t, impl="reference", skip=skip,
                                                           logits_for="last")[:2])
    logits, fresh = fresh_forward(params, qwen35.init_state(cfg, 1, max_len, jnp.float32), tokens)
    kept = dstate["model"]
    assert int(kept.length[0]) == tokens.shape[1]
    for a, b in zip((*kept.recurrent, *kept.conv), (*fresh.recurrent, *fresh.conv)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(np.asarray(dstate["logits"]), np.asarray(logits[:, 0]), atol=2e-3, rtol=2e-3)


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    return H.small_vocab_model(str(tmp_path_factory.mktemp("v6sd")))


@pytest.fixture(scope="module")
def ar_samples(small_vocab_model):
    """AR's first 3 tokens of the 12,000 rows below (seed 1): one draw, which each sampling test compares with (it
    is deterministic, so each test drawing it again would get the same tokens)."""
    ids = np.tile(np.asarray([[1, 2, 3, 1, 2]]), (12_000, 1))
    return ids, stats_helpers.ar_samples(small_vocab_model, ids, 3, temperature=1.0)


# partial-mlp is left out (the suite's time): its drafts are sampled and their q reported by the same `_choose` as
# residual-reuse's (no shortlist), only its draft forward differs, which test_exact.py runs in bf16.
@pytest.mark.parametrize("drafter", [SelfDrafter("layer-skip", skip_layers=(1,), shortlist_size=4),
                                     SelfDrafter("residual-reuse", skip_layers=(0,))],
                         ids=["layer-skip-shortlist", "residual-reuse"])
def test_self_draft_sampling_preserves_distribution(small_vocab_model, ar_samples, drafter):
    """layer-skip drafts among a 4-token shortlist of the 6-token vocabulary: tokens 1 and 4 are never drafted
    (their q is zero), yet every token keeps its target probability."""
    model, (ids, ar) = small_vocab_model, ar_samples
    params = dict(model.params, draft={"shortlist": jnp.asarray([0, 2, 3, 5], jnp.int32)})
    spec = generate_speculative(params, model.config, ids, 3, drafter=drafter, gamma=2, max_len=ids.shape[1] + 6,
                                sampling=SamplingConfig(temperature=1.0), seed=2, eos_ids=(), state_dtype=jnp.float32)
    assert 0.2 < spec.stats["mean_accepted"] < 1.9  # both the rejection path and the accept path ran
    assert_first_tokens_match(ar, spec.tokens, model.vocab_size)


@pytest.mark.parametrize("method,options,match", [
    ("partial-mlp", {"mlp_keep": 0}, r"mlp_keep must be a fraction in \(0, 1\]"),
    ("partial-mlp", {"mlp_keep": 1.5}, r"mlp_keep must be a fraction in \(0, 1\].*got 1.5"),
    ("partial-mlp", {"mlp_keep": "half"}, "mlp_keep must be a fraction"),
    ("partial-mlp", {"mlp_keep": True}, "mlp_keep must be a fraction"),
    ("partial-mlp", {"skip_layers": (1,)}, r"unknown options \['skip_layers'\]"),
    ("layer-skip", {"skip_layers": (8,)}, r"skip_layers: layer 8 is out of range; the model has layers 0..7"),
    ("layer-skip", {"skip_layers": (-1,)}, "skip_layers: layer -1 is out of range"),
    ("residual-reuse", {"skip_layers": (2, 2)}, r"skip_layers repeats a layer: \[2, 2\]"),
    ("layer-skip", {"skip_layers": tuple(range(8))}, "skip_layers skips every one of the model's 8 layers"),
    ("layer-skip", {"skip_layers": ()}, "skip_layers is empty"),
    ("layer-skip", {"skip_layers": "3"}, "skip_layers must be a list of layer indices"),
    ("residual-reuse", {"skip_layers": (1.5,)}, "skip_layers must hold integer layer indices"),
    ("layer-skip", {"mlp_keep": 0.5}, r"unknown options \['mlp_keep'\]"),
    ("layer-skip", {"shortlist_size": -1}, r"shortlist_size must be >= 0; got -1"),
    ("partial-mlp", {"shortlist_size": 10 ** 6}, r"shortlist_size must be in \[0, \d+\] \(the stored shortlist\)"),
    ("residual-reuse", {"shortlist_size": 2.5}, "shortlist_size must be an integer"),
    ("layer-skip", {"unroll_drafts": 1}, r"unroll_drafts must be True or False; got 1"),
])
def test_bad_self_draft_options_are_one_clear_error(method, options, match, monkeypatch):
    from specdec_jax.decoding import speculative
    model, ids = _shipped()
    monkeypatch.setattr(speculative, "run_spec_loop", lambda *a, **k: pytest.fail("computed before the error"))
    with pytest.raises(InputError, match=match):
        sj.generate(model, ids, 4, method=method, **options)


def test_a_scanned_draft_chain_drafts_as_the_unrolled_one(small_vocab_model):
    """unroll=False compiles the chain as a loop: the same drafts and the same provisional K/V writes."""
    import dataclasses
    cfg, params = small_vocab_model.config, small_vocab_model.params
    prompt = jnp.asarray([[1, 2, 3, 1, 2], [4, 0, 5, 2, 2]], jnp.int32)
    base = SelfDrafter("layer-skip", skip_layers=(0,))
    # jitted, as inside a generation (op by op, each of the draft model's ops would compile on its own)
    state = jax.jit(functools.partial(base.init, cfg=cfg, max_len=16))(params, prompt=prompt, first_token=prompt[:, 0])
    history = jnp.concatenate([prompt, jnp.zeros((2, 11), jnp.int32)], axis=1)
    out = {}
    for unroll in (True, False):
        propose = jax.jit(functools.partial(dataclasses.replace(base, unroll=unroll).propose, cfg=cfg, gamma=4))
        out[unroll] = propose(params, state=state, history=history, hist_len=jnp.full((2,), 5), key=jax.random.PRNGKey(0))
        loops = while_loops(propose.lower(params, state=state, history=history, hist_len=jnp.full((2,), 5), key=jax.random.PRNGKey(0)).compile().as_text())
        assert bool(loops) != unroll, loops  # the chain is a loop only when rolled
    np.testing.assert_array_equal(out[True][0], out[False][0])
    for a, b in zip(out[True][2]["model"].keys + out[True][2]["model"].values,
                    out[False][2]["model"].keys + out[False][2]["model"].values):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_shortlist_drafts_come_from_the_shortlist_and_the_output_is_ar():
    """shortlist_size: greedy output still AR's (fp32), every draft of a 3-token shortlist is one of those 3."""
    model, ids = _shipped()
    out = sj.generate(model, ids, 24, method="layer-skip", shortlist_size=2048, eos_token_id=False)
    np.testing.assert_array_equal(out.tokens, _ar(24))
    assert out.stats["mean_accepted"] > 0.3  # drafts from the shortlist head are real guesses (garbage: ~0)
    drafter = SelfDrafter("layer-skip", skip_layers=default_skip_layers(8), shortlist_size=3, unroll=False)

    @jax.jit  # as inside a generation (op by op, each of the forward's ops would compile on its own)
    def draft(params, prompt):
        dstate = drafter.init(params, model.config, prompt[:, :-1], 64, first_token=prompt[:, -1])
        return drafter.propose(params, model.config, dstate, None, None, 4, jax.random.PRNGKey(0))[0]

    drafts = draft(model.params, jnp.asarray(ids, jnp.int32))
    allowed = set(np.asarray(model.params["draft"]["shortlist"][:3]).tolist())
    assert set(np.asarray(drafts).ravel().tolist()) <= allowed


def test_shortlist_needs_a_stored_shortlist(small_vocab_model):
    with pytest.raises(InputError, match=r"shortlist_size=8 needs the checkpoint's token shortlist"):
        sj.generate(small_vocab_model, [[1, 2]], 4, method="layer-skip", shortlist_size=8)


def test_default_skip_layers_is_the_middle_quarter():
    assert default_skip_layers(8) == (3, 4)
    assert default_skip_layers(32) == tuple(range(12, 20))
    assert default_skip_layers(2) == (1,) and default_skip_layers(4) == (1,)
