"""One shared suite for every gated-delta implementation, against the naive per-step recurrence.

Implementations: "reference" (jnp) and "pallas" (the GPU kernels, run with interpret=True on CPU;
the Mosaic GPU recurrent kernel too where this jax can interpret it). Pallas interpret mode fills
every kernel output with NaN before the kernel runs, so "all finite" below also means "every
element was written". Inputs have strong decay (g down to -20), L2-normalised or raw keys, fixed
seeds. Tolerances: relative error ||a - b|| / ||b|| <= 1e-5 (fp32), <= 2e-2 (bf16 inputs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gated_delta as gd
from pallas_kernels.gated_delta import pallas_ops, reference
from tests.gdn_inputs import make_inputs, rel_err

IMPLS = ["reference", "pallas"]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _has_mosaic_interpret() -> bool:
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError:
        return False
    return hasattr(plgpu, "InterpretGPUParams")


def _check(name, got, want, tol):
    assert got is not None, f"{name} missing"
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.isfinite(np.asarray(got).astype(np.float32)).all(), f"{name}: non-finite (unwritten) elements"
    err = rel_err(got, want)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


# The ground truth, jitted: one program per shape and options instead of one per jnp op and shape (the same
# per-step recurrence in float32; tests/gdn_inputs.py says why it matters on CPU).
naive = jax.jit(reference.naive_recurrent_gated_delta_rule, static_argnames=(
    "scale", "output_final_state", "return_pseudo_values", "return_all_states", "use_qk_l2norm"))
# The ops under test, jitted as the model runs them (eagerly, their jnp forms would compile op by op).
chunk = jax.jit(gd.chunk_gated_delta_rule, static_argnames=(
    "scale", "output_final_state", "return_pseudo_values", "use_qk_l2norm", "implementation", "interpret"))
recurrent = jax.jit(gd.fused_recurrent_gated_delta_rule, static_argnames=(
    "scale", "output_final_state", "return_pseudo_values", "return_all_states", "use_qk_l2norm", "implementation",
    "interpret"))


def _kw(impl):
    return dict(implementation="pallas", interpret=True) if impl == "pallas" else dict(implementation=impl)


# (B, T, H, HV, K, V, dtype, initial state, in-kernel q/k L2 norm). Every listed T, group size
# HV/H in {1, 2, 3}, K=V in {64, 128} and one odd size appear; big T x big K only once (interpret
# mode is slow).
CHUNK_CASES = [
    (1, 1, 1, 1, 64, 64, jnp.float32, True, False),
    (1, 7, 2, 4, 64, 64, jnp.float32, False, False),
    (2, 63, 1, 3, 64, 64, jnp.float32, True, True),
    (1, 64, 2, 2, 128, 128, jnp.float32, True, True),
    (1, 65, 1, 2, 64, 64, jnp.bfloat16, True, True),
    (1, 200, 1, 3, 48, 40, jnp.float32, True, False),
    (1, 200, 2, 2, 128, 128, jnp.bfloat16, False, True),
    (1, 1000, 1, 1, 64, 64, jnp.float32, True, True),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda c: "B{}_T{}_H{}_HV{}_K{}_V{}_{}_s0{}_l2{}".format(
    *c[:6], jnp.dtype(c[6]).name, int(c[7]), int(c[8])))
def test_chunk_matches_naive(impl, case):
    b, t, h, hv, k_dim, v_dim, dtype, with_s0, l2 = case
    x = make_inputs(b, t, h, hv, k_dim, v_dim, dtype, seed=t, normalize_k=not l2)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    s0 = x["s0"] if with_s0 else None
    want = naive(*args, initial_state=s0, return_pseudo_values=True, use_qk_l2norm=l2)
    got = chunk(*args, initial_state=s0, return_pseudo_values=True, use_qk_l2norm=l2, **_kw(impl))
    tol = TOL[dtype]
    assert got.o.dtype == dtype
    _check("o", got.o, want.o, tol)
    _check("final_state", got.final_state, want.final_state, tol)
    _check("v_new", got.v_new, want.v_new, tol)
    _check("g_cumsum", got.g_cumsum, want.g_cumsum, 1e-6)


RECURRENT_CASES = [
    (1, 1, 1, 1, 64, 64, jnp.float32, True, False),
    (2, 7, 1, 3, 64, 64, jnp.float32, True, True),
    (1, 63, 2, 2, 48, 40, jnp.float32, True, False),
    (1, 64, 1, 4, 128, 128, jnp.float32, True, True),
    (1, 16, 2, 4, 128, 128, jnp.bfloat16, True, True),
    (1, 65, 1, 1, 64, 64, jnp.float32, False, False),
]


_CASE_ID = lambda c: "B{}_T{}_H{}_HV{}_K{}_V{}_{}_s0{}_l2{}".format(*c[:6], jnp.dtype(c[6]).name, int(c[7]),
                                                                    int(c[8]))
# The Mosaic GPU kernel needs K % 64 == 0 and HV % 4 == 0 (other sizes fall back to the Triton kernel);
# its interpret mode is slow, so it gets the small cases.
MOSAIC_CASES = [(1, 5, 1, 4, 64, 64, jnp.float32, True, True), (1, 16, 2, 4, 128, 128, jnp.bfloat16, True, True),
                (2, 3, 4, 8, 128, 32, jnp.float32, False, False)]
_mosaic = dict(backend="mosaic", block_v=16)
RECURRENT_PARAMS = (
    [pytest.param(impl, {}, c, id=f"{impl}-{_CASE_ID(c)}") for impl in IMPLS for c in RECURRENT_CASES]
    + [pytest.param("pallas", _mosaic, c, id=f"pallas-mosaic-{_CASE_ID(c)}", marks=pytest.mark.skipif(
        not _has_mosaic_interpret(), reason="Mosaic GPU interpret mode needs jax >= 0.12")) for c in MOSAIC_CASES])


@pytest.mark.parametrize("impl,extra,case", RECURRENT_PARAMS)
def test_recurrent_matches_naive(impl, extra, case):
    b, t, h, hv, k_dim, v_dim, dtype, with_s0, l2 = case
    x = make_inputs(b, t, h, hv, k_dim, v_dim, dtype, seed=100 + t, normalize_k=not l2)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    s0 = x["s0"] if with_s0 else None
    want = naive(*args, initial_state=s0, return_pseudo_values=True, return_all_states=True, use_qk_l2norm=l2)
    tol = TOL[dtype]
    # Kernel options beyond the shared signature go to pallas_ops directly (the dispatcher has none).
    op = (functools.partial(pallas_ops.fused_recurrent_gated_delta_rule, interpret=True, **extra) if extra
          else functools.partial(recurrent, **_kw(impl)))
    # Pseudo-value mode (what speculative verification uses) ...
    got = op(*args, initial_state=s0, return_pseudo_values=True, use_qk_l2norm=l2)
    _check("o", got.o, want.o, tol)
    _check("final_state", got.final_state, want.final_state, tol)
    _check("v_new", got.v_new, want.v_new, tol)
    _check("g_cumsum", got.g_cumsum, want.g_cumsum, 1e-6)
    if extra:  # snapshots always run on the Triton kernel, tested above
        return
    # ... and the snapshot baseline: one state per position.
    snap = op(*args, initial_state=s0, return_all_states=True, use_qk_l2norm=l2, output_final_state=False)
    assert snap.final_state is None
    _check("all_states", snap.all_states, want.all_states, tol)
    _check("o (snapshot mode)", snap.o, want.o, tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("variant, seed", [({"split_output": False}, 11), ({"wy_solver": "merge"}, 12)],
                         ids=["fused_state_kernel", "merge_solver"])
def test_chunk_kernel_variants(dtype, variant, seed):
    """split_output=False (O inside the sequential chunk loop) and wy_solver="merge" (the triangular
    inverse from products only) compute the same function."""
    x = make_inputs(1, 130, 2, 4, 64, 64, dtype, seed=seed, normalize_k=False)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    want = naive(*args, initial_state=x["s0"], return_pseudo_values=True, use_qk_l2norm=True)
    got = pallas_ops.chunk_gated_delta_rule(*args, initial_state=x["s0"], return_pseudo_values=True,
                                            use_qk_l2norm=True, interpret=True, **variant)
    for name in ("o", "final_state", "v_new"):
        _check(name, getattr(got, name), getattr(want, name), TOL[dtype])


@pytest.mark.parametrize("solver", ["substitution", "merge"])
@pytest.mark.parametrize("similarity", [0.0, 0.9, 1.0])
def test_unit_lower_inverse(solver, similarity):
    """(I + A)^{-1} of the chunk's A, from unrelated to identical keys (where products of A grow)."""
    from pallas_kernels.gated_delta import chunk_kernel
    rng = np.random.default_rng(3)
    k = similarity * rng.standard_normal(128) + (1 - similarity) * rng.standard_normal((64, 128))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    gam = np.cumsum(-0.05 * np.ones(64))
    a = np.tril(0.9 * (k @ k.T) * np.exp(gam[:, None] - gam[None, :]), -1)
    want = np.linalg.inv(np.eye(64) + a)
    got = chunk_kernel.unit_lower_inverse(jnp.asarray(a, jnp.float32), jax.lax.Precision.HIGHEST, solver)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="solver"):
        chunk_kernel.unit_lower_inverse(jnp.asarray(a, jnp.float32), jax.lax.Precision.HIGHEST, "lu")


