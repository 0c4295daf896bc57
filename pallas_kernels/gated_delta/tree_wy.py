"""Tree-WY: verify a whole draft tree of the gated delta rule in one pass, commit any node without snapshots.

A draft tree has N nodes in topological order: `parents[i] < i`, the root (node 0, the anchor
token) has parent -1. Per value head, with anc(i) the ancestors of i *including* i (derivation in
README.md, "Tree-WY"):

    gamma_i = sum_{j in anc(i)} g_j                Gamma_ij = exp(gamma_i - gamma_j) if j in anc(i) else 0
    A_ij = beta_i (k_i . k_j) Gamma_ij for j a strict ancestor of i   (strictly lower triangular)
    T = (I + A)^{-1};   U = T (beta V);   W = T (beta e^gamma K);   V_new = U - W S0
    O = scale [ (Q e^gamma) S0 + ((Q K^T) * Gamma) V_new ]
    commit node a:  S_a = e^{gamma_a} S0 + sum_{j in anc(a)} e^{gamma_a - gamma_j} k_j v_new_j^T

Row i of V_new is the pseudo-value u_i of the sequential recurrence run along the root-to-i path,
and o_i its output there: every node sees exactly its own path (rounding only). A chain
(parents = i - 1) reduces to the chunked WY form of `reference.chunk_gated_delta_rule_reference`.

Precision: gamma_i - gamma_j is never a difference of two path sums (those reach -1000s under
strong decay and cancel); it is formed directly as the sum of g over the path nodes strictly
after j up to i, (M[i] & ~M[j]) . g with M the ancestor matrix, and exponentiated under the mask.

Shapes: q, k [B, N, H, K]; v [B, N, HV, V]; g, beta [B, N, HV]; parents [N] or [B, N] int32
(traced: one compilation serves every tree shape of size N); initial_state [B, HV, K, V] fp32.

Implementations (one signature, `tree_gated_delta_rule(..., implementation=)`):
- "reference": ancestor-masked jnp (this file), the XLA path; any N, differentiable.
- "naive": the sequential recurrence `naive_recurrent_gated_delta_rule` along every root path
  (host-side path extraction: parents must be concrete). Ground truth for tests.
- "pallas": one Triton-backend Pallas kernel (`tree_kernel.py`), N <= 64 (padded to 16/32/64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .reference import GatedDeltaOutput, check_accepted_counts, check_commit_inputs, check_gated_delta_inputs, \
    l2_normalize, naive_recurrent_gated_delta_rule, prepare_inputs
from .tree_common import (MAX_PALLAS_NODES, batched_parents, ancestor_matrix, check_parents,  # noqa: F401
                          n_squarings, path_gammas)

_HIGHEST = lax.Precision.HIGHEST
F32 = jnp.float32
IMPLEMENTATIONS = ("reference", "naive", "pallas")
STATE_MODES = ("tree-wy", "snapshots")


def path_decay_exponents(anc: jax.Array, g: jax.Array) -> jax.Array:
    """E[b, h, i, j] = gamma_i - gamma_j for j in anc(i) (else 0), as a direct path sum.

    E_ij = sum_l M_il (1 - M_jl) g_l: the gates of the path nodes strictly after j up to i. Every
    product is g_l times 0 or 1 (exact), so E keeps the precision of a sum of (depth_i - depth_j)
    terms, never a difference of two large sums. anc [N, N] or [B, N, N] bool; g [B, N, HV].
    Returns [B, HV, N, N] fp32.
    """
    b = g.shape[0]
    anc = jnp.broadcast_to(anc, (b,) + anc.shape[-2:])
    m = anc.astype(F32)
    on_path = m[:, None, :, :] * jnp.moveaxis(g.astype(F32), 1, 2)[:, :, None, :]  # [B, HV, N(i), N(l)]
    expo = jnp.einsum("bhil,bjl->bhij", on_path, 1.0 - m, precision=_HIGHEST)
    return jnp.where(anc[:, None], expo, 0.0)


def _exp_masked(x: jax.Array, mask: jax.Array) -> jax.Array:
    """exp(x) where mask else 0, with exp never evaluated off the mask."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


