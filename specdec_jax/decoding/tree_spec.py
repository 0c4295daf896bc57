"""Tree speculative decoding for Qwen3.5 (greedy or sampling, exact): one jitted draft-tree -> verify ->
accept -> commit step inside a `lax.while_loop`, mirroring `speculative.py` (same SpecState, same stats
keys).

A static tree of N nodes in topological order (node 0 = the root = the anchor, the last emitted token
not yet processed; `parents[i] < i`). One forward verifies every node from the committed state:

- full-attention layers attend to the committed cache plus the node's ancestors (ancestor mask);
  RoPE position of node i = length + depth[i]; node K/V are written (temporarily) at slots
  length + i;
- GDN layers run `tree_gated_delta_rule` (Tree-WY: each node sees exactly its root path) and the
  causal conv reads, at lag l, the pre-conv input of the node's l-th ancestor (or the committed conv
  state when the path runs out).

Greedy acceptance keeps the deepest root path whose every node equals the target argmax at its
parent, then emits the target's token after it. Sampling acceptance (`sampling_tree_accept`) is
multi-draft recursive rejection sampling over the tree (SpecInfer-style, deterministic drafts): the
emitted tokens are distributed exactly as sampling the target alone. Commit: the accepted path's K/V
are moved to the contiguous slots length..length+a, the conv state is the window at the end of the
path, the GDN state is rebuilt from pseudo-values (`tree_commit_state`, rollback="pseudo") or picked
from per-node snapshots (`tree_node_states`, rollback="snapshot", the baseline). length += a + 1.

Tree shapes are static (numpy parents / depth; passed to jit as tuples): one compile per shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.gated_delta import tree_wy

from ..models.qwen35.config import FULL_ATTENTION
from ..results import GenerateResult
from ..models import layers as L
from ..models.qwen35 import model as qwen35
from .sampling import SamplingConfig, probabilities
from .speculative import SpecState, advance, emit_accepted, run_spec_loop

ROLLBACK_MODES = ("pseudo", "snapshot")


# ------------------------------------------------------------------------------------ tree shape

def tree_from_branching(branching) -> tuple[np.ndarray, np.ndarray]:
    """Static tree from a branching list: level d nodes each get branching[d] children.

    (4, 2, 2, 1) -> 1 + 4 + 8 + 16 + 16 nodes; (1,) * g is a chain of g drafts; (k,) a star.
    Returns (parents int32 [N], depth int32 [N]); node 0 is the root (parent -1), nodes are in
    breadth-first (hence topological) order, siblings consecutive.
    """
    parents, depth = [-1], [0]
    level = [0]
    for d, b in enumerate(branching):
        if int(b) < 1:
            raise ValueError(f"tree_from_branching: branching factors must be >= 1; got {tuple(branching)}")
        nxt = []
        for p in level:
            for _ in range(int(b)):
                parents.append(p)
                depth.append(d + 1)
                nxt.append(len(parents) - 1)
        level = nxt
    return np.asarray(parents, np.int32), np.asarray(depth, np.int32)


def tree_depth(parents) -> np.ndarray:
    """depth [N] from parents [N] (topological order)."""
    parents = np.asarray(parents)
    depth = np.zeros(parents.shape[0], np.int32)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    return depth


def check_tree(parents, depth) -> None:
    parents, depth = np.asarray(parents), np.asarray(depth)
    n = parents.shape[0]
    if n < 1 or parents[0] != -1 or np.any(parents[1:] < 0) or np.any(parents[1:] >= np.arange(1, n)):
        raise ValueError(f"tree: node 0 must be the only root and parents[i] < i; got {parents.tolist()}")
    if not np.array_equal(depth, tree_depth(parents)):
        raise ValueError("tree: depth does not match parents")


def path_table(parents) -> np.ndarray:
    """Host-side: table [N, Dmax + 1]: entry d = the ancestor of node i at depth d (d <= depth[i]);
    later entries repeat node i (never read as accepted)."""
    parents = np.asarray(parents)
    depth = tree_depth(parents)
    n, dmax = parents.shape[0], int(depth.max())
    out = np.zeros((n, dmax + 1), np.int32)
    for i in range(n):
        j, path = i, []
        while j >= 0:
            path.append(j)
            j = parents[j]
        path = path[::-1]
        out[i, :len(path)] = path
        out[i, len(path):] = i
    return out


def conv_index(parents, width: int) -> np.ndarray:
    """Host-side: [N, W] indices into [conv_state (W-1) ; node inputs (N)] for the causal conv window
    of every node: column w reads lag W-1-w along the node's root path (the node itself at w = W-1;
    ancestors, then the committed conv state when the path runs out)."""
    parents = np.asarray(parents)
    n = parents.shape[0]
    out = np.zeros((n, width), np.int32)
    for i in range(n):
        j, lag_state = i, 0
        for w in range(width - 1, -1, -1):
            if j >= 0:
                out[i, w] = (width - 1) + j
                j = parents[j]
            else:
                lag_state += 1
                out[i, w] = (width - 1) - lag_state
    return out


# ---------------------------------------------------------------------------------- tree forward

def tree_gdn_mixer(p: dict, cfg, x: jax.Array, conv_state: jax.Array, rec_state: jax.Array, parents: np.ndarray,
                   impl: str, collect):
    """Gated DeltaNet over the N tree nodes: x [B, N, D] -> out [B, N, D], extras (k, g, v_new, the
    conv source [B, W-1+N, C] and, for collect="snapshot", every node's state [B, N, HV, K, V])."""
    B, N, _ = x.shape
    HV, V, W = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    qkv, z, b, a = qwen35.gdn_projections(p, cfg, x)

    source = jnp.concatenate([conv_state.astype(qkv.dtype), qkv], axis=1)  # [B, W-1+N, C]
    window = source[:, jnp.asarray(conv_index(parents, W))]  # [B, N, W, C]
    w = p["conv"].astype(jnp.float32)  # [C, W]
    conv = sum(window[:, :, i].astype(jnp.float32) * w[:, i] for i in range(W))  # same order as gdn_mixer
    conv = jax.nn.silu(conv.astype(qkv.dtype))

    q, k, v = qwen35.gdn_heads(cfg, conv)
    beta, g = qwen35.gdn_gates(p, b, a)
    tree_impl = impl if impl in tree_wy.IMPLEMENTATIONS else "auto"
    if tree_impl == "auto" and N > tree_wy.MAX_PALLAS_NODES:
        tree_impl = "reference"  # the Pallas kernel covers N <= 64
    res = tree_wy.tree_gated_delta_rule(q, k, v, g, beta, jnp.asarray(parents), initial_state=rec_state,
                                        use_qk_l2norm=True, implementation=tree_impl)
    o = L.gated_rms_norm(res.o.astype(x.dtype), z, p["norm"], cfg.rms_norm_eps)  # [B, N, HV, V]
    out = L.linear(o.reshape(B, N, HV * V), p["out_proj"])
    extras = {"k": k, "g": g, "v_new": res.v_new, "conv_source": source}
    if collect == "snapshot":
        extras["all_states"] = tree_wy.tree_node_states(rec_state, k, v, g, beta, jnp.asarray(parents),
                                                        use_qk_l2norm=True)
    return out, extras


def tree_forward(params: dict, cfg, state: qwen35.Qwen35State, node_ids: jax.Array, parents, depth, *,
                 impl: str = "auto", collect: str = "pseudo"):
    """Verify a draft tree from the committed `state`.

    node_ids [B, N] (node 0 = the anchor); parents, depth: static numpy [N] (`tree_from_branching`).
    Returns (logits [B, N, vocab] float32, verified state (attention caches with node i's K/V at
    slot length + i; conv/recurrent/length unchanged), extras {"gdn": per GDN layer k, g, v_new,
    conv_source (+ all_states for collect="snapshot"), "hidden": final-normed hidden [B, N, D]}).
    The cache must have room for length + N slots.
    """
    parents, depth = np.asarray(parents, np.int32), np.asarray(depth, np.int32)
    B, N = node_ids.shape
    dtype = params["embed"].dtype
    x = params["embed"][node_ids].astype(dtype)  # [B, N, D]
    positions = state.length[:, None] + jnp.asarray(depth)[None, :]  # RoPE positions [B, N]
    keys, values = list(state.keys), list(state.values)
    mask = None
    if keys:
        S = state.max_len
        anc = jnp.asarray(tree_wy.ancestor_matrix(jnp.asarray(parents)))  # [N, N]
        slots = jnp.arange(S, dtype=jnp.int32)
        rel = slots[None, :] - state.length[:, None]  # [B, S]: node index of a tree slot
        committed = rel < 0  # [B, S]
        in_tree = (rel >= 0) & (rel < N)
        tree_vis = jnp.take(anc, jnp.clip(rel, 0, N - 1), axis=1)  # [N, B, S]
        mask = committed[:, None, :] | (in_tree[:, None, :] & jnp.moveaxis(tree_vis, 0, 1))  # [B, N, S]
    gdn_extras = []
    for i, layer_type in enumerate(cfg.layer_types):
        p = params["layers"][i]
        slot = cfg.slot(i)
        h = L.rms_norm(x, p["input_norm"], cfg.rms_norm_eps, zero_centered=True)
        if layer_type == FULL_ATTENTION:
            # attention_mixer writes K/V at positions[:, 0] = length (the root has depth 0): slots length + i.
            h, keys[slot], values[slot] = qwen35.attention_mixer(p["mixer"], cfg, h, keys[slot], values[slot],
                                                                 positions, mask)
        else:
            h, ex = tree_gdn_mixer(p["mixer"], cfg, h, state.conv[slot], state.recurrent[slot], parents, impl,
                                   collect)
            gdn_extras.append(ex)
        x = x + h
        x = x + qwen35.mlp(p["mlp"], cfg, L.rms_norm(x, p["post_norm"], cfg.rms_norm_eps, zero_centered=True))
    hidden = L.rms_norm(x, params["final_norm"], cfg.rms_norm_eps, zero_centered=True)
    logits = lax.dot_general(hidden, qwen35.lm_head_weight(params).astype(dtype), (((2,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    verified = state.replace(keys=tuple(keys), values=tuple(values))
    return logits, verified, {"gdn": gdn_extras, "hidden": hidden}


# ------------------------------------------------------------------------------- accept / commit

def greedy_tree_accept(node_ids: jax.Array, logits: jax.Array, parents, depth):
    """Deepest root path whose every non-root node equals the target argmax at its parent.

    Returns (accepted_node [B], n_accepted [B] = its depth, next_token [B] = the target argmax at it,
    path [B, Dmax + 1] node indices of the root path (entries past n_accepted repeat the node)).
    Ties between equally deep valid paths go to the lowest node index (all are exact).
    """
    parents, depth = np.asarray(parents), np.asarray(depth)
    N = parents.shape[0]
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, N]
    par = jnp.asarray(np.maximum(parents, 0))
    ok = (node_ids == target[:, par]) | (jnp.arange(N) == 0)[None, :]  # [B, N]
    anc = jnp.asarray(tree_wy.ancestor_matrix(jnp.asarray(parents)))  # [N, N]
    path_ok = jnp.all(ok[:, None, :] | ~anc[None], axis=-1)  # [B, N]
    score = jnp.where(path_ok, jnp.asarray(depth)[None, :], -1)
    node = jnp.argmax(score, axis=-1).astype(jnp.int32)  # first deepest
    n_acc = jnp.asarray(depth)[node]
    next_token = jnp.take_along_axis(target, node[:, None], axis=1)[:, 0]
    path = jnp.asarray(path_table(parents))[node]  # [B, Dmax + 1]
    return node, n_acc, next_token, path


def children_table(parents) -> np.ndarray:
    """Host-side: table [N, Kmax] of each node's children in sibling order, padded with -1
    (Kmax = the largest branching factor, at least 1)."""
    parents = np.asarray(parents)
    n = parents.shape[0]
    kids = [[] for _ in range(n)]
    for i in range(1, n):
        kids[int(parents[i])].append(i)
    out = np.full((n, max(1, max(len(k) for k in kids))), -1, np.int32)
    for i, k in enumerate(kids):
        out[i, :len(k)] = k
    return out


def sampling_tree_accept(node_ids: jax.Array, target_probs: jax.Array, parents, depth, key: jax.Array):
    """Exact tree acceptance for sampling: multi-draft recursive rejection sampling (SpecInfer-style)
    for deterministic draft children (each child is a point-mass draft).

    node_ids [B, N] (node 0 = the anchor); target_probs p [B, N, V]: node i's row is the (warped)
    target distribution of the token after node i (`sampling.probabilities`); parents, depth: static
    numpy [N]; key: a PRNG key.

    Start at the root with residual r = p[root]. Visit the current node's children in sibling order:
    child c with token t is accepted with probability r(t) / sum(r) (= min(1, r(t) / q(t)) with q the
    point mass at t); on acceptance move to c and set r = p[c]; on rejection set r(t) = 0 (the residual
    max(0, r - q), renormalised). When no child is accepted (or at a leaf) emit next_token ~ r. A token
    rejected once has r = 0, so duplicate siblings stay exact. If the residual mass is 0 (probability-0
    event, e.g. rounding) next_token falls back to p at the node: never NaN.

    Returns (accepted_node [B], n_accepted [B] = its depth, next_token [B], path [B, Dmax + 1]) as
    `greedy_tree_accept` does.
    """
    parents, depth = np.asarray(parents), np.asarray(depth)
    B, N = node_ids.shape
    V = target_probs.shape[-1]
    dmax = int(depth.max())
    kids = children_table(parents)  # [N, Kmax]
    k_accept, k_emit = jax.random.split(key)
    u = jax.random.uniform(k_accept, (B, max(dmax, 1), kids.shape[1]), jnp.float32)
    probs = target_probs.astype(jnp.float32)
    vocab = jnp.arange(V, dtype=jnp.int32)[None, :]

    def probs_at(node):  # [B] -> [B, V]
        return jnp.take_along_axis(probs, node[:, None, None], axis=1)[:, 0]

    node = jnp.zeros((B,), jnp.int32)
    r = probs[:, 0]  # residual, kept unnormalised: acceptance compares against its mass
    searching = jnp.ones((B,), bool)  # still at a node whose children may be tried
    for d in range(dmax):
        # Only nodes at depth d can be current here: try as many children as the widest of them has.
        at_d = np.flatnonzero(depth == d)
        width = int((kids[at_d] >= 0).sum(axis=1).max()) if at_d.size else 0
        moved = jnp.zeros((B,), bool)
        for j in range(width):
            child = jnp.asarray(kids[:, j])[node]  # [B], -1 = no such child
            tried = searching & ~moved & (child >= 0)
            c = jnp.maximum(child, 0)
            tok = jnp.take_along_axis(node_ids, c[:, None], axis=1)[:, 0].astype(jnp.int32)
            r_tok = jnp.take_along_axis(r, tok[:, None], axis=1)[:, 0]
            mass = jnp.sum(r, axis=-1)
            # u < r(t) / mass without dividing; mass 0 or r(t) = 0 rejects.
            acc = tried & (u[:, d, j] * mass < r_tok)
            rej = tried & ~acc
            r = jnp.where(acc[:, None], probs_at(c), jnp.where(rej[:, None] & (vocab == tok[:, None]), 0.0, r))
            node = jnp.where(acc, c, node)
            moved = moved | acc
        searching = searching & moved
    mass = jnp.sum(r, axis=-1, keepdims=True)
    r = jnp.where(mass > 0, r, probs_at(node))
    next_token = jax.random.categorical(k_emit, jnp.log(r), axis=-1).astype(jnp.int32)
    n_acc = jnp.asarray(depth)[node]
    path = jnp.asarray(path_table(parents))[node]  # [B, Dmax + 1]
    return node, n_acc, next_token, path


def tree_commit(before: qwen35.Qwen35State, verified: qwen35.Qwen35State, extras: dict, parents,
                accepted_node: jax.Array, path: jax.Array, n_keep: jax.Array) -> qwen35.Qwen35State:
    """Committed state after keeping the first n_keep [B] nodes of the root path `path` [B, Dmax + 1]
    ending at accepted_node [B] (n_keep = depth + 1, or 0 for a finished row: state unchanged).

    Attention: the path's K/V (written at length + node) move to length..length+Dmax (slots past the
    new length are stale and masked). Conv: the window ending at the last kept node. GDN: Tree-WY
    commit from pseudo-values, or the node snapshot (extras from `tree_forward(collect="snapshot")`).
    """
    parents = np.asarray(parents, np.int32)
    n_keep = n_keep.astype(jnp.int32)
    keep = n_keep > 0
    last = jnp.take_along_axis(path, jnp.maximum(n_keep - 1, 0)[:, None], axis=1)[:, 0]  # [B]
    last = jnp.where(keep, last, -1)

    def compact(cache):
        # Unconditional: a finished row keeps its length, and every slot >= length is masked anyway.
        def one(c, start, pth):
            return lax.dynamic_update_slice_in_dim(c, c[start + pth], start, axis=0)  # moved [Dmax + 1, NKV, hd]
        return jax.vmap(one)(cache, before.length, path)

    keys = tuple(compact(c) for c in verified.keys)
    values = tuple(compact(c) for c in verified.values)
    conv, rec = [], []
    for c0, s0, ex in zip(before.conv, before.recurrent, extras["gdn"]):
        W1 = c0.shape[1]
        idx = jnp.asarray(conv_index(parents, W1 + 1))[jnp.maximum(last, 0), 1:]  # [B, W-1]
        new_conv = jnp.take_along_axis(ex["conv_source"], idx[:, :, None], axis=1).astype(c0.dtype)
        conv.append(jnp.where(keep[:, None, None], new_conv, c0))
        if "all_states" in ex:
            picked = jnp.take_along_axis(ex["all_states"], jnp.maximum(last, 0)[:, None, None, None, None],
                                         axis=1)[:, 0]
            rec.append(jnp.where(keep[:, None, None, None], picked, s0))
        else:
            rec.append(tree_wy.tree_commit_state(s0, ex["k"], ex["g"], ex["v_new"], jnp.asarray(parents), last,
                                                 use_qk_l2norm=True))
    return qwen35.Qwen35State(keys=keys, values=values, conv=jnp.stack(conv), recurrent=jnp.stack(rec),
                              length=before.length + n_keep)


# ---------------------------------------------------------------------------------------- step

def tree_accept(node_ids: jax.Array, logits: jax.Array, parents, depth, key: jax.Array, sampling: SamplingConfig):
    """Dispatch on the sampling config: `greedy_tree_accept` on the logits, else `sampling_tree_accept`
    on the warped target distributions (the same transform AR sampling applies)."""
    if sampling.greedy:
        return greedy_tree_accept(node_ids, logits, parents, depth)
    return sampling_tree_accept(node_ids, probabilities(logits, sampling), parents, depth, key)


def tree_step(params, cfg, state: SpecState, drafter_state, key, *, drafter, parents: tuple, rollback: str,
              max_new_tokens: int, eos_ids: tuple[int, ...], impl: str = "auto",
              sampling: SamplingConfig = SamplingConfig()):
    """One tree step (greedy, or exact sampling per `sampling`). parents: static tuple.
    Returns (state, drafter_state, emitted [B, Dmax+1], n_emit)."""
    parents = np.asarray(parents, np.int32)
    depth = tree_depth(parents)
    active = ~state.done
    k_draft, k_accept = jax.random.split(key)
    node_ids, drafter_state = drafter.propose_tree(params, cfg, drafter_state, state.history, state.hist_len,
                                                   parents, depth, k_draft)
    node_ids = node_ids.astype(jnp.int32).at[:, 0].set(state.anchor)
    logits, verified, extras = tree_forward(params, cfg, state.model, node_ids, parents, depth, impl=impl,
                                            collect=rollback)
    node, n_acc, next_token, path = tree_accept(node_ids, logits, parents, depth, k_accept, sampling)
    path_tokens = jnp.take_along_axis(node_ids, path, axis=1)  # [B, Dmax + 1], root first
    emitted, n_emit, n_keep, hit_eos = emit_accepted(path_tokens[:, 1:], n_acc, next_token, active, eos_ids,
                                                     room=state.budget - state.n_out)
    model = tree_commit(state.model, verified, extras, parents, node, path, n_keep)
    state = advance(state, model, emitted, n_emit, n_acc, hit_eos, active)
    path_hidden = jnp.take_along_axis(extras["hidden"], path[:, :, None], axis=1)  # [B, Dmax + 1, D]
    # emitted[:, d] is the token after path node d: a chain drafter's update reads the tree's path as a chain.
    drafter_state = drafter.update(drafter_state, emitted=emitted, n_emitted=n_emit, n_keep=n_keep,
                                   verified={"hidden": path_hidden}, params=params, cfg=cfg)
    return state, drafter_state, emitted, n_emit


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "drafter", "parents", "rollback", "eos_ids",
                                             "impl", "sampling"),
                   donate_argnames=("state", "drafter_state"))
def _tree_loop(params, state, drafter_state, key, accept_p=None, step_limit=None, *, cfg, max_new_tokens, drafter,
               parents, rollback, eos_ids, impl, sampling=SamplingConfig()):
    """The decode loop. step_limit: None, or a traced step count at which the loop stops (a chunk of a streamed
    generation: the returned states continue it; step keys are folded from `key` and the step index, so chunks
    draw what one loop draws). accept_p: the chain loop's forced acceptance, which trees do not take."""
    if accept_p is not None:
        raise ValueError("accept_p: forced acceptance is the chain loop's (speculative._spec_loop)")
    step = functools.partial(tree_step, params, cfg, drafter=drafter, parents=parents, rollback=rollback,
                             max_new_tokens=max_new_tokens, eos_ids=eos_ids, impl=impl, sampling=sampling)

    def cond(carry):
        running = ~jnp.all(carry[0].done)
        return running if step_limit is None else running & (carry[0].steps < step_limit)

    def body(carry):
        state, drafter_state, key = carry
        state, drafter_state, _, _ = step(state, drafter_state, jax.random.fold_in(key, state.steps))
        return state, drafter_state, key

    state, drafter_state, _ = lax.while_loop(cond, body, (state, drafter_state, key))
    pad = eos_ids[0] if eos_ids else 0
    filled = jnp.arange(max_new_tokens)[None, :] < state.n_out[:, None]
    tokens = jnp.where(filled, state.out[:, :max_new_tokens], pad)
    return tokens, state, drafter_state


def generate_tree(params, cfg, prompt: np.ndarray, max_new_tokens: int, *, drafter, parents, max_len: int | None = None,
                  eos_ids: tuple[int, ...] = (), state_dtype=jnp.float32, rollback: str = "pseudo",
                  impl: str = "auto", seed: int = 0, return_state: bool = False,
                  sampling: SamplingConfig = SamplingConfig(), lens=None, chunk: int = 0,
                  token_buffer: int = 0, initial=None, starts=None, stream=None,
                  drafter_initial=None) -> GenerateResult:
    """Tree speculative generation. parents: static tree [N]. Exact: greedy (the default `sampling`)
    equals greedy AR; with temperature > 0 the tokens are distributed as AR sampling with the same
    temperature / top-k / top-p (the first token is sampled from the prefill with AR's key for it).

    max_len defaults to (and must be at least) prompt + max_new_tokens + N: the last verification
    writes N node slots past the committed length. lens, chunk, token_buffer: a bucketed generation (padded,
    ragged prompt buffer; traced new-token count: `speculative.generate_speculative`). stream: (chunk_steps, emit)
    or None (`run_spec_loop`). initial, starts, drafter_initial: a continuation (`speculative._spec_prefill`).
    """
    if rollback not in ROLLBACK_MODES:
        raise ValueError(f"rollback must be one of {ROLLBACK_MODES}; got {rollback!r}")
    parents = np.asarray(parents, np.int32)
    depth = tree_depth(parents)
    check_tree(parents, depth)
    n, dmax = parents.shape[0], int(depth.max())
    prompt = jnp.asarray(prompt, jnp.int32)
    longest = prompt.shape[1] if lens is None else int(np.max(lens))  # with a continuation: the whole history
    need = longest + max_new_tokens + n
    max_len = need if max_len is None else max_len
    if max_len < need:
        raise ValueError(f"max_len must be >= prompt + max_new_tokens + N = {need}; got {max_len}")
    key_loop, key_first = jax.random.split(jax.random.PRNGKey(seed))
    buffer = token_buffer or max_new_tokens
    static_p = dict(cfg=cfg, max_len=max_len, sampling=sampling, eos_ids=eos_ids, state_dtype=state_dtype,
                    gamma=dmax, max_new_tokens=buffer, drafter=drafter, impl=impl, chunk=chunk)
    static_l = dict(cfg=cfg, max_new_tokens=buffer, drafter=drafter, parents=tuple(parents.tolist()),
                    rollback=rollback, eos_ids=eos_ids, impl=impl, sampling=sampling)
    info = {"method": "tree-" + drafter.name, "tree_nodes": n, "tree_depth": dmax, "rollback": rollback}
    return run_spec_loop(params, prompt, key_first, key_loop, static_p, _tree_loop, static_l, max_new_tokens, info,
                         return_state, lens=lens, budget=max_new_tokens if token_buffer else None, initial=initial,
                         starts=starts, stream=stream, drafter_initial=drafter_initial)
