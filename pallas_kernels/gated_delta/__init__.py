"""Gated delta rule: one signature, several implementations, chosen by a static flag.

    implementation = "reference"  pure jnp (chunked WY for the chunk op, the step recurrence for
                                  the recurrent op); runs everywhere, differentiable
                     "naive"      the per-step recurrence (ground truth)
                     "pallas"     GPU kernels (interpret=True runs them on CPU for tests)

`default_implementation(op)` picks, on GPU, the implementation measured fastest for that op (the
measurements are named at `_PALLAS_BY_DEFAULT`): Pallas for the chunk, recurrent and replay ops, XLA for
the pseudo-value commit. Elsewhere: reference.
The environment variable SPECDEC_GDN_IMPLEMENTATION overrides it: one implementation for every op
("reference"), or per op ("recurrent=pallas,commit=pallas"; ops: chunk, recurrent, commit, replay, tree).
"""

from __future__ import annotations

import functools
import os

import jax

from . import reference
from . import packed
from .packed import PackedLayout, gate_values, short_conv_silu
from .reference import GatedDeltaOutput, check_gated_delta_inputs, l2_normalize

IMPLEMENTATIONS = ("reference", "naive", "pallas")
OPS = ("chunk", "recurrent", "commit", "replay", "tree")
ENV_VAR = "SPECDEC_GDN_IMPLEMENTATION"


@functools.cache
def _pallas_module():
    try:
        from . import pallas_ops
    except ImportError:
        return None
    return pallas_ops


def pallas_available() -> bool:
    return _pallas_module() is not None


# Ops whose Pallas kernel has been measured faster than the XLA path on the GPU (H200): the chunk op (prefill, long
# verification: 5.6x the XLA path at T = 8192, benchmarks/results/gdn_h200.md), and the recurrent op in decode and in
# verification of up to 64 tokens, and so the replay commit that re-runs it (a 9-token verification at the 9B shape
# 5.63 ms against 6.76 ms for the chunk kernels and 7.47 ms as an XLA loop; docs/LOG.md, 2026-12-01). The
# pseudo-value commit stays on XLA: its Pallas kernel measured slower (9B: 0.37 / 2.14 ms against 0.30 / 0.35 ms at
# gamma 8 / 16).
_PALLAS_BY_DEFAULT = frozenset({"chunk", "recurrent"})

# Whether a replay-rollback verification stores the inputs its commit replays from (`replay_inputs`: keys, gates and
# pseudo-values, nothing stacked first). None: where the step recurrence runs as the compiled Pallas kernel (the GPU),
# not elsewhere (the CPU's paths replay from stacked inputs); True / False force it (tests). Same bits as the full
# replay, step by step at the 9B shape; speedup / tokens per step at gamma 8 0.936-0.975 with it (docs/LOG.md,
# 2026-12-02 and 2026-12-03; kernel README).
REPLAY_STASH: bool | None = None
# Whether the step recurrence runs in the packed form where the Pallas kernel takes the layout (q, k, v read where they
# lie in the conv output, beta and g formed in the kernel): 9B AR 4.846 -> 4.806 ms per token, steps ~1% faster
# (docs/LOG.md, 2026-12-03). False runs the plain form (tests compare the two).
PACKED_FORM = True


def replay_stash_enabled(implementation: str | None = "auto") -> bool:
    """Whether a model's verification under replay rollback passes `replay_inputs` to its step kernels (the stacks of
    keys, gates and pseudo-values its commit replays from with `replay_pseudo_values`), read when a function is
    traced: REPLAY_STASH where set, else on where the step recurrence runs as the compiled Pallas kernel (the GPU)."""
    if REPLAY_STASH is not None:
        return bool(REPLAY_STASH)
    return jax.default_backend() == "gpu" and _resolve(implementation, "recurrent") == "pallas"


def packed_form_enabled(implementation: str | None = "auto", layout: PackedLayout | None = None) -> bool:
    """Whether a model runs its step recurrences in the packed form (`packed_recurrent_gated_delta_rule`: q, k, v read
    where they lie in the layer's conv output, beta and g computed inside the step kernel), read when a function is
    traced: where PACKED_FORM holds, the step recurrence is the Pallas kernel and its packed form takes `layout`
    (None: any it takes). Where it is on, a model runs every step recurrence in that form (decode and verification
    alike, so both compute each position's gates with the same instructions) and, under replay rollback, commits from
    the kernel's stash."""
    if not PACKED_FORM or _resolve(implementation, "recurrent") != "pallas":
        return False
    return layout is None or _pallas_module().packed_form_supported(layout)