# ----------------------------------------------------------------------------------------------
# Reference (ancestor-masked jnp): the XLA path
# ----------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"))
def _tree_reference(q, k, v, g, beta, parents, initial_state, *, scale, use_qk_l2norm):
    out_dtype = v.dtype
    b, n = q.shape[:2]
    parents = batched_parents(parents, b, n)
    q, k, v, g, beta, s0 = prepare_inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)  # q scaled
    anc = ancestor_matrix(parents)  # [B, N, N]
    gamma = path_gammas(anc, g)  # [B, N, HV]
    expo = path_decay_exponents(anc, g)  # [B, HV, N, N]
    eye = jnp.eye(n, dtype=bool)
    decay = _exp_masked(expo, anc[:, None])  # Gamma (ancestors incl. self) [B, HV, N, N]
    decay_strict = jnp.where(eye, 0.0, decay)

    head_major = lambda x: jnp.moveaxis(x, 1, 2)  # [B, N, HV, ...] -> [B, HV, N, ...]
    qh, kh, vh = head_major(q), head_major(k), head_major(v)  # [B, HV, N, K|V]
    gam, bet = head_major(gamma), head_major(beta)  # [B, HV, N]
    kk = jnp.einsum("bhik,bhjk->bhij", kh, kh, precision=_HIGHEST)
    a = bet[..., :, None] * kk * decay_strict  # strictly lower triangular (parents[i] < i)
    lhs = jnp.eye(n, dtype=F32) + a
    solve = lambda rhs: jax.scipy.linalg.solve_triangular(lhs, rhs, lower=True, unit_diagonal=True)
    u = solve(bet[..., None] * vh)  # [B, HV, N, V]
    w = solve((bet * jnp.exp(gam))[..., None] * kh)  # [B, HV, N, K]
    v_new = u - jnp.einsum("bhnk,bhkv->bhnv", w, s0, precision=_HIGHEST)  # pseudo-values
    qk = jnp.einsum("bhik,bhjk->bhij", qh, kh, precision=_HIGHEST) * decay
    o = (jnp.einsum("bhnk,bhkv->bhnv", qh * jnp.exp(gam)[..., None], s0, precision=_HIGHEST)
         + jnp.einsum("bhij,bhjv->bhiv", qk, v_new, precision=_HIGHEST))
    return GatedDeltaOutput(o=head_major(o).astype(out_dtype), final_state=None, v_new=head_major(v_new),
                            g_cumsum=gamma)


def tree_gated_delta_rule_reference(q, k, v, g, beta, parents, *, initial_state, scale=None,
                                    use_qk_l2norm=False) -> GatedDeltaOutput:
    """Tree-WY verification in jnp (ancestor masks, one triangular solve per head).

    q, k [B, N, H, K]; v [B, N, HV, V]; g, beta [B, N, HV]; parents [N] or [B, N] int32 (traced ok);
    initial_state [B, HV, K, V] fp32 (None: zeros). Returns GatedDeltaOutput(o [B, N, HV, V] in
    v.dtype, final_state None, v_new [B, N, HV, V] fp32 pseudo-values, g_cumsum [B, N, HV] fp32
    path gammas). Node i's o and v_new are those of the recurrence along its root path.
    """
    b, n = check_gated_delta_inputs(q, k, v, g, beta, initial_state)[:2]
    check_parents(parents, b, n)
    return _tree_reference(q, k, v, g, beta, parents, initial_state,
                           scale=None if scale is None else float(scale), use_qk_l2norm=bool(use_qk_l2norm))


# ----------------------------------------------------------------------------------------------
# Naive ground truth: the sequential recurrence along every root path
# ----------------------------------------------------------------------------------------------

def root_paths(parents) -> np.ndarray:
    """Host-side: index [..., N, L] of every node's root path (root first), front-padded with -1.

    L is the depth of the deepest node + 1. parents must be concrete.
    """
    p = np.asarray(parents, np.int64)
    flat = p.reshape(-1, p.shape[-1])
    paths = []
    for row in flat:
        for i in range(row.shape[0]):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = int(row[j])
            paths.append(path[::-1])
    depth = max(len(x) for x in paths)
    out = np.full((len(paths), depth), -1, np.int32)
    for r, path in enumerate(paths):
        out[r, depth - len(path):] = path
    return out.reshape(p.shape + (depth,))


