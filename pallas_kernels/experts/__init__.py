"""A mixture-of-experts layer's expert products: each token copy's SwiGLU expert. One signature, three implementations.

    implementation = "gather"  plain jnp: each copy's expert weights gathered ([copies, 2I, D] in memory: few copies)
                     "ragged"  plain jnp: copies sorted by expert, XLA's grouped product over transposed weights
                     "pallas"  grouped kernel (kernel.py, Pallas Triton): copies sorted by expert and padded to
                               whole tiles, each expert's stored weights read once per tile of its copies, no
                               transposed or gathered copy of any weight (interpret mode off the GPU: tests)

`resolve` is what the models take ("auto"): "gather" for few copies and "ragged" for many, and on the GPU
`GPU_DEFAULT` when it names an implementation: the kernel. Measured on an H100 (docs/LOG.md, 2026-12-07): at one
35B-A3B layer a 1024-token prefill chunk takes 1.5-2.1 ms across the tiles against ragged's 22 ms; XLA's paths run out
of memory at the 40-layer model's prefill; inside the 40-layer model's decode the two products take 31 µs a layer
(1.5 TB/s of the 48 MB that 8 experts hold). The kernel harness's decode cases (single calls, 0.3-0.5 ms) are
dispatch-bound and pick no tiles.

Copies whose expert id lies outside [0, E) select no expert (a model's padding rows): they come out zero, and
"ragged" and "pallas" give them no row of any product ("gather" still gathers expert 0's weights for them, then
discards the result). A shared expert (`shared`: its own gate_up [2I, D] and down [D, I], the stack's expert shape)
is one more copy per selected token, after its k routed ones; the kernel runs it as tile expert E, reading the
shared weights where they are stored (no copy of the stack with it appended). Blocks: DECODE_BLOCKS for decode-shape forwards, PREFILL_BLOCKS for prefill chunks; both walk K in
the same steps, so a row's result is the same in either (README.md).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import reference

IMPLEMENTATIONS = ("gather", "ragged", "pallas")
GPU_DEFAULT: str | None = "pallas"  # what "auto" takes on the GPU (None: XLA's paths, as off it); see above
# The kernel's tiles (rows per tile, output columns per program, K step, warps, pipeline stages), the sweep's picks
# (bench_moe.chosen_blocks: decode by time summed over the decode cases, prefill the fastest with the same block_k).
# block_k is shared: a row's products accumulate over K in the same steps in both.
# Decode block_n 32, not the sweep's 64: twice the programs on a step's few experts; inside the 10-layer 35B-A3B model
# on an H100 AR went 745.1 -> 749.6 tok/s alone (docs/LOG.md, 2026-12-07 evening). A row's bits do not depend on
# block_n (each program sums its columns over the same K steps).
DECODE_BLOCKS = {"block_m": 16, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 3}
PREFILL_BLOCKS = {"block_m": 64, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3}


class GroupLayout(NamedTuple):
    """Copies sorted by expert, each expert's group padded to whole tiles of block_m rows."""
    dest: jax.Array  # [N k] int32: each copy's row in the padded layout (rows, out of range, when it selects none)
    tile_expert: jax.Array  # [tiles] int32: each tile's expert, -1 for tiles past the last group
    rows: int  # static: tiles * block_m, a bound for any routing of N k copies over E experts


