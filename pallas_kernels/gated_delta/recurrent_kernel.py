"""Fused step recurrence for small T (decode, chain verification) as a Pallas (Triton backend) kernel.

Grid (B*HV, V/BV): each program keeps one [K, BV] fp32 state block in registers and walks the T
positions (T <= 64 in practice; any T works):

    S <- e^{g_t} S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T (scale q_t)

Rollback outputs: `u_t` (pseudo-values, [T, BV] per program: 1/K of a state per position) and,
for the snapshot baseline, the state after every position ([T, K, BV] per program).

One kernel per mode, over the helpers of `recurrent_chain` (the step's math, the loaders, the chain driver):

- `_step_kernel` (`recurrent_fwd`, `recurrent_packed_fwd`): decode and verification. Counted (`counts` given): the
  update of position t is kept only where t < counts[b], so the final state is the state after the first counts[b]
  positions (outputs past them are computed and meaningless): a decode step at a padded row count.
- `_replay_kernel` (`replay_fwd`): the commit of the replay rollback: the state after the accepted prefix,
  recomputed from the old state by the very arithmetic that verification (and AR decode) ran, so it equals the
  recurrence's state bit for bit (one read and one write of the state).
- `_pseudo_replay_kernel` (`replay_pseudo_fwd`, the GPU's commit): the verification stores the keys as its steps used
  them and the pseudo-values u_t they computed (`stash`), and each kept step is the step's own elementwise update on
  them, with no reduction, so any block shape gives the same bits (kernel README, "The pseudo-value replay").

Stacked states (`layer` given): the model keeps every GDN layer's state in one array [L, B, HV, K, V]; a step reads
and writes its own layer's blocks in place (the layer index is an input, so one compiled kernel serves every layer and
nothing copies the stack), and the replay commits every layer in ONE launch, the layers as batch rows (L * B).
At the Qwen3.5-9B shape that replay took 62 / 85 / 100 us per step at gamma 2 / 8 / 16, against 101 / 154 / 288 us for
24 launches, one per layer; fewer launches over separate arrays, and deferring the replay into the next
verification's launch, measured slower (docs/LOG.md, 2026-12-01 and 2026-12-02; kernel README).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ._kernel_utils import F32
from .packed import packed_loader
from .recurrent_chain import (decayed_state, gated_delta_step, initial_state, kept_count, kept_only,  # noqa: F401
                              plain_loader, pseudo_loader, rank_one_update, run_chain, write_state)

# Up to this many steps the kernel is unrolled; from 3 rows (every verification and its replay) the same step runs as a
# loop. Unrolled at 9 rows it is ~4,600 instructions run once, 31.8% of its warp samples waiting for instructions, 13.38
# against 10.53 us as a loop; in the model, with the loads a step ahead, gamma 2 / 4 / 8 steps 4.936 / 5.010 / 5.211 ms
# unrolled to 16, 4.910 / 4.964 / 5.122 with this bound (docs/LOG.md, 2026-12-03; kernel README, "A loop from 3 rows").
MAX_UNROLL = 2
# From 2 to this many steps all inputs are loaded before the first update (registers allow it). Measured on an H200 at
# the Qwen3.5-9B layer shape: T = 17 29.1 -> 19.9 us, T = 9 20.6 -> 20.2 us, but T = 1 (decode) 15.8 -> 24.7 us, so a
# single step loads as it goes (kernel README). The replay takes the same bound.
PRELOAD_MAX = 32
# The replay runs only the steps it keeps (a branch per unrolled step; the loop form ends at n): the same bits
# (interpret tests of both forms); a gamma-16 step at p 0.6 5.688 -> 5.508 ms on an H200 (docs/LOG.md, 2026-12-02).
REPLAY_SKIP = True
# Every position's loads are issued before any step input is formed (all at once unrolled, a step ahead in the loop):
# the same arithmetic either way; without it each position's loads waited behind the previous position's gates.
FETCH_FIRST = True


def _unroll(t: int, interpret: bool) -> bool:
    # Interpret mode runs the same step as a loop: unrolled it compiles ~10x slower on CPU. Why the bound is low:
    # compiled locally for sm_90a (Triton 3.8 + ptxas), an unrolled verification step is ~22 KB of code (the cubin
    # 200 KiB at T = 9, 373 KiB at T = 17; 208 registers, no spills), where the loop form is ~37 KiB whatever T; at 17
    # rows the unrolled kernel took 27.6 us per 9B layer against 7.8 at 9.
    return t <= MAX_UNROLL and not interpret


def _skip_unkept() -> bool:
    return REPLAY_SKIP


def _fetch_first() -> bool:
    return FETCH_FIRST


def _preload(preload, t: int, replay: bool = False) -> bool:
    return 1 < t <= PRELOAD_MAX if preload is None else bool(preload)


# ---------------------------------------------------------------------------------- kernels, one per mode
# Three kernels share the loaders, the chain driver and the state's read and write below: `_step_kernel` (decode and
# verification: outputs per position, optionally counted, stacked, stashed, packed), `_replay_kernel` (the replay
# rollback's commit: the state after the kept positions, by the same step) and `_pseudo_replay_kernel` (the GPU's
# commit: each kept step the step's own update on the keys, gates and pseudo-values a verification stored).


def _step_kernel(*refs, n_steps, scale, has_s0, want_vnew, want_states, l2norm, unroll, n_heads, preload,
                 counted=False, want_state=True, stacked=False, stash_group=0, stash_aliased=True, packed=False):
    """Decode and verification: each position's output o_t = S_t^T (scale q_t), its pseudo-value (want_vnew) and
    state (want_states), and the final state (want_state; counted: the state after the first counts[b] positions,
    while every row's output is still computed). stacked: the state refs hold every layer's block [L, K, BV]; a layer
    index ref (after the counts) says which one this call reads and writes.
    stash_group > 0 (with stacked): three more refs after the state's, the pseudo-value replay's inputs of every
    layer (k [L, T, Kp] fp32 as the steps used them, normalised where l2norm; g [L, T] as read; u [L, T, BV] fp32);
    this call stores its keys, gates and the pseudo-values it computes into layer `layer`'s rows (stash_group: value
    heads per key head, so one program of each key head writes the keys).
    packed (the packed form, `recurrent_packed_fwd`): instead of q, k, v, g, beta the refs are this program's columns
    of the layer's conv output ([R, K], [R, K], [R, BV]: q, k, v where they lie), the raw gate inputs b and a ([R],
    where they lie in the input projection's output) and A_log and dt_bias of every head ([HVp]); each position's
    beta and g are computed here (`packed.packed_loader`)."""
    n_valid = None
    if counted:
        n_valid, refs = kept_count(refs, n_heads)
    layer = None
    if stacked:
        layer_ref, refs = refs[0], refs[1:]
        layer = layer_ref[0]
    n_in = 7 if packed else 5
    inputs, rest = refs[:n_in], list(refs[n_in:])
    s0_ref = rest.pop(0) if has_s0 else None
    if stash_group and stash_aliased:
        del rest[:3]  # the stash's input buffers: aliased to its outputs below, never read
    o_ref = rest.pop(0)
    st_ref = rest.pop(0) if want_state else None
    vnew_ref = rest.pop(0) if want_vnew else None
    states_ref = rest.pop(0) if want_states else None
    stash_row = None
    if stash_group:
        # Which stacks this program writes, decided here: program ids are not read inside a loop body (interpret
        # mode cannot lower them there).
        first_block = pl.program_id(1) == 0
        key_writer = first_block & ((pl.program_id(0) % n_heads) % stash_group == 0)
        stash_row = functools.partial(_stash_row, rest, layer, first_block, key_writer)
    if packed:  # program ids read here, outside any loop body (see stash_row above)
        fetch, prepare = packed_loader(inputs, pl.program_id(0) % n_heads, l2norm)
        kdim, bv = inputs[0].shape[-1], inputs[2].shape[-1]
    else:
        q_ref, k_ref, v_ref, g_ref, beta_ref = inputs
        fetch, prepare = plain_loader(q_ref, k_ref, v_ref, g_ref, beta_ref, l2norm)
        kdim, bv = k_ref.shape[-1], v_ref.shape[-1]
    state = initial_state(s0_ref, layer, kdim, bv)

    def step(t, state, x):  # state [K, BV] fp32 -> (state after position t, its pseudo-value)
        q, k, g, v, beta = x[:5]
        new, u = gated_delta_step(state, k, v, g, beta)
        o_ref[t, :] = jnp.sum(new * (q * scale)[:, None], axis=0).astype(o_ref.dtype)
        if want_vnew:
            vnew_ref[t, :] = u
        if want_states:
            states_ref[t, :, :] = new
        # Past n_valid the state stays (a counted verification still computes every row's output).
        return (new if n_valid is None else jnp.where(t < n_valid, new, state)), u

    state, xs, us = run_chain(state, n_steps=n_steps, unroll=unroll, preload=preload, fetch_first=_fetch_first(),
                              fetch=fetch, prepare=prepare, step=step, stash_row=stash_row)
    if st_ref is not None:
        write_state(st_ref, layer, state)
    if stash_row:
        # After the chain, from the values the loads above brought in and the pseudo-values the chain computed:
        # stores only. (Loading inputs again before the chain, as a first form did, put a load's latency and three
        # branches ahead of it: +5-10 us per 9B layer; docs/LOG.md, 2026-12-02.)
        for t, (x, u) in enumerate(zip(xs, us)):
            stash_row(t, x[5], u)


def _replay_kernel(n_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, st_ref, *, n_steps, l2norm, unroll, n_heads,
                   preload):
    """The replay rollback's commit: the state after the first counts[b] positions, recomputed from s0 by the step
    decode and verification run (`gated_delta_step`, same loads and normalisation), so it is their state bit for
    bit. With REPLAY_SKIP only the kept steps run."""
    n_valid, _ = kept_count((n_ref,), n_heads)
    fetch, prepare = plain_loader(None, k_ref, v_ref, g_ref, beta_ref, l2norm)
    state = initial_state(s0_ref, None, k_ref.shape[-1], v_ref.shape[-1])
    skip = _skip_unkept()

    def step(t, state, x):
        q, k, g, v, beta = x[:5]
        new, u = gated_delta_step(state, k, v, g, beta)
        return (new if skip else jnp.where(t < n_valid, new, state)), u

    state, _, _ = run_chain(state, n_steps=n_steps, unroll=unroll, preload=preload, fetch_first=_fetch_first(),
                            fetch=fetch, prepare=prepare, step=step, kept=kept_only(step, n_valid) if skip else None,
                            stop_at=n_valid if skip else None)
    write_state(st_ref, None, state)


def _pseudo_replay_kernel(n_ref, k_ref, g_ref, u_ref, s0_ref, st_ref, *, n_steps, unroll, n_heads, preload):
    """The pseudo-value replay: each kept step is `rank_one_update(decayed_state(S, g_t), k_t, u_t)` on the keys (fp32,
    as the steps used them), gates and pseudo-values a verification stored: the verification's own update on the same
    values, elementwise (so any block shape gives the same bits). With REPLAY_SKIP only the kept steps run."""
    n_valid, _ = kept_count((n_ref,), n_heads)
    fetch, prepare = pseudo_loader(k_ref, g_ref, u_ref)
    state = initial_state(s0_ref, None, k_ref.shape[-1], u_ref.shape[-1])
    skip = _skip_unkept()

    def step(t, state, x):
        _, k, g, u, _ = x
        new = rank_one_update(decayed_state(state, g), k, u)
        return (new if skip else jnp.where(t < n_valid, new, state)), None

    state, _, _ = run_chain(state, n_steps=n_steps, unroll=unroll, preload=preload, fetch_first=_fetch_first(),
                            fetch=fetch, prepare=prepare, step=step, kept=kept_only(step, n_valid) if skip else None,
                            stop_at=n_valid if skip else None)
    write_state(st_ref, None, state)


def _stash_row(stash_refs, layer, first_block, key_writer, t, raw, u) -> None:
    """Store position t's key and gate `raw` = (k [Kp] fp32 as the step used it, g as read) and its pseudo-value u [BV]
    (fp32) into layer `layer` of the pseudo-value replay's input stacks: pseudo-values by every program (its own block), gates by the
    first value block of each head, keys by the first value head of each key head (the programs sharing a block hold
    the same values; one writes). Stores only: the arithmetic is untouched, and a commit replays every layer from
    these stacks in one launch without stacking 24 layers' inputs first (16-21 us per 9B step)."""
    ks_ref, gs_ref, us_ref = stash_refs[-3:]
    k, g = raw
    us_ref[layer, t, :] = u
    # Masked stores, not branches: straight-line code after the chain.
    plt.store(gs_ref.at[layer, t], g, mask=first_block)
    plt.store(ks_ref.at[layer, t, :], k, mask=jnp.broadcast_to(key_writer, k.shape))


