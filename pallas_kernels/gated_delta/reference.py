"""Pure-jnp ground truth for the gated delta rule (Gated DeltaNet).

Per value head, with state S in R^{K x V} (derivations in README.md):

    S_t = e^{g_t} S_{t-1} + k_t u_t^T,      u_t = beta_t (v_t - (e^{g_t} S_{t-1})^T k_t)
    o_t = S_t^T (scale * q_t)

`u_t` is the *pseudo-value*: the chunked WY form computes exactly these values (V_new), which is
what lets speculative decoding rebuild the state at any accepted position without snapshots
(`commit_state`).

Shapes (einsum letters as in DESIGN.md): q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV];
states [B, HV, K, V] float32. HV is a multiple of H: value head j reads key head j // (HV // H).

Three implementations share one signature:
- `naive_recurrent_gated_delta_rule`: the per-step recurrence (slow, fp32; ground truth).
- `chunk_gated_delta_rule_reference`: chunked WY form (chunk 64, any T): the XLA path, differentiable.
- `recurrent_gated_delta_rule_reference`: the step recurrence for small T (decode / chain verify),
  optionally returning one state snapshot per position (the rollback baseline).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

CHUNK_SIZE = 64
# The reference is ground truth: fp32 matmuls at full precision on every backend.
_HIGHEST = lax.Precision.HIGHEST


class GatedDeltaOutput(NamedTuple):
    """Result of a gated-delta call. Optional fields are None when not requested."""

    o: jax.Array  # [B, T, HV, V] in v.dtype
    final_state: jax.Array | None  # [B, HV, K, V] float32
    v_new: jax.Array | None = None  # [B, T, HV, V] float32 pseudo-values u_t
    g_cumsum: jax.Array | None = None  # [B, T, HV] float32 cumulative gates from the start
    all_states: jax.Array | None = None  # [B, T, HV, K, V] float32 per-position snapshots
    # (k, g, u) stacks [L, B, T, ...] with this call's keys, gates and pseudo-values in its layer's rows
    # (see check_replay_inputs_stack)
    replay_inputs: tuple | None = None
    # [B, T, H, K] float32: the keys as the steps used them (normalised where they normalise); the reference returns
    # them with its pseudo-values (the Pallas kernel stores them into replay_inputs instead)
    keys: jax.Array | None = None


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (as transformers/fla compute it)."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def check_gated_delta_inputs(q, k, v, g, beta, initial_state=None) -> tuple[int, int, int, int, int, int]:
    """Validate shapes; return (B, T, H, HV, K, V). Raises ValueError naming the bad argument."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"gated_delta: q and k must both be [B, T, H, K]; got q {q.shape}, k {k.shape}")
    B, T, H, K = q.shape
    if T < 1:
        raise ValueError(f"gated_delta: T (axis 1 of q, k, v, g, beta) must be >= 1; got q {q.shape}")
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"gated_delta: v must be [B={B}, T={T}, HV, V]; got {v.shape}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"gated_delta: value heads HV={HV} must be a multiple of key heads H={H}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, HV):
            raise ValueError(f"gated_delta: {name} must be [B, T, HV] = {(B, T, HV)}; got {x.shape}")
    if initial_state is not None and initial_state.shape != (B, HV, K, V):
        raise ValueError(
            f"gated_delta: initial_state must be [B, HV, K, V] = {(B, HV, K, V)}; got {initial_state.shape}")
    return B, T, H, HV, K, V


def check_accepted_counts(n_accepted, b: int, limit: int, name: str = "n_accepted", low: int = 0) -> None:
    """n_accepted: a scalar or [B] integer array; when concrete, every value in [low, limit].

    Traced counts (inside jit) cannot be checked here; out-of-range traced values act as clamped.
    """
    shape = jnp.shape(n_accepted)
    if shape not in ((), (1,), (b,)):
        raise ValueError(f"gated_delta: {name} must be a scalar or [B={b}]; got shape {shape}")
    try:
        values = np.asarray(n_accepted)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"gated_delta: {name} must be integers; got dtype {values.dtype}")
    if values.size and (values.min() < low or values.max() > limit):
        raise ValueError(f"gated_delta: {name} must lie in [{low}, {limit}]; got {values.tolist()}")