def padded_rows(copies: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded layout: each non-empty group wastes fewer than block_m rows, and at most
    min(E, copies) groups are non-empty."""
    bound = copies + min(num_experts, copies) * (block_m - 1)
    return -(-bound // block_m) * block_m


# Up to this many copies (decode steps and verifications: rows x top-k; 256 covers 32 rows) the layout is built from
# compare matrices ([copies, copies] and [E, E] in a few fusions) instead of a sort and scatters; more copies
# (prefill chunks) sort. Both give the same layout (`group_layout`). On an H100 the compared layout decoded the
# 10-layer 35B-A3B shape at 745.5 tok/s against the sorted one's 706.1, the same tokens (docs/LOG.md, 2026-12-07 night).
LAYOUT_COMPARE_MAX_COPIES = 256


def group_layout(expert_ids: jax.Array, selected: jax.Array, num_experts: int, block_m: int) -> GroupLayout:
    """expert_ids [N, k] int32 and selected [N, k] bool -> the padded sorted layout (static shapes, traced counts).
    Copies of one expert keep their order (copy index) inside its group."""
    E = num_experts
    flat = jnp.where(selected, expert_ids, E).reshape(-1).astype(jnp.int32)  # [M]; E: no expert
    M = flat.shape[0]
    rows = padded_rows(M, E, block_m)
    experts_ = jnp.arange(E, dtype=jnp.int32)
    if M <= LAYOUT_COMPARE_MAX_COPIES:
        # No sort, no scatter: a copy's place in its group is the count of earlier copies of its expert.
        sizes = jnp.sum(flat[:, None] == experts_[None, :], axis=0, dtype=jnp.int32)  # [E]
        earlier = jnp.arange(M)[None, :] < jnp.arange(M)[:, None]  # [M, M]: copy j before copy i
        rank = jnp.sum(earlier & (flat[None, :] == flat[:, None]), axis=1, dtype=jnp.int32)  # [M]
        padded = -(-sizes // block_m) * block_m
        ends = jnp.sum(jnp.where(experts_[None, :] <= experts_[:, None], padded[None, :], 0), axis=1,
                       dtype=jnp.int32)  # [E]: inclusive prefix sums
        starts = ends - padded
        dest = jnp.where(flat < E, starts[jnp.minimum(flat, E - 1)] + rank, rows).astype(jnp.int32)
    else:
        sizes = jnp.bincount(flat, length=E + 1)[:E].astype(jnp.int32)  # [E]
        padded = -(-sizes // block_m) * block_m
        ends = jnp.cumsum(padded)
        starts = ends - padded
        first = jnp.cumsum(sizes) - sizes  # each group's first index among the sorted copies
        order = jnp.argsort(flat, stable=True)
        e_sorted = flat[order]
        clamped = jnp.minimum(e_sorted, E - 1)
        dest_sorted = jnp.where(e_sorted < E, starts[clamped] + jnp.arange(M, dtype=jnp.int32) - first[clamped], rows)
        dest = jnp.zeros((M,), jnp.int32).at[order].set(dest_sorted.astype(jnp.int32))
    tile_rows = jnp.arange(rows // block_m, dtype=jnp.int32) * block_m
    # compare_all, not searchsorted's default "scan": that is a while loop of log2(E) steps, which XLA's GPU runtime
    # drives from the host, in every MoE layer of every decode step (the table drafter's lookup measured it).
    tile_expert = jnp.searchsorted(ends, tile_rows, side="right", method="compare_all").astype(jnp.int32)
    return GroupLayout(dest, jnp.where(tile_expert < E, tile_expert, -1), rows)


# Decode-shape forwards of at most block_m tokens (AR steps, batch-1 verifications) run the kernel on shared rows:
# every tile multiplies the same block_m rows (all the forward's tokens) by its own expert, one tile per expert the
# step selects (the union of the copies' experts), so no sorted layout and no gathered rows are built: the layout is
# one [copies, copies] reduction (`first_copy_tiles`) and each expert's weights are still read once. A row's bits
# are those of the sorted layout (a row's products do not depend on its tile's other rows or its place in the
# tile: README.md). False: the sorted layout for every forward. On an H100 at the 10-layer 35B-A3B shape: AR
# 806.4 tok/s against the layout's 768.1, a gamma-4 step 1.98 ms against 2.13, the same tokens (docs/LOG.md,
# 2026-12-08; `bench_moe.py --stages variants`).
SHARED_ROWS_DECODE = True


def first_copy_tiles(expert_ids: jax.Array, selected: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """expert_ids [N, k] int32 and selected [N, k] bool -> (copy_tile [N k] int32, tile_expert [N k] int32).

    Tile t belongs to copy t's expert where copy t is the first selected copy of that expert, else to none (-1); a
    selected copy's tile is its expert's first copy (N k for copies that select none). So the tiles in use are the
    step's distinct experts, each once."""
    E = num_experts
    flat = jnp.where(selected, expert_ids, E).reshape(-1).astype(jnp.int32)  # [M]; E: no expert
    M = flat.shape[0]
    copies = jnp.arange(M, dtype=jnp.int32)
    same = (flat[None, :] == flat[:, None]) & (flat[None, :] < E)  # [M(i), M(j)]: copy j has copy i's expert
    first = jnp.min(jnp.where(same, copies[None, :], M), axis=1).astype(jnp.int32)  # [M]; M where i selects none
    return first, jnp.where(first == copies, flat, -1)


def shared_rows_fit(tokens: int, decode_shape: bool, blocks: dict | None = None) -> bool:
    """Whether a forward of `tokens` rows runs the kernel on shared rows (SHARED_ROWS_DECODE: decode shapes, at most
    one tile of rows)."""
    return decode_shape and SHARED_ROWS_DECODE and tokens <= tiles_for(True, blocks)["block_m"]


def shared_rows_products(x, copy_tile, tile_expert, selected, gate_up, down, tiles: dict | None = None,
                         shared: tuple | None = None) -> jax.Array:
    """The kernel's products for N <= block_m tokens x [N, D] on shared rows, from `first_copy_tiles`' copy_tile
    [N k] and tile_expert [N k]; selected [N, k] bool -> y [N, k, D], zero where not selected. shared: None, or a
    shared expert's (gate_up [2I, D], down [D, I]), which tile expert E names."""
    N, k = selected.shape
    tiles = tiles_for(True, tiles)
    bm = tiles["block_m"]
    rows = jnp.pad(x, ((0, bm - N), (0, 0)))  # [block_m, D]
    kw = dict(tiles, interpret=jax.default_backend() != "gpu")
    s_gu, s_down = (None, None) if shared is None else (shared[0][None], shared[1][None])  # [1, 2I, D], [1, D, I]
    h = _kernel().grouped_matmul(rows, tile_expert, gate_up, swiglu=True, shared_rows=True, shared_w=s_gu,
                                 **kw)  # [M bm, I]
    y = _kernel().grouped_matmul(h, tile_expert, down, swiglu=False, shared_w=s_down, **kw)  # [M bm, D]
    token = jnp.arange(N * k, dtype=jnp.int32) // k
    y = y[jnp.minimum(copy_tile, N * k - 1) * bm + token].reshape(N, k, -1)
    return jnp.where(selected[..., None], y, jnp.zeros((), x.dtype))


def _shared_rows_products(x, ids, selected, gate_up, down, tiles: dict, shared: tuple | None = None) -> jax.Array:
    """`expert_swiglu` for N <= block_m tokens on shared rows (SHARED_ROWS_DECODE): -> y [N, k, D]. With `shared`,
    ids may be E (the shared expert)."""
    copy_tile, tile_expert = first_copy_tiles(ids, selected, gate_up.shape[0] + (shared is not None))
    return shared_rows_products(x, copy_tile, tile_expert, selected, gate_up, down, tiles, shared)


def gather_rows(x: jax.Array, copy_token: jax.Array, layout: GroupLayout) -> jax.Array:
    """x [N, D], copy_token [M] (each copy's token) -> the padded layout's rows [rows, D], zero where no copy sits.
    Few copies: each row finds its copy by comparing against every copy's destination (a gather, no scatter);
    more: a scatter."""
    M = copy_token.shape[0]
    if M <= LAYOUT_COMPARE_MAX_COPIES:
        here = layout.dest[None, :] == jnp.arange(layout.rows, dtype=jnp.int32)[:, None]  # [rows, M]
        src = jnp.sum(jnp.where(here, jnp.arange(M, dtype=jnp.int32)[None, :], 0), axis=1)  # [rows]
        return jnp.where(jnp.any(here, axis=1)[:, None], x[copy_token[src]], jnp.zeros((), x.dtype))
    return jnp.zeros((layout.rows, x.shape[1]), x.dtype).at[layout.dest].set(x[copy_token], mode="drop")


def resolve(implementation: str | None, copies: int, num_experts: int) -> str:
    """The implementation `implementation` ("auto" / None / a name) means for `copies` token copies."""
    if implementation in (None, "auto"):
        if GPU_DEFAULT is not None and jax.default_backend() == "gpu":
            return GPU_DEFAULT
        return "gather" if copies <= num_experts else "ragged"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"experts: implementation must be one of {IMPLEMENTATIONS} or 'auto'; got {implementation!r}")
    return implementation