def tree_gated_delta_rule_naive(q, k, v, g, beta, parents, *, initial_state, scale=None, use_qk_l2norm=False,
                                return_node_states=False) -> GatedDeltaOutput:
    """Ground truth: `naive_recurrent_gated_delta_rule` run along each node's root-to-node path.

    All B*N paths run as one batch of the per-step recurrence, front-padded to the deepest path with
    steps that have q = k = v = 0, g = 0, beta = 0 (exact identities: e^0 S = S, u = 0). parents
    must be concrete (host-side path extraction). Same outputs as the reference; with
    `return_node_states`, also all_states [B, N, HV, K, V] = each node's state after its path.
    """
    b, n, h, k_dim = q.shape
    hv, v_dim = v.shape[2], v.shape[3]
    check_gated_delta_inputs(q, k, v, g, beta, initial_state)
    check_parents(parents, b, n)
    paths = jnp.asarray(root_paths(np.broadcast_to(np.asarray(parents), (b, n))))  # [B, N, L]
    depth = paths.shape[-1]
    valid = paths >= 0
    safe = jnp.maximum(paths, 0)

    def gather(x):  # [B, N, ...] -> [B*N, L, ...], padded steps zeroed
        idx = safe.reshape(b, n * depth)
        xg = jnp.take_along_axis(x, idx.reshape((b, n * depth) + (1,) * (x.ndim - 2)), axis=1)
        xg = xg.reshape((b, n, depth) + x.shape[2:])
        xg = jnp.where(valid.reshape((b, n, depth) + (1,) * (x.ndim - 2)), xg, jnp.zeros((), x.dtype))
        return xg.reshape((b * n, depth) + x.shape[2:])

    s0 = (jnp.zeros((b, hv, k_dim, v_dim), F32) if initial_state is None else initial_state.astype(F32))
    s0 = jnp.repeat(s0, n, axis=0)  # [B*N, HV, K, V]
    out = naive_recurrent_gated_delta_rule(
        gather(q), gather(k), gather(v), gather(g), gather(beta), scale=scale, initial_state=s0,
        output_final_state=return_node_states, return_pseudo_values=True, use_qk_l2norm=use_qk_l2norm)
    last = lambda x: x[:, -1].reshape((b, n) + x.shape[2:])
    return GatedDeltaOutput(
        o=last(out.o), final_state=None, v_new=last(out.v_new), g_cumsum=last(out.g_cumsum),
        all_states=out.final_state.reshape(b, n, hv, k_dim, v_dim) if return_node_states else None)


# ----------------------------------------------------------------------------------------------
# Commit without snapshots, and the snapshot baseline
# ----------------------------------------------------------------------------------------------

