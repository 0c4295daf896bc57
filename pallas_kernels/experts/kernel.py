"""Grouped expert products (Pallas, Triton backend): every weight tile of an expert read once per tile of its copies.

The copies are laid out sorted by expert, each expert's group padded to whole tiles of `block_m` rows
(`__init__.group_layout`); tile t belongs to expert tile_expert[t] (-1: unused, written as zeros). Grid (tiles,
column blocks): a program multiplies its tile's rows [BM, K] by one block of its expert's stored rows [BN, K]
(the checkpoint's [E, F, K] layout, no transposed copy), walking K in fixed steps of `block_k`. A row's result is a
function of that row and its expert alone, accumulated over K in the same order whatever the tile's other rows,
so a token's expert output does not depend on which tokens share its experts (README.md).

With `swiglu`, the weights are (gate ; up) stacked [E, 2I, K]: a program reads gate rows j and up rows I + j of one
column block and writes silu(gate) * up, so the [copies, 2I] intermediate never reaches memory.

With `shared_w` [1, F, K] (a model's shared expert, stored apart from the stack), tile expert E names it: its tiles run
the same K steps on those weights (a second loop, empty for every other tile), so the shared expert is one more tile
of the same launch and no copy of the stack with it appended exists.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

F32 = jnp.float32


def _dot_t(a, b, exact):
    """a [M, K] @ b [N, K]^T, fp32 accumulation."""
    prec = lax.Precision.HIGHEST if exact and a.dtype == F32 else None
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=F32)


def _grouped_kernel(tile_expert_ref, x_ref, w_ref, *refs, block_n, block_k, k_dim, half, swiglu, exact, shared):
    s_ref, o_ref = refs if shared else (None, refs[0])
    E = w_ref.shape[0]
    e = tile_expert_ref[pl.program_id(0)]
    cols = pl.program_id(1) * block_n
    # An unused tile reads nothing and writes zeros. The trip counts are built as int32 products: Triton's loop
    # needs its bounds of one type, and a `where` of Python ints lowered to an i1 bound (H100, jax 0.11.2).
    steps = jnp.int32(k_dim // block_k)
    n_routed = (((e >= 0) & (e < E)) if shared else (e >= 0)).astype(jnp.int32) * steps
    n_shared = (e == E).astype(jnp.int32) * steps  # the shared expert's tiles (only with shared_w)
    e = jnp.clip(e, 0, E - 1) if shared else jnp.maximum(e, 0)
    rows = x_ref.shape[0]

    def step_on(w_at):
        def step(i, acc):
            at = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
            x = x_ref[:, at]  # [BM, BK]
            if swiglu:
                g, u = acc
                g = g + _dot_t(x, w_at(cols, at).astype(x.dtype), exact)
                u = u + _dot_t(x, w_at(half + cols, at).astype(x.dtype), exact)
                return g, u
            return acc + _dot_t(x, w_at(cols, at).astype(x.dtype), exact)
        return step

    routed = step_on(lambda c, at: w_ref[e, pl.ds(c, block_n), at])
    zero = jnp.zeros((rows, block_n), F32)
    acc = lax.fori_loop(jnp.int32(0), n_routed, routed, (zero, zero) if swiglu else zero)
    if shared:  # the same steps in the same order on the shared expert's weights: a routed expert's arithmetic
        acc = lax.fori_loop(jnp.int32(0), n_shared, step_on(lambda c, at: s_ref[0, pl.ds(c, block_n), at]), acc)
    if swiglu:
        g, u = acc
        o_ref[...] = (g / (1.0 + jnp.exp(-g)) * u).astype(o_ref.dtype)  # silu(g) * u, in ops every backend lowers
    else:
        o_ref[...] = acc.astype(o_ref.dtype)


def grouped_matmul(x, tile_expert, w, *, swiglu: bool, block_m: int, block_n: int, block_k: int, num_warps: int,
                   num_stages: int, interpret: bool = False, shared_rows: bool = False, shared_w=None):
    """x [R, K] (R = tiles * block_m rows, sorted and padded by expert), tile_expert [tiles] int32, w [E, F, K].
    shared_rows: x is one tile's rows [block_m, K] that every tile multiplies (each by its own expert).
    shared_w: None, or [1, F, K]: the weights of tile expert E (a shared expert kept apart from the stack).

    Returns [tiles * block_m, F] (or [.., F / 2] with swiglu: silu(gate) * up) in x.dtype. F (F / 2) and K must be
    multiples of block_n and block_k (`__init__` checks)."""
    R, K = x.shape
    E, F, _ = w.shape
    out_cols = F // 2 if swiglu else F
    tiles = tile_expert.shape[0] if shared_rows else R // block_m
    shared = shared_w is not None
    kernel = functools.partial(_grouped_kernel, block_n=block_n, block_k=block_k, k_dim=K, half=out_cols,
                               swiglu=swiglu, exact=interpret or x.dtype == F32, shared=shared)
    in_specs = [
        pl.BlockSpec((tiles,), lambda t, j: (0,)),
        pl.BlockSpec((block_m, K), (lambda t, j: (0, 0)) if shared_rows else (lambda t, j: (t, 0))),
        pl.BlockSpec((E, F, K), lambda t, j: (0, 0, 0)),  # indexed by the tile's expert inside the kernel
    ]
    operands = [tile_expert.astype(jnp.int32), x, w]
    if shared:
        assert shared_w.shape == (1, F, K), (shared_w.shape, w.shape)
        in_specs.append(pl.BlockSpec((1, F, K), lambda t, j: (0, 0, 0)))
        operands.append(shared_w)
    return pl.pallas_call(
        kernel,
        grid=(tiles, out_cols // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((tiles * block_m, out_cols), x.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_expert_swiglu" if swiglu else "grouped_expert_down",
    )(*operands)
