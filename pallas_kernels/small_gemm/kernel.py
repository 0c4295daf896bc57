"""Few-row float32 product at full precision as a Pallas (Triton backend) kernel.

Grid (N / BLOCK_N,): each program owns BLOCK_N output columns, i.e. BLOCK_N contiguous rows of the weight
([out, in], the checkpoint's orientation), and walks the contraction in BLOCK_K steps:

    acc [16, BLOCK_N] += x[:, k0:k0+BLOCK_K] (16 rows, zero-padded) @ w[n0:n0+BLOCK_N, k0:k0+BLOCK_K]^T

as an IEEE float32 dot (no TF32): every weight is read once, by one program, in full 128-byte lines. The
input rows are padded to 16, the smallest row count of Triton's dot; padded rows are computed and dropped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MAX_ROWS = 16  # rows are padded to this (Triton's dot needs 16)
BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 3


def supports(m: int, n: int, k: int, block_n: int = BLOCK_N, block_k: int = BLOCK_K) -> bool:
    """Row counts 1..16 and sizes the blocks tile exactly (no masked edges)."""
    return 1 <= m <= MAX_ROWS and n % block_n == 0 and k % block_k == 0


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, n_k: int):
    def body(i, acc):
        start = pl.multiple_of(i * block_k, block_k)
        xk = x_ref[:, pl.ds(start, block_k)]  # [16, BK]
        wk = w_ref[:, pl.ds(start, block_k)]  # [BN, BK]
        return acc + lax.dot_general(xk, wk, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                     preferred_element_type=jnp.float32)

    o_ref[...] = lax.fori_loop(0, n_k, body, jnp.zeros(o_ref.shape, jnp.float32))


def small_gemm(x: jax.Array, w: jax.Array, *, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
               num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES, interpret: bool = False) -> jax.Array:
    """x [M, K] float32 (M <= 16) @ w [N, K]^T float32 -> [M, N] float32; sizes must pass `supports`."""
    m, k = x.shape
    n = w.shape[0]
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"small_gemm takes float32 operands; got {x.dtype} and {w.dtype}")
    if w.shape[1] != k:
        raise ValueError(f"small_gemm: x [M, K] = {x.shape} and w [N, K] = {w.shape} disagree on K")
    if not supports(m, n, k, block_n, block_k):
        raise ValueError(f"small_gemm: M = {m} must lie in [1, {MAX_ROWS}], N = {n} be a multiple of {block_n} and "
                         f"K = {k} of {block_k}")
    xp = jnp.pad(x, ((0, MAX_ROWS - m), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, n_k=k // block_k),
        grid=(n // block_n,),
        in_specs=[pl.BlockSpec((MAX_ROWS, k), lambda j: (0, 0)), pl.BlockSpec((block_n, k), lambda j: (j, 0))],
        out_specs=pl.BlockSpec((MAX_ROWS, block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((MAX_ROWS, n), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="small_gemm_f32",
    )(xp, w)
    return out[:m]
