"""Tree drafters: node tokens [B, N] for a static draft tree (node 0 = the anchor, filled by the step).

Interface (used by `decoding.tree_spec.tree_step`):
    init(params, cfg, prompt, max_len, **kw) -> drafter state
    propose_tree(params, cfg, state, history, hist_len, parents, depth, key) -> (node_ids [B, N], state)
    update(state, *, emitted, n_keep, verified, params, cfg, ...) -> state   (path read as a chain)
parents / depth are static numpy arrays [N] (topological order, siblings in rank order).

- TreeNgramDrafter: prompt lookup with several candidates. Every distinct earlier occurrence of the
  last tokens (longest match first, then most recent) gives one continuation; the tree's leaves are
  assigned candidates (a node's first child follows its parent's candidate, later siblings open the
  next one), so branches are different earlier matches. Missing candidates repeat the last token.
- TreeMtpDrafter: Qwen3.5's MTP head. The children of a node are the top-k of the head's prediction
  at that node (level 1 from the stored prediction after the anchor); deeper levels run the head once
  per level, batched over that level's nodes, each on its own copy of the head's KV cache (its
  path's provisional entries). update() is the chain MTP drafter's, on the accepted path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .mtp import MtpDrafter


def sibling_rank(parents) -> np.ndarray:
    """rank[i] = how many earlier nodes share i's parent (root: 0)."""
    parents = np.asarray(parents)
    rank = np.zeros(parents.shape[0], np.int32)
    seen: dict[int, int] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            rank[i] = seen.get(int(p), 0)
            seen[int(p)] = rank[i] + 1
    return rank


def candidate_ids(parents) -> tuple[np.ndarray, int]:
    """Per node, which candidate continuation it follows, and how many candidates (the leaves)."""
    parents = np.asarray(parents)
    rank = sibling_rank(parents)
    cid = np.zeros(parents.shape[0], np.int32)
    count = 1
    for i in range(1, parents.shape[0]):
        if rank[i] == 0:
            cid[i] = cid[parents[i]]
        else:
            cid[i] = count
            count += 1
    return cid, count


def ngram_candidates(history: jax.Array, length: jax.Array, n_cand: int, steps: int, max_n: int,
                     min_n: int = 1) -> jax.Array:
    """One sequence: history [H] with `length` valid tokens -> candidates [n_cand, steps] int32.

    A start s (1 <= s < length) qualifies when history[s-n:s] == history[length-n:length] for some
    n in [min_n, max_n]; starts rank by the longest such n, then by recency. Candidate r is
    history[s_r:] (past the known text: the last known token); missing candidates repeat the last token.
    """
    H = history.shape[0]
    pos = jnp.arange(H, dtype=jnp.int32)
    padded = jnp.concatenate([jnp.zeros((max_n,), history.dtype), history])  # padded[max_n + t] = history[t]
    best = jnp.zeros((H,), jnp.int32)
    for n in range(min_n, max_n + 1):
        match = (pos >= n) & (pos < length) & (length >= n)
        for j in range(n):
            # history[s - n + j] == history[length - n + j]
            here = lax.dynamic_slice_in_dim(padded, max_n - n + j, H)
            match &= here == padded[jnp.maximum(max_n + length - n + j, 0)]
        best = jnp.where(match, n, best)
    score = jnp.where(best > 0, best * H + pos, -1)
    top, starts = lax.top_k(score, n_cand)  # [n_cand]
    last = history[jnp.maximum(length - 1, 0)]
    idx = starts[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]  # [n_cand, steps]
    known = (top[:, None] >= 0) & (idx < length)
    tok = jnp.where(known, history[jnp.clip(idx, 0, H - 1)], -1)
    # Past the known text: continue with the last known token of the candidate (or the anchor).
    fill = jnp.where(top >= 0, history[jnp.clip(jnp.minimum(starts + steps, length) - 1, 0, H - 1)], last)
    return jnp.where(tok >= 0, tok, fill[:, None]).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TreeNgramDrafter:
    max_n: int = 3
    min_n: int = 1
    name = "ngram"

    def init(self, params, cfg, prompt, max_len, **_):
        return ()

    def update(self, drafter_state, **_):
        return drafter_state

    def propose_tree(self, params, cfg, drafter_state, history, hist_len, parents, depth, key):
        cid, n_cand = candidate_ids(parents)
        dmax = int(np.max(depth))
        cands = jax.vmap(lambda h, n: ngram_candidates(h, n, n_cand, max(dmax, 1), self.max_n, self.min_n))(
            history, hist_len)  # [B, n_cand, Dmax]
        d = np.maximum(np.asarray(depth) - 1, 0)
        nodes = cands[:, jnp.asarray(cid), jnp.asarray(d)]  # [B, N]
        anchor = jnp.take_along_axis(history, jnp.maximum(hist_len - 1, 0)[:, None], axis=1)
        return nodes.at[:, 0].set(anchor[:, 0]), drafter_state


