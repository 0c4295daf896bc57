"""The Gated DeltaNet layer of the Qwen3.5 hybrids (a part of `qwen35`, which re-exports these names): its input
projection split, conv, gates, the token mixer that runs the gated-delta ops, and the commit rules applied to every
GDN layer at once.

The step recurrence (decode and chain verification) runs in the packed form where `gated_delta.packed_form_enabled`
holds and the layout allows it (`packed_form`): the kernel reads q, k, v where they lie in the conv output and b, a
in the input projection's output and forms the gates itself, so no XLA op splits them or forms the gates between the
layer's projections and the kernel. Decode and verification run the same form, so their arithmetic stays alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_kernels import gated_delta

from ... import sharding
from .config import Qwen35Config
from ...sharding import STATE_HEADS, TOKEN_HEADS
from .. import layers as L
from .params import fused_segments

# Longest verification the step recurrence runs (snapshot and replay rollback; the Pallas recurrent
# kernel unrolls its steps up to this length).
MAX_RECURRENT_VERIFY = 64


def linear_key_heads(cfg: Qwen35Config) -> int:
    """GDN key heads as stored (q and k): linear_num_key_heads, or one copy per device when the mesh is larger."""
    return sharding.stored_units(cfg.linear_num_key_heads, cfg.tp_size)


def conv_channels(cfg: Qwen35Config) -> int:
    """Channels of the GDN conv and its state: cfg.conv_dim, with the key-head copies of a large mesh."""
    return 2 * linear_key_heads(cfg) * cfg.linear_key_head_dim + cfg.linear_value_dim


def gdn_projections(p: dict, cfg: Qwen35Config, x: jax.Array):
    """The fused input projection split: x [B, T, D] -> qkv [B, T, conv_channels] (pre-conv), z [B, T, HV, V],
    b, a [B, T, HV]. Under a mesh the rows are grouped per device (sharding.py): qkv stays grouped, as the conv
    weight and conv state are."""
    return split_projection(cfg, L.linear(x, p["in_proj"]))


def split_projection(cfg: Qwen35Config, proj: jax.Array):
    """`gdn_projections` from the fused projection's output proj [B, T, C + HV*V + 2*HV] (qkv | z | b | a)."""
    B, T, _ = proj.shape
    HV, V = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    widths = sharding.group_widths(fused_segments(cfg)["in_proj"], cfg.tp_size)  # q, k, v, z, b, a
    qkv, z, b, a = sharding.split_groups(proj, (sum(widths[:3]),) + widths[3:], cfg.tp_size)
    return qkv, z.reshape(B, T, HV, V), b, a


def gdn_heads(cfg: Qwen35Config, conv: jax.Array):
    """The conv output [B, T, conv_channels] as heads: q, k [B, T, H, K] (H = linear_key_heads(cfg)),
    v [B, T, HV, V]."""
    B, T, _ = conv.shape
    q, k, v = sharding.split_groups(conv, sharding.group_widths(fused_segments(cfg)["conv"], cfg.tp_size), cfg.tp_size)
    H, K = linear_key_heads(cfg), cfg.linear_key_head_dim
    return (q.reshape(B, T, H, K), k.reshape(B, T, H, K),
            v.reshape(B, T, cfg.linear_num_value_heads, cfg.linear_value_head_dim))


# The outputs of a gated-delta op, per device under a mesh: every field split over its heads.
_GDN_OUTPUT_SPECS = gated_delta.GatedDeltaOutput(o=TOKEN_HEADS, final_state=STATE_HEADS, v_new=TOKEN_HEADS,
                                                 g_cumsum=TOKEN_HEADS, all_states=TOKEN_HEADS)


def gdn_rule(cfg: Qwen35Config, rule, q, k, v, g, beta, initial_state, state_steps=None, **options):
    """rule (gated_delta.fused_recurrent_gated_delta_rule or chunk_gated_delta_rule) from initial_state; under a
    mesh once per device on its own heads (sharding.over_heads: the heads are independent, and a Pallas kernel
    cannot be split by GSPMD). options: the rule's static keyword arguments."""
    def run(q, k, v, g, beta, s0, steps):
        return rule(q, k, v, g, beta, initial_state=s0, **({} if steps is None else {"state_steps": steps}),
                    **options)

    run = sharding.over_heads(run, cfg.mesh, (TOKEN_HEADS,) * 5 + (STATE_HEADS, P()), _GDN_OUTPUT_SPECS)
    return run(q, k, v, g, beta, initial_state, state_steps)


