"""Public Pallas entry points of the gated delta rule (same signatures as reference.py).

    chunk_gated_delta_rule            any T (prefill / verification): chunk_kernel.py (three kernels)
    fused_recurrent_gated_delta_rule  small T from a state (decode / chain verify): recurrent_kernel.py
    packed_recurrent_gated_delta_rule the same, q, k, v read where they lie in a layer's conv output and the gates
                                      computed in the kernel from the projection's columns
    commit_state                      state after `n_accepted` positions from pseudo-values: commit_kernel.py
    replay_state                      state after `n_steps` positions, replayed by the recurrent kernel's step
    replay_pseudo_values              the same from the keys and pseudo-values that step used and computed (elementwise)

The kernels use the Pallas Triton backend (the recurrent op also has a Mosaic GPU kernel,
`backend="mosaic"`) and run unchanged with `interpret=True` on CPU. Inputs of any size are
accepted: K and V are zero-padded to a power of two (>= 16) and T to a multiple of the chunk
(chunk op) or to a power of two >= 16 (commit); results are sliced back. Keyword-only
tuning arguments (`block_v`, `state_dot`, `split_output`, `backend`, warps) default to the values
measured best on an H200 where a measurement exists (README.md, "Benchmarks").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import chunk_kernel, commit_kernel, recurrent_kernel
from ._kernel_utils import F32, check_block_v, dot_precisions, is_low_precision, next_pow2, pad_axis
from .packed import check_packed_inputs
from .reference import (GatedDeltaOutput, check_accepted_counts, check_commit_inputs,
                        check_gated_delta_inputs, check_replay_inputs_stack,
                        check_replay_inputs, check_stacked_state, compensated_cumsum)

CHUNK = chunk_kernel.CHUNK


def _scale(scale, k_dim: int) -> float:
    return float(k_dim ** -0.5 if scale is None else scale)


def _pad_kv(q, k, v, initial_state, kp: int, vp: int):
    q, k = pad_axis(q, 3, kp), pad_axis(k, 3, kp)
    v = pad_axis(v, 3, vp)
    if initial_state is not None:  # [..., K, V]: one state or a stack of layers' states
        nd = initial_state.ndim
        initial_state = pad_axis(pad_axis(initial_state.astype(F32), nd - 2, kp), nd - 1, vp)
    return q, k, v, initial_state


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "return_pseudo_values",
                                             "use_qk_l2norm", "interpret", "block_v", "state_dot",
                                             "split_output", "num_warps", "state_stages", "wy_solver"))
def _chunk(q, k, v, g, beta, initial_state, *, scale, output_final_state, return_pseudo_values, use_qk_l2norm,
           interpret, block_v, state_dot, split_output, num_warps, state_stages, wy_solver):
    b, t, _, hv, k_dim, v_dim = check_gated_delta_inputs(q, k, v, g, beta, initial_state)
    low = is_low_precision(k.dtype)
    prec, merge_prec = dot_precisions(low, interpret)
    kp, vp = next_pow2(k_dim), next_pow2(v_dim)
    tp = -(-t // CHUNK) * CHUNK
    q, k, v, s0 = _pad_kv(q, k, v, initial_state, kp, vp)
    # Padded steps have g = 0 and beta = 0: they neither decay nor write the state.
    q, k, v = (pad_axis(x, 1, tp) for x in (q, k, v))
    g_f = pad_axis(g.astype(F32), 1, tp)  # [B, Tp, HV]
    gam, gam_lo = compensated_cumsum(jnp.moveaxis(g_f, 1, 2).reshape(b, hv, tp // CHUNK, CHUNK))
    gam, gam_lo = gam.reshape(b, hv, tp), gam_lo.reshape(b, hv, tp)  # [B, HV, Tp] cumulative gate per chunk
    beta_t = jnp.moveaxis(pad_axis(beta.astype(F32), 1, tp), 1, 2)  # [B, HV, Tp]
    if state_dot == "bf16" and low:
        state_dtype = k.dtype
    else:
        state_dtype = F32
    o, final, v_new = chunk_kernel.chunk_fwd(
        q, k, v, gam, gam_lo, beta_t, s0, scale=scale, l2norm=use_qk_l2norm, want_vnew=return_pseudo_values,
        wu_dtype=k.dtype if low else F32, state_dtype=state_dtype, prec=prec, merge_prec=merge_prec,
        block_v=block_v, interpret=interpret, split_output=split_output, wy_warps=num_warps[0],
        state_warps=num_warps[1], out_warps=num_warps[2], state_stages=state_stages, wy_solver=wy_solver)
    return GatedDeltaOutput(
        o=o[:, :t, :, :v_dim],
        final_state=final[:, :, :k_dim, :v_dim] if output_final_state else None,
        v_new=v_new[:, :t, :, :v_dim] if return_pseudo_values else None,
        g_cumsum=jnp.cumsum(g.astype(F32), axis=1) if return_pseudo_values else None,
    )


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=True,
                           return_pseudo_values=False, use_qk_l2norm=False, interpret=False, block_v=32,
                           state_dot="bf16", split_output=True, num_warps=(4, 4, 4),
                           state_stages=3, wy_solver="substitution") -> GatedDeltaOutput:
    """Chunked gated delta rule for any T (prefill / verification), Pallas kernels.

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state [B, HV, K, V] fp32 or None.
    Returns GatedDeltaOutput(o [B, T, HV, V] in v.dtype, final_state [B, HV, K, V] fp32,
    v_new [B, T, HV, V] fp32 and g_cumsum [B, T, HV] fp32 when `return_pseudo_values`).
    `block_v`: value columns per program of the state kernel; `state_dot`: "f32" (TF32 tensor-core
    products with the fp32 state) or "bf16" (state rounded to bf16 for the products, as fla does);
    both only matter for 16-bit inputs. `split_output`: O from a separate kernel parallel over chunks
    (True) or inside the sequential chunk loop (False); see chunk_kernel.chunk_fwd. `num_warps`:
    warps of the (WY, state, output) kernels; `state_stages`: pipeline stages of the state kernel
    (3 measured fastest at T = 8192: kernel README, "Benchmarks"). `wy_solver`: how the
    64x64 triangular inverse is formed, "substitution" (measured) or "merge" (products only, to be
    measured; chunk_kernel.unit_lower_inverse).
    """
    check_gated_delta_inputs(q, k, v, g, beta, initial_state)
    return _chunk(q, k, v, g, beta, initial_state, scale=_scale(scale, q.shape[-1]),
                  output_final_state=output_final_state, return_pseudo_values=return_pseudo_values,
                  use_qk_l2norm=use_qk_l2norm, interpret=interpret, block_v=check_block_v(block_v),
                  state_dot=state_dot,
                  split_output=split_output, num_warps=tuple(int(w) for w in num_warps),
                  state_stages=int(state_stages), wy_solver=str(wy_solver))


def _use_mosaic(backend, k_dim, v_dim, hv, block_v, return_all_states) -> bool:
    if backend == "triton" or return_all_states:  # per-position snapshots: Triton kernel only
        return False
    from . import recurrent_mgpu
    return recurrent_mgpu.supported(k_dim, v_dim, hv, block_v)


@functools.partial(jax.jit, static_argnames=("scale", "output_final_state", "return_pseudo_values",
                                             "return_all_states", "use_qk_l2norm", "interpret", "block_v",
                                             "num_warps", "backend", "preload", "new_stash"))
def _recurrent(q, k, v, g, beta, initial_state, state_steps, state_layer, stash, *, scale, output_final_state,
               return_pseudo_values, return_all_states, use_qk_l2norm, interpret, block_v, num_warps, backend, preload,
               new_stash=False):
    stacked = state_layer is not None
    b, _, _, hv, k_dim, v_dim = check_gated_delta_inputs(q, k, v, g, beta, None if stacked else initial_state)
    layer = None
    if stacked:  # the stack of every layer's state: the kernel reads and writes layer state_layer's in place
        layer = jnp.asarray(state_layer, jnp.int32).reshape(1)
        backend = "triton"
    counts = None
    if state_steps is not None:  # Triton kernel only (the Mosaic kernel has no counted form)
        counts = jnp.broadcast_to(jnp.asarray(state_steps, jnp.int32).reshape(-1), (b,))
        counts = pad_axis(counts, 0, next_pow2(b, 1))  # Triton blocks are powers of two
        backend = "triton"
    if _use_mosaic(backend, k_dim, v_dim, hv, block_v, return_all_states) and stash is None and not new_stash:
        from . import recurrent_mgpu
        s0 = (jnp.zeros((b, hv, k_dim, v_dim), F32) if initial_state is None else initial_state.astype(F32))
        o, final, u = recurrent_mgpu.recurrent_fwd_mgpu(q, k, v, g, beta, s0, scale=scale, l2norm=use_qk_l2norm,
                                                        want_vnew=return_pseudo_values, block_v=block_v,
                                                        interpret=interpret)
        return GatedDeltaOutput(
            o=o, final_state=final if output_final_state else None, v_new=u,
            g_cumsum=jnp.cumsum(g.astype(F32), axis=1) if return_pseudo_values else None)
    kp, vp = next_pow2(k_dim), next_pow2(v_dim)
    q, k, v, s0 = _pad_kv(q, k, v, initial_state, kp, vp)
    if new_stash:  # new stacks of every layer's keys, gates and pseudo-values, this call's rows written (no zero-fill)
        n_layers = initial_state.shape[0]
        stash = (jax.ShapeDtypeStruct((n_layers,) + k.shape, F32), jax.ShapeDtypeStruct((n_layers,) + g.shape, g.dtype),
                 jax.ShapeDtypeStruct((n_layers,) + v.shape, F32))
    elif stash is not None:  # keys and pseudo-values padded as the kernel writes them (a copy only where not 2^n)
        stash = (pad_axis(stash[0], 4, kp), stash[1], pad_axis(stash[2], 4, vp))
    o, final, u, states, stash = recurrent_kernel.recurrent_fwd(
        q, k, v, g, beta, s0, scale=scale, l2norm=use_qk_l2norm, want_vnew=return_pseudo_values,
        want_states=return_all_states, block_v=block_v, interpret=interpret, num_warps=num_warps, preload=preload,
        counts=counts, want_state=output_final_state, layer=layer, stash=stash)
    if stash is not None:
        stash = (stash[0][..., :k_dim], stash[1], stash[2][..., :v_dim])
    return GatedDeltaOutput(
        o=o[..., :v_dim],
        final_state=final[..., :k_dim, :v_dim] if output_final_state else None,
        v_new=u[..., :v_dim] if return_pseudo_values else None,
        g_cumsum=jnp.cumsum(g.astype(F32), axis=1) if return_pseudo_values else None,
        all_states=states[..., :k_dim, :v_dim] if return_all_states else None,
        replay_inputs=stash,
    )


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=True,
                                     return_pseudo_values=False, return_all_states=False, use_qk_l2norm=False,
                                     interpret=False, block_v=8, num_warps=1, backend="triton",
                                     preload=None, state_steps=None, state_layer=None,
                                     replay_inputs=None) -> GatedDeltaOutput:
    """Step recurrence for small T (decode, chain verification) from an initial state, Pallas kernel.

    Shapes as `chunk_gated_delta_rule`. Rollback modes: `return_pseudo_values` (v_new = u_t and
    g_cumsum, for `commit_state`) or `return_all_states` (all_states [B, T, HV, K, V] fp32, one
    snapshot per position: the baseline). `backend`: "triton" (recurrent_kernel.py) or "mosaic"
    (recurrent_mgpu.py, Mosaic GPU; falls back to Triton for snapshots or unsupported sizes).
    `preload`: load every position's inputs before the first state update (None: when 1 < T <= 32);
    the arithmetic, and so every result, is the same either way.
    `state_steps` [B] int (traced) or None: the final state is the state after that many positions
    (a decode step at a padded row count); outputs past them are meaningless.
    `state_layer` (int, or a traced int32 scalar) or None: `initial_state` is a stack of layers' states
    [L, B, HV, K, V]; the run starts from layer `state_layer`'s and `final_state` is the stack with that layer's
    state replaced, written in place (reference.check_stacked_state).
    `replay_inputs` (with `state_layer`) or None: the stacks reference.check_replay_inputs_stack describes, or "new";
    the kernel stores this call's k, g and the pseudo-values its steps compute into layer `state_layer`'s rows, in
    place (output field `replay_inputs`; with "new", new stacks whose other layers' rows are unwritten).
    """
    if state_layer is None:
        check_gated_delta_inputs(q, k, v, g, beta, initial_state)
        if replay_inputs is not None:
            raise ValueError("gated_delta: replay_inputs needs state_layer (a stack of layers' states)")
    else:
        shapes = check_gated_delta_inputs(q, k, v, g, beta)
        check_stacked_state(initial_state, state_layer, shapes)
        if replay_inputs is not None:
            check_replay_inputs_stack(replay_inputs, (q, k, v, g, beta), initial_state.shape[0])
    if state_steps is not None:
        check_accepted_counts(state_steps, q.shape[0], q.shape[1], name="state_steps")
    new_stash = isinstance(replay_inputs, str)
    return _recurrent(q, k, v, g, beta, initial_state, state_steps, state_layer,
                      None if replay_inputs is None or new_stash else tuple(replay_inputs), new_stash=new_stash,
                      scale=_scale(scale, q.shape[-1]),
                      output_final_state=output_final_state, return_pseudo_values=return_pseudo_values,
                      return_all_states=return_all_states, use_qk_l2norm=use_qk_l2norm, interpret=interpret,
                      block_v=check_block_v(block_v), num_warps=num_warps, backend=backend, preload=preload)


# The packed step kernel's (block_v, warps), decode and verification alike (they must run one setting to compute the
# same bits). (8, 2) was faster per call at 9 rows in isolation, but not in the model's steps, so (8, 1) stays
# (docs/LOG.md, 2026-12-03).
STEP_BLOCK = (8, 1)


def launch_setting(default: tuple[int, int], block_v=None, num_warps=None) -> tuple[int, int]:
    """(block_v, num_warps): the arguments where given, else `default`."""
    return (default[0] if block_v is None else check_block_v(block_v),
            default[1] if num_warps is None else int(num_warps))


def step_block_setting(block_v=None, num_warps=None) -> tuple[int, int]:
    """(block_v, num_warps) of the packed step kernel: the arguments where given, else STEP_BLOCK."""
    return launch_setting(STEP_BLOCK, block_v, num_warps)


def packed_form_supported(layout, block_v: int = 8) -> bool:
    """Whether the packed form's kernel takes `layout` (packed.PackedLayout) as it is: K and V powers of two >= 16
    (its blocks are the channels where they lie, so nothing is padded) and whole value blocks."""
    k_dim, v_dim = layout.key_dim, layout.value_dim
    return k_dim == next_pow2(k_dim) and v_dim == next_pow2(v_dim) and v_dim % min(block_v, v_dim) == 0


@functools.partial(jax.jit, static_argnames=("layout", "n_steps", "scale", "output_final_state", "return_pseudo_values",
                                             "return_all_states", "use_qk_l2norm", "interpret", "block_v",
                                             "num_warps", "preload", "new_stash"))
def _recurrent_packed(conv, gates, a_log, dt_bias, initial_state, state_steps, state_layer, stash, *, layout, n_steps,
                      scale, output_final_state, return_pseudo_values, return_all_states, use_qk_l2norm, interpret,
                      block_v, num_warps, preload, new_stash=False):
    b, hv = conv.shape[0], layout.value_heads
    heads = next_pow2(hv, 1)  # Triton blocks are powers of two
    a_log, dt_bias = pad_axis(a_log, 0, heads), pad_axis(dt_bias, 0, heads)
    layer = None if state_layer is None else jnp.asarray(state_layer, jnp.int32).reshape(1)
    counts = None
    if state_steps is not None:
        counts = jnp.broadcast_to(jnp.asarray(state_steps, jnp.int32).reshape(-1), (b,))
        counts = pad_axis(counts, 0, next_pow2(b, 1))
    if new_stash:
        n_layers = initial_state.shape[0]
        stash = (jax.ShapeDtypeStruct((n_layers, b, n_steps, layout.key_heads, layout.key_dim), F32),
                 jax.ShapeDtypeStruct((n_layers, b, n_steps, hv), F32),
                 jax.ShapeDtypeStruct((n_layers, b, n_steps, hv, layout.value_dim), F32))
    s0 = initial_state if initial_state is None else initial_state.astype(F32)
    o, final, u, states, stash = recurrent_kernel.recurrent_packed_fwd(
        conv, gates, a_log, dt_bias, s0, layout=layout, n_steps=n_steps, scale=scale, l2norm=use_qk_l2norm,
        block_v=block_v, interpret=interpret, want_vnew=return_pseudo_values, want_states=return_all_states,
        num_warps=num_warps, preload=preload, counts=counts, want_state=output_final_state, layer=layer, stash=stash)
    return GatedDeltaOutput(o=o, final_state=final if output_final_state else None, v_new=u, all_states=states,
                            replay_inputs=stash)


def packed_recurrent_gated_delta_rule(conv, gates, a_log, dt_bias, *, layout, n_steps, scale=None, initial_state=None,
                                      output_final_state=True, return_pseudo_values=False, return_all_states=False,
                                      use_qk_l2norm=False, interpret=False, block_v=None, num_warps=None, preload=None,
                                      state_steps=None, state_layer=None, replay_inputs=None) -> GatedDeltaOutput:
    """`fused_recurrent_gated_delta_rule` on the inputs `packed.packed_inputs` takes from (conv, gates, a_log,
    dt_bias, layout, n_steps), read where they lie and the gates computed inside the step kernel (its packed form:
    recurrent_kernel.recurrent_packed_fwd); `packed_form_supported(layout)` must hold. Same state, stash and count
    arguments as the plain op (its g_cumsum is not returned); `block_v`, `num_warps` as its defaults (the replay's
    blocks must match); None: `step_block_setting()`."""
    block_v, num_warps = step_block_setting(block_v, num_warps)
    if not packed_form_supported(layout, block_v):
        raise ValueError(f"gated_delta: the packed form needs key_dim and value_dim powers of two >= 16; got "
                         f"{layout.key_dim}, {layout.value_dim}")
    b, _ = check_packed_inputs(conv, gates, a_log, dt_bias, layout, n_steps)
    sds = jax.ShapeDtypeStruct
    shapes = (b, n_steps, layout.key_heads, layout.value_heads, layout.key_dim, layout.value_dim)
    if state_layer is None:
        if replay_inputs is not None:
            raise ValueError("gated_delta: replay_inputs needs state_layer (a stack of layers' states)")
        if initial_state is not None and initial_state.shape != (b,) + shapes[3:]:
            raise ValueError(f"gated_delta: initial_state must be [B, HV, K, V] = {(b,) + shapes[3:]}; got "
                             f"{initial_state.shape}")
    else:
        check_stacked_state(initial_state, state_layer, shapes)
        if replay_inputs is not None:
            keys, values = sds(shapes[:3] + shapes[4:5], conv.dtype), sds(shapes[:2] + shapes[3:4] + shapes[5:], F32)
            gate = sds(shapes[:2] + shapes[3:4], F32)
            check_replay_inputs_stack(replay_inputs, (keys, keys, values, gate, gate), initial_state.shape[0])
    if state_steps is not None:
        check_accepted_counts(state_steps, b, n_steps, name="state_steps")
    new_stash = isinstance(replay_inputs, str)
    return _recurrent_packed(conv, gates, a_log, dt_bias, initial_state, state_steps, state_layer,
                             None if replay_inputs is None or new_stash else tuple(replay_inputs), layout=layout,
                             n_steps=int(n_steps), scale=_scale(scale, layout.key_dim),
                             output_final_state=output_final_state, return_pseudo_values=return_pseudo_values,
                             return_all_states=return_all_states, use_qk_l2norm=use_qk_l2norm, interpret=interpret,
                             block_v=block_v, num_warps=num_warps, preload=preload, new_stash=new_stash)


@functools.partial(jax.jit, static_argnames=("use_qk_l2norm", "interpret", "block_v"))
def _commit(initial_state, k, g, v_new, n_accepted, *, use_qk_l2norm, interpret, block_v):
    b, t, _, k_dim = k.shape
    v_dim = v_new.shape[3]
    kp, vp, tp = next_pow2(k_dim), next_pow2(v_dim), next_pow2(t)
    s0 = pad_axis(pad_axis(initial_state.astype(F32), 2, kp), 3, vp)
    k = pad_axis(pad_axis(k, 3, kp), 1, tp)
    u = pad_axis(pad_axis(v_new.astype(F32), 3, vp), 1, tp)
    g_t = jnp.moveaxis(pad_axis(g.astype(F32), 1, tp), 1, 2)  # [B, HV, Tp]
    n = jnp.broadcast_to(jnp.asarray(n_accepted, jnp.int32).reshape(-1), (b,))
    out = commit_kernel.commit_fwd(s0, k, g_t, u, n, l2norm=use_qk_l2norm, block_v=block_v, interpret=interpret)
    return out[:, :, :k_dim, :v_dim]


def commit_state(initial_state, k, g, v_new, n_accepted, *, use_qk_l2norm=False, interpret=False, block_v=32):
    """State after accepting the first `n_accepted` positions, rebuilt from pseudo-values (no snapshots).

    initial_state [B, HV, K, V] fp32; k [B, T, H, K] (as given to the verify call); g [B, T, HV] raw
    gates; v_new [B, T, HV, V]; n_accepted [B] int (traced, 0 <= a <= T). Returns [B, HV, K, V] fp32.
    """
    check_commit_inputs(initial_state, k, g, v_new, n_accepted)
    return _commit(initial_state, k, g, v_new, n_accepted, use_qk_l2norm=use_qk_l2norm, interpret=interpret,
                   block_v=check_block_v(block_v))


@functools.partial(jax.jit, static_argnames=("use_qk_l2norm", "interpret", "block_v", "num_warps", "preload"))
def _replay(initial_state, k, v, g, beta, n_steps, *, use_qk_l2norm, interpret, block_v, num_warps, preload):
    b, _, _, k_dim = k.shape
    v_dim = v.shape[3]
    kp, vp = next_pow2(k_dim), next_pow2(v_dim)
    s0 = pad_axis(pad_axis(initial_state.astype(F32), 2, kp), 3, vp)
    k, v = pad_axis(k, 3, kp), pad_axis(v, 3, vp)
    n = jnp.broadcast_to(jnp.asarray(n_steps, jnp.int32).reshape(-1), (b,))
    n = pad_axis(n, 0, next_pow2(b, 1))  # Triton blocks are powers of two
    out = recurrent_kernel.replay_fwd(k, v, g, beta, s0, n, l2norm=use_qk_l2norm, block_v=block_v,
                                      interpret=interpret, num_warps=num_warps, preload=preload)
    return out[:, :, :k_dim, :v_dim]


def replay_state(initial_state, k, v, g, beta, n_steps, *, use_qk_l2norm=False, interpret=False, block_v=8,
                 num_warps=1, preload=None):
    """State after the first `n_steps` [B] positions (traced), replayed from `initial_state` by the
    recurrent kernel's step with its grid, block and warps (`block_v`, `num_warps` must match the
    `fused_recurrent_gated_delta_rule` call whose states it reproduces). Returns [B, HV, K, V] fp32."""
    check_replay_inputs(initial_state, k, v, g, beta, n_steps)
    return _replay(initial_state, k, v, g, beta, n_steps, use_qk_l2norm=use_qk_l2norm, interpret=interpret,
                   block_v=check_block_v(block_v), num_warps=num_warps, preload=preload)


# The pseudo-value replay's (block_v, warps) by position count: free (every operation is elementwise, so every setting
# gives the same bits), chosen on an H200 at the 9B shape, 24 layers in one launch (docs/LOG.md, 2026-12-03): at
# T = 3 / 9 / 17 the verification's own (8, 1) took 94 / 117 / 115 us, (32, 4) 61 / 68 / 97 us, (64, 4) 67 / 72 / 83 us.
# Up to 16 positions (the unrolled form) (32, 4); from 17 (the loop form) (64, 4).
PSEUDO_REPLAY_SETTINGS = ((16, (32, 4)), (None, (64, 4)))  # (up to T, setting); None: any T


def pseudo_replay_setting(t: int, block_v=None, num_warps=None) -> tuple[int, int]:
    """(block_v, num_warps) of the pseudo-value replay of t positions: the arguments where given, else the measured
    default for t."""
    default = next(setting for bound, setting in PSEUDO_REPLAY_SETTINGS if bound is None or t <= bound)
    return launch_setting(default, block_v, num_warps)


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "num_warps", "preload"))
def _replay_pseudo(initial_state, k, g, v_new, n_steps, *, interpret, block_v, num_warps, preload):
    b, _, _, k_dim = k.shape
    v_dim = v_new.shape[3]
    kp, vp = next_pow2(k_dim), next_pow2(v_dim)
    s0 = pad_axis(pad_axis(initial_state.astype(F32), 2, kp), 3, vp)
    k, u = pad_axis(k.astype(F32), 3, kp), pad_axis(v_new.astype(F32), 3, vp)
    n = jnp.broadcast_to(jnp.asarray(n_steps, jnp.int32).reshape(-1), (b,))
    n = pad_axis(n, 0, next_pow2(b, 1))  # Triton blocks are powers of two
    out = recurrent_kernel.replay_pseudo_fwd(k, g, u, s0, n, block_v=block_v, interpret=interpret,
                                             num_warps=num_warps, preload=preload)
    return out[:, :, :k_dim, :v_dim]


def replay_pseudo_values(initial_state, k, g, v_new, n_steps, *, interpret=False, block_v=None, num_warps=None,
                         preload=None):
    """State after the first `n_steps` [B] positions (traced), from the keys `k` [B, T, H, K] (fp32, as the steps
    used them: normalised where they normalise) and pseudo-values `v_new` [B, T, HV, V] fp32 that the recurrent
    kernel's steps used and computed (its `replay_inputs`): each kept step is that kernel's own update on the same
    values, elementwise, so any `block_v` / `num_warps` gives the same bits (defaults: the measured fastest).
    Returns [B, HV, K, V] fp32."""
    check_commit_inputs(initial_state, k, g, v_new, n_steps, name="replay_pseudo_values")
    block_v, num_warps = pseudo_replay_setting(k.shape[1], block_v, num_warps)
    return _replay_pseudo(initial_state, k, g, v_new, n_steps, interpret=interpret, block_v=block_v,
                          num_warps=num_warps, preload=preload)