def check_commit_inputs(initial_state, k, g, v_new, n_accepted,
                        name: str = "commit_state") -> tuple[int, int, int, int, int, int]:
    """Validate `commit_state` (or `name`: a rule of the same arguments) arguments; return (B, T, H, HV, K, V).
    Raises ValueError naming the argument."""
    if k.ndim != 4:
        raise ValueError(f"{name}: k must be [B, T, H, K]; got {k.shape}")
    B, T, H, K = k.shape
    if v_new.ndim != 4 or v_new.shape[:2] != (B, T):
        raise ValueError(f"{name}: v_new must be [B={B}, T={T}, HV, V]; got {v_new.shape}")
    HV, V = v_new.shape[2:]
    if HV % H:
        raise ValueError(f"{name}: value heads HV={HV} must be a multiple of key heads H={H}")
    if g.shape != (B, T, HV):
        raise ValueError(f"{name}: g must be [B, T, HV] = {(B, T, HV)}; got {g.shape}")
    if initial_state.shape != (B, HV, K, V):
        raise ValueError(f"{name}: initial_state must be [B, HV, K, V] = {(B, HV, K, V)}; "
                         f"got {initial_state.shape}")
    check_accepted_counts(n_accepted, B, T)
    return B, T, H, HV, K, V


def prepare_inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm):
    """fp32 copies with key heads expanded to value heads (the reference may materialise them)."""
    B, T, H, HV, K, V = check_gated_delta_inputs(q, k, v, g, beta, initial_state)
    scale = K ** -0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    group = HV // H
    q = jnp.repeat(q.astype(jnp.float32), group, axis=2)  # [B, T, HV, K]
    k = jnp.repeat(k.astype(jnp.float32), group, axis=2)  # [B, T, HV, K]
    s0 = (jnp.zeros((B, HV, K, V), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    return (q * scale, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32), s0)


def _decayed(state, g_t):
    return state * jnp.exp(g_t)[..., None, None]


def _rank_one(decayed, k_t, u_t):
    return decayed + k_t[..., :, None] * u_t[..., None, :]


def _step(state, k_t, v_t, g_t, b_t):
    """One step for every (batch, head): state [B, HV, K, V] -> (new state, u_t [B, HV, V]). Shared by
    the recurrence and the replays, so all compute each state by the same operations. The prediction
    scales the undecayed state's product (as the Pallas kernel does: recurrent_chain.gated_delta_step)."""
    pred = jnp.exp(g_t)[..., None] * jnp.einsum("bhkv,bhk->bhv", state, k_t, precision=_HIGHEST)
    u_t = b_t[..., None] * (v_t - pred)  # [B, HV, V]
    return _rank_one(_decayed(state, g_t), k_t, u_t), u_t


def check_stacked_state(states, layer, shapes: tuple[int, int, int, int, int, int]) -> None:
    """A stack of layers' states [L, B, HV, K, V] for inputs of shapes (B, T, H, HV, K, V) and the layer to run
    from (a Python int in [0, L), or a traced int32 scalar). Raises ValueError naming the bad argument."""
    B, _, _, HV, K, V = shapes
    if states is None or states.ndim != 5 or tuple(states.shape[1:]) != (B, HV, K, V):
        raise ValueError(f"gated_delta: with state_layer, initial_state must be a stack of layers' states "
                         f"[L, B, HV, K, V] = [L, {B}, {HV}, {K}, {V}]; got "
                         f"{None if states is None else tuple(states.shape)}")
    if isinstance(layer, (int, np.integer)):
        if not 0 <= int(layer) < states.shape[0]:
            raise ValueError(f"gated_delta: state_layer must lie in [0, {states.shape[0]}) (layers in the stack); "
                             f"got {int(layer)}")
    elif jnp.shape(layer) not in ((), (1,)) or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"gated_delta: state_layer must be an integer scalar; got shape {jnp.shape(layer)}, "
                         f"dtype {jnp.result_type(layer)}")