def _block_specs(t: int, hv: int, group: int, kp: int, bv: int):
    """Blocks of program (batch * value head i, value block j), shared by the recurrent and replay kernels
    (same blocks, same reduction order): keys [T, Kp] of key head (i % HV) // group, values [T, BV], gates
    [T] read in their [B, T, HV] layout (one scalar per step, no transpose launch), state [Kp, BV]."""
    key_spec = pl.BlockSpec((None, t, None, kp), lambda i, j: (i // hv, 0, (i % hv) // group, 0))
    val_spec = pl.BlockSpec((None, t, None, bv), lambda i, j: (i // hv, 0, i % hv, j))
    gate_spec = pl.BlockSpec((None, t, None), lambda i, j: (i // hv, 0, i % hv))
    state_spec = pl.BlockSpec((None, None, kp, bv), lambda i, j: (i // hv, i % hv, 0, j))
    return key_spec, val_spec, gate_spec, state_spec


def recurrent_fwd(q, k, v, g, beta, s0, *, scale, l2norm, want_vnew, want_states, block_v, interpret,
                  num_warps=1, num_stages=2, preload=None, counts=None, want_state=True, layer=None, stash=None):
    """q, k [B, T, H, Kp]; v [B, T, HV, Vp]; g, beta [B, T, HV]; s0 [B, HV, Kp, Vp] fp32 or None;
    counts [Bp] int32 (Bp >= B a power of two) or None: the final state is the state after counts[b]
    positions (None: after all T). want_state: False writes no final state (a verification whose commit
    replays from s0).
    layer: None, or int32 [1]: s0 is then the stack of every layer's state [L, B, HV, Kp, Vp], the run starts from
    layer[0]'s, and the final state returned is the whole stack with that layer's state written in place (the other
    layers' blocks are neither read nor written: no copy of the stack, one kernel for every layer).
    stash: None, or (with layer) the pseudo-value replay's input stacks (k [L, B, T, H, Kp] and g [L, B, T, HV] in
    the inputs' dtypes, u [L, B, T, HV, Vp] fp32): returned last, with layer layer[0]'s rows replaced by this call's
    k, g and the pseudo-values u its steps computed (written in place: the other layers' rows are untouched); as
    ShapeDtypeStructs, new stacks are returned whose other layers' rows are unwritten (what the first layer of a
    forward asks for: no zero-fill).

    Returns o [B, T, HV, Vp] (v.dtype), final state [B, HV, Kp, Vp] fp32 (written over s0's buffer: each
    program reads its block before writing it; XLA copies s0 first where the caller still needs it) or
    None, u [B, T, HV, Vp] fp32 or None, states [B, T, HV, Kp, Vp] fp32 or None.
    """
    b, t, h, kp = q.shape
    hv, vp = v.shape[2], v.shape[3]
    key_spec, val_spec, gate_spec, _ = _block_specs(t, hv, hv // h, kp, min(block_v, vp))
    return _recurrent_call([q, k, v, g, beta], [key_spec, key_spec, val_spec, gate_spec, gate_spec], s0,
                           dims=(b, t, h, hv, kp, vp), out_dtype=v.dtype, packed=False,
                           scale=scale, l2norm=l2norm, want_vnew=want_vnew, want_states=want_states, block_v=block_v,
                           interpret=interpret, num_warps=num_warps, num_stages=num_stages, preload=preload,
                           counts=counts, want_state=want_state, layer=layer, stash=stash)


def recurrent_packed_fwd(conv, gates, a_log, dt_bias, s0, *, layout, n_steps, scale, l2norm, block_v, interpret,
                         want_vnew=False, want_states=False, num_warps=1, num_stages=2, preload=None, counts=None,
                         want_state=True, layer=None, stash=None):
    """The recurrent kernel in its packed form: each program reads its q, k and v columns where they lie in the layer's
    conv output and computes its positions' beta and g itself (`packed.packed_loader`), so no XLA op splits the conv output
    or forms the gates between the layer's projections and the kernel.

    conv [B, R, C] (channels q | k | v, `layout`: packed.PackedLayout, K and V powers of two >= 16); gates
    [B, R, G] (b and a at layout.b_column / a_column + head); a_log, dt_bias [HVp] (zero-padded to a power of two);
    n_steps <= R: the positions run. Everything else and the returns as `recurrent_fwd`, for inputs of n_steps
    positions; the stash's gates are float32 (g as computed).
    """
    b, h, hv = conv.shape[0], layout.key_heads, layout.value_heads
    kp, vp = layout.key_dim, layout.value_dim
    group, bv = hv // h, min(block_v, vp)
    rows = conv.shape[1]
    q_spec = pl.BlockSpec((None, rows, kp), lambda i, j: (i // hv, 0, (i % hv) // group))
    k_spec = pl.BlockSpec((None, rows, kp), lambda i, j: (i // hv, 0, h + (i % hv) // group))
    v_first, v_per_head = 2 * h * kp // bv, vp // bv  # v's first block and blocks per head, in units of bv channels
    v_spec = pl.BlockSpec((None, rows, bv), lambda i, j: (i // hv, 0, v_first + (i % hv) * v_per_head + j))
    r = gates.shape[1]
    b_spec = pl.BlockSpec((None, r, None), lambda i, j: (i // hv, 0, layout.b_column + i % hv))
    a_spec = pl.BlockSpec((None, r, None), lambda i, j: (i // hv, 0, layout.a_column + i % hv))
    head_spec = pl.BlockSpec((a_log.shape[0],), lambda i, j: (0,))
    return _recurrent_call(
        [conv, conv, conv, gates, gates, a_log, dt_bias], [q_spec, k_spec, v_spec, b_spec, a_spec, head_spec, head_spec],
        s0, dims=(b, n_steps, h, hv, kp, vp), out_dtype=conv.dtype, packed=True, scale=scale, l2norm=l2norm,
        want_vnew=want_vnew, want_states=want_states, block_v=block_v, interpret=interpret, num_warps=num_warps,
        num_stages=num_stages, preload=preload, counts=counts, want_state=want_state, layer=layer, stash=stash,
        name="gdn_recurrent_packed")


def _recurrent_call(args, in_specs, s0, *, dims, out_dtype, packed, scale, l2norm, want_vnew,
                    want_states, block_v, interpret, num_warps, num_stages, preload, counts, want_state, layer, stash,
                    name="gdn_recurrent"):
    """The recurrent kernel's launch from its step inputs `args` (with their block specs): the counts, layer index,
    state, stash and outputs around them, shared by the plain and packed forms. dims: (B, T, H, HV, Kp, Vp)."""
    b, t, h, hv, kp, vp = dims
    group = hv // h
    bv = min(block_v, vp)
    nv = vp // bv
    has_s0 = s0 is not None
    _, val_spec, _, state_spec = _block_specs(t, hv, group, kp, bv)
    args, in_specs = list(args), list(in_specs)
    if counts is not None:
        in_specs.insert(0, pl.BlockSpec((counts.shape[0],), lambda i, j: (0,)))
        args.insert(0, counts)
    stacked = layer is not None
    if stacked:
        if not has_s0:
            raise ValueError("recurrent_fwd: a layer index needs the stacked initial state")
        # Every layer's [K, BV] block of this program's head and value block; the kernel indexes the layer.
        state_spec = pl.BlockSpec((s0.shape[0], None, None, kp, bv), lambda i, j: (0, i // hv, i % hv, 0, j))
        in_specs.insert(1 if counts is not None else 0, pl.BlockSpec((1,), lambda i, j: (0,)))
        args.insert(1 if counts is not None else 0, layer)
    if has_s0:
        in_specs.append(state_spec)
        args.append(s0)
    state_arg = len(args) - 1
    stash_specs = []
    if stash is not None:
        if not stacked:
            raise ValueError("recurrent_fwd: the replay's input stash needs the layer index (stacked states)")
        n_layers = stash[0].shape[0]
        stash_specs = [
            pl.BlockSpec((n_layers, None, t, None, kp), lambda i, j: (0, i // hv, 0, (i % hv) // group, 0)),
            pl.BlockSpec((n_layers, None, t, None), lambda i, j: (0, i // hv, 0, i % hv)),
            pl.BlockSpec((n_layers, None, t, None, bv), lambda i, j: (0, i // hv, 0, i % hv, j))]
        stash_aliased = not all(isinstance(x, jax.ShapeDtypeStruct) for x in stash)
        first_stash = len(args)
        if stash_aliased:
            in_specs += stash_specs
            args += list(stash)
    out_specs = [val_spec] + ([state_spec] if want_state else [])
    out_shape = [jax.ShapeDtypeStruct((b, t, hv, vp), out_dtype)]
    if want_state:
        out_shape.append(jax.ShapeDtypeStruct(s0.shape if stacked else (b, hv, kp, vp), F32))
    # The final state over s0's buffer: in the decode loop the state is carried in place, where a separate
    # output cost a 2 MiB copy per GDN layer and token at the 9B shape (24 `memcpy128`, 55 us per token).
    aliases = {state_arg: 1} if has_s0 and want_state else {}
    if want_vnew:
        out_specs.append(val_spec)
        out_shape.append(jax.ShapeDtypeStruct((b, t, hv, vp), F32))
    if want_states:
        out_specs.append(pl.BlockSpec((None, t, None, kp, bv), lambda i, j: (i // hv, 0, i % hv, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((b, t, hv, kp, vp), F32))
    if stash is not None:
        if stash_aliased:
            aliases.update({first_stash + i: len(out_shape) + i for i in range(len(stash))})
        out_specs += stash_specs
        out_shape += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in stash]
    outs = pl.pallas_call(
        functools.partial(_step_kernel, n_steps=t, scale=scale, has_s0=has_s0, want_vnew=want_vnew,
                          want_states=want_states, l2norm=l2norm, n_heads=hv,
                          preload=_preload(preload, t), counted=counts is not None,
                          unroll=_unroll(t, interpret), want_state=want_state, stacked=stacked,
                          stash_group=group if stash is not None else 0,
                          stash_aliased=stash is not None and stash_aliased, packed=packed),
        grid=(b * hv, nv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*args)
    outs = list(outs)
    o = outs.pop(0)
    final = outs.pop(0) if want_state else None
    u = outs.pop(0) if want_vnew else None
    states = outs.pop(0) if want_states else None
    return o, final, u, states, (tuple(outs) if stash is not None else None)


def _replay_launch(counts, inputs, in_specs, s0, state_spec, *, grid, pseudo, l2norm, interpret, num_warps,
                   num_stages, preload, name):
    """One replay launch: counts, the step inputs (with their block specs) and the state s0 (aliased to the output)."""
    t, hv = inputs[0].shape[1], s0.shape[1]
    options = dict(n_steps=t, n_heads=hv, preload=_preload(preload, t, replay=True), unroll=_unroll(t, interpret))
    kernel = (functools.partial(_pseudo_replay_kernel, **options) if pseudo
              else functools.partial(_replay_kernel, l2norm=l2norm, **options))
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.BlockSpec((counts.shape[0],), lambda i, j: (0,))] + list(in_specs) + [state_spec],
        out_specs=state_spec,
        out_shape=jax.ShapeDtypeStruct(s0.shape, F32),
        input_output_aliases={len(inputs) + 1: 0},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(counts, *inputs, s0)


def replay_fwd(k, v, g, beta, s0, counts, *, l2norm, block_v, interpret, num_warps=1, num_stages=2, preload=None):
    """State after the first counts[b] positions, by the recurrent kernel's own step (see module doc).

    k [B, T, H, Kp]; v [B, T, HV, Vp]; g, beta [B, T, HV]; s0 [B, HV, Kp, Vp] fp32; counts [B] int32.
    Returns [B, HV, Kp, Vp] fp32, written over s0's buffer (each program reads and writes one block).
    Same grid, block shape and warps as `recurrent_fwd`, so every reduction runs in the same order.
    """
    b, t, h, kp = k.shape
    hv, vp = v.shape[2], v.shape[3]
    bv = min(block_v, vp)
    key_spec, val_spec, gate_spec, state_spec = _block_specs(t, hv, hv // h, kp, bv)
    return _replay_launch(counts, (k, v, g, beta), (key_spec, val_spec, gate_spec, gate_spec), s0, state_spec,
                          grid=(b * hv, vp // bv), pseudo=False, l2norm=l2norm, interpret=interpret,
                          num_warps=num_warps, num_stages=num_stages, preload=preload, name="gdn_replay")


def replay_pseudo_fwd(k, g, u, s0, counts, *, block_v, interpret, num_warps, num_stages=2, preload=None):
    """State after the first counts[b] positions from the keys and pseudo-values the verification's steps used and
    computed: each kept step is the recurrence's own `rank_one_update(decayed_state(S, g_t), k_t, u_t)` on the same
    values, so the state is the recurrence's bit for bit. Every operation is elementwise (no reduction: the keys come
    normalised), so the block shape and warps are free (`block_v`, `num_warps`: any, the same bits) and the chain's
    latency is a few instructions per step.

    k [B, T, H, Kp] fp32 (as the steps used them); g [B, T, HV]; u [B, T, HV, Vp] fp32; s0 [B, HV, Kp, Vp] fp32;
    counts [B] int32. Returns [B, HV, Kp, Vp] fp32, written over s0's buffer.
    """
    b, t, h, kp = k.shape
    hv, vp = u.shape[2], u.shape[3]
    bv = min(block_v, vp)
    key_spec, val_spec, gate_spec, state_spec = _block_specs(t, hv, hv // h, kp, bv)
    return _replay_launch(counts, (k, g, u), (key_spec, gate_spec, val_spec), s0, state_spec,
                          grid=(b * hv, vp // bv), pseudo=True, l2norm=False, interpret=interpret,
                          num_warps=num_warps, num_stages=num_stages, preload=preload, name="gdn_replay_pseudo")