@dataclasses.dataclass(frozen=True)
class TreeMtpDrafter:
    shortlist_size: int = 0
    needs_hidden = True
    carry_kind = MtpDrafter.carry_kind  # the chain drafter's state: a continuation may switch between the two
    carried = staticmethod(MtpDrafter.carried)

    @property
    def name(self) -> str:
        return "mtp-shortlist" if self.shortlist_size else "mtp"

    @property
    def _chain(self) -> MtpDrafter:
        # XLA's head forward: the decode blocks were measured on chains, not on a tree's batched levels.
        return MtpDrafter(self.shortlist_size, kernels="xla")

    def init(self, params, cfg, prompt, max_len, **kw):
        return self._chain.init(params, cfg, prompt, max_len, **kw)

    def update(self, state, **kw):
        return self._chain.update(state, **kw)

    def _top(self, params, logits: jax.Array, k: int) -> jax.Array:
        """Top-k token ids [..., k] from head logits (mapped back from the shortlist)."""
        ids = lax.top_k(logits, k)[1]
        if self.shortlist_size:
            ids = params["draft"]["shortlist"][: self.shortlist_size][ids]
        return ids.astype(jnp.int32)

    def propose_tree(self, params, cfg, state, history, hist_len, parents, depth, key):
        parents, depth = np.asarray(parents), np.asarray(depth)
        N = parents.shape[0]
        B = history.shape[0]
        rank = sibling_rank(parents)
        n_child = np.bincount(parents[1:], minlength=N) if N > 1 else np.zeros(N, np.int64)
        kmax = max(int(n_child.max()), 1)
        nodes = jnp.zeros((B, N), jnp.int32)
        # Per node being expanded: its head logits [B, V'], output hidden [B, 1, D] and head caches.
        top = self._top(params, state["logits"], kmax)  # root's children
        tops = {0: top}  # node -> top-k ids [B, kmax]
        hid = {0: state["hidden"]}
        cache = {0: (state["k"], state["v"])}
        for d in range(1, int(depth.max()) + 1):
            members = [i for i in range(N) if depth[i] == d]
            for i in members:
                nodes = nodes.at[:, i].set(tops[int(parents[i])][:, rank[i]])
            expand = [i for i in members if n_child[i] > 0]
            if not expand:
                break
            m = len(expand)
            # Batch the level's nodes: [m * B, ...]; each node continues its parent's head state.
            hidden = jnp.concatenate([hid[int(parents[i])] for i in expand], axis=0)  # [m*B, 1, D]
            k_c = jnp.concatenate([cache[int(parents[i])][0] for i in expand], axis=0)
            v_c = jnp.concatenate([cache[int(parents[i])][1] for i in expand], axis=0)
            tok = jnp.concatenate([nodes[:, i] for i in expand], axis=0)[:, None]  # [m*B, 1]
            pos = jnp.tile(state["length"] + (d - 1), m)[:, None]  # provisional entry past the committed length
            logits, hout, k_c, v_c = self._chain._run(params, cfg, hidden, tok, k_c, v_c, pos)
            ids = self._top(params, logits[:, 0], kmax)  # [m*B, kmax]
            for r, i in enumerate(expand):
                sl = slice(r * B, (r + 1) * B)
                tops[i], hid[i], cache[i] = ids[sl], hout[sl], (k_c[sl], v_c[sl])
        return nodes, state