COMMIT_CASES = [(1, 1, 1, 2, 64, 64, False), (2, 7, 1, 3, 64, 64, True), (1, 64, 2, 2, 128, 128, True),
                (1, 20, 1, 2, 48, 40, False)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", COMMIT_CASES, ids=lambda c: "B{}_T{}_H{}_HV{}_K{}_V{}_l2{}".format(
    c[0], c[1], c[2], c[3], c[4], c[5], int(c[6])))
def test_commit_every_accepted_count(impl, case):
    """commit_state(a) == naive state after a positions, for every a, from one compiled function."""
    b, t, h, hv, k_dim, v_dim, l2 = case
    x = make_inputs(b, t, h, hv, k_dim, v_dim, seed=200 + t, normalize_k=not l2)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    want = naive(*args, initial_state=x["s0"], return_pseudo_values=True, return_all_states=True,
                 use_qk_l2norm=l2)
    commit = jax.jit(functools.partial(gd.commit_state, use_qk_l2norm=l2, **_kw(impl)))
    states = jnp.concatenate([x["s0"][:, None], want.all_states], axis=1)  # [B, T+1, HV, K, V]: after a steps
    for a in range(t + 1):
        # Batch rows accept different counts: row i accepts (a + i) mod (T + 1).
        n = jnp.asarray([(a + i) % (t + 1) for i in range(b)], jnp.int32)
        got = commit(x["s0"], x["k"], x["g"], want.v_new, n)
        _check(f"state after a={n.tolist()}", got, states[jnp.arange(b), n], 1e-5)
    assert commit._cache_size() == 1, "n_accepted must be traced: one compilation for every a"


def _pseudo_replay_inputs(impl, args, s0):
    """((keys as the steps used them, gates, pseudo-values), the state after each position [B, T, HV, K, V]) from one
    recurrent call: what its kernel stores for the pseudo-value replay (a one-layer stack, replay_inputs="new")
    beside the states that replay must reproduce (the same call, so the same keys: on the jnp path a separately
    compiled call may normalise them with other rounding)."""
    run = jax.jit(lambda s: gd.fused_recurrent_gated_delta_rule(
        *args, initial_state=s[None], state_layer=0, use_qk_l2norm=True, output_final_state=False,
        return_all_states=True, replay_inputs="new", **_kw(impl)))
    out = run(s0)
    return tuple(x[0] for x in out.replay_inputs), out.all_states


REPLAY_CASES = [(2, 9, 2, 4, 32, 32, jnp.float32), (2, 9, 2, 4, 32, 32, jnp.bfloat16),
                (3, 17, 1, 3, 48, 40, jnp.bfloat16), (1, 1, 1, 1, 16, 16, jnp.float32)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", REPLAY_CASES, ids=lambda c: "B{}_T{}_H{}_HV{}_K{}_V{}_{}".format(
    *c[:6], jnp.dtype(c[6]).name))