def check_replay_inputs_stack(stacks, inputs: tuple, n_layers: int) -> None:
    """The pseudo-value replay's input stacks (k [L, B, T, H, K] float32, the keys as the steps used them; g
    [L, B, T, HV] in the gates' dtype; u [L, B, T, HV, V] float32) for a recurrent call on inputs (q, k, v, g, beta)
    with a stack of L states.
    Or "new": new stacks, whose rows of other layers than the call's are unspecified (zeros here; unwritten by the
    Pallas kernel), for the first layer of a forward. Raises ValueError naming the bad stack."""
    if isinstance(stacks, str) and stacks == "new":
        return
    if not isinstance(stacks, (tuple, list)) or len(stacks) != 3:
        raise ValueError("gated_delta: replay_inputs must be a tuple (k, g, u) of stacks [L, B, T, ...]; got "
                         f"{type(stacks).__name__}")
    _, k, v, g, _ = inputs
    for name, stack, (shape, dtype) in zip(("k", "g", "u"), stacks,
                                           ((k.shape, jnp.float32), (g.shape, g.dtype), (v.shape, jnp.float32))):
        want = (n_layers,) + tuple(shape)
        if tuple(stack.shape) != want or stack.dtype != dtype:
            raise ValueError(f"gated_delta: replay_inputs {name} must be {list(want)} in {jnp.dtype(dtype).name}; "
                             f"got {list(stack.shape)} {jnp.dtype(stack.dtype).name}")


def stacked_rule(rule, q, k, v, g, beta, *, initial_state, state_layer, replay_inputs=None,
                 **kwargs) -> GatedDeltaOutput:
    """`rule` (a recurrent op of one state) run from layer `state_layer` of the stack `initial_state`
    [L, B, HV, K, V]; final_state is the stack with that layer's state replaced (None if not asked for), and
    replay_inputs (None, or the stacks of check_replay_inputs_stack) those stacks with this call's k, g and
    pseudo-values in that layer's rows."""
    layer = jnp.asarray(state_layer, jnp.int32).reshape(())
    s0 = lax.dynamic_index_in_dim(initial_state, layer, axis=0, keepdims=False)
    want_u = kwargs.get("return_pseudo_values", False)
    if replay_inputs is not None:
        kwargs = kwargs | {"return_pseudo_values": True}
    out = rule(q, k, v, g, beta, initial_state=s0, **kwargs)
    if replay_inputs is not None:
        rows = (out.keys, g, out.v_new)  # the keys as the rule's steps used them: the very values, not a recomputation
        if isinstance(replay_inputs, str):  # "new"
            replay_inputs = tuple(jnp.zeros((initial_state.shape[0],) + x.shape, x.dtype) for x in rows)
        out = out._replace(replay_inputs=tuple(lax.dynamic_update_index_in_dim(stack, x, layer, axis=0)
                                               for stack, x in zip(replay_inputs, rows)))
        if not want_u:
            out = out._replace(v_new=None, g_cumsum=None, keys=None)
    if out.final_state is None:
        return out
    return out._replace(final_state=lax.dynamic_update_index_in_dim(
        initial_state, out.final_state.astype(initial_state.dtype), layer, axis=0))


def naive_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                                     output_final_state=True, return_pseudo_values=False,
                                     return_all_states=False, use_qk_l2norm=False,
                                     state_steps=None) -> GatedDeltaOutput:
    """The per-step recurrence, fp32. Ground truth for every other implementation.

    state_steps [B] int (traced) or None: the final state is the state after that many positions
    (a decode step at a padded row count); outputs past them are meaningless."""
    B, T = q.shape[:2]
    if state_steps is not None:
        check_accepted_counts(state_steps, B, T, name="state_steps")
        n = jnp.broadcast_to(jnp.asarray(state_steps, jnp.int32).reshape(-1), (B,))
    out_dtype = v.dtype
    group = v.shape[2] // q.shape[2]
    q, k, v, g, beta, s0 = prepare_inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)

    def step(state, xs):  # state [B, HV, K, V]
        t, q_t, k_t, v_t, g_t, b_t = xs  # [], [B, HV, K], [B, HV, K], [B, HV, V], [B, HV], [B, HV]
        new, u_t = _step(state, k_t, v_t, g_t, b_t)
        o_t = jnp.einsum("bhkv,bhk->bhv", new, q_t, precision=_HIGHEST)
        carry = new if state_steps is None else jnp.where((t < n)[:, None, None, None], new, state)
        return carry, (o_t, u_t, new if return_all_states else None)

    xs = (jnp.arange(T),) + tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    final, (o, u, states) = lax.scan(step, s0, xs)
    return GatedDeltaOutput(
        o=jnp.moveaxis(o, 0, 1).astype(out_dtype),
        final_state=final if output_final_state else None,
        v_new=jnp.moveaxis(u, 0, 1) if return_pseudo_values else None,
        g_cumsum=jnp.cumsum(g, axis=1) if return_pseudo_values else None,
        all_states=jnp.moveaxis(states, 0, 1) if return_all_states else None,
        keys=k[:, :, ::group] if return_pseudo_values else None,
    )