def _expand_keys(k, hv: int, use_qk_l2norm: bool) -> jax.Array:
    if use_qk_l2norm:
        k = l2_normalize(k)
    return jnp.repeat(k.astype(F32), hv // k.shape[2], axis=2)  # [B, N, HV, K]


def tree_commit_state(initial_state, k, g, v_new, parents, accepted_node, *, use_qk_l2norm=False) -> jax.Array:
    """State after accepting the root path of `accepted_node`, rebuilt from pseudo-values (no snapshots).

        S_a = e^{gamma_a} S0 + sum_{j in anc(a)} e^{gamma_a - gamma_j} k_j v_new_j^T

    initial_state [B, HV, K, V]; k [B, N, H, K] (as given to verification; normalised here when
    `use_qk_l2norm`); g [B, N, HV] raw gates; v_new [B, N, HV, V]; parents [N] or [B, N];
    accepted_node [B] int (traced: masks only, one compilation for every node; -1 returns S0).
    gamma_a - gamma_j is the sum of the gates on the path strictly after j (no cancellation).
    Returns [B, HV, K, V] fp32.
    """
    b, n, _, hv, _, _ = check_commit_inputs(initial_state, k, g, v_new, jnp.zeros((), jnp.int32))
    check_parents(parents, b, n)
    check_accepted_counts(accepted_node, b, n - 1, name="accepted_node", low=-1)
    parents = batched_parents(parents, b, n)
    anc = ancestor_matrix(parents)  # [B, N, N]
    a = jnp.broadcast_to(jnp.asarray(accepted_node, jnp.int32).reshape(-1), (b,))
    pick = jnp.arange(n, dtype=jnp.int32)[None, :] == a[:, None]  # [B, N] one-hot (none for a = -1)
    on_path = jnp.any(pick[:, :, None] & anc, axis=1)  # [B, N] anc(a)
    g_kept = jnp.where(on_path[..., None], g.astype(F32), 0.0)  # [B, N, HV]
    # sum_{l in anc(a), l not in anc(j)} g_l: the path gates strictly after j (j on the path)
    after = jnp.einsum("bjl,blh->bjh", (~anc).astype(F32), g_kept, precision=_HIGHEST)  # [B, N, HV]
    weights = _exp_masked(after, on_path[..., None])  # [B, N, HV]
    gamma_a = jnp.sum(g_kept, axis=1)  # [B, HV]
    kf = _expand_keys(k, hv, use_qk_l2norm)
    s0 = initial_state.astype(F32) * jnp.exp(gamma_a)[..., None, None]
    return s0 + jnp.einsum("bjhk,bjhv,bjh->bhkv", kf, v_new.astype(F32), weights, precision=_HIGHEST)


def tree_node_states(initial_state, k, v, g, beta, parents, *, use_qk_l2norm=False) -> jax.Array:
    """Snapshot baseline: every node's state, each one step from its parent's: [B, N, HV, K, V] fp32.

    What production engines keep for tree verification (one K x V state per node and head); the
    memory Tree-WY avoids. A fori_loop over nodes in topological order, traced parents.
    """
    b, n, _, _ = k.shape
    hv, k_dim, v_dim = v.shape[2], k.shape[3], v.shape[3]
    parents = batched_parents(parents, b, n)
    kf = _expand_keys(k, hv, use_qk_l2norm)  # [B, N, HV, K]
    vf, gf, bf = v.astype(F32), g.astype(F32), beta.astype(F32)
    s0 = initial_state.astype(F32)
    rows = jnp.arange(b)

    def body(i, states):  # states [B, N, HV, K, V]
        p = parents[:, i]  # [B]
        prev = jnp.where((p >= 0)[:, None, None, None], states[rows, jnp.maximum(p, 0)], s0)
        k_i, v_i = kf[:, i], vf[:, i]  # [B, HV, K], [B, HV, V]
        decayed = prev * jnp.exp(gf[:, i])[..., None, None]
        pred = jnp.einsum("bhkv,bhk->bhv", decayed, k_i, precision=_HIGHEST)
        u = bf[:, i][..., None] * (v_i - pred)
        return states.at[:, i].set(decayed + k_i[..., :, None] * u[..., None, :])

    return lax.fori_loop(0, n, body, jnp.zeros((b, n, hv, k_dim, v_dim), F32))


def speculative_state_bytes(n_nodes: int, hv: int, k_dim: int, v_dim: int, mode: str, *, h: int | None = None,
                            bytes_per_elem: int = 4) -> int:
    """Bytes one sequence keeps per GDN layer to be able to commit any node of an N-node draft.

    "tree-wy": k (H key heads; default H = HV), g and v_new per node plus the parents (int32): what
    `tree_commit_state` reads. "snapshots": one K x V state per node and value head.
    """
    h = hv if h is None else h
    if mode == "tree-wy":
        return n_nodes * (h * k_dim + hv * (v_dim + 1)) * bytes_per_elem + n_nodes * 4
    if mode == "snapshots":
        return n_nodes * hv * k_dim * v_dim * bytes_per_elem
    raise ValueError(f"speculative_state_bytes: mode must be one of {STATE_MODES}; got {mode!r}")


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------

@functools.cache
def _pallas_module():
    try:
        from . import tree_kernel
    except ImportError:
        return None
    return tree_kernel


def default_implementation() -> str:
    """SPECDEC_GDN_IMPLEMENTATION overrides (op "tree"); else pallas on GPU (when importable), else reference."""
    from . import env_override
    forced = env_override("tree")
    if forced:
        return forced
    return "pallas" if jax.default_backend() == "gpu" and _pallas_module() is not None else "reference"


def tree_gated_delta_rule(q, k, v, g, beta, parents, *, initial_state, scale=None, use_qk_l2norm=False,
                          implementation="auto", interpret=False) -> GatedDeltaOutput:
    """Tree-WY verification: every node's output and pseudo-value along its root path, in one pass.

    Shapes and outputs as `tree_gated_delta_rule_reference`. implementation: "reference" (jnp),
    "naive" (per-path recurrence; concrete parents), "pallas" (N <= 64; interpret mode is used
    automatically off-GPU), "auto" (pallas on GPU, reference elsewhere).
    """
    impl = default_implementation() if implementation in (None, "auto") else implementation
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"tree_wy: implementation must be one of {IMPLEMENTATIONS} or 'auto'; got {impl!r}")
    kwargs = dict(initial_state=initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm)
    if impl == "reference":
        return tree_gated_delta_rule_reference(q, k, v, g, beta, parents, **kwargs)
    if impl == "naive":
        return tree_gated_delta_rule_naive(q, k, v, g, beta, parents, **kwargs)
    mod = _pallas_module()
    if mod is None:
        raise ValueError("tree_wy: implementation 'pallas' requested but tree_kernel is not importable")
    interpret = bool(interpret) or jax.default_backend() != "gpu"
    return mod.tree_gated_delta_rule_pallas(q, k, v, g, beta, parents, interpret=interpret, **kwargs)


__all__ = ["ancestor_matrix", "path_gammas", "path_decay_exponents", "root_paths", "n_squarings",
           "tree_gated_delta_rule", "tree_gated_delta_rule_reference", "tree_gated_delta_rule_naive",
           "tree_commit_state", "tree_node_states", "speculative_state_bytes", "MAX_PALLAS_NODES"]