def kernel_fits(gate_up_shape: tuple, down_shape: tuple, blocks: dict) -> bool:
    """Whether the kernel's tiles divide the weights (I and D by block_n and block_k, both >= 16)."""
    _, two_i, d = gate_up_shape
    inter = down_shape[2]
    bn, bk = blocks["block_n"], blocks["block_k"]
    return two_i == 2 * inter and all(n % bn == 0 for n in (inter, d)) and all(n % bk == 0 for n in (inter, d))


@functools.cache
def _kernel():
    from . import kernel
    return kernel


def tiles_for(decode_shape: bool, blocks: dict | None = None) -> dict:
    """The kernel's tiles for a decode-shape forward (DECODE_BLOCKS) or a prefill chunk (PREFILL_BLOCKS), with
    `blocks` overriding."""
    return dict(DECODE_BLOCKS if decode_shape else PREFILL_BLOCKS, **(blocks or {}))


def shared_fits(gate_up_shape: tuple, down_shape: tuple, shared_gate_up_shape: tuple, shared_down_shape: tuple) -> bool:
    """Whether a shared expert of these shapes ([2S, D], [D, S]) can be a tile of the stack's kernel: one expert's
    shape (S = I)."""
    return tuple(shared_gate_up_shape) == tuple(gate_up_shape[1:]) and tuple(shared_down_shape) == tuple(down_shape[1:])


