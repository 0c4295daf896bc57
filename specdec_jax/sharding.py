"""Tensor parallelism over the axis "tp" of a `jax.sharding.Mesh`: which axis of each Qwen3.5 parameter and decode
state is split, the grouped row order of fused projections, and the checks that a model can be split.

Placement is JAX's own: `NamedSharding` + `PartitionSpec`, `jax.device_put` at load, `with_sharding_constraint`
where a state is created inside a jit, GSPMD propagation for everything else, and `jax.shard_map` around the
gated-delta kernels (a Pallas kernel is opaque to GSPMD, which would gather every head onto every device). This
module only decides, from each parameter's role, which axis is split (`PARAM_PARTITIONS`):

  heads    attention q (+ gate) / k / v heads and the o_proj input; GDN heads: the q/k/v/z/b/a projections,
           the conv channels, A_log, dt_bias and the out_proj input
  columns  MLP gate/up output columns and down-projection input columns (dense, and the MoE shared expert)
  experts  the MoE expert axis
  vocab    embedding and LM head rows (the MTP head shares them)
  (rest)   replicated: norms, the router, the shared expert's gate, the MTP fc, draft tables

Fused projections (one weight for q|k|v|z|b|a, for gate|up) are stored in *grouped* row order: the rows device i
needs are contiguous (group i = its q heads, its k heads, its v heads, ...), so an even split of the row axis gives
each device whole heads, and the forward takes the parts apart with a reshape, without communication
(`split_groups`). With one group the order is the checkpoint's own.

Heads that are only read by other heads (attention key/value heads, GDN key heads) may be fewer than the mesh: then
each group holds a copy of the one head its query (value) heads read, as vLLM replicates KV heads. Every other
count must be a multiple of the mesh size.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from .errors import InputError

TP = "tp"

# Leaf name (the last key of a parameter's path) -> the partition of that parameter; absent: replicated.
PARAM_PARTITIONS: dict[str, P] = {
    "embed": P(TP, None),  # [vocab, D]
    "lm_head": P(TP, None),  # [vocab, D]
    "qkv_proj": P(TP, None),  # [grouped (q, gate) | k | v rows, D]
    "o_proj": P(None, TP),  # [D, heads * hd]
    "in_proj": P(TP, None),  # [grouped q | k | v | z | b | a rows, D]
    "conv": P(TP, None),  # [grouped q | k | v channels, W]
    "A_log": P(TP),  # [HV]
    "dt_bias": P(TP),  # [HV]
    "out_proj": P(None, TP),  # [D, HV * V]
    "gate_up_proj": P(TP, None),  # [grouped gate | up rows, D]
    "down_proj": P(None, TP),  # [D, F]
    "experts_gate_up": P(TP, None, None),  # [E, 2I, D]
    "experts_down": P(TP, None, None),  # [E, D, I]
    "shared_gate_up_proj": P(TP, None),  # [grouped gate | up rows, D]
    "shared_down_proj": P(None, TP),  # [D, S]
}

# Decode-state field -> partition (the heads axis, matching the parameters that write it).
STATE_PARTITIONS: dict[str, P] = {
    "keys": P(None, None, TP, None),  # [B, S, KV heads, hd]
    "values": P(None, None, TP, None),
    "conv": P(None, None, None, TP),  # [n_gdn, B, W - 1, grouped channels]
    "recurrent": P(None, None, TP, None, None),  # [n_gdn, B, HV, K, V]
    "length": P(),
}

# The gated-delta kernels' operands: per-token tensors [B, T, heads, ...] and states [B, heads, K, V].
TOKEN_HEADS = P(None, None, TP)
STATE_HEADS = P(None, TP)


# ------------------------------------------------------------------------------------------- the mesh

def tp_size(mesh: Mesh | None) -> int:
    """Devices along the "tp" axis (1 without a mesh)."""
    return 1 if mesh is None else int(mesh.shape[TP])


def check_mesh(mesh, where: str) -> None:
    """A `jax.sharding.Mesh` with an axis named "tp"; one InputError otherwise."""
    if not isinstance(mesh, Mesh):
        raise InputError(f"{where}: mesh must be a jax.sharding.Mesh with an axis named {TP!r} "
                         f"(e.g. jax.make_mesh((2,), ({TP!r},))); got {type(mesh).__name__}")
    if TP not in mesh.axis_names:
        raise InputError(f"{where}: the mesh has axes {tuple(mesh.axis_names)}; expected one named {TP!r} "
                         f"(the axis the heads, MLP columns, experts and vocabulary are split over)")


def auto_axes(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis Auto: shardings are propagated by GSPMD inside the jitted
    steps (jax.make_mesh makes Explicit axes by default, whose sharding-in-types rules the model code does not
    follow)."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


@dataclasses.dataclass(frozen=True)
class SplitCount:
    """A count split over the mesh: `name` (as the config spells it), `value`; `repeatable`: a head count that may
    be smaller than the mesh (each device then holds a copy of one head)."""

    name: str
    value: int
    repeatable: bool = False


def split_problems(counts: tuple[SplitCount, ...], tp: int) -> list[str]:
    """What cannot be split over `tp` devices (empty: everything can)."""
    problems = []
    for c in counts:
        if c.value % tp == 0:
            continue
        if c.repeatable and tp % c.value == 0:
            continue
        expected = (f"a multiple of {tp} or a divisor of it (then each device holds a copy of one head)"
                    if c.repeatable else f"a multiple of {tp}")
        problems.append(f"{c.name}={c.value} is not {expected}")
    return problems


def check_split(counts: tuple[SplitCount, ...], mesh: Mesh, where: str) -> None:
    """One InputError listing every count that cannot be split over the mesh's "tp" axis."""
    problems = split_problems(counts, tp_size(mesh))
    if problems:
        raise InputError(f"{where}: cannot split the model over the mesh axis {TP!r} of size {tp_size(mesh)}: "
                         + "; ".join(problems))


