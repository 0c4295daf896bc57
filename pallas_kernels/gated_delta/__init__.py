"""Gated delta rule: one signature, several implementations, chosen by a static flag.

    implementation = "reference"  pure jnp (chunked WY for the chunk op, the step recurrence for
                                  the recurrent op); runs everywhere, differentiable
                     "naive"      the per-step recurrence (ground truth)
                     "pallas"     GPU kernels (interpret=True runs them on CPU for tests)

`default_implementation()` picks pallas on GPU when the kernels are importable, else reference;
the environment variable SPECDEC_GDN_IMPLEMENTATION overrides it.
"""

from __future__ import annotations

import functools
import os

import jax

from . import reference
from .reference import GatedDeltaOutput, check_gated_delta_inputs, l2_normalize

IMPLEMENTATIONS = ("reference", "naive", "pallas")


@functools.cache
def _pallas_module():
    try:
        from . import pallas_ops
    except ImportError:
        return None
    return pallas_ops


def pallas_available() -> bool:
    return _pallas_module() is not None


def default_implementation() -> str:
    """SPECDEC_GDN_IMPLEMENTATION overrides; else pallas on GPU when importable, else reference."""
    forced = os.environ.get("SPECDEC_GDN_IMPLEMENTATION")
    if forced:
        return forced
    return "pallas" if jax.default_backend() == "gpu" and pallas_available() else "reference"


def _resolve(implementation: str | None) -> str:
    impl = default_implementation() if implementation in (None, "auto") else implementation
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
        return reference.chunk_gated_delta_rule_reference(q, k, v, g, beta, **kwargs)
    if impl == "naive":
        return reference.naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    return _pallas_module().chunk_gated_delta_rule(q, k, v, g, beta, interpret=interpret, **kwargs)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                                     output_final_state=True, return_pseudo_values=False,
                                     return_all_states=False, use_qk_l2norm=False, implementation="auto",
                                     interpret=False) -> GatedDeltaOutput:
    """Step recurrence for small T (decode, chain verification) from an initial state.

    Rollback modes: `return_all_states` (one state snapshot per position, the baseline) or
    `return_pseudo_values` (v_new, g_cumsum for `commit_state`).
    """
    impl = _resolve(implementation)
    kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  return_pseudo_values=return_pseudo_values, return_all_states=return_all_states,
                  use_qk_l2norm=use_qk_l2norm)
    if impl in ("reference", "naive"):
        return reference.naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    return _pallas_module().fused_recurrent_gated_delta_rule(q, k, v, g, beta, interpret=interpret, **kwargs)


def commit_state(initial_state, k, g, v_new, n_accepted, *, use_qk_l2norm=False, implementation="auto",
                 interpret=False):
    """State after accepting the first `n_accepted` [B] positions (traced), from pseudo-values."""
    impl = _resolve(implementation)
    if impl in ("reference", "naive"):
        return reference.commit_state_reference(initial_state, k, g, v_new, n_accepted,
                                                use_qk_l2norm=use_qk_l2norm)
    return _pallas_module().commit_state(initial_state, k, g, v_new, n_accepted, use_qk_l2norm=use_qk_l2norm,
                                         interpret=interpret)


__all__ = ["GatedDeltaOutput", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "commit_state",
           "check_gated_delta_inputs", "l2_normalize", "default_implementation", "pallas_available"]