def test_replay_equals_the_recurrence_bit_for_bit(impl, case):
    """replay_state(n) is the state the recurrent op of the same implementation reached after n steps, bit
    for bit (the same step code, not a rebuild), for every n and ragged batch rows, from one compilation."""
    b, t, h, hv, k_dim, v_dim, dtype = case
    x = make_inputs(b, t, h, hv, k_dim, v_dim, dtype, seed=300 + t, normalize_k=False)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    # Both jitted, as in the model (eager op-by-op dispatch rounds the q/k normalisation differently).
    run = jax.jit(functools.partial(gd.fused_recurrent_gated_delta_rule, return_all_states=True, use_qk_l2norm=True,
                                    **_kw(impl)))(*args, initial_state=x["s0"])
    states = jnp.concatenate([x["s0"][:, None], run.all_states], axis=1)  # [B, T+1, HV, K, V]: after n steps
    replay = jax.jit(functools.partial(gd.replay_state, use_qk_l2norm=True, **_kw(impl)))
    # The pseudo-value replay: the recurrence's own update on the keys it used and the u it computed.
    pseudo = jax.jit(functools.partial(gd.replay_pseudo_values, **_kw(impl)))
    stash, stash_states = _pseudo_replay_inputs(impl, args, x["s0"])
    stash_states = jnp.concatenate([x["s0"][:, None], stash_states], axis=1)
    for a in range(t + 1):
        n = jnp.asarray([(a + i) % (t + 1) for i in range(b)], jnp.int32)
        for got, want in ((replay(x["s0"], x["k"], x["v"], x["g"], x["beta"], n), states[jnp.arange(b), n]),
                          (pseudo(x["s0"], *stash, n), stash_states[jnp.arange(b), n])):
            assert bool(jnp.all(jnp.isfinite(got))), "unwritten elements"
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"n={n.tolist()}")
    assert replay._cache_size() == 1 and pseudo._cache_size() == 1, "n_steps must be traced: one compilation"
    np.testing.assert_array_equal(np.asarray(run.final_state), np.asarray(states[:, t]))


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_stacked_states_run_one_layer_in_place(impl):
    """With `state_layer` the op reads layer l of a stack of layers' states and returns the stack with only that
    layer's state replaced: the same bits as the op on that layer's state alone (counted steps, uncounted, a
    verification that writes no state, snapshots), from one compilation for every layer (the index is traced)."""
    b, t, h, hv, k_dim, v_dim = 2, 3, 1, 2, 16, 16
    x = make_inputs(b, t, h, hv, k_dim, v_dim, jnp.float32, seed=41, normalize_k=False)
    stack = jnp.stack([x["s0"] * (1 + 0.5 * i) for i in range(3)])  # [L=3, B, HV, K, V], distinct layers
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    n = jnp.asarray([2, 3], jnp.int32)
    for options in (dict(state_steps=n), dict(), dict(output_final_state=False), dict(return_all_states=True)):
        op = functools.partial(gd.fused_recurrent_gated_delta_rule, use_qk_l2norm=True, **_kw(impl), **options)
        one = jax.jit(lambda s0: op(*args, initial_state=s0))
        stacked = jax.jit(lambda s, layer: op(*args, initial_state=s, state_layer=layer))
        for layer in (0, 2):
            want, got = one(stack[layer]), stacked(stack, jnp.int32(layer))
            np.testing.assert_array_equal(np.asarray(got.o), np.asarray(want.o), err_msg=str(options))
            if want.final_state is None:
                assert got.final_state is None
            else:
                np.testing.assert_array_equal(np.asarray(got.final_state),
                                              np.asarray(stack.at[layer].set(want.final_state)), err_msg=str(options))
            if options.get("return_all_states"):
                np.testing.assert_array_equal(np.asarray(got.all_states), np.asarray(want.all_states))
        assert stacked._cache_size() == 1, "the layer index must be traced: one compilation for every layer"
    with pytest.raises(ValueError, match=r"state_layer must lie in \[0, 3\)"):
        gd.fused_recurrent_gated_delta_rule(*args, initial_state=stack, state_layer=3, **_kw(impl))
    with pytest.raises(ValueError, match=r"stack of layers' states \[L, B, HV, K, V\]"):
        gd.fused_recurrent_gated_delta_rule(*args, initial_state=x["s0"], state_layer=0, **_kw(impl))


