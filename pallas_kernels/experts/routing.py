"""A decode step's routing in one kernel (Pallas, Triton backend): softmax router, top-k, renormalised weights and
the shared-rows tiles (`first_copy_tiles`) of at most `block_m` tokens, one program.

XLA emits this chain (softmax, top-k by ranks, renormalisation, padding masks, the copies' first-copy reduction) as
several small kernels per MoE layer, each a launch on a step that reads a few MB of weights; here it is one launch.
Top-k is k rounds of (max, lowest expert id holding it): lax.top_k's experts, order and ties. Nothing here touches
a weight, so the kernel's numerics only have to be those of a fixed program: AR steps and verifications run the same
one, and a row's routing reads its own logits alone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

F32 = jnp.float32


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _route_kernel(logits_ref, valid_ref, w_ref, i_ref, tile_ref, te_ref, *, k: int, num_experts: int):
    NP, E = logits_ref.shape
    KP = w_ref.shape[1]
    logits = logits_ref[...].astype(F32)  # [NP, E]
    valid = valid_ref[...] != 0  # [NP, 1]
    m = jnp.max(logits, axis=1, keepdims=True)
    e = jnp.exp(logits - m)
    probs = e / jnp.sum(e, axis=1, keepdims=True)  # jax.nn.softmax's formula
    experts = lax.broadcasted_iota(jnp.int32, (NP, E), 1)
    slots = lax.broadcasted_iota(jnp.int32, (NP, KP), 1)
    rows = lax.broadcasted_iota(jnp.int32, (NP, KP), 0)
    top_w = jnp.zeros((NP, KP), F32)
    top_i = jnp.full((NP, KP), -1, jnp.int32)
    first = jnp.full((1, E), NP * k, jnp.int32)  # [1, E]: each expert's first selected copy (n k + s)
    left = probs
    total = jnp.zeros((NP, 1), F32)
    for s in range(k):  # rank s: the largest probability left, the lowest expert id among equals
        v = jnp.max(left, axis=1, keepdims=True)  # [NP, 1]
        i = jnp.min(jnp.where(left == v, experts, E), axis=1, keepdims=True)  # [NP, 1]
        left = jnp.where(experts == i, -1.0, left)
        total = total + v
        top_w = jnp.where(slots == s, v, top_w)
        top_i = jnp.where(slots == s, i, top_i)
        copy = lax.broadcasted_iota(jnp.int32, (NP, 1), 0) * k + s  # [NP, 1]
        hit = (experts == i) & valid  # [NP, E]
        first = jnp.minimum(first, jnp.min(jnp.where(hit, copy, NP * k), axis=0, keepdims=True))
    top_w = top_w / total
    live = valid & (slots < k)  # [NP, KP]
    top_i = jnp.where(live, top_i, -1)
    top_w = jnp.where(live, top_w, 0.0)
    # A copy's tile: its expert's first copy (a gather from `first` by the copy's expert, as a masked reduction).
    tile = jnp.full((NP, KP), NP * k, jnp.int32)
    for s in range(k):
        i_s = jnp.sum(jnp.where(slots == s, top_i, 0), axis=1, keepdims=True)  # [NP, 1]
        t_s = jnp.min(jnp.where(experts == i_s, first, NP * k), axis=1, keepdims=True)  # [NP, 1]
        tile = jnp.where(slots == s, t_s, tile)
    tile = jnp.where(live, tile, NP * k)
    te = jnp.where(live & (tile == rows * k + slots), top_i, -1)  # tile n k + s: its expert where copy (n, s) is first
    w_ref[...] = top_w
    i_ref[...] = top_i
    tile_ref[...] = tile
    te_ref[...] = te


def route_top_k(logits: jax.Array, valid: jax.Array | None, k: int, *, interpret: bool | None = None):
    """logits [N, E], valid [N] bool or None -> (top_w [N, k] float32 renormalised, top_i [N, k] int32 (-1 where the
    row is not valid), copy_tile [N k] int32 (N k: none), tile_expert [N k] int32 (-1: unused)).

    top_w, top_i: jax.nn.softmax, lax.top_k and the division by the k weights' sum, as `route_logits` computes them
    (the weights' last bits may differ: a fixed program's reduction order); copy_tile, tile_expert:
    `first_copy_tiles`. E must be a power of two."""
    N, E = logits.shape
    if E & (E - 1):
        raise ValueError(f"route_top_k: the number of experts must be a power of two; got {E}")
    NP, KP = max(16, _pow2(N)), max(16, _pow2(k))
    valid = jnp.ones((N,), bool) if valid is None else valid
    lg = jnp.pad(logits, ((0, NP - N), (0, 0)))
    vd = jnp.pad(valid.astype(jnp.int32), (0, NP - N))[:, None]  # [NP, 1]
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    full = lambda shape: pl.BlockSpec(shape, lambda: (0,) * len(shape))
    out = pl.pallas_call(
        functools.partial(_route_kernel, k=k, num_experts=E),
        grid=(),
        in_specs=[full((NP, E)), full((NP, 1))],
        out_specs=[full((NP, KP))] * 4,
        out_shape=[jax.ShapeDtypeStruct((NP, KP), F32)] + [jax.ShapeDtypeStruct((NP, KP), jnp.int32)] * 3,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="moe_route_top_k",
    )(lg, vd)
    top_w, top_i, tile, te = (a[:N, :k] for a in out)
    return top_w, top_i, jnp.minimum(tile, N * k).reshape(-1), te.reshape(-1)  # a valid copy's tile is < N k
