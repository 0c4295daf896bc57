"""Tree speculative decoding on Qwen3.5: tree forward == per-path forward, greedy tree spec == AR,
committed state == AR state, Tree-WY and snapshot rollback agree, n-gram and MTP tree drafters."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.decoding import tree_spec as ts
from specdec_jax.drafters.tree import TreeMtpDrafter, TreeNgramDrafter, candidate_ids, ngram_candidates, \
    sibling_rank
from specdec_jax.models import qwen35
from tests import qwen_helpers as H


_forward = jax.jit(qwen35.forward, static_argnames=("cfg",))
_tree_forward = jax.jit(ts.tree_forward, static_argnames=("cfg", "parents", "depth", "impl", "collect"))


_commit = jax.jit(ts.tree_commit, static_argnames=("parents",))


def _tf(params, cfg, state, nodes, parents, depth, **kw):
    """Jitted tree_forward (static tree as tuples)."""
    return _tree_forward(params, cfg, state, nodes, tuple(parents.tolist()), tuple(depth.tolist()), **kw)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ref = H.build_reference(H.tiny_text_config(ratio=2, vocab=61), seed=21)
    folder = str(tmp_path_factory.mktemp("tree"))
    H.save_reference(ref, folder)
    return sj.load(folder, dtype="float32")


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    ref = H.build_reference(H.tiny_text_config(ratio=2, vocab=61), seed=5)
    folder = str(tmp_path_factory.mktemp("tree_mtp"))
    H.save_reference(ref, folder, mtp_layers=1, seed=31)
    return sj.load(folder, dtype="float32")


@dataclasses.dataclass(frozen=True)
class OracleTreeDrafter:
    """Test drafter: the true continuation on one branch per level (which sibling rotates with the
    position), wrong tokens on the others; every branch wrong where (position % miss_every == row)."""

    reference: tuple  # per row: prompt + continuation
    miss_every: int
    vocab: int
    name = "oracle"

    def init(self, params, cfg, prompt, max_len, **_):
        return ()

    def update(self, drafter_state, **_):
        return drafter_state

    def propose_tree(self, params, cfg, drafter_state, history, hist_len, parents, depth, key):
        ref = jnp.asarray(self.reference, jnp.int32)
        depth = jnp.asarray(depth)
        pos = hist_len[:, None] - 1 + depth[None, :]  # [B, N]: position of each node's token
        true = jnp.take_along_axis(ref, jnp.clip(pos, 0, ref.shape[1] - 1), axis=1)
        parents = np.asarray(parents)
        n_sib = np.bincount(parents[1:], minlength=parents.shape[0])[np.maximum(parents, 0)]
        rank = jnp.asarray(sibling_rank(parents))
        good = rank[None, :] == pos % jnp.asarray(np.maximum(n_sib, 1))[None, :]
        rows = jnp.arange(ref.shape[0])[:, None]
        good &= (pos % self.miss_every) != (rows % self.miss_every)
        return jnp.where(good, true, (true + 1 + rank[None, :]) % self.vocab), drafter_state


def _oracle(model, ids, n, miss_every=5):
    ar = sj.generate(model, ids, n, eos_token_id=False).tokens
    reference = tuple(map(tuple, np.concatenate([ids, ar], axis=1).tolist()))
    return ar, OracleTreeDrafter(reference, miss_every, model.vocab_size)


def test_tree_shapes():
    parents, depth = ts.tree_from_branching((4, 2, 2, 1))
    assert parents.shape == (1 + 4 + 8 + 16 + 16,)
    assert np.all(parents[1:] < np.arange(1, parents.shape[0])) and parents[0] == -1
    np.testing.assert_array_equal(depth, ts.tree_depth(parents))
    p, d = ts.tree_from_branching((1, 1, 1))
    np.testing.assert_array_equal(p, [-1, 0, 1, 2])
    np.testing.assert_array_equal(d, [0, 1, 2, 3])
    table = ts.path_table(parents)
    for i in range(parents.shape[0]):
        j = i
        for dd in range(depth[i], -1, -1):
            assert table[i, dd] == j
            j = parents[j]
    cid, n = candidate_ids(ts.tree_from_branching((3, 2))[0])
    assert n == 6 and cid[1] == 0 and cid[4] == 0  # first children follow the parent's candidate


def test_chain_tree_equals_forward(model):
    cfg, params = model.config, model.params
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(2, 9)), jnp.int32)
    state = qwen35.init_state(cfg, 2, 32, jnp.float32)
    _, state, _ = _forward(params, cfg, state, prompt)
    parents, depth = ts.tree_from_branching((1,) * 6)
    nodes = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(2, 7)), jnp.int32)
    got, verified, _ = _tf(params, cfg, state, nodes, parents, depth, impl="reference")
    want, want_state, _ = _forward(params, cfg, state, nodes)
    assert H.rel_err(got, want) <= 1e-5
    for a, b in zip(verified.keys + verified.values, want_state.keys + want_state.values):
        assert H.rel_err(a[:, :16], b[:, :16]) <= 1e-5


def test_tree_forward_and_commit_equal_per_path_forward(model):
    """Every node's logits are those of the plain forward over its root path, and committing the node
    gives that forward's state (Tree-WY and snapshot rollback, which therefore agree)."""
    cfg, params = model.config, model.params
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(2, 5)), jnp.int32)
    state = qwen35.init_state(cfg, 2, 32, jnp.float32)
    _, state, _ = _forward(params, cfg, state, prompt)
    parents, depth = ts.tree_from_branching((2, 2, 1))
    nodes = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(2, parents.shape[0])), jnp.int32)
    table = ts.path_table(parents)
    verify = {r: _tf(params, cfg, state, nodes, parents, depth, collect=r) for r in ("pseudo", "snapshot")}
    for i in range(parents.shape[0]):
        path = table[i, :depth[i] + 1]
        want_logits, want, _ = _forward(params, cfg, state, nodes[:, path])
        committed = []
        for rollback, (logits, verified, extras) in verify.items():
            assert H.rel_err(logits[:, i], want_logits[:, -1]) <= 1e-5, i
            acc = jnp.full((2,), i, jnp.int32)
            got = _commit(state, verified, extras, tuple(parents.tolist()), acc, jnp.asarray(table)[acc],
                          jnp.full((2,), depth[i] + 1, jnp.int32))
            committed.append(got)
            np.testing.assert_array_equal(got.length, want.length)
            L = int(want.length[0])
            for a, b in zip(got.keys + got.values, want.keys + want.values):
                assert H.rel_err(a[:, :L], b[:, :L]) <= 1e-5
            for a, b in zip(got.conv, want.conv):
                assert H.rel_err(a, b) <= 1e-5
            for a, b in zip(got.recurrent, want.recurrent):
                assert H.rel_err(a, b) <= 1e-5, (rollback, i)
        for a, b in zip(committed[0].recurrent, committed[1].recurrent):
            assert H.rel_err(a, b) <= 1e-5
    # A finished row (n_keep = 0) keeps its state.
    _, verified, extras = verify["pseudo"]
    kept = _commit(state, verified, extras, tuple(parents.tolist()), jnp.asarray([3, 3]),
                   jnp.asarray(table)[jnp.asarray([3, 3])], jnp.asarray([0, 3]))
    for a, b in zip(kept.recurrent + kept.conv, state.recurrent + state.conv):
        np.testing.assert_array_equal(a[0], b[0])
    assert int(kept.length[0]) == int(state.length[0])


