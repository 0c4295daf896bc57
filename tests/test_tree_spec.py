"""Tree speculative decoding on Qwen3.5: tree forward == per-path forward, greedy tree spec == AR,
committed state == AR state, Tree-WY and snapshot rollback agree, n-gram and MTP tree drafters,
exact tree sampling (the acceptance rule against enumerated probabilities, end to end against AR)."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.decoding import tree_spec as ts
from specdec_jax.decoding.sampling import SamplingConfig
from specdec_jax.drafters.tree import TreeMtpDrafter, TreeNgramDrafter, candidate_ids, ngram_candidates, \
    sibling_rank
from specdec_jax.models.qwen35 import model as qwen35
from tests import qwen_helpers as H
from tests import stats_helpers
from tests.stats_helpers import assert_first_tokens_match


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
    for a, b in zip((*kept.recurrent, *kept.conv), (*state.recurrent, *state.conv)):
        np.testing.assert_array_equal(a[0], b[0])
    assert int(kept.length[0]) == int(state.length[0])


# Two rows each, as every greedy tree test here: one AR program for them all (a batch of one: the trained checkpoint's
# tree below).
@pytest.mark.parametrize("branching,batch,rollback", [
    ((1, 1, 1, 1), 2, "pseudo"),  # chain
    ((4,), 2, "pseudo"),  # star
    ((2, 2, 2), 2, "pseudo"),
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
            got = state.model.batch_rows(slice(row, row + 1))
            np.testing.assert_array_equal(got.length, want.length)
            L = seq.shape[1]
            for a, b in zip(got.recurrent, want.recurrent):
                assert H.rel_err(a, b) <= 1e-5, rollback
            for a, b in zip(got.conv, want.conv):
                assert H.rel_err(a, b) <= 1e-5
            for a, b in zip(got.keys + got.values, want.keys + want.values):
                assert H.rel_err(a[:, :L], b[:, :L]) <= 1e-5


def test_eos_stops_tree_generation(model):
    ids = np.random.default_rng(4).integers(0, model.vocab_size, size=(2, 6))
    free = sj.generate(model, ids, 16, eos_token_id=False).tokens
    eos = int(free[0, 5])  # row 0 stops at its sixth token, row 1 where it meets it (if it does)
    ar = sj.generate(model, ids, 16, eos_token_id=eos).tokens
    drafter = OracleTreeDrafter(tuple(tuple(np.concatenate([i, f]).tolist()) for i, f in zip(ids, free)), 7,
                                model.vocab_size)
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


# The two tree drafters through the public API (generate(method="ngram-tree" | "mtp-tree", tree=...): the tree loop
# the direct generate_tree calls here run, at the bucketed shapes), so each drafter's greedy program compiles once.
def test_ngram_tree_drafter_equals_ar(model):
    rng = np.random.default_rng(3)
    repetitive = np.tile(rng.integers(0, model.vocab_size, size=5), 5)[None]
    random = rng.integers(0, model.vocab_size, size=(1, 25))
    ids = np.concatenate([repetitive, random], axis=0)
    ar = sj.generate(model, ids, 20, eos_token_id=False).tokens
    res = sj.generate(model, ids, 20, method="ngram-tree", tree=(3, 1, 1), eos_token_id=False)
    assert res.stats["method"] == "tree-ngram"
    np.testing.assert_array_equal(res.tokens, ar)


TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "tiny-qwen35-code")


def test_mtp_tree_on_trained_checkpoint_is_exact_and_beats_chain():
    """generate(method="mtp-tree") at its default tree (4, 2, 1), greedy: AR's tokens. Chain MTP (gamma 3..6) accepts
    ~0.9 drafts per step here; the MTP top-k tree ~1.9."""
    model = sj.load(TINY, dtype="float32")
    ids = np.asarray([[1542, 12, 290, 1239, 11, 2023, 198, 220, 220, 220, 422]]) % model.vocab_size
    ar = sj.generate(model, ids, 48, eos_token_id=False).tokens
    res = sj.generate(model, ids, 48, method="mtp-tree", eos_token_id=False)
    assert res.stats["method"] == "tree-mtp"
    np.testing.assert_array_equal(res.tokens, ar)
    assert res.stats["mean_accepted"] > 1.3


def test_an_oversized_tree_is_refused(model):
    """Oversized trees are refused clearly (that generate(method="mtp-tree" | "ngram-tree", tree=...) is exact:
    test_ngram_tree_drafter_equals_ar, test_mtp_tree_on_trained_checkpoint_is_exact_and_beats_chain)."""
    from specdec_jax.errors import InputError
    with pytest.raises(InputError, match="at most 64"):
        sj.generate(model, np.ones((2, 7), np.int32), 4, method="ngram-tree", tree=(8, 8))


# -------------------------------------------------------------------------------- tree sampling

def _chi2_gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of counts [K] to exact probabilities [K]; 0 if a probability-0
    category was observed."""
    n = counts.sum()
    if np.any(counts[probs <= 0] > 0):
        return 0.0
    keep = probs > 0
    expected = n * probs[keep]
    stat = float(np.sum((counts[keep] - expected) ** 2 / expected))
    return float(jax.scipy.special.gammaincc((int(keep.sum()) - 1) / 2, stat / 2))


