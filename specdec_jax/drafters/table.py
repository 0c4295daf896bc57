"""Model-generated draft tables: an n-gram continuation table and a token shortlist.

Built offline from the target's own sampled generations (scripts/build_draft_tables.py) and stored
beside the checkpoint as `draft_tables.safetensors`:

    table_ctx   [M, 2] int32   bigram contexts (sorted by their hash)
    table_keys  [M]    int32   hash of each context (sorted; searched on device)
    table_next  [M, P] int32   the most frequent P-token continuation of each context
    uni_next    [V, P] int32   fallback: the most frequent continuation after a single token
    shortlist   [N]    int32   the N most frequent generated tokens (for the MTP shortlist head)

`TableDrafter` looks the last two tokens up on device (binary search over the sorted hashes,
then an exact context check) and chains lookups until it has gamma tokens.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from ..errors import CheckpointError
from ..loading import check_safetensors, open_safetensors
from .stateless import StatelessDrafter

PHRASE = 4  # tokens per stored continuation
SEARCH_METHODS = ("compare_all", "scan_unrolled", "scan", "sort")  # jnp.searchsorted's
_HASH_MULT = 1_000_003


def context_hash(a, b, xp=jnp):
    """Non-negative int32 hash of bigram contexts (xp = numpy on the host, jax.numpy on device);
    collisions are harmless: lookups check the stored context exactly."""
    a = xp.asarray(a).astype(xp.uint32)
    b = xp.asarray(b).astype(xp.uint32)
    h = a * xp.uint32(_HASH_MULT) + b * xp.uint32(2_654_435_761) + xp.uint32(0x9E3779B9)  # wraps mod 2^32
    return (h >> xp.uint32(1)).astype(xp.int32)


def build_tables(sequences: list[np.ndarray], vocab_size: int, shortlist_size: int) -> dict[str, np.ndarray]:
    """Count continuations in generated token sequences; keep the most frequent one per context."""
    bigram: dict[tuple[int, int], collections.Counter] = collections.defaultdict(collections.Counter)
    unigram: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    freq = np.zeros(vocab_size, np.int64)
    for seq in sequences:
        seq = [int(t) for t in seq]
        np.add.at(freq, seq, 1)
        for i in range(1, len(seq) - PHRASE):
            phrase = tuple(seq[i + 1:i + 1 + PHRASE])
            bigram[(seq[i - 1], seq[i])][phrase] += 1
            unigram[seq[i]][phrase] += 1
    ctx = np.asarray(sorted(bigram), np.int32).reshape(-1, 2)
    nxt = np.asarray([bigram[tuple(c)].most_common(1)[0][0] for c in ctx.tolist()], np.int32).reshape(-1, PHRASE)
    keys = context_hash(ctx[:, 0], ctx[:, 1], xp=np)
    order = np.argsort(keys, kind="stable")
    uni = np.repeat(np.arange(vocab_size, dtype=np.int32)[:, None], PHRASE, axis=1)  # unseen: repeat the token
    for tok, counter in unigram.items():
        uni[tok] = counter.most_common(1)[0][0]
    shortlist = np.argsort(-freq, kind="stable")[:shortlist_size].astype(np.int32)
    return {"table_ctx": ctx[order], "table_keys": keys[order], "table_next": nxt[order], "uni_next": uni,
            "shortlist": shortlist}


TOKEN_ID_TABLES = ("table_ctx", "table_next", "uni_next", "shortlist")


def save_draft_tables(tables: dict[str, np.ndarray], path: str, metadata: dict[str, str]) -> None:
    """Token-id tables as uint16 when the vocabulary fits (half the bytes: the shipped checkpoint folder has a
    size budget); `table_keys` (a * vocab + b) stays int32. The loader widens everything to int32."""
    def stored(name, v):
        small = name in TOKEN_ID_TABLES and v.size and 0 <= v.min() and v.max() <= np.iinfo(np.uint16).max
        return np.ascontiguousarray(v.astype(np.uint16) if small else v)

    save_file({k: stored(k, v) for k, v in tables.items()}, path, metadata=metadata)


def load_draft_tables(path: str, vocab_size: int) -> dict[str, jax.Array]:
    """Read and validate draft tables (shapes, id ranges) into device arrays."""
    check_safetensors(path)
    with open_safetensors(path) as f:  # the library's errors as one CheckpointError
        raw = {k: f.get_tensor(k) for k in f.keys()}
    need = {"table_ctx": 2, "table_keys": 1, "table_next": 2, "uni_next": 2, "shortlist": 1}
    for name, ndim in need.items():
        if name not in raw:
            raise CheckpointError(f"tensor '{name}' is missing from '{path}'")
        if raw[name].ndim != ndim:
            raise CheckpointError(f"tensor '{name}' in '{path}' has shape {raw[name].shape}; expected {ndim} dims")
    if raw["uni_next"].shape[0] != vocab_size:
        raise CheckpointError(f"tensor 'uni_next' in '{path}' has {raw['uni_next'].shape[0]} rows; expected the "
                              f"vocabulary size {vocab_size}")
    for name in TOKEN_ID_TABLES:
        x = raw[name].astype(np.int64)
        if x.size and (x.min() < 0 or x.max() >= vocab_size):
            raise CheckpointError(f"tensor '{name}' in '{path}' holds token ids outside [0, {vocab_size})")
    return {k: jnp.asarray(v, jnp.int32) for k, v in raw.items() if k in need}


def table_lookup(tables: dict, a: jax.Array, b: jax.Array, search: str = "compare_all") -> jax.Array:
    """Continuation [PHRASE] after context (a, b): the bigram entry if present, else the unigram one.
    search: jnp.searchsorted's method (every method finds the same index)."""
    keys = tables["table_keys"]
    key = context_hash(a, b)
    idx = jnp.clip(jnp.searchsorted(keys, key, method=search), 0, keys.shape[0] - 1)
    # Equal hashes sit next to each other; check a few for the exact context.
    hit_idx, hit = idx, jnp.bool_(False)
    for off in range(3):
        j = jnp.clip(idx + off, 0, keys.shape[0] - 1)
        ok = (keys[j] == key) & (tables["table_ctx"][j, 0] == a) & (tables["table_ctx"][j, 1] == b)
        hit_idx = jnp.where(~hit & ok, j, hit_idx)
        hit = hit | ok
    return jnp.where(hit, tables["table_next"][hit_idx], tables["uni_next"][b])