def test_replay_stash_switch_default_and_bad_values(monkeypatch):
    """gated_delta.REPLAY_STASH: None (the default), the stash follows the platform (on only where the step recurrence
    is the compiled Pallas kernel, the GPU; off on this CPU); True / False force it."""
    assert gd.REPLAY_STASH is None
    assert gd.replay_stash_enabled("auto") is (jax.default_backend() == "gpu")
    assert gd.replay_stash_enabled("reference") is False
    for value in (True, False):
        monkeypatch.setattr(gd, "REPLAY_STASH", value)
        assert gd.replay_stash_enabled("reference") is value


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_replay_inputs_are_copied_into_their_layers_rows(impl):
    """With `replay_inputs` (the replay rollback's stacks of every layer's keys, gates and pseudo-values) a
    stacked-state call returns the stacks with its own k and g, as given, and the pseudo-values its steps computed in
    layer `state_layer`'s rows and every other row untouched (with "new", new stacks holding its rows); its outputs and
    state are those of the call without them; one compilation serves every layer; the pseudo-value replay of those
    stacks as L * B batch rows gives each layer its own replay's bits. Bad stacks are one clear error."""
    from specdec_jax.models.qwen35 import model as qwen35
    b, t, h, hv, k_dim, v_dim, n_layers = 2, 3, 1, 2, 16, 16, 3
    x = make_inputs(b, t, h, hv, k_dim, v_dim, jnp.bfloat16, seed=43, normalize_k=False)
    args = (x["q"], x["k"], x["v"], x["g"].astype(jnp.float32), x["beta"])
    stack = jnp.stack([x["s0"] * (1 + 0.5 * i) for i in range(n_layers)])
    stash_like = (jnp.zeros(args[1].shape, jnp.float32), args[3], jnp.zeros(args[2].shape, jnp.float32))  # k, g, u
    filler = tuple(jnp.full((n_layers,) + a.shape, 7, a.dtype) for a in stash_like)
    # The keys as the steps used them: normalised in float32 (in the kernel's program, or the rule's fusion: to the
    # last bit their rounding is the compiled call's, so they are compared within 1e-6 here; gates and pseudo-values
    # bit for bit).
    used_keys = gd.l2_normalize(args[1])

    def same(got, want, name):
        if name == "k":
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=name)

    for options in (dict(output_final_state=False), dict(state_steps=jnp.asarray([1, 3], jnp.int32))):
        op = functools.partial(gd.fused_recurrent_gated_delta_rule, *args, use_qk_l2norm=True, **_kw(impl), **options)
        with_stash = jax.jit(lambda s, st, layer: op(initial_state=s, state_layer=layer, replay_inputs=st))
        without = jax.jit(lambda s, layer: op(initial_state=s, state_layer=layer))
        pseudo = jax.jit(lambda s, layer: op(initial_state=s, state_layer=layer, return_pseudo_values=True))
        compiled = []
        for layer in (0, 2, 1):
            got, want = with_stash(stack, filler, jnp.int32(layer)), without(stack, jnp.int32(layer))
            np.testing.assert_array_equal(np.asarray(got.o, np.float32), np.asarray(want.o, np.float32))
            assert got.v_new is None
            if want.final_state is not None:
                np.testing.assert_array_equal(np.asarray(got.final_state), np.asarray(want.final_state))
            rows = (used_keys, args[3], pseudo(stack, jnp.int32(layer)).v_new)
            for name, st, a, fill in zip("kgu", got.replay_inputs, rows, filler):
                assert st.dtype == fill.dtype, name
                same(st, fill.at[layer].set(a), name)
            compiled.append(with_stash._cache_size())
        # (interpret mode's first call of some Pallas ops changes JAX's tracing context once: one retrace, then none)
        assert compiled[2] == compiled[1], "the layer index must be traced: one compilation for every layer"
        fresh = jax.jit(lambda s, layer: op(initial_state=s, state_layer=layer, replay_inputs="new"))(stack, jnp.int32(1))
        np.testing.assert_array_equal(np.asarray(fresh.o, np.float32), np.asarray(want.o, np.float32))
        rows = (used_keys, args[3], pseudo(stack, jnp.int32(1)).v_new)
        for name, st, a, fill in zip("kgu", fresh.replay_inputs, rows, filler):  # "new": the call's own rows defined
            assert st.shape == fill.shape and st.dtype == fill.dtype, name
            same(st[1], a, name)
    stacks = (filler[0].at[:].set(used_keys), filler[1].at[:].set(args[3]),
              jnp.stack([0.1 * (i + 1) * x["v"].astype(jnp.float32) for i in range(n_layers)]))
    n = jnp.asarray([1, 3], jnp.int32)
    replay = functools.partial(gd.replay_pseudo_values, **_kw(impl))
    got = jax.jit(lambda s, st: qwen35.stacked_state_rule(None, replay, s, st, n))(stack, stacks)
    for i in range(n_layers):
        want = jax.jit(replay)(stack[i], *(st[i] for st in stacks), n)
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want), err_msg=f"layer {i}")
    with pytest.raises(ValueError, match=r"replay_inputs u must be \[3, 2, 3, 2, 16\] in float32"):
        gd.fused_recurrent_gated_delta_rule(*args, initial_state=stack, state_layer=0, **_kw(impl),
                                            replay_inputs=filler[:2] + (filler[2].astype(jnp.bfloat16),))
    with pytest.raises(ValueError, match=r"replay_inputs must be a tuple \(k, g, u\)"):
        gd.fused_recurrent_gated_delta_rule(*args, initial_state=stack, state_layer=0, **_kw(impl),
                                            replay_inputs=filler[:2])
    with pytest.raises(ValueError, match="replay_inputs needs state_layer"):
        gd.fused_recurrent_gated_delta_rule(*args, initial_state=x["s0"], **_kw(impl), replay_inputs=filler)
    with pytest.raises(ValueError, match=r"replay_pseudo_values: v_new must be \[B=2, T=3, HV, V\]"):
        gd.replay_pseudo_values(x["s0"], args[1], args[3], stacks[2][0, :, :2], n, implementation=impl)


@pytest.mark.parametrize("rule", ["replay", "pseudo"])
def test_commit_of_every_layer_in_one_call_equals_one_call_per_layer(rule):
    """qwen35.stacked_state_rule: the commit of L layers as L * B batch rows of one call (one kernel launch on the
    GPU) gives each layer the bits of its own call, for ragged counts."""
    from specdec_jax.models.qwen35 import model as qwen35
    b, t, h, hv, k_dim, v_dim, n_layers = 2, 4, 1, 2, 16, 16, 3
    xs = [make_inputs(b, t, h, hv, k_dim, v_dim, jnp.float32, seed=60 + i, normalize_k=False) for i in range(n_layers)]
    stack = jnp.stack([x["s0"] for x in xs])
    n = jnp.asarray([1, 4], jnp.int32)
    if rule == "replay":
        op, names = functools.partial(gd.replay_state, use_qk_l2norm=True, **_kw("pallas")), ("k", "v", "g", "beta")
    else:
        op, names = functools.partial(gd.commit_state, use_qk_l2norm=True), ("k", "g", "v")
    per_layer = tuple([x[name] for x in xs] for name in names)
    got = jax.jit(lambda s, *ins: qwen35.stacked_state_rule(None, op, s, ins, n))(stack, *per_layer)
    for i, x in enumerate(xs):
        want = jax.jit(op)(x["s0"], *(x[name] for name in names), n)
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want), err_msg=f"layer {i}")


@pytest.mark.parametrize("form, skip, case", [
    ("unrolled", "0", (2, 5, 1, 2, 16, 16, jnp.float32)), ("unrolled", "1", (2, 5, 1, 2, 16, 16, jnp.float32)),
    ("unrolled", "1", (2, 1, 1, 1, 16, 16, jnp.bfloat16)), ("loop", "1", (2, 5, 1, 2, 16, 16, jnp.bfloat16))],
    ids=["unrolled_preloaded", "unrolled_preloaded_skip", "unrolled_one_step_skip", "loop_skip"])