def implementation_for(implementation: str | None, copies: int, gate_up_shape: tuple, down_shape: tuple,
                       tiles: dict) -> str:
    """The implementation `expert_swiglu` runs: `resolve`'s choice, and XLA's paths where the kernel's `tiles` do not
    divide the weights. Only the kernel ("pallas") computes a copy in the same bits whatever the number of copies
    (fixed tiles); XLA's products may change their order with the shape."""
    E = gate_up_shape[0]
    chosen = resolve(implementation, copies, E)
    if chosen == "pallas" and not kernel_fits(gate_up_shape, down_shape, tiles):
        chosen = "gather" if copies <= E else "ragged"
    return chosen


def expert_swiglu(x: jax.Array, expert_ids: jax.Array, gate_up: jax.Array, down: jax.Array, *,
                  implementation: str | None = "auto", decode_shape: bool = False,
                  blocks: dict | None = None, shared: tuple | None = None,
                  shared_selected: jax.Array | None = None) -> jax.Array:
    """x [N, D], expert_ids [N, k] int, gate_up [E, 2I, D], down [E, D, I] -> y [N, k, D] in x.dtype.

    y[n, s] = down[e] @ (silu(g) * u), (g ; u) = gate_up[e] @ x[n], e = expert_ids[n, s]; zero where e lies outside
    [0, E). decode_shape: the forward is a decode step or a verification (DECODE_BLOCKS) rather than a prefill chunk.
    blocks: the kernel's tiles (overrides). shared: None, or a shared expert's (gate_up [2I, D], down [D, I]), run on
    the tokens where shared_selected [N] bool (None: all): then y is [N, k + 1, D], y[:, k] the shared expert's
    output (zero where not selected); the kernel runs it as one more tile of the same launches (`shared_fits`)."""
    N, k = expert_ids.shape
    E = gate_up.shape[0]
    selected = (expert_ids >= 0) & (expert_ids < E)
    tiles = tiles_for(decode_shape, blocks)
    chosen = implementation_for(implementation, N * k, gate_up.shape, down.shape, tiles)
    ids = jnp.clip(expert_ids, 0, E - 1)
    if shared is not None:
        if not shared_fits(gate_up.shape, down.shape, shared[0].shape, shared[1].shape):
            raise ValueError(f"experts: a shared expert of shapes {shared[0].shape}, {shared[1].shape} is not one "
                             f"expert of the stack's {gate_up.shape[1:]}, {down.shape[1:]}")
        on = jnp.ones((N,), bool) if shared_selected is None else shared_selected.astype(bool)
        if chosen != "pallas":  # XLA's paths: the shared expert as its own product, beside the routed ones
            y = expert_swiglu(x, expert_ids, gate_up, down, implementation=chosen, decode_shape=decode_shape,
                              blocks=blocks)
            return jnp.concatenate([y, reference.dense(x, shared[0], shared[1], on)[:, None]], axis=1)
        ids = jnp.concatenate([ids, jnp.full((N, 1), E, jnp.int32)], axis=1)  # [N, k + 1]: E, the shared expert
        selected = jnp.concatenate([selected, on[:, None]], axis=1)
        k = k + 1
    if chosen == "gather":
        return reference.gathered(x, ids, gate_up, down, selected)
    if chosen == "ragged":
        return reference.sorted_ragged(x, ids, gate_up, down, selected)
    if shared_rows_fit(N, decode_shape, blocks):
        return _shared_rows_products(x, ids, selected, gate_up, down, tiles, shared)
    layout = group_layout(ids, selected, E + (shared is not None), tiles["block_m"])
    copy_token = jnp.arange(N * k, dtype=jnp.int32) // k
    rows = gather_rows(x, copy_token, layout)  # [rows, D]
    kw = dict(tiles, interpret=jax.default_backend() != "gpu")
    s_gu, s_down = (None, None) if shared is None else (shared[0][None], shared[1][None])  # [1, 2I, D], [1, D, I]
    h = _kernel().grouped_matmul(rows, layout.tile_expert, gate_up, swiglu=True, shared_w=s_gu, **kw)  # [rows, I]
    y = _kernel().grouped_matmul(h, layout.tile_expert, down, swiglu=False, shared_w=s_down, **kw)  # [rows, D]
    y = y[jnp.minimum(layout.dest, layout.rows - 1)].reshape(N, k, -1)
    return jnp.where(selected[..., None], y, jnp.zeros((), x.dtype))


__all__ = ["IMPLEMENTATIONS", "DECODE_BLOCKS", "PREFILL_BLOCKS", "LAYOUT_COMPARE_MAX_COPIES", "SHARED_ROWS_DECODE",
           "GroupLayout", "group_layout", "first_copy_tiles", "shared_rows_fit", "shared_rows_products", "gather_rows",
           "shared_fits",
           "padded_rows",
           "resolve", "kernel_fits", "tiles_for", "implementation_for", "expert_swiglu", "reference"]