def gdn_state_rule(mesh, rule, initial_state, *per_token, n, **options):
    """A commit rule (gated_delta.replay_state or commit_state) of the state [B, HV, K, V] over per-token tensors
    [B, T, heads, ...] and counts n [B]; under a mesh (cfg.mesh) once per device on its own heads."""
    run = sharding.over_heads(lambda s0, *xs: rule(s0, *xs[:-1], xs[-1], **options), mesh,
                              (STATE_HEADS,) + (TOKEN_HEADS,) * len(per_token) + (P(),), STATE_HEADS)
    return run(initial_state, *per_token, n)


def gdn_gates(p: dict, b: jax.Array, a: jax.Array):
    """beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias) (float32), both [B, T, HV]."""
    return gated_delta.gate_values(b, a, p["A_log"], p["dt_bias"])


def packed_form(cfg: Qwen35Config, impl: str) -> gated_delta.PackedLayout | None:
    """The layout of the packed form of this model's step recurrences (gated_delta.packed_recurrent_gated_delta_rule:
    q, k, v read where they lie in the conv output, beta and g computed in the kernel from the projection's columns),
    or None where they take separate inputs: the form is off or its kernel does not take the layout
    (gated_delta.packed_form_enabled), or the rows are grouped per device (a mesh). A static choice per model and
    implementation, so every step recurrence of a model (decode and verification) runs in one form."""
    if cfg.mesh is not None or cfg.tp_size != 1:
        return None
    HV, V = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    b_column = conv_channels(cfg) + HV * V  # the fused projection's columns: qkv | z | b | a
    layout = gated_delta.PackedLayout(linear_key_heads(cfg), HV, cfg.linear_key_head_dim, V, b_column, b_column + HV)
    return layout if gated_delta.packed_form_enabled(impl, layout) else None


def conv_window_at(window: jax.Array, n: jax.Array, width: int) -> jax.Array:
    """The conv state after the first n [B] of the new inputs: window [B, W-1+T, C] -> [B, width=W-1, C]."""
    return jax.vmap(lambda w, a: lax.dynamic_slice_in_dim(w, a, width, axis=0))(window, n)


def stacked_conv_windows_at(windows: list, n: jax.Array, width: int) -> jax.Array:
    """Every GDN layer's conv state after the first n [B] new inputs, in one op: windows, L arrays
    [B, W-1+T, C] -> [L, B, width, C]. One op, not one per layer: at the 9B shape the 24 per-layer slices were 24
    launches, about 46 us per commit (docs/LOG.md, 2026-12-02)."""
    stacked = jnp.stack(windows)  # [L, B, W-1+T, C]
    n_layers, batch = stacked.shape[:2]
    rows = conv_window_at(stacked.reshape((n_layers * batch,) + stacked.shape[2:]), jnp.tile(n, n_layers), width)
    return rows.reshape((n_layers, batch) + rows.shape[1:])