def test_replay_forms_equal_the_recurrence(form, skip, case, monkeypatch, request):
    """The GPU's unrolled forms (interpret mode otherwise runs the loop form) and the replay that skips the steps
    it does not keep (recurrent_kernel.REPLAY_SKIP): the state after n steps is the recurrence's, bit for bit, for
    every n."""
    from pallas_kernels.gated_delta import recurrent_kernel
    b, t, h, hv, k_dim, v_dim, dtype = case
    x = make_inputs(b, t, h, hv, k_dim, v_dim, dtype, seed=350 + t, normalize_k=False)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    # The pseudo-value replay's inputs from the loop form (interpret mode cannot lower the unrolled form's masked
    # stores; on this CPU both forms compute the same values, as the assertions below check for the states).
    jax.clear_caches()
    request.addfinalizer(jax.clear_caches)
    stash, _ = _pseudo_replay_inputs("pallas", args, x["s0"])
    if form == "unrolled":
        monkeypatch.setattr(recurrent_kernel, "_unroll", lambda t, interpret: True)
    monkeypatch.setattr(recurrent_kernel, "REPLAY_SKIP", skip == "1")
    # Both settings are read when a kernel is traced: no trace of the same shapes may be reused from another case,
    # nor this case's traces by later tests.
    jax.clear_caches()
    run = jax.jit(functools.partial(gd.fused_recurrent_gated_delta_rule, return_all_states=True, use_qk_l2norm=True,
                                    **_kw("pallas")))(*args, initial_state=x["s0"])
    states = jnp.concatenate([x["s0"][:, None], run.all_states], axis=1)
    replay = jax.jit(functools.partial(gd.replay_state, use_qk_l2norm=True, **_kw("pallas")))
    # The pseudo-value replay is elementwise: every block width and warp count gives the recurrence's bits.
    pseudos = [jax.jit(functools.partial(pallas_ops.replay_pseudo_values, interpret=True, block_v=bv, num_warps=w))
               for bv, w in ((8, 1), (16, 4), (64, 2))]
    for a in range(t + 1):
        n = jnp.asarray([(a + i) % (t + 1) for i in range(b)], jnp.int32)
        for got in [replay(x["s0"], x["k"], x["v"], x["g"], x["beta"], n)] + [p(x["s0"], *stash, n) for p in pseudos]:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(states[jnp.arange(b), n]),
                                          err_msg=f"n={n.tolist()}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", REPLAY_CASES[:3], ids=lambda c: "B{}_T{}_H{}_HV{}_K{}_V{}_{}".format(
    *c[:6], jnp.dtype(c[6]).name))
def test_counted_recurrence_is_the_recurrence_bit_for_bit(impl, case):
    """state_steps=n (the decode shape: rows past n are padding): the final state is the state the uncounted
    recurrence reached after n steps and the outputs of the first n rows are its outputs, bit for bit, for
    every n and ragged rows, from one compilation; the replay commit of those n reaches the same state."""
    b, t, h, hv, k_dim, v_dim, dtype = case
    x = make_inputs(b, t, h, hv, k_dim, v_dim, dtype, seed=400 + t, normalize_k=False)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    full = jax.jit(functools.partial(gd.fused_recurrent_gated_delta_rule, return_all_states=True, use_qk_l2norm=True,
                                     **_kw(impl)))(*args, initial_state=x["s0"])
    states = jnp.concatenate([x["s0"][:, None], full.all_states], axis=1)  # [B, T+1, HV, K, V]
    counted = jax.jit(lambda s0, n, *a: gd.fused_recurrent_gated_delta_rule(
        *a, initial_state=s0, state_steps=n, use_qk_l2norm=True, **_kw(impl)))
    replay = jax.jit(functools.partial(gd.replay_state, use_qk_l2norm=True, **_kw(impl)))
    all_rows = counted(x["s0"], jnp.full((b,), t, jnp.int32), *args)
    _check("outputs", all_rows.o, full.o, TOL[dtype])
    for a in range(t + 1):
        n = jnp.asarray([(a + i) % (t + 1) for i in range(b)], jnp.int32)
        got = counted(x["s0"], n, *args)
        np.testing.assert_array_equal(np.asarray(got.final_state), np.asarray(states[jnp.arange(b), n]),
                                      err_msg=f"state, n={n.tolist()}")
        # A row's output does not depend on how many rows are valid (AR step vs verification).
        valid = np.arange(t)[None, :] < np.asarray(n)[:, None]  # [B, T]
        np.testing.assert_array_equal(np.asarray(got.o)[valid], np.asarray(all_rows.o)[valid], err_msg="outputs")
        np.testing.assert_array_equal(np.asarray(replay(x["s0"], x["k"], x["v"], x["g"], x["beta"], n)),
                                      np.asarray(got.final_state), err_msg="replay")
    assert counted._cache_size() == 1, "state_steps must be traced: one compilation for every n"
    with pytest.raises(ValueError, match="state_steps"):
        gd.fused_recurrent_gated_delta_rule(*args, initial_state=x["s0"], state_steps=jnp.full((b,), t + 1),
                                            **_kw(impl))