def _exact_emissions(node_ids, probs, parents) -> dict:
    """Enumerated distribution of what one tree step emits when sampling the target alone: draw from
    p at the current node; a token equal to one of its children's (the first such child) moves there
    and continues, any other token (or any token at a leaf) ends the step. {token tuple: probability}."""
    kids = ts.children_table(parents)
    out: dict = {}

    def walk(node, prefix, mass):
        for t, pt in enumerate(probs[node]):
            if pt <= 0:
                continue
            child = next((c for c in kids[node] if c >= 0 and node_ids[c] == t), None)
            if child is None:
                out[prefix + (t,)] = out.get(prefix + (t,), 0.0) + mass * pt
            else:
                walk(child, prefix + (t,), mass * pt)

    walk(0, (), 1.0)
    return out


def _emitted(node_ids, node, n_acc, next_token, path) -> list:
    """Per sample: the accepted path's tokens then next_token (what the step emits)."""
    toks = node_ids[path[:, 1:]]  # [S, Dmax]
    return [tuple(toks[s, :n_acc[s]].tolist()) + (int(next_token[s]),) for s in range(node.shape[0])]


def _fit_pvalue(samples: list, exact: dict, prefix_len: int) -> float:
    """Goodness of fit of the samples' first prefix_len tokens to the exact distribution, both truncated."""
    cut = lambda seq: seq[:prefix_len]
    probs: dict = {}
    for seq, pr in exact.items():
        probs[cut(seq)] = probs.get(cut(seq), 0.0) + pr
    cats = sorted(set(probs) | {cut(s) for s in samples})
    index = {c: i for i, c in enumerate(cats)}
    counts = np.bincount([index[cut(s)] for s in samples], minlength=len(cats))
    return _chi2_gof_pvalue(counts, np.asarray([probs.get(c, 0.0) for c in cats]))


# A hand-made tree over V = 5: root children 2, 2 (duplicate), 4; node 1 (token 2) has children 1, 3,
# node 3 (token 4) one child 0. Row 0: p at node 1 is top-k-like (token 1, its first child's, has p = 0).
# Row 1: other tokens (a duplicate at depth 2 too) and a root p that is zero on a child token.
_PARENTS = np.asarray([-1, 0, 0, 0, 1, 1, 3], np.int32)
_NODES = np.asarray([[0, 2, 2, 4, 1, 3, 0],
                     [1, 0, 3, 1, 2, 2, 4]], np.int32)
_P = np.asarray([
    [[0.10, 0.30, 0.25, 0.05, 0.30], [0.40, 0.00, 0.30, 0.30, 0.00], [0.20, 0.20, 0.20, 0.20, 0.20],
     [0.50, 0.10, 0.10, 0.10, 0.20], [0.05, 0.05, 0.05, 0.05, 0.80], [0.30, 0.30, 0.20, 0.10, 0.10],
     [0.00, 0.00, 1.00, 0.00, 0.00]],
    [[0.35, 0.25, 0.00, 0.30, 0.10], [0.10, 0.20, 0.60, 0.05, 0.05], [0.25, 0.25, 0.25, 0.25, 0.00],
     [0.20, 0.20, 0.20, 0.20, 0.20], [0.60, 0.10, 0.10, 0.10, 0.10], [0.00, 0.50, 0.00, 0.50, 0.00],
     [0.10, 0.20, 0.30, 0.40, 0.00]],
], np.float32)


def _tree_samples(rule, n: int, seed: int = 0):
    """rule(node_ids [B, N], p [B, N, V], key) -> acceptance tuple; vmapped over n keys."""
    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    out = jax.jit(jax.vmap(lambda k: rule(jnp.asarray(_NODES), jnp.asarray(_P), k)))(keys)
    return [np.asarray(o) for o in out]  # each [n, B, ...]