# The small-T path (decode, chain verification) is the same recurrence; XLA fuses it well for T <= 64.
recurrent_gated_delta_rule_reference = naive_recurrent_gated_delta_rule


def replay_state_reference(initial_state, k, v, g, beta, n_steps, *, use_qk_l2norm=False):
    """State after the first n_steps [B] positions (traced, 0 <= n <= T), recomputed by the recurrence's
    own step from `initial_state`: the replay commit (bit-identical to the state the recurrence reached
    there, unlike the pseudo-value rebuild, which is exact only in exact arithmetic).

    initial_state [B, HV, K, V]; k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]. Returns fp32.
    """
    B, T, H, HV, K, V = check_replay_inputs(initial_state, k, v, g, beta, n_steps)
    q = jnp.zeros_like(k)  # unused by the state
    _, k, v, g, beta, s0 = prepare_inputs(q, k, v, g, beta, None, initial_state, use_qk_l2norm)
    n = jnp.broadcast_to(jnp.asarray(n_steps, jnp.int32).reshape(-1), (B,))

    def step(state, xs):
        t, k_t, v_t, g_t, b_t = xs
        new, _ = _step(state, k_t, v_t, g_t, b_t)
        return jnp.where((t < n)[:, None, None, None], new, state), None

    xs = (jnp.arange(T),) + tuple(jnp.moveaxis(x, 1, 0) for x in (k, v, g, beta))
    final, _ = lax.scan(step, s0, xs)
    return final