def test_unrolled_recurrent_kernel_with_and_without_preload(monkeypatch):
    """The GPU form of the small-T kernels (steps unrolled; inputs loaded before the chain or per step) in
    interpret mode: every state, output and pseudo-value bit-identical between the two, the replay within
    fp32 rounding of the recurrence, both within rounding of the naive recurrence."""
    from pallas_kernels.gated_delta import recurrent_kernel
    monkeypatch.setattr(recurrent_kernel, "_unroll", lambda t, interpret: True)
    x = make_inputs(2, 4, 1, 2, 16, 16, jnp.bfloat16, seed=77, normalize_k=False)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    outs = {}
    for preload in (False, True):
        run = pallas_ops.fused_recurrent_gated_delta_rule(*args, initial_state=x["s0"], return_all_states=True,
                                                          return_pseudo_values=True, use_qk_l2norm=True,
                                                          interpret=True, preload=preload)
        replayed = pallas_ops.replay_state(x["s0"], x["k"], x["v"], x["g"], x["beta"], jnp.asarray([2, 4]),
                                           use_qk_l2norm=True, interpret=True, preload=preload)
        # Bit-equality of replay and recurrence in this form is checked on the GPU (tune_recurrent.py): in
        # interpret mode XLA's CPU compiler fuses the two unrolled bodies differently (last-bit FMA differences).
        _check("replay", replayed, run.all_states[jnp.arange(2), jnp.asarray([1, 3])], 1e-6)
        outs[preload] = run
    for name in ("o", "final_state", "v_new", "all_states"):
        np.testing.assert_array_equal(np.asarray(getattr(outs[True], name)), np.asarray(getattr(outs[False], name)))
    want = naive(*args, initial_state=x["s0"], use_qk_l2norm=True)
    _check("o", outs[True].o, want.o, TOL[jnp.bfloat16])
    _check("state", outs[True].final_state, want.final_state, 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunk_verify_then_commit(impl):
    """Long verification through the chunk path (T > 64), then commit at chunk-boundary counts."""
    b, t, h, hv, k_dim, v_dim = 1, 130, 1, 2, 64, 64
    x = make_inputs(b, t, h, hv, k_dim, v_dim, seed=7)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    want = naive(*args, initial_state=x["s0"], return_all_states=True)
    out = chunk(*args, initial_state=x["s0"], return_pseudo_values=True, **_kw(impl))
    commit = jax.jit(functools.partial(gd.commit_state, **_kw(impl)))
    for a in (1, 63, 64, 65, 128, 130):
        got = commit(x["s0"], x["k"], x["g"], out.v_new, jnp.full((b,), a, jnp.int32))
        _check(f"state after a={a}", got, want.all_states[:, a - 1], 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pattern", ["strong_then_weak", "weak_then_strong", "alternating"])
def test_chunk_precision_when_cumulative_gates_are_large(impl, pattern):
    """Inside a chunk the cumulative gate reaches -1000 with g = -20; decays between later positions
    with weak gates must still be accurate (the cumulative gate is carried as hi + lo, not a plain
    fp32 cumsum whose 6e-5 ulp there would enter every exponent). Against a float64 recurrence."""
    t, hv, d = 64, 2, 16
    x = make_inputs(1, t, 1, hv, d, d, seed=21)
    weak = np.full((1, t, hv), -3e-3, np.float32)
    g = {"strong_then_weak": np.where(np.arange(t)[None, :, None] < 40, -20.0, weak),
         "weak_then_strong": np.where(np.arange(t)[None, :, None] >= 24, -20.0, weak),
         "alternating": np.where((np.arange(t)[None, :, None] // 8) % 2 == 0, -19.5, weak)}[pattern]
    args = (x["q"], x["k"], x["v"], jnp.asarray(g, jnp.float32), x["beta"])
    want = _float64_recurrence(*args, x["s0"])
    out = chunk(*args, initial_state=x["s0"], return_pseudo_values=True, **_kw(impl))
    for name, got, ref in (("o", out.o, want[0]), ("final_state", out.final_state, want[1]),
                           ("v_new", out.v_new, want[2])):
        err = rel_err(got, ref)
        assert err <= 2e-6, f"{name}: relative error {err:.2e}"


def _float64_recurrence(q, k, v, g, beta, s0):
    """(o, final state, u) of the per-step recurrence in numpy float64 (H = 1 key head)."""
    q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, s0))
    scale = q.shape[-1] ** -0.5
    o, u_all = np.zeros(v.shape), np.zeros(v.shape)
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - np.einsum("bhkv,bk->bhv", s, k[:, t, 0]))
        s = s + k[:, t, 0][:, None, :, None] * u[:, :, None, :]
        o[:, t], u_all[:, t] = np.einsum("bhkv,bk->bhv", s, q[:, t, 0] * scale), u
    return o, s, u_all


def test_pseudo_values_equal_wy_form():
    """The WY pseudo-values of the chunk form are the per-step u_t (README.md, derivation)."""
    x = make_inputs(1, 64, 1, 1, 64, 64, seed=3)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    want = naive(*args, initial_state=x["s0"], return_pseudo_values=True)
    got = jax.jit(functools.partial(reference.chunk_gated_delta_rule_reference, return_pseudo_values=True))(
        *args, initial_state=x["s0"])
    _check("v_new", got.v_new, want.v_new, 1e-5)


def test_bad_shapes_raise():
    x = make_inputs(1, 4, 2, 3, 16, 16)  # HV=3 is not a multiple of H=2
    with pytest.raises(ValueError, match="multiple"):
        gd.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], implementation="pallas", interpret=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_inputs_raise_one_clear_error(impl):
    """Every op checks its arguments before compute: a ValueError naming the argument and the expected
    shape or range, never a broadcast, a deep einsum error or a silently wrong result."""
    x = make_inputs(2, 5, 1, 2, 16, 16, seed=9)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    out = gd.fused_recurrent_gated_delta_rule(*args, initial_state=x["s0"], return_pseudo_values=True, **_kw(impl))
    commit = functools.partial(gd.commit_state, **_kw(impl))
    ok = (x["s0"], x["k"], x["g"], out.v_new)
    bad_commit = [
        ((x["s0"], x["k"], x["g"], out.v_new[:, :4]), "v_new must be"),
        ((x["s0"], x["k"], x["g"][:, :4], out.v_new), "g must be"),
        ((x["s0"], x["k"], x["g"][..., :1], out.v_new), "g must be"),
        ((x["s0"][:, :1], x["k"], x["g"], out.v_new), "initial_state must be"),
        ((x["s0"][:1], x["k"], x["g"], out.v_new), "initial_state must be"),
        ((x["s0"][..., :8, :], x["k"], x["g"], out.v_new), "initial_state must be"),
        ((x["s0"], x["k"][0], x["g"], out.v_new), "k must be"),
    ]
    for bad, pattern in bad_commit:
        with pytest.raises(ValueError, match=pattern):
            commit(*bad, jnp.asarray([1, 2]))
    for n, pattern in ((jnp.asarray([6, 0]), r"n_accepted must lie in \[0, 5\]"), (-1, "must lie in"),
                       (jnp.asarray([1, 2, 3]), "scalar or \\[B=2\\]"), (jnp.asarray([1.0, 2.0]), "integers")):
        with pytest.raises(ValueError, match=pattern):
            commit(*ok, n)
    replay = functools.partial(gd.replay_state, **_kw(impl))
    for bad, pattern in (((x["s0"], x["k"], x["v"][:, :4], x["g"], x["beta"]), "v must be"),
                         ((x["s0"], x["k"], x["v"], x["g"], x["beta"][:, :4]), "beta must be"),
                         ((x["s0"][:1], x["k"], x["v"], x["g"], x["beta"]), "initial_state must be"),
                         ((x["s0"], x["k"][0], x["v"], x["g"], x["beta"]), "k must be")):
        with pytest.raises(ValueError, match=pattern):
            replay(*bad, jnp.asarray([1, 2]))
    with pytest.raises(ValueError, match=r"n_steps must lie in \[0, 5\]"):
        replay(x["s0"], x["k"], x["v"], x["g"], x["beta"], jnp.asarray([6, 0]))
    empty = {name: a[:, :0] for name, a in zip("qkvgb", args)}
    with pytest.raises(ValueError, match="T .* must be >= 1"):
        gd.chunk_gated_delta_rule(empty["q"], empty["k"], empty["v"], empty["g"], empty["b"], **_kw(impl))
    with pytest.raises(ValueError, match="q and k must both be"):
        gd.chunk_gated_delta_rule(x["q"][:, :, 0], x["k"][:, :, 0], x["v"], x["g"], x["beta"], **_kw(impl))


def test_block_v_must_be_a_power_of_two():
    """Other widths would leave value columns unwritten (the grid covers V // block_v programs)."""
    x = make_inputs(1, 5, 1, 1, 16, 64, seed=10)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    for op in (pallas_ops.chunk_gated_delta_rule, pallas_ops.fused_recurrent_gated_delta_rule):
        with pytest.raises(ValueError, match="block_v must be a power of two"):
            op(*args, initial_state=x["s0"], interpret=True, block_v=48)
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        pallas_ops.commit_state(x["s0"], x["k"], x["g"], x["v"].astype(jnp.float32), 1, interpret=True, block_v=24)


def test_default_implementation_rule_and_env_override(monkeypatch):
    """Measured ops only: on GPU the chunk and recurrent ops are Pallas, the pseudo-value commit XLA, elsewhere
    the reference; the replay follows the recurrent op; the env var overrides every op or a listed few, and a
    bad value is one clear error."""
    monkeypatch.delenv(gd.ENV_VAR, raising=False)
    on_gpu = jax.default_backend() == "gpu" and gd.pallas_available()
    for op in ("chunk", "recurrent", "replay"):
        assert gd.default_implementation(op) == ("pallas" if on_gpu else "reference"), op
    assert gd.default_implementation("commit") == "reference"
    monkeypatch.setenv(gd.ENV_VAR, "recurrent=naive")
    assert gd.default_implementation("replay") == "naive"  # the replay runs the recurrent op's arithmetic
    monkeypatch.setenv(gd.ENV_VAR, "naive")
    assert {gd.default_implementation(op) for op in gd.OPS} == {"naive"}
    monkeypatch.setenv(gd.ENV_VAR, "recurrent=pallas, commit=pallas")
    assert gd.resolve("auto", "recurrent") == "pallas" and gd.resolve(None, "commit") == "pallas"
    assert gd.resolve("auto", "chunk") == ("pallas" if on_gpu else "reference")  # not listed: measured default
    assert gd.resolve("reference", "recurrent") == "reference"  # an explicit choice wins
    for bad, msg in (("recurrent=fast", "implementation must be one of"), ("verify=pallas", "unknown op")):
        monkeypatch.setenv(gd.ENV_VAR, bad)
        with pytest.raises(ValueError, match=msg):
            gd.default_implementation("recurrent")


def test_verification_routes_through_the_recurrent_kernel_when_enabled(monkeypatch):
    """With the recurrent op on Pallas, a short verification (1 < T <= 64) runs the fused recurrent
    kernel (one launch per layer) and gives the chunk path's outputs and pseudo-values."""
    from specdec_jax.models.qwen35 import model as qwen35
    calls = []
    for name in ("fused_recurrent_gated_delta_rule", "packed_recurrent_gated_delta_rule"):  # either form of the kernel
        monkeypatch.setattr(gd, name, functools.partial(lambda real, *a, **k: calls.append(1) or real(*a, **k),
                                                        getattr(gd, name)))
    cfg = qwen35.Qwen35Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_key_head_dim=16,
                              linear_value_head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                              linear_conv_kernel_dim=4, layer_types=("linear_attention",))
    rng = np.random.default_rng(0)
    D, C = cfg.hidden_size, cfg.conv_dim
    HV, V = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    p = {"in_proj": jnp.asarray(rng.standard_normal((C + HV * V + 2 * HV, D)) * 0.2, jnp.float32),
         "conv": jnp.asarray(rng.standard_normal((C, 4)) * 0.3, jnp.float32),
         "A_log": jnp.asarray(rng.standard_normal(HV) * 0.1, jnp.float32),
         "dt_bias": jnp.asarray(rng.standard_normal(HV) * 0.1, jnp.float32),
         "norm": jnp.ones((V,), jnp.float32),
         "out_proj": jnp.asarray(rng.standard_normal((D, HV * V)) * 0.2, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((1, 9, D)), jnp.float32)
    conv0 = jnp.asarray(rng.standard_normal((1, 3, C)) * 0.1, jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((2, 1, HV, 16, 16)) * 0.1, jnp.float32)  # two layers' states; runs slot 1
    monkeypatch.delenv(gd.ENV_VAR, raising=False)
    want = qwen35.gdn_mixer(p, cfg, x, conv0, s0, 1, "auto", "pseudo")
    assert not calls  # the chunk path
    monkeypatch.setenv(gd.ENV_VAR, "recurrent=pallas")
    got = qwen35.gdn_mixer(p, cfg, x, conv0, s0, 1, "auto", "pseudo")
    assert calls  # the recurrent kernel (interpret mode here)
    for a, b in ((got[0], want[0]), (got[2], want[2]), (got[3]["v_new"], want[3]["v_new"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_pseudo_replay_setting_by_length_env_and_bad_values(monkeypatch):
    """The pseudo-value replay's block and warps: the measured default by position count, explicit arguments over
    it; a block that is not a power of two is one clear error."""
    assert pallas_ops.pseudo_replay_setting(9) == (32, 4) and pallas_ops.pseudo_replay_setting(17) == (64, 4)
    assert pallas_ops.pseudo_replay_setting(9, block_v=8, num_warps=1) == (8, 1)
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        pallas_ops.pseudo_replay_setting(9, block_v=12)


# The packed form (the step kernel reading q, k, v where they lie in a layer's conv output and forming the gates from the
# projection's columns): (B, H, HV, K, V, rows R, positions run, dtype).
PACKED_CASES = [(2, 2, 4, 16, 16, 6, 4, jnp.float32), (1, 1, 2, 32, 16, 3, 1, jnp.bfloat16)]


def _packed_inputs(b, h, hv, k_dim, v_dim, rows, dtype, seed):
    layout = gd.PackedLayout(h, hv, k_dim, v_dim, b_column=5, a_column=5 + hv + 3)  # gate columns among others
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    conv = jax.random.normal(keys[0], (b, rows, layout.channels)).astype(dtype)
    gates = jax.random.normal(keys[1], (b, rows, layout.a_column + hv + 2)).astype(dtype)
    a_log, dt_bias = (0.5 * jax.random.normal(k, (hv,)) for k in keys[2:4])
    stack = 0.2 * jax.random.normal(keys[4], (3, b, hv, k_dim, v_dim))  # three layers' states
    return layout, (conv, gates, a_log, dt_bias), stack


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", PACKED_CASES, ids=lambda c: "B{}_H{}_HV{}_K{}_V{}_R{}_T{}_{}".format(
    *c[:7], jnp.dtype(c[7]).name))
def test_packed_form_is_the_recurrence_on_its_inputs(impl, case):
    """packed_recurrent_gated_delta_rule (stacked states, counted, its stash) against the plain op on the inputs
    packed.packed_inputs takes apart; and within the form, bit for bit: each valid row's output and the state
    after n steps do not depend on the count (the decode step and a verification compute alike), and the pseudo-value
    replay from its stash reaches the counted state."""
    b, h, hv, k_dim, v_dim, rows, t, dtype = case
    layout, ins, stack = _packed_inputs(b, h, hv, k_dim, v_dim, rows, dtype, seed=600 + t)
    run = jax.jit(lambda n, s, *x: gd.packed_recurrent_gated_delta_rule(
        *x, layout=layout, n_steps=t, initial_state=s, state_layer=1, state_steps=n, use_qk_l2norm=True,
        replay_inputs="new", **_kw(impl)))
    plain = gd.fused_recurrent_gated_delta_rule(
        *gd.packed.packed_inputs(*ins, layout, t), initial_state=stack[1], use_qk_l2norm=True,
        return_all_states=True, implementation="naive")
    states = jnp.concatenate([stack[1][:, None], plain.all_states], axis=1)  # [B, T+1, HV, K, V]
    full = run(jnp.full((b,), t, jnp.int32), stack, *ins)
    _check("outputs", full.o, plain.o, TOL[dtype])
    for a in range(t + 1):
        n = jnp.asarray([(a + i) % (t + 1) for i in range(b)], jnp.int32)
        got = run(n, stack, *ins)
        _check("state", got.final_state[1], states[jnp.arange(b), n], TOL[dtype])
        np.testing.assert_array_equal(np.asarray(got.final_state[::2]), np.asarray(stack[::2]))  # other layers
        valid = np.arange(t)[None, :] < np.asarray(n)[:, None]
        np.testing.assert_array_equal(np.asarray(got.o)[valid], np.asarray(full.o)[valid])
        stash = tuple(x[1] for x in got.replay_inputs)
        np.testing.assert_array_equal(
            np.asarray(gd.replay_pseudo_values(stack[1], *stash, n, **_kw(impl))), np.asarray(got.final_state[1]),
            err_msg=f"n={n.tolist()}")


def test_packed_form_bad_inputs_and_switch(monkeypatch):
    """Bad packed-form inputs are one clear error naming the argument; gated_delta.PACKED_FORM False turns the form off;
    layouts the kernel does not take (K or V not a power of two >= 16) are off."""
    layout, (conv, gates, a_log, dt_bias), _ = _packed_inputs(1, 1, 2, 16, 16, 3, jnp.float32, 1)
    call = lambda *x, **kw: gd.packed_recurrent_gated_delta_rule(*x, **({"layout": layout, "n_steps": 2} | kw))
    with pytest.raises(ValueError, match="conv must be"):
        call(conv[..., :-1], gates, a_log, dt_bias)
    with pytest.raises(ValueError, match="n_steps must be"):
        call(conv, gates, a_log, dt_bias, n_steps=4)
    with pytest.raises(ValueError, match="b_column"):
        call(conv, gates, a_log, dt_bias, layout=layout._replace(b_column=gates.shape[2]))
    with pytest.raises(ValueError, match="dt_bias must be"):
        call(conv, gates, a_log, dt_bias[:1])
    assert gd.packed_form_enabled("pallas", layout) and not gd.packed_form_enabled("reference", layout)
    assert not gd.packed_form_enabled("pallas", layout._replace(key_dim=24))
    monkeypatch.setattr(gd, "PACKED_FORM", False)
    assert not gd.packed_form_enabled("pallas", layout)
    if gd.pallas_available():  # the step kernel's (block_v, warps): arguments, else STEP_BLOCK (8, 1)
        from pallas_kernels.gated_delta import pallas_ops
        assert pallas_ops.step_block_setting() == pallas_ops.STEP_BLOCK == (8, 1)
        assert pallas_ops.step_block_setting(4, None) == (4, 1) and pallas_ops.step_block_setting(None, 2) == (8, 2)
        with pytest.raises(ValueError, match="block_v must be"):
            pallas_ops.step_block_setting(12, None)
        # recurrent_kernel.FETCH_FIRST (every position's loads issued before any input is formed; False: as they
        # come): the same bits either way.
        monkeypatch.setattr(gd, "PACKED_FORM", True)
        from pallas_kernels.gated_delta import recurrent_kernel
        stack = jnp.zeros((2, 1, 2, 16, 16), jnp.float32)
        def run():  # the knob is read when the kernel is traced: no cached trace
            jax.clear_caches()
            return call(conv, gates, a_log, dt_bias, n_steps=3, initial_state=stack, state_layer=0,
                        replay_inputs="new", use_qk_l2norm=True, **_kw("pallas"))
        outs = []
        for value in ("0", "1"):
            monkeypatch.setattr(recurrent_kernel, "FETCH_FIRST", value == "1")
            res = run()
            outs.append([np.asarray(x) for x in (res.o, *res.replay_inputs)])
        for a, b in zip(*outs):
            np.testing.assert_array_equal(a, b)
