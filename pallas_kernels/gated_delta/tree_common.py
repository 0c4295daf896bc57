"""Tree structure helpers shared by the tree-WY reference (`tree_wy.py`) and its Pallas kernel
(`tree_kernel.py`): ancestor matrices from traced parent indices, parent checks, path gate sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = jnp.float32
_HIGHEST = lax.Precision.HIGHEST
MAX_PALLAS_NODES = 64  # the Pallas tree kernel pads N to 16 / 32 / 64


# ----------------------------------------------------------------------------------------------
# Tree structure helpers (traced parents)
# ----------------------------------------------------------------------------------------------

def n_squarings(n: int) -> int:
    """Squarings of the one-step reach matrix (I + P) that cover every root path of an n-node tree.

    After s squarings the matrix reaches ancestors up to 2^s steps away; the deepest node of an
    n-node tree is n - 1 steps from the root.
    """
    return max(0, n - 2).bit_length()


def ancestor_matrix(parents) -> jax.Array:
    """M[..., i, j] = (j is an ancestor of i, i included): bool [N, N] or [B, N, N].

    parents: int [N] or [B, N] (traced is fine), parents[i] < i, roots have -1. Computed by
    repeated squaring of the one-step matrix I + P (log2 N small integer matmuls, no loop over nodes).
    """
    parents = jnp.asarray(parents, jnp.int32)
    n = parents.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    reach = (parents[..., :, None] == idx) | (idx[:, None] == idx[None, :])  # [..., N, N] one step or self
    for _ in range(n_squarings(n)):
        r = reach.astype(jnp.int32)
        reach = jnp.einsum("...ij,...jl->...il", r, r) > 0
    return reach


def batched_parents(parents, b: int, n: int) -> jax.Array:
    parents = jnp.asarray(parents, jnp.int32)
    if parents.shape not in ((n,), (b, n)):
        raise ValueError(f"tree_wy: parents must be [N={n}] or [B={b}, N={n}]; got {parents.shape}")
    return jnp.broadcast_to(parents, (b, n))


def check_parents(parents, b: int, n: int) -> None:
    """Shape check always; topological order (-1 <= parents[i] < i) checked when parents are concrete."""
    batched_parents(parents, b, n)
    try:
        p = np.asarray(parents)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if p.size and (np.any(p < -1) or np.any(p >= np.arange(n))):
        raise ValueError("tree_wy: parents must be in topological order, -1 <= parents[i] < i "
                         f"(roots have -1); got {p.tolist()}")


def path_gammas(anc: jax.Array, g: jax.Array) -> jax.Array:
    """gamma_i = sum_{j in anc(i)} g_j: anc bool [N, N] or [B, N, N], g [B, N, HV] -> [B, N, HV] fp32."""
    anc = jnp.broadcast_to(anc, (g.shape[0],) + anc.shape[-2:]).astype(F32)
    return jnp.einsum("bil,blh->bih", anc, g.astype(F32), precision=_HIGHEST)