# ------------------------------------------------------------------------------ grouped fused layouts

@dataclasses.dataclass(frozen=True)
class Segment:
    """One part of a fused axis, in the checkpoint's order: `units` heads (or channels) of `width` rows each."""

    units: int
    width: int = 1


def units_per_group(units: int, groups: int) -> int:
    """Units each group holds: its share, or one copy when there are fewer units than groups."""
    return units // groups if units >= groups else 1


def stored_units(units: int, groups: int) -> int:
    """Units in the grouped layout (copies included): max(units, groups) for counts that pass `split_problems`."""
    return groups * units_per_group(units, groups)


def group_widths(segments: tuple[Segment, ...], groups: int) -> tuple[int, ...]:
    """Rows of each segment inside one group."""
    return tuple(units_per_group(s.units, groups) * s.width for s in segments)


def grouped_rows(segments: tuple[Segment, ...], groups: int) -> np.ndarray:
    """Indices into the checkpoint's row order giving the grouped order: for each group, each segment's units of
    that group (unit g * units // groups onwards: its share, or the one unit it copies)."""
    for s in segments:
        if s.units % groups and groups % s.units:
            raise ValueError(f"a segment of {s.units} units cannot be grouped {groups} ways")
    starts = np.cumsum([0] + [s.units * s.width for s in segments])
    rows = []
    for g in range(groups):
        for s, start in zip(segments, starts):
            first = g * s.units // groups
            rows.append(start + np.arange(first * s.width, (first + units_per_group(s.units, groups)) * s.width))
    return np.concatenate(rows)


def split_groups(y: jax.Array, widths: tuple[int, ...], groups: int) -> list[jax.Array]:
    """The parts of a grouped last axis: widths[i] = part i's width in one group; part i comes back
    [..., groups * widths[i]], group-major. One group: plain slices of the checkpoint's order."""
    lead = y.shape[:-1]
    if groups == 1:
        starts = np.cumsum((0,) + tuple(widths))
        return [y[..., a:b] for a, b in zip(starts[:-1], starts[1:])]
    y = y.reshape(*lead, groups, sum(widths))  # the split axis stays whole per device: no communication
    starts = np.cumsum((0,) + tuple(widths))
    return [y[..., a:b].reshape(*lead, groups * (b - a)) for a, b in zip(starts[:-1], starts[1:])]


# ---------------------------------------------------------------------------------------- placement

def param_partition(path: tuple) -> P:
    """The partition of the parameter at `path` (a tuple of keys) from its role; replicated when not listed."""
    name = path[-1] if path else None
    return PARAM_PARTITIONS.get(name, P()) if isinstance(name, str) else P()


def place(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    """x laid out over the mesh by `spec` (device_put: each device receives its own part)."""
    return jax.device_put(x, NamedSharding(mesh, spec))


def replicate(tree, mesh: Mesh):
    """Every leaf of a pytree copied onto every device of the mesh."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def constrain(x: jax.Array, mesh: Mesh | None, spec: P) -> jax.Array:
    """x created sharded by `spec` (inside a jit: a sharding constraint for GSPMD); unchanged without a mesh."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def over_heads(fn, mesh: Mesh | None, in_specs, out_specs):
    """fn run once per device on its own heads (jax.shard_map), or fn itself without a mesh. For per-head
    kernels: a Pallas call is opaque to GSPMD, which would otherwise gather all heads onto every device."""
    if mesh is None:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