def replay_pseudo_values_reference(initial_state, k, g, v_new, n_steps):
    """State after the first n_steps [B] positions from the keys k [B, T, H, K] (float32, as the recurrence used them:
    normalised where it normalises) and pseudo-values v_new [B, T, HV, V] the recurrence computed there: each kept
    step is the recurrence's own update (`_rank_one(_decayed(S, g_t), k_t, u_t)`) on the same values, so the state
    is the recurrence's, with no reduction. Returns fp32 [B, HV, K, V]."""
    B, T, H, HV, K, V = check_commit_inputs(initial_state, k, g, v_new, n_steps, name="replay_pseudo_values")
    k = jnp.repeat(k.astype(jnp.float32), HV // H, axis=2)
    n = jnp.broadcast_to(jnp.asarray(n_steps, jnp.int32).reshape(-1), (B,))

    def step(state, xs):
        t, k_t, g_t, u_t = xs
        new = _rank_one(_decayed(state, g_t), k_t, u_t)
        return jnp.where((t < n)[:, None, None, None], new, state), None

    xs = (jnp.arange(T),) + tuple(jnp.moveaxis(x, 1, 0) for x in (k, g.astype(jnp.float32), v_new.astype(jnp.float32)))
    final, _ = lax.scan(step, initial_state.astype(jnp.float32), xs)
    return final


def check_replay_inputs(initial_state, k, v, g, beta, n_steps) -> tuple[int, int, int, int, int, int]:
    """Validate `replay_state` arguments; return (B, T, H, HV, K, V). Raises ValueError naming the argument."""
    if k.ndim != 4:
        raise ValueError(f"replay_state: k must be [B, T, H, K]; got {k.shape}")
    B, T, H, K = k.shape
    if T < 1:
        raise ValueError(f"replay_state: T (axis 1 of k, v, g, beta) must be >= 1; got k {k.shape}")
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"replay_state: v must be [B={B}, T={T}, HV, V]; got {v.shape}")
    HV, V = v.shape[2:]
    if HV % H:
        raise ValueError(f"replay_state: value heads HV={HV} must be a multiple of key heads H={H}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, HV):
            raise ValueError(f"replay_state: {name} must be [B, T, HV] = {(B, T, HV)}; got {x.shape}")
    if initial_state.shape != (B, HV, K, V):
        raise ValueError(f"replay_state: initial_state must be [B, HV, K, V] = {(B, HV, K, V)}; "
                         f"got {initial_state.shape}")
    check_accepted_counts(n_steps, B, T, name="n_steps")
    return B, T, H, HV, K, V


def compensated_cumsum(g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Cumulative sum over the last axis as an unevaluated pair hi + lo (fp32 each).

    Within a chunk the cumulative gate can reach -1000 (64 steps of g = -20), where one fp32 ulp is
    6e-5: a decay e^{gamma_i - gamma_j} between two later positions with weak gates would then carry
    that absolute error in its exponent. Carrying the rounding error of every addition in `lo`
    (TwoSum, combined by a parallel scan) keeps differences accurate to fp32 relative precision:
    gamma_i - gamma_j = (hi_i - hi_j) + (lo_i - lo_j), where the first difference is exact or small.
    """
    def two_sum(a, b):  # s + err == a + b exactly
        s = a + b
        bb = s - a
        return s, (a - (s - bb)) + (b - bb)

    def combine(x, y):
        s, err = two_sum(x[0], y[0])
        return s, x[1] + y[1] + err

    g = g.astype(jnp.float32)
    return lax.associative_scan(combine, (g, jnp.zeros_like(g)), axis=g.ndim - 1)


def gate_difference(hi_i, lo_i, hi_j, lo_j):
    """(hi_i + lo_i) - (hi_j + lo_j), accurate where the two sums are large and close."""
    return (hi_i - hi_j) + (lo_i - lo_j)


def _masked_decay(diff, mask):
    """exp(diff) where mask else 0; masked before exp (no overflow)."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)


def chunk_gated_delta_rule_reference(q, k, v, g, beta, *, scale=None, initial_state=None,
                                     output_final_state=True, return_pseudo_values=False,
                                     use_qk_l2norm=False, chunk_size=CHUNK_SIZE) -> GatedDeltaOutput:
    """Chunked WY form in jnp (any T; padded inside). Differentiable; the XLA path of the model."""
    out_dtype = v.dtype
    B, T, _, HV, _, _ = check_gated_delta_inputs(q, k, v, g, beta, initial_state)
    q, k, v, g, beta, s0 = prepare_inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    C = chunk_size
    n_chunks = -(-T // C)
    pad = n_chunks * C - T
    if pad:
        # Padded steps have g = 0 and beta = 0: they neither decay nor write the state.
        pad_fn = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g, beta = map(pad_fn, (q, k, v, g, beta))

    def to_chunks(x):  # [B, NC*C, HV, ...] -> [B, HV, NC, C, ...]
        x = x.reshape((B, n_chunks, C) + x.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    qc, kc, vc, gc, bc = map(to_chunks, (q, k, v, g, beta))  # [B, HV, NC, C(, K|V)]
    gamma, gamma_lo = compensated_cumsum(gc)  # [B, HV, NC, C] cumulative gate inside the chunk (hi + lo)
    idx = jnp.arange(C)
    causal = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    pairwise = gate_difference(gamma[..., :, None], gamma_lo[..., :, None], gamma[..., None, :],
                               gamma_lo[..., None, :])  # [B, HV, NC, C, C] gamma_i - gamma_j
    decay_incl = _masked_decay(pairwise, causal)  # [B, HV, NC, C, C]
    decay_strict = jnp.where(strict, decay_incl, 0.0)

    kk = jnp.einsum("...ik,...jk->...ij", kc, kc, precision=_HIGHEST)
    a = bc[..., :, None] * kk * decay_strict  # strictly lower triangular
    eye = jnp.eye(C, dtype=jnp.float32)
    lhs = eye + a
    solve = lambda rhs: jax.scipy.linalg.solve_triangular(lhs, rhs, lower=True, unit_diagonal=True)
    u = solve(bc[..., None] * vc)  # [B, HV, NC, C, V]
    w = solve((bc * jnp.exp(gamma))[..., None] * kc)  # [B, HV, NC, C, K]
    qk = jnp.einsum("...ik,...jk->...ij", qc, kc, precision=_HIGHEST) * decay_incl  # [.., C, C]
    q_decayed = qc * jnp.exp(gamma)[..., None]  # [B, HV, NC, C, K]
    gamma_last = gamma[..., -1]  # [B, HV, NC]
    to_end = gate_difference(gamma_last[..., None], gamma_lo[..., -1:], gamma, gamma_lo)  # [B, HV, NC, C]
    k_to_end = kc * jnp.exp(to_end)[..., None]  # [B, HV, NC, C, K]

    def chunk_step(state, xs):  # state [B, HV, K, V]
        u_c, w_c, qk_c, qd_c, kend_c, glast_c = xs
        v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, state, precision=_HIGHEST)
        o_c = (jnp.einsum("bhck,bhkv->bhcv", qd_c, state, precision=_HIGHEST)
               + jnp.einsum("bhij,bhjv->bhiv", qk_c, v_new, precision=_HIGHEST))
        new = (state * jnp.exp(glast_c)[..., None, None]
               + jnp.einsum("bhck,bhcv->bhkv", kend_c, v_new, precision=_HIGHEST))
        return new, (o_c, v_new)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, qk, q_decayed, k_to_end, gamma_last))
    final, (o, v_new) = lax.scan(chunk_step, s0, xs)  # o, v_new: [NC, B, HV, C, V]

    def from_chunks(x):  # [NC, B, HV, C, V] -> [B, T, HV, V]
        x = jnp.moveaxis(x, 0, 2).reshape(B, HV, n_chunks * C, x.shape[-1])
        return jnp.moveaxis(x, 1, 2)[:, :T]

    return GatedDeltaOutput(
        o=from_chunks(o).astype(out_dtype),
        final_state=final if output_final_state else None,
        v_new=from_chunks(v_new) if return_pseudo_values else None,
        g_cumsum=jnp.cumsum(g[:, :T], axis=1) if return_pseudo_values else None,
    )


def commit_state_reference(initial_state, k, g, v_new, n_accepted, *, use_qk_l2norm=False):
    """State after the first `n_accepted` positions, rebuilt from pseudo-values (no snapshots).

    S_a = e^{gamma_a} S0 + sum_{j<=a} e^{gamma_a - gamma_j} k_j v_new_j^T

    initial_state [B, HV, K, V]; k [B, T, H, K] (as given to the kernel; normalised here when
    `use_qk_l2norm`); g [B, T, HV] raw gates; v_new [B, T, HV, V]; n_accepted [B] int (traced,
    0 <= a <= T; a = 0 returns S0).
    """
    B, T, H, HV, K, V = check_commit_inputs(initial_state, k, g, v_new, n_accepted)
    if use_qk_l2norm:
        k = l2_normalize(k)
    k = jnp.repeat(k.astype(jnp.float32), HV // H, axis=2)  # [B, T, HV, K]
    a = jnp.broadcast_to(jnp.asarray(n_accepted, jnp.int32).reshape(-1), (B,))
    keep = (jnp.arange(T)[None, :] < a[:, None])[..., None]  # [B, T, 1]
    g_kept = jnp.where(keep, g.astype(jnp.float32), 0.0)  # [B, T, HV]
    # gamma_a - gamma_j = sum_{j < i < a} g_i as an exclusive suffix sum: near the accepted boundary it
    # sums few terms, so it keeps full precision where cumsum differences would cancel (strong decay).
    suffix = jnp.cumsum(g_kept[:, ::-1], axis=1)[:, ::-1]  # [B, T, HV] sum_{i >= j}
    decay_to_a = jnp.concatenate([suffix[:, 1:], jnp.zeros_like(suffix[:, :1])], axis=1)
    weights = jnp.where(keep, jnp.exp(decay_to_a), 0.0)  # [B, T, HV]
    gamma_a = jnp.sum(g_kept, axis=1)  # [B, HV]
    s0 = initial_state.astype(jnp.float32) * jnp.exp(gamma_a)[..., None, None]
    return s0 + jnp.einsum("bthk,bthv,bth->bhkv", k, v_new.astype(jnp.float32), weights,
                           precision=_HIGHEST)