def test_sampling_tree_accept_exact_distribution():
    """Emitted tokens of one step follow the target: first token ~ p[root]; (t1, t2) ~ p[root](t1)
    p[child(t1)](t2) when t1 is a child's token (else t1 alone); the whole emission as enumerated.
    Wrong rules (children always accepted; next token from p ignoring the rejections) fail."""
    depth = ts.tree_depth(_PARENTS)
    n = 40_000
    rule = lambda nodes, p, k: ts.sampling_tree_accept(nodes, p, _PARENTS, depth, k)
    node, n_acc, nxt, path = _tree_samples(rule, n)
    np.testing.assert_array_equal(n_acc, depth[node])
    np.testing.assert_array_equal(path, ts.path_table(_PARENTS)[node])
    assert not np.any(node[:, 0] == 2) and not np.any(node[:, 1] == 5)  # duplicate siblings: never accepted
    for row in range(_NODES.shape[0]):
        exact = _exact_emissions(_NODES[row], _P[row], _PARENTS)
        assert abs(sum(exact.values()) - 1) < 1e-6
        # Sanity of the enumeration itself: the first token's marginal is p[root].
        first = np.zeros(5)
        for seq, pr in exact.items():
            first[seq[0]] += pr
        np.testing.assert_allclose(first, _P[row, 0], atol=1e-6)
        samples = _emitted(_NODES[row], node[:, row], n_acc[:, row], nxt[:, row], path[:, row])
        assert max(len(s) for s in samples) == 3  # depth-2 acceptances happened
        for prefix_len in (1, 2, 3):
            assert _fit_pvalue(samples, exact, prefix_len) > 1e-3, (row, prefix_len)

    # Negative controls on the same test.
    def always_accept(nodes, p, k):  # first child at every level, next token from p there
        first_child = ts.children_table(_PARENTS)[:, 0]
        walk = [0]
        while first_child[walk[-1]] >= 0:
            walk.append(int(first_child[walk[-1]]))
        leaf = jnp.full((nodes.shape[0],), walk[-1], jnp.int32)
        tok = jax.random.categorical(k, jnp.log(p[:, walk[-1]]), axis=-1).astype(jnp.int32)
        return leaf, jnp.asarray(depth)[leaf], tok, jnp.asarray(ts.path_table(_PARENTS))[leaf]

    def no_residual(nodes, p, k):  # right acceptances, but next token from p at the node
        k1, k2 = jax.random.split(k)
        node, n_acc, _, path = ts.sampling_tree_accept(nodes, p, _PARENTS, depth, k1)
        p_node = jnp.take_along_axis(p, node[:, None, None], axis=1)[:, 0]
        return node, n_acc, jax.random.categorical(k2, jnp.log(p_node), axis=-1).astype(jnp.int32), path

    for wrong in (always_accept, no_residual):
        node, n_acc, nxt, path = _tree_samples(wrong, n, seed=1)
        samples = _emitted(_NODES[0], node[:, 0], n_acc[:, 0], nxt[:, 0], path[:, 0])
        assert _fit_pvalue(samples, _exact_emissions(_NODES[0], _P[0], _PARENTS), 3) < 1e-6, wrong.__name__


def test_sampling_tree_accept_point_masses():
    """Point-mass targets: a child whose token has p = 1 is always accepted, one with p = 0 never is
    (the next sibling then is, from the residual), and the leaf's one-hot p gives the next token."""
    parents = np.asarray([-1, 0, 0, 1, 2], np.int32)
    depth = ts.tree_depth(parents)
    nodes = jnp.asarray([[0, 3, 1, 2, 0], [0, 1, 3, 0, 2]], jnp.int32)
    p = jnp.zeros((2, 5, 4)).at[:, 0, 1].set(1.0).at[:, 1:, 2].set(1.0)  # root: token 1; others: token 2
    keys = jax.random.split(jax.random.PRNGKey(0), 256)
    rule = jax.jit(jax.vmap(lambda k: ts.sampling_tree_accept(nodes, p, parents, depth, k)))
    node, n_acc, nxt, _ = (np.asarray(x) for x in rule(keys))
    # Row 0: token 3 rejected, token 1 (node 2) accepted, then node 4 (token 0) rejected: next = 2.
    # Row 1: node 1 (token 1) accepted, node 3 (token 0) rejected: next = 2.
    np.testing.assert_array_equal(node, np.broadcast_to([2, 1], node.shape))
    np.testing.assert_array_equal(n_acc, np.ones_like(n_acc))
    np.testing.assert_array_equal(nxt, np.full_like(nxt, 2))


@pytest.fixture(scope="module")
def small_vocab_mtp_model(tmp_path_factory):
    return H.small_vocab_model(str(tmp_path_factory.mktemp("tree_v6")), mtp_layers=1, mtp_seed=7)


@pytest.fixture(scope="module")
def ar_samples(small_vocab_mtp_model):
    """AR's first 3 tokens of the 20,000 rows below (seed 1): one draw, which each tree sampling test compares with
    (it is deterministic, so each test drawing it again would get the same tokens)."""
    ids = np.tile(np.asarray([[1, 2, 3, 1, 2]]), (20_000, 1))
    return ids, stats_helpers.ar_samples(small_vocab_mtp_model, ids, 3, temperature=0.9, top_k=5)


@pytest.mark.parametrize("drafter", [TreeNgramDrafter(), TreeMtpDrafter()], ids=["ngram", "mtp"])
def test_tree_sampling_preserves_distribution(small_vocab_mtp_model, ar_samples, drafter):
    """First 3 tokens of 20,000 rows (one batch, ragged acceptance): tree sampling == AR sampling."""
    model = small_vocab_mtp_model
    V = model.vocab_size
    ids, ar = ar_samples
    sampling = SamplingConfig(temperature=0.9, top_k=5)
    parents, _ = ts.tree_from_branching((2, 2))
    tree = ts.generate_tree(model.params, model.config, ids, 3, drafter=drafter, parents=parents, sampling=sampling,
                            seed=2)
    assert tree.stats["mean_accepted"] > 0.2  # acceptances and rejections both happened
    assert_first_tokens_match(ar, tree.tokens, V)