@pytest.mark.parametrize("branching,batch,rollback", [
    ((1, 1, 1, 1), 2, "pseudo"),  # chain
    ((4,), 1, "pseudo"),  # star
    ((2, 2, 2), 1, "pseudo"),
    ((3, 2, 1), 2, "snapshot"),
])
def test_greedy_tree_equals_ar(model, branching, batch, rollback):
    ids = np.random.default_rng(len(branching) + batch).integers(0, model.vocab_size, size=(batch, 7))
    ar, drafter = _oracle(model, ids, 24)
    parents, _ = ts.tree_from_branching(branching)
    res = ts.generate_tree(model.params, model.config, ids, 24, drafter=drafter, parents=parents, rollback=rollback)
    np.testing.assert_array_equal(res.tokens, ar)
    dmax = len(branching)
    assert res.stats["mean_accepted"] > 0.5 * min(dmax, 3)  # the right branch really was found
    assert res.stats["verify_steps"] < 24


def test_state_after_tree_generation_equals_ar_state(model):
    ids = np.random.default_rng(9).integers(0, model.vocab_size, size=(2, 6))
    ar, drafter = _oracle(model, ids, 20, miss_every=4)
    parents, _ = ts.tree_from_branching((2, 2, 1))
    for rollback in ("pseudo",):
        res = ts.generate_tree(model.params, model.config, ids, 20, drafter=drafter, parents=parents,
                               rollback=rollback, return_state=True)
        np.testing.assert_array_equal(res.tokens, ar)
        state = res.stats["state"]
        for row in range(2):
            n_out = int(state.n_out[row])
            seq = np.concatenate([ids[row], np.asarray(state.out)[row, : n_out - 1]])[None]
            fresh = qwen35.init_state(model.config, 1, state.model.max_len, jnp.float32)
            _, want, _ = _forward(model.params, model.config, fresh, jnp.asarray(seq))
            got = jax.tree.map(lambda x: x[row:row + 1], state.model)
            np.testing.assert_array_equal(got.length, want.length)
            L = seq.shape[1]
            for a, b in zip(got.recurrent, want.recurrent):
                assert H.rel_err(a, b) <= 1e-5, rollback
            for a, b in zip(got.conv, want.conv):
                assert H.rel_err(a, b) <= 1e-5
            for a, b in zip(got.keys + got.values, want.keys + want.values):
                assert H.rel_err(a[:, :L], b[:, :L]) <= 1e-5