def env_override(op: str) -> str | None:
    """The implementation SPECDEC_GDN_IMPLEMENTATION asks for `op`, or None (unset / op not listed)."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    if "=" not in raw:
        choice = {op: raw}
    else:
        choice = {}
        for item in raw.split(","):
            name, _, impl = item.partition("=")
            name, impl = name.strip(), impl.strip()
            if name not in OPS:
                raise ValueError(f"{ENV_VAR}={raw!r}: unknown op {name!r}; expected one of {OPS}")
            choice[name] = impl
    for impl in choice.values():
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"{ENV_VAR}={raw!r}: implementation must be one of {IMPLEMENTATIONS}; got {impl!r}")
    return choice.get(op)


def default_implementation(op: str = "chunk") -> str:
    """SPECDEC_GDN_IMPLEMENTATION overrides; else pallas on GPU for measured ops, else reference."""
    forced = env_override(op)
    if forced:
        return forced
    if op == "replay":  # the replay must run the recurrence's own arithmetic: same implementation
        return default_implementation("recurrent")
    on_gpu = jax.default_backend() == "gpu" and pallas_available()
    return "pallas" if on_gpu and op in _PALLAS_BY_DEFAULT else "reference"


def _interpret(flag: bool) -> bool:
    """Pallas kernels compile for the GPU only; elsewhere they run in interpret mode."""
    return bool(flag) or jax.default_backend() != "gpu"


def resolve(implementation: str | None, op: str = "chunk") -> str:
    """The implementation that `implementation` ("auto" / None / a name) means for `op`."""
    return _resolve(implementation, op)


def _resolve(implementation: str | None, op: str = "chunk") -> str:
    impl = default_implementation(op) if implementation in (None, "auto") else implementation
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"gated_delta: implementation must be one of {IMPLEMENTATIONS} or 'auto'; got {impl!r}")
    if impl == "pallas" and not pallas_available():
        raise ValueError("gated_delta: implementation 'pallas' requested but pallas_kernels.gated_delta.pallas_ops "
                         "is not importable")
    return impl


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=True,
                           return_pseudo_values=False, use_qk_l2norm=False, implementation="auto",
                           interpret=False) -> GatedDeltaOutput:
    """Chunked gated delta rule for any T (prefill / verification).

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state [B, HV, K, V] fp32.
    Returns GatedDeltaOutput(o [B, T, HV, V], final_state, v_new, g_cumsum).
    """
    impl = _resolve(implementation)
    kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  return_pseudo_values=return_pseudo_values, use_qk_l2norm=use_qk_l2norm)
    if impl == "reference":
        # Short inputs (verification) use one chunk of exactly T rows instead of padding to 64.
        chunk = min(reference.CHUNK_SIZE, q.shape[1])
        return reference.chunk_gated_delta_rule_reference(q, k, v, g, beta, chunk_size=chunk, **kwargs)
    if impl == "naive":
        return reference.naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    return _pallas_module().chunk_gated_delta_rule(q, k, v, g, beta, interpret=_interpret(interpret), **kwargs)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                                     output_final_state=True, return_pseudo_values=False,
                                     return_all_states=False, use_qk_l2norm=False, implementation="auto",
                                     interpret=False, state_steps=None, state_layer=None,
                                     replay_inputs=None) -> GatedDeltaOutput:
    """Step recurrence for small T (decode, chain verification) from an initial state.

    Rollback modes: `return_all_states` (one state snapshot per position, the baseline) or
    `return_pseudo_values` (v_new, g_cumsum for `commit_state`). `state_steps` [B] (traced) or None:
    the final state is the one after that many positions, the rest of the T rows being padding (a decode
    step at a padded row count: every row meets the same kernel, and the state is the recurrence's).
    `state_layer` (int or traced int32 scalar) or None: `initial_state` is a stack of layers' states
    [L, B, HV, K, V], the run starts from that layer's, and `final_state` is the stack with that layer's state
    replaced (the Pallas kernel reads and writes that layer's blocks in place: a model keeps its GDN states in
    one array, so that a commit can replay every layer in one launch).
    `replay_inputs` (with `state_layer`) or None: stacks (k, g, u) of every layer's keys (fp32, as the steps used
    them), gates and pseudo-values [L, B, T, ...] (reference.check_replay_inputs_stack), or "new" (new stacks, other layers' rows unspecified: no
    zero-fill on the GPU, for the first layer of a forward); the output's `replay_inputs` are those stacks with this
    call's keys, gates and pseudo-values in layer `state_layer`'s rows (the Pallas kernel stores them in place), so
    that a commit replays every layer from them in one launch (`replay_pseudo_values`) with nothing stacked first.
    """
    impl = _resolve(implementation, "recurrent")
    kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  return_pseudo_values=return_pseudo_values, return_all_states=return_all_states,
                  use_qk_l2norm=use_qk_l2norm, state_steps=state_steps)
    if impl in ("reference", "naive"):
        if state_layer is None:
            if replay_inputs is not None:
                raise ValueError("gated_delta: replay_inputs needs state_layer (a stack of layers' states)")
            return reference.naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
        reference.check_stacked_state(initial_state, state_layer, check_gated_delta_inputs(q, k, v, g, beta))
        if replay_inputs is not None:
            reference.check_replay_inputs_stack(replay_inputs, (q, k, v, g, beta), initial_state.shape[0])
        return reference.stacked_rule(reference.naive_recurrent_gated_delta_rule, q, k, v, g, beta,
                                      state_layer=state_layer, replay_inputs=replay_inputs, **kwargs)
    return _pallas_module().fused_recurrent_gated_delta_rule(q, k, v, g, beta, interpret=_interpret(interpret),
                                                             state_layer=state_layer, replay_inputs=replay_inputs,
                                                             **kwargs)


def packed_recurrent_gated_delta_rule(conv, gates, a_log, dt_bias, *, layout: PackedLayout, n_steps: int, scale=None,
                                      initial_state=None, output_final_state=True, return_pseudo_values=False,
                                      return_all_states=False, use_qk_l2norm=False, implementation="auto",
                                      interpret=False, state_steps=None, state_layer=None,
                                      replay_inputs=None) -> GatedDeltaOutput:
    """`fused_recurrent_gated_delta_rule` of n_steps positions whose inputs lie as a Gated DeltaNet layer produces them
    (packed.packed_inputs): conv [B, R, C] (the conv output of R >= n_steps rows; channels q | k | v), gates
    [B, R, G] (b and a of value head h at columns layout.b_column + h, layout.a_column + h), a_log and dt_bias [HV].
    The Pallas implementation reads q, k, v and b, a where they lie and computes beta and g inside the step kernel
    (no XLA op between the layer's projections and the kernel); the others, and Pallas for a layout its kernel does
    not take, take the inputs apart with jnp and run the plain op. Its stash's gates are float32."""
    impl = _resolve(implementation, "recurrent")
    kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  return_pseudo_values=return_pseudo_values, return_all_states=return_all_states,
                  use_qk_l2norm=use_qk_l2norm, state_steps=state_steps, state_layer=state_layer,
                  replay_inputs=replay_inputs, interpret=interpret)
    if impl != "pallas" or not _pallas_module().packed_form_supported(layout):
        inputs = packed.packed_inputs(conv, gates, a_log, dt_bias, layout, n_steps)
        return fused_recurrent_gated_delta_rule(*inputs, implementation=impl, **kwargs)
    return _pallas_module().packed_recurrent_gated_delta_rule(
        conv, gates, a_log, dt_bias, layout=layout, n_steps=n_steps, **(kwargs | {"interpret": _interpret(interpret)}))