@dataclasses.dataclass(frozen=True)
class TableDrafter(StatelessDrafter):
    # How the sorted context hashes are searched. jnp.searchsorted's default ("scan") compiles to a while loop of
    # log2(M) steps, which XLA's GPU runtime drives from the host inside every decode step. H200, tiny checkpoint end
    # to end at gamma 4: scan 0.33x, compare_all 0.99x, scan_unrolled 0.99x of AR (docs/LOG.md, 2026-12-02).
    # compare_all reads all M hashes per lookup (M = 18254 there); scan_unrolled reads log2(M) of them, so for tables
    # of millions of contexts it is the one to try.
    search: str = "compare_all"
    name = "ngram-table"

    def propose(self, params, cfg, drafter_state, history, hist_len, gamma: int, key, **_):
        tables = params["draft"]

        def one(h, n):
            a, b = h[jnp.maximum(n - 2, 0)], h[n - 1]
            out = []
            while len(out) < gamma:
                phrase = table_lookup(tables, a, b, self.search)
                out.extend(phrase[i] for i in range(PHRASE))
                a, b = phrase[PHRASE - 2], phrase[PHRASE - 1]
            return jnp.stack(out[:gamma]).astype(jnp.int32)

        return jax.vmap(one)(history, hist_len), None, drafter_state