def test_eos_stops_tree_generation(model):
    ids = np.random.default_rng(4).integers(0, model.vocab_size, size=(1, 6))
    free = sj.generate(model, ids, 16, eos_token_id=False).tokens[0]
    eos = int(free[5])
    ar = sj.generate(model, ids, 16, eos_token_id=eos).tokens
    drafter = OracleTreeDrafter((tuple(np.concatenate([ids[0], free]).tolist()),), 7, model.vocab_size)
    parents, _ = ts.tree_from_branching((2, 2, 1))
    res = ts.generate_tree(model.params, model.config, ids, 16, drafter=drafter, parents=parents, eos_ids=(eos,))
    np.testing.assert_array_equal(res.tokens, ar)


def test_ngram_candidates():
    hist = jnp.asarray([5, 1, 2, 7, 1, 2, 8, 3, 1, 2, 0, 0], jnp.int32)
    c = np.asarray(ngram_candidates(hist, jnp.int32(10), 3, 2, max_n=2))
    # suffix (1, 2): matches end at 6 (-> 8, 3) and 3 (-> 7, 1); then the 1-gram "2" has no other start.
    np.testing.assert_array_equal(c[0], [8, 3])
    np.testing.assert_array_equal(c[1], [7, 1])
    np.testing.assert_array_equal(c[2], [2, 2])  # no third candidate: the last token repeated


def test_ngram_tree_drafter_equals_ar(model):
    rng = np.random.default_rng(3)
    repetitive = np.tile(rng.integers(0, model.vocab_size, size=5), 5)[None]
    random = rng.integers(0, model.vocab_size, size=(1, 25))
    ids = np.concatenate([repetitive, random], axis=0)
    ar = sj.generate(model, ids, 20, eos_token_id=False).tokens
    parents, _ = ts.tree_from_branching((3, 1, 1))
    res = ts.generate_tree(model.params, model.config, ids, 20, drafter=TreeNgramDrafter(), parents=parents)
    np.testing.assert_array_equal(res.tokens, ar)


@pytest.mark.parametrize("branching,rollback", [((3, 1, 1), "pseudo")])
def test_mtp_tree_drafter_equals_ar(mtp_model, branching, rollback):
    ids = np.random.default_rng(11).integers(0, mtp_model.vocab_size, size=(2, 9))
    ar = sj.generate(mtp_model, ids, 20, eos_token_id=False).tokens
    parents, _ = ts.tree_from_branching(branching)
    res = ts.generate_tree(mtp_model.params, mtp_model.config, ids, 20, drafter=TreeMtpDrafter(), parents=parents,
                           rollback=rollback)
    np.testing.assert_array_equal(res.tokens, ar)


TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "tiny-qwen35-code")


def test_mtp_tree_on_trained_checkpoint_is_exact_and_beats_chain():
    """Chain MTP (gamma 3..6) accepts ~0.9 drafts per step here; a (4, 2, 1) MTP top-k tree ~1.9."""
    model = sj.load(TINY, dtype="float32")
    ids = np.asarray([[1542, 12, 290, 1239, 11, 2023, 198, 220, 220, 220, 422]]) % model.vocab_size
    ar = sj.generate(model, ids, 48, eos_token_id=False).tokens
    parents, _ = ts.tree_from_branching((4, 2, 1))
    res = ts.generate_tree(model.params, model.config, ids, 48, drafter=TreeMtpDrafter(), parents=parents)
    np.testing.assert_array_equal(res.tokens, ar)
    assert res.stats["mean_accepted"] > 1.3


def test_tree_methods_through_the_public_api(tmp_path):
    """generate(method="mtp-tree" | "ngram-tree", tree=...) is exact, and sampling is refused clearly."""
    from specdec_jax.errors import InputError
    ref = H.build_reference(H.tiny_text_config(ratio=2, vocab=41), seed=13)
    H.save_reference(ref, str(tmp_path), mtp_layers=1, seed=13)
    model = sj.load(tmp_path, dtype="float32")
    ids = np.random.default_rng(0).integers(0, model.vocab_size, size=(2, 7))
    ar = sj.generate(model, ids, 16, eos_token_id=False).tokens
    for method, tree in (("mtp-tree", (2, 2)), ("ngram-tree", (3, 1))):
        out = sj.generate(model, ids, 16, method=method, tree=tree, eos_token_id=False)
        np.testing.assert_array_equal(out.tokens, ar)
    with pytest.raises(InputError, match="greedy decoding only"):
        sj.generate(model, ids, 4, method="mtp-tree", temperature=1.0)
    with pytest.raises(InputError, match="at most 64"):
        sj.generate(model, ids, 4, method="ngram-tree", tree=(8, 8))