def commit_state(initial_state, k, g, v_new, n_accepted, *, use_qk_l2norm=False, implementation="auto",
                 interpret=False):
    """State after accepting the first `n_accepted` [B] positions (traced), from pseudo-values."""
    impl = _resolve(implementation, "commit")
    if impl in ("reference", "naive"):
        return reference.commit_state_reference(initial_state, k, g, v_new, n_accepted,
                                                use_qk_l2norm=use_qk_l2norm)
    return _pallas_module().commit_state(initial_state, k, g, v_new, n_accepted, use_qk_l2norm=use_qk_l2norm,
                                         interpret=_interpret(interpret))


def replay_state(initial_state, k, v, g, beta, n_steps, *, use_qk_l2norm=False, implementation="auto",
                 interpret=False):
    """State after the first `n_steps` [B] positions (traced), recomputed from `initial_state` by the
    recurrence's own step: the replay commit. Bit-identical to the state `fused_recurrent_gated_delta_rule`
    of the same implementation reaches at that position (k, v, g, beta as given to it)."""
    impl = _resolve(implementation, "replay")
    if impl in ("reference", "naive"):
        return reference.replay_state_reference(initial_state, k, v, g, beta, n_steps, use_qk_l2norm=use_qk_l2norm)
    return _pallas_module().replay_state(initial_state, k, v, g, beta, n_steps, use_qk_l2norm=use_qk_l2norm,
                                         interpret=_interpret(interpret))


def replay_pseudo_values(initial_state, k, g, v_new, n_steps, *, implementation="auto", interpret=False):
    """State after the first `n_steps` [B] positions (traced) from the keys `k` [B, T, H, K] (fp32, as the steps used
    them: normalised where they normalise) and pseudo-values `v_new` [B, T, HV, V] fp32 that
    `fused_recurrent_gated_delta_rule` of the same implementation used and computed (its `replay_inputs`): each kept
    step is the recurrence's own update on the same values, so the state is the one it reached there, bit for bit,
    with no reduction in the chain (the replay commit's fast form)."""
    impl = _resolve(implementation, "replay")
    if impl in ("reference", "naive"):
        return reference.replay_pseudo_values_reference(initial_state, k, g, v_new, n_steps)
    return _pallas_module().replay_pseudo_values(initial_state, k, g, v_new, n_steps, interpret=_interpret(interpret))


__all__ = ["GatedDeltaOutput", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "commit_state",
           "replay_state", "replay_pseudo_values", "replay_stash_enabled", "packed_recurrent_gated_delta_rule",
           "packed_form_enabled", "PackedLayout", "short_conv_silu", "gate_values",
           "check_gated_delta_inputs", "l2_normalize", "default_implementation", "env_override", "resolve",
           "pallas_available"]
