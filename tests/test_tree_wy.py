"""Tree-WY (pallas_kernels/gated_delta/tree_wy.py): every node equals the recurrence along its root path.

Ground truth is `tree_gated_delta_rule_naive`: `naive_recurrent_gated_delta_rule` run along each
root-to-node path. Implementations "reference" (jnp) and "pallas" (interpret mode on CPU: outputs
are NaN-filled before the kernel runs, so "all finite" also means "every element was written").
Trees: single root, random (deep and bushy), chains (also equal to the chain WY form), stars,
4-ary; N in {1, 5, 16, 37, 64}; HV/H in {1, 2, 3}; gates mostly mild with strong decay down to -20.
Relative error ||a - b|| / ||b|| <= 1e-5 for fp32 (2e-2 for bf16 inputs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import reference
from pallas_kernels.gated_delta import tree_wy as tw
from tests.gdn_inputs import make_inputs, rel_err

IMPLS = ["reference", "pallas"]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _check(name, got, want, tol):
    assert got is not None, f"{name} missing"
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.isfinite(np.asarray(got).astype(np.float32)).all(), f"{name}: non-finite (unwritten) elements"
    err = rel_err(got, want)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


def make_parents(kind: str, n: int, seed: int) -> np.ndarray:
    """Topologically ordered parents [N] (root 0 has -1)."""
    rng = np.random.default_rng(seed)
    idx = np.arange(n)
    if kind == "chain":
        p = idx - 1
    elif kind == "star":
        p = np.where(idx > 0, 0, -1)
    elif kind == "4ary":
        p = (idx - 1) // 4
    elif kind == "random":  # half the nodes extend the previous one (deep paths), half branch anywhere
        p = np.array([-1] + [i - 1 if rng.random() < 0.5 else int(rng.integers(0, i)) for i in range(1, n)])
    else:
        raise ValueError(kind)
    p[0] = -1
    return p.astype(np.int32)


def naive_tree(q, k, v, g, beta, parents, *, initial_state, **options):
    """The ground truth as one compiled program (its root paths come from the concrete parents, closed over);
    eagerly, each of its jnp ops would compile on its own per shape."""
    run = lambda q, k, v, g, beta, s0: tw.tree_gated_delta_rule_naive(q, k, v, g, beta, parents, initial_state=s0,
                                                                       **options)
    return jax.jit(run)(q, k, v, g, beta, initial_state)


# The op under test, jitted as the model runs it (parents traced).
tree = jax.jit(tw.tree_gated_delta_rule, static_argnames=("scale", "use_qk_l2norm", "implementation", "interpret"))


def _kw(impl):
    return dict(implementation="pallas", interpret=True) if impl == "pallas" else dict(implementation=impl)


# (B, N, H, HV, K, V, tree kind, dtype, in-kernel q/k L2 norm, fraction of strong gates).
# B = 2 rows get different trees (row 1 uses seed + 1), except for chains and stars.
TREE_CASES = [
    (1, 1, 1, 1, 16, 16, "chain", jnp.float32, False, 0.1),
    (2, 5, 1, 2, 32, 32, "random", jnp.float32, True, 0.1),
    (1, 16, 1, 3, 48, 40, "star", jnp.float32, False, 0.1),
    (1, 16, 2, 2, 32, 32, "chain", jnp.float32, True, 0.5),
    (2, 37, 1, 3, 32, 32, "4ary", jnp.float32, False, 0.3),
    (1, 64, 2, 4, 64, 64, "random", jnp.float32, True, 0.1),
    (1, 64, 1, 3, 32, 16, "chain", jnp.float32, False, 0.5),
    (1, 64, 1, 2, 64, 64, "star", jnp.float32, True, 0.3),
    (2, 24, 1, 2, 64, 64, "random", jnp.bfloat16, True, 0.1),
]
_case_id = lambda c: "B{}_N{}_H{}_HV{}_K{}_V{}_{}_{}_l2{}_strong{}".format(*c[:7], jnp.dtype(c[7]).name, int(c[8]),
                                                                          c[9])


def _parents_for(case, seed):
    b, n, kind = case[0], case[1], case[6]
    rows = [make_parents(kind, n, seed + r) for r in range(b)]
    return np.stack(rows) if b > 1 and kind in ("random",) else rows[0]


@functools.lru_cache(maxsize=None)
def _case_data(case):
    """Inputs, parents and the per-path ground truth of one case (shared by both implementations)."""
    b, n, h, hv, k_dim, v_dim, kind, dtype, l2, strong = case
    seed = 1000 + n + hv
    x = make_inputs(b, n, h, hv, k_dim, v_dim, dtype, seed=seed, normalize_k=not l2, strong=strong)
    parents = _parents_for(case, seed)
    want = naive_tree(x["q"], x["k"], x["v"], x["g"], x["beta"], parents, initial_state=x["s0"], use_qk_l2norm=l2,
                      return_node_states=True)
    return x, parents, want


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", TREE_CASES, ids=_case_id)
def test_tree_matches_every_root_path(impl, case):
    dtype, l2, kind = case[7], case[8], case[6]
    x, parents, want = _case_data(case)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], parents)
    got = tree(*args, initial_state=x["s0"], use_qk_l2norm=l2, **_kw(impl))
    tol = TOL[dtype]
    assert got.o.dtype == dtype and got.final_state is None
    _check("o", got.o, want.o, tol)
    _check("v_new", got.v_new, want.v_new, tol)
    _check("g_cumsum (path gammas)", got.g_cumsum, want.g_cumsum, 1e-6)
    if kind == "chain":  # a chain is the chain WY form: same outputs and pseudo-values
        chain = jax.jit(functools.partial(reference.chunk_gated_delta_rule_reference, return_pseudo_values=True,
                                          use_qk_l2norm=l2))(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                             initial_state=x["s0"])
        _check("o vs chain WY", got.o, chain.o, tol)
        _check("v_new vs chain WY", got.v_new, chain.v_new, tol)
        _check("g_cumsum vs chain", got.g_cumsum, chain.g_cumsum, 1e-6)


def test_naive_tree_equals_chain_recurrence():
    """Sanity of the ground truth itself: on a chain the per-path runs are the one sequential run."""
    x = make_inputs(1, 12, 1, 2, 16, 16, seed=5)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    seq = reference.naive_recurrent_gated_delta_rule(*args, initial_state=x["s0"], return_pseudo_values=True,
                                                     return_all_states=True)
    tree = tw.tree_gated_delta_rule_naive(*args, make_parents("chain", 12, 0), initial_state=x["s0"],
                                          return_node_states=True)
    for name in ("o", "v_new", "g_cumsum", "all_states"):
        _check(name, getattr(tree, name), getattr(seq, name), 1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_parents_traced_one_compilation(impl):
    """Different trees of the same size run through one compiled function (parents are data)."""
    b, n, h, hv, k_dim, v_dim = 2, 16, 1, 2, 32, 32
    x = make_inputs(b, n, h, hv, k_dim, v_dim, seed=77)
    fn = jax.jit(lambda par, s0: tw.tree_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], par,
                                                          initial_state=s0, **_kw(impl)))
    for kind, seed in (("random", 1), ("star", 2), ("4ary", 3)):
        par = np.stack([make_parents(kind, n, seed), make_parents("random", n, seed + 10)])
        want = tw.tree_gated_delta_rule_naive(x["q"], x["k"], x["v"], x["g"], x["beta"], par, initial_state=x["s0"])
        got = fn(jnp.asarray(par), x["s0"])
        _check(f"o ({kind})", got.o, want.o, 1e-5)
        _check(f"v_new ({kind})", got.v_new, want.v_new, 1e-5)
    assert fn._cache_size() == 1


COMMIT_CASES = [(2, 16, 1, 2, 32, 32, "random", False), (1, 64, 2, 4, 64, 64, "random", True),
                (2, 37, 1, 3, 32, 24, "4ary", False)]


@pytest.mark.parametrize("case", COMMIT_CASES, ids=lambda c: "B{}_N{}_H{}_HV{}_K{}_V{}_{}_l2{}".format(
    *c[:7], int(c[7])))
def test_commit_every_node(case):
    """tree_commit_state(a) == the sequential state after a's root path, for every node a (and a = -1: S0),
    from one compiled function (accepted_node and parents traced); the snapshot baseline agrees too."""
    b, n, h, hv, k_dim, v_dim, kind, l2 = case
    seed = 300 + n
    x = make_inputs(b, n, h, hv, k_dim, v_dim, seed=seed, normalize_k=not l2, strong=0.3)
    par = np.stack([make_parents(kind, n, seed + r) for r in range(b)]) if kind == "random" else \
        make_parents(kind, n, seed)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], par)
    want = naive_tree(*args, initial_state=x["s0"], use_qk_l2norm=l2, return_node_states=True)
    states = jnp.concatenate([x["s0"][:, None], want.all_states], axis=1)  # [B, 1+N]: index a+1
    verified = tw.tree_gated_delta_rule_reference(*args, initial_state=x["s0"], use_qk_l2norm=l2)
    commit = jax.jit(functools.partial(tw.tree_commit_state, use_qk_l2norm=l2))
    par_j = jnp.asarray(par)
    for a in range(-1, n):
        # Batch rows accept different nodes: row r accepts node (a + 7 r) mod (N + 1) - 1.
        acc = jnp.asarray([(a + 1 + 7 * r) % (n + 1) - 1 for r in range(b)], jnp.int32)
        got = commit(x["s0"], x["k"], x["g"], verified.v_new, par_j, acc)
        _check(f"state after node {acc.tolist()}", got, states[jnp.arange(b), acc + 1], 1e-5)
    assert commit._cache_size() == 1, "accepted_node must be traced: one compilation for every node"
    # The snapshot baseline (one state per node, each from its parent's) is the same set of states.
    snaps = jax.jit(functools.partial(tw.tree_node_states, use_qk_l2norm=l2))(
        x["s0"], x["k"], x["v"], x["g"], x["beta"], par_j)
    _check("tree_node_states", snaps, want.all_states, 1e-5)


def test_commit_after_pallas_verify():
    """The kernel's pseudo-values commit to the sequential state as well (pallas verify -> jnp commit)."""
    b, n, h, hv, k_dim, v_dim = 1, 20, 1, 2, 32, 32
    x = make_inputs(b, n, h, hv, k_dim, v_dim, seed=21)
    par = make_parents("random", n, 21)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], par)
    want = tw.tree_gated_delta_rule_naive(*args, initial_state=x["s0"], return_node_states=True)
    out = tw.tree_gated_delta_rule(*args, initial_state=x["s0"], implementation="pallas", interpret=True)
    commit = jax.jit(tw.tree_commit_state)
    for a in (0, n // 2, n - 1):
        got = commit(x["s0"], x["k"], x["g"], out.v_new, par, jnp.asarray([a], jnp.int32))
        _check(f"state after node {a}", got, want.all_states[:, a], 1e-5)


def test_ancestor_matrix_and_path_gammas():
    par = np.array([-1, 0, 0, 1, 3, 2, 5, 5], np.int32)
    want = np.zeros((8, 8), bool)
    for i in range(8):
        j = i
        while j >= 0:
            want[i, j] = True
            j = par[j]
    np.testing.assert_array_equal(np.asarray(tw.ancestor_matrix(par)), want)
    batched = tw.ancestor_matrix(jnp.stack([par, make_parents("chain", 8, 0)]))
    np.testing.assert_array_equal(np.asarray(batched[0]), want)
    np.testing.assert_array_equal(np.asarray(batched[1]), np.tri(8, dtype=bool))
    # Strong decay: path sums reach -1000s, yet gamma_i - gamma_j near i keeps full precision.
    n = 64
    chain = make_parents("chain", n, 0)
    g = jnp.full((1, n, 1), -20.0).at[0, -1, 0].set(-1e-3)
    expo = tw.path_decay_exponents(tw.ancestor_matrix(chain), g)  # [1, 1, N, N]
    assert float(expo[0, 0, n - 1, n - 2]) == pytest.approx(-1e-3, rel=1e-6)
    assert float(expo[0, 0, n - 1, n - 1]) == 0.0
    assert float(expo[0, 0, 3, 5]) == 0.0  # not an ancestor: masked
    gam = tw.path_gammas(tw.ancestor_matrix(chain), g)
    assert float(gam[0, -1, 0]) == pytest.approx(-20.0 * (n - 1) - 1e-3, rel=1e-6)


def test_speculative_state_bytes():
    """Memory to commit any node of a 64-node tree: k, g, v_new per node vs one state per node."""
    n, hv, k_dim, v_dim = 64, 32, 128, 128
    wy = tw.speculative_state_bytes(n, hv, k_dim, v_dim, "tree-wy")
    snap = tw.speculative_state_bytes(n, hv, k_dim, v_dim, "snapshots")
    assert snap == n * hv * k_dim * v_dim * 4  # 128 MiB per layer
    assert wy == n * hv * (k_dim + v_dim + 1) * 4 + n * 4
    assert snap / wy >= 16  # the target
    assert snap / wy == pytest.approx(63.7, abs=0.1)
    # Shared key heads (Qwen3.5-9B: H = 16 key heads for HV = 32 value heads) store k once per key head.
    wy_gqa = tw.speculative_state_bytes(n, hv, k_dim, v_dim, "tree-wy", h=16)
    assert snap / wy_gqa == pytest.approx(84.9, abs=0.1)
    with pytest.raises(ValueError, match="mode"):
        tw.speculative_state_bytes(n, hv, k_dim, v_dim, "paged")


def test_bad_inputs_raise():
    x = make_inputs(1, 4, 1, 1, 16, 16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="topological"):
        tw.tree_gated_delta_rule(*args, np.array([-1, 2, 0, 1]), initial_state=x["s0"], implementation="reference")
    with pytest.raises(ValueError, match="parents must be"):
        tw.tree_gated_delta_rule(*args, np.array([-1, 0, 0]), initial_state=x["s0"], implementation="reference")
    with pytest.raises(ValueError, match="implementation"):
        tw.tree_gated_delta_rule(*args, np.array([-1, 0, 0, 1]), initial_state=x["s0"], implementation="fast")
    out = tw.tree_gated_delta_rule(*args, np.array([-1, 0, 0, 1]), initial_state=x["s0"], implementation="reference")
    commit_args = (x["s0"], x["k"], x["g"], out.v_new)
    with pytest.raises(ValueError, match="topological"):
        tw.tree_commit_state(*commit_args, np.array([-1, 0, 3, 1]), 2)
    with pytest.raises(ValueError, match=r"accepted_node must lie in \[-1, 3\]"):
        tw.tree_commit_state(*commit_args, np.array([-1, 0, 0, 1]), 4)
    with pytest.raises(ValueError, match="initial_state must be"):
        tw.tree_commit_state(x["s0"][:, :, :8], x["k"], x["g"], out.v_new, np.array([-1, 0, 0, 1]), 1)
    with pytest.raises(ValueError, match="g must be"):
        tw.tree_commit_state(x["s0"], x["k"], x["g"][:, :3], out.v_new, np.array([-1, 0, 0, 1]), 1)
    big = make_inputs(1, 65, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="N <= 64"):
        tw.tree_gated_delta_rule(big["q"], big["k"], big["v"], big["g"], big["beta"], make_parents("chain", 65, 0),
                                 initial_state=big["s0"], implementation="pallas", interpret=True)


def test_auto_dispatch(monkeypatch):
    """auto = pallas on a GPU, reference elsewhere; the environment variable overrides it."""
    monkeypatch.delenv("SPECDEC_GDN_IMPLEMENTATION", raising=False)
    assert tw.default_implementation() == ("pallas" if jax.default_backend() == "gpu" else "reference")
    monkeypatch.setenv("SPECDEC_GDN_IMPLEMENTATION", "pallas")
    assert tw.default_implementation() == "pallas"