def gdn_mixer(p: dict, cfg: Qwen35Config, x: jax.Array, conv_state: jax.Array, rec_states: jax.Array, slot: int,
              impl: str, collect, n_valid=None, live_rows=None, replay_inputs=None, prefill_lens=None):
    """Gated DeltaNet token mixer. x [B, T, D] -> out [B, T, D], new conv state, new recurrent states, extras.

    rec_states: every GDN layer's state [n_gdn, B, HV, K, V]; this layer's is rec_states[slot]. The step kernel
    reads and writes it in place; the other paths (chunk, a mesh) take it out and put it back.

    n_valid [B] or None: rows past it are padding (decode shape); the new states are those after n_valid.
    live_rows (static, with n_valid) or None: no valid row lies past the first live_rows, so the recurrence
    runs on those only and the rest get a zero GDN output (see `forward`).
    replay_inputs: under replay rollback on one device, the (k, g, u) stacks [n_gdn, B, T, ...] of the layers before
    (None: created here), returned in extras with this layer's keys, gates and pseudo-values stored by the step
    kernel.
    prefill_lens [B] or None: a padded prefill chunk whose rows past prefill_lens are padding. Their gates are set
    to g = 0, beta = 0, under which a step leaves the state exactly as it is (decay e^0 = 1, update 0 * ...), so
    the chunked rule's final state is the state after the valid rows; the conv window is taken at that boundary."""
    B, T, _ = x.shape
    HV, V, W = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    proj = L.linear(x, p["in_proj"])  # [B, T, C + HV*V + 2*HV]; the packed form reads b and a where they lie in it
    qkv, z, b, a = split_projection(cfg, proj)

    window = jnp.concatenate([conv_state.astype(qkv.dtype), qkv], axis=1)  # [B, W-1+T, C]
    new_conv = window[:, T:] if n_valid is None else conv_window_at(window, n_valid, W - 1)  # [B, W-1, C]
    conv = gated_delta.short_conv_silu(window, p["conv"], T)  # [B, T, C]
    q, k, v = gdn_heads(cfg, conv)
    beta, g = gdn_gates(p, b, a)
    if prefill_lens is not None:
        if n_valid is not None or collect:
            raise ValueError("gdn_mixer: prefill_lens is a prefill's padding; it takes neither n_valid nor collect")
        valid = (jnp.arange(T, dtype=jnp.int32)[None, :] < prefill_lens[:, None])[..., None]  # [B, T, 1]
        beta, g = jnp.where(valid, beta, 0.0).astype(beta.dtype), jnp.where(valid, g, 0.0).astype(g.dtype)
        new_conv = conv_window_at(window, prefill_lens, W - 1)
    live = T if n_valid is None or live_rows is None else min(int(live_rows), T)
    layout = packed_form(cfg, impl)
    if n_valid is not None and gated_delta.resolve(impl, "recurrent") != "pallas":
        # The decode shape on the jnp recurrence: its inputs are computed for all T rows, as one value whatever
        # `live` is (XLA's CPU compiler, fusing the slice below into their producers, computed them in another
        # order: last-bit differences in bf16 and fp32). The Pallas kernel reads its inputs from memory, written
        # by elementwise producers, so on the GPU the barrier is left out: there it cost one copy per input and
        # GDN layer, 120 copies and 120 us per 9B token (docs/LOG.md, 2026-12-01).
        q, k, v, g, beta = lax.optimization_barrier((q, k, v, g, beta))
    if live < T:
        # The step recurrence is a chain of dependent steps, one per row: padding rows would lengthen it (at the
        # 9B shape about 0.5 us per row and layer). A row's steps are the same instructions whatever the row
        # count, so the valid rows' outputs and states are unchanged.
        q, k, v, g, beta = (t[:, :live] for t in (q, k, v, g, beta))
        n_valid = jnp.minimum(n_valid, live)

    snapshots, replay = collect == "snapshot", collect == "replay"
    # Under replay rollback the commit recomputes the state from rec_states, so verification writes none (one
    # write of every GDN state saved per step); the states returned are then the unchanged rec_states.
    skip_state = replay and cfg.mesh is None
    kwargs = dict(output_final_state=not skip_state, return_pseudo_values=bool(collect) and not replay,
                  use_qk_l2norm=True, implementation=impl)
    if (snapshots or replay or n_valid is not None) and T > MAX_RECURRENT_VERIFY:
        raise ValueError(f"{collect or 'a decode-shape forward'} runs at most {MAX_RECURRENT_VERIFY} positions "
                         f"through the step recurrence; got T={T}")
    recurrent = gated_delta.fused_recurrent_gated_delta_rule
    # The packed form commits from its kernel's stash (the keys and gates it used), never from inputs computed here.
    if skip_state and replay_inputs is None and (layout is not None or gated_delta.replay_stash_enabled(impl)):
        replay_inputs = "new"  # the first GDN layer: new stacks, each later layer fills its rows

    def run(rule, state_steps=None, **options):  # -> (result, the states after it)
        if rule is recurrent and cfg.mesh is None:
            if skip_state and replay_inputs is not None:
                options["replay_inputs"] = replay_inputs
            if layout is not None:  # the kernel reads q, k, v and b, a where they lie (every row: the same
                # conv op in AR and verification) and forms the gates itself
                res = gated_delta.packed_recurrent_gated_delta_rule(
                    conv, proj, p["A_log"], p["dt_bias"], layout=layout, n_steps=live, initial_state=rec_states,
                    state_steps=state_steps, state_layer=slot, **options)
            else:
                res = gdn_rule(cfg, rule, q, k, v, g, beta, rec_states, state_steps, state_layer=slot, **options)
            return res, rec_states if res.final_state is None else res.final_state
        res = gdn_rule(cfg, rule, q, k, v, g, beta, rec_states[slot], state_steps, **options)
        return res, rec_states if res.final_state is None else rec_states.at[slot].set(res.final_state)

    if n_valid is not None:
        # Decode shape: every row, AR step or verification, through the same step kernel; the state is
        # the one after the valid rows. A verification that writes no state runs uncounted: its outputs are the
        # same (each row's output comes before the count's mask), and at 17 rows the 24 layers' kernels took 662
        # us per 9B step against 744 us counted.
        steps = None if skip_state and not snapshots else n_valid
        res, new_states = run(recurrent, steps, return_all_states=snapshots, **kwargs)
    elif snapshots:
        res, new_states = run(recurrent, return_all_states=True, **kwargs)
    elif prefill_lens is None and (T == 1 or replay or (collect and T <= MAX_RECURRENT_VERIFY
                              and gated_delta.resolve(impl, "recurrent") == "pallas")):
        # Decode; verification under replay rollback (the commit re-runs this very step, so the committed
        # state is the recurrence's); short verification when the recurrent op is a Pallas kernel (one
        # launch per layer, measured faster than the chunk kernels on the GPU: see verify_forms_choice()).
        res, new_states = run(recurrent, **kwargs)
    else:
        # Prefill (an unrolled 64-step kernel took minutes to compile), and verification elsewhere: the
        # chunked form is parallel over T (as an XLA loop the step recurrence is T dependent launches).
        res, new_states = run(gated_delta.chunk_gated_delta_rule, **kwargs)
    o = res.o if live == T else jnp.pad(res.o, ((0, 0), (0, T - live), (0, 0), (0, 0)))  # padding rows: zeros
    o = L.gated_rms_norm(o.astype(x.dtype), z, p["norm"], cfg.rms_norm_eps)  # [B, T, HV, V]
    out = L.linear(o.reshape(B, T, HV * V), p["out_proj"])
    extras = {}
    if replay:  # what the step needs to run again: keys (normalised in the kernel), values, gates; on one device
        # every layer's so far, stacked by the step kernel
        extras = ({"replay_inputs": res.replay_inputs} if res.replay_inputs is not None
                  else {"k": k, "v": v, "g": g, "beta": beta}) | {"conv_window": window}
    elif collect:
        extras = {"k": k, "g": g, "v_new": res.v_new, "conv_window": window}
        if snapshots:
            extras["all_states"] = res.all_states  # [B, T, HV, K, V]: the per-position baseline
    return out, new_conv, new_states, extras


def stacked_state_rule(mesh, rule, states, per_layer: tuple, n: jax.Array, **options) -> jax.Array:
    """A commit rule (gated_delta.replay_state or commit_state) applied to every GDN layer in ONE call: states
    [L, B, HV, K, V], per_layer a tuple of per-token inputs, each a list of L arrays [B, T, ...] or one stack
    [L, B, T, ...], counts n [B]. The layers become batch rows (L * B: the kernels' programs are per batch row and
    head, so each row runs the arithmetic it runs alone, and the bits are those of one call per layer). Returns
    [L, B, HV, K, V]."""
    n_layers, batch = states.shape[:2]
    merged = tuple((xs if isinstance(xs, jax.Array) else jnp.stack(xs)).reshape((n_layers * batch,) + xs[0].shape[1:])
                   for xs in per_layer)
    out = gdn_state_rule(mesh, rule, states.reshape((n_layers * batch,) + states.shape[2:]), *merged,
                         n=jnp.tile(n, n_layers), **options)
    return out.reshape(states.shape)
