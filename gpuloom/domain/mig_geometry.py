"""MIG geometry as data: slices, legal instance placements, valid partitions, the
repartitioning tree of the FAR paper (Figure 4) and instance creation/destruction times
(Table 1 of the paper).

A placement's *footprint* is the set of slices it blocks. It equals its size except for the
3-slice instance at slice 0 of the 7-slice GPUs, which also takes slice 3's memory: no other
instance can use S3 while it exists, so the planner treats it as blocking S0-S3.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


class UnknownGpuError(ValueError):
    """The GPU model has no MIG geometry here."""


@dataclass(frozen=True, order=True)
class Placement:
    """One legal MIG instance: `size` compute slices starting at `first_slice`; `slices` are
    the ones it blocks while it exists (its footprint, `span` of them)."""

    size: int
    first_slice: int
    span: int
    slices: tuple[int, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Stored, not computed on access: the planners read it in their innermost loops.
        footprint = tuple(range(self.first_slice, self.first_slice + self.span))
        object.__setattr__(self, "slices", footprint)

    def overlaps(self, other: Placement) -> bool:
        return (
            self.first_slice < other.first_slice + other.span
            and other.first_slice < self.first_slice + self.span
        )

    @property
    def label(self) -> str:
        return f"{self.size}g@{self.first_slice}"


@dataclass(frozen=True)
class ReconfigTimes:
    """Seconds to create and to destroy an instance of each size (NVML, sequential)."""

    create_s: Mapping[int, float]
    destroy_s: Mapping[int, float]


@dataclass(frozen=True)
class TreeNode:
    """A node of the repartitioning tree: an instance and the instances it splits into."""

    placement: Placement
    parent: int | None
    children: tuple[int, ...]


@dataclass(frozen=True)
class MigGeometry:
    """Everything the planners need to know about one MIG-capable GPU model."""

    name: str
    slice_count: int
    sizes: tuple[int, ...]
    placements: tuple[Placement, ...]
    tree: tuple[TreeNode, ...]
    reconfig: ReconfigTimes
    partitions: tuple[tuple[Placement, ...], ...]

    def placement(self, size: int, first_slice: int) -> Placement:
        for placement in self.placements:
            if placement.size == size and placement.first_slice == first_slice:
                return placement
        raise ValueError(f"{self.name} has no {size}-slice instance at slice {first_slice}")

    def is_legal(self, size: int, first_slice: int) -> bool:
        return any(p.size == size and p.first_slice == first_slice for p in self.placements)

    def create_s(self, size: int) -> float:
        return self.reconfig.create_s[size]

    def destroy_s(self, size: int) -> float:
        return self.reconfig.destroy_s[size]

    def with_reconfig_times(
        self,
        create_s: Mapping[int, float] | None = None,
        destroy_s: Mapping[int, float] | None = None,
    ) -> MigGeometry:
        """The same GPU with other creation/destruction times (sizes not given keep theirs)."""
        create = {**self.reconfig.create_s, **(create_s or {})}
        destroy = {**self.reconfig.destroy_s, **(destroy_s or {})}
        for label, times in (("create", create), ("destroy", destroy)):
            for size, seconds in times.items():
                if size not in self.sizes:
                    raise ValueError(f"{self.name} has no instance size {size}")
                if not seconds >= 0:
                    raise ValueError(f"{label} time for size {size} must be >= 0, got {seconds}")
        return dataclasses.replace(
            self, reconfig=ReconfigTimes(MappingProxyType(create), MappingProxyType(destroy))
        )


def valid_partitions(
    placements: Iterable[Placement], slice_count: int
) -> tuple[tuple[Placement, ...], ...]:
    """All sets of disjoint placements whose footprints cover every slice: the valid partitions."""
    ordered = sorted(placements, key=lambda p: (p.first_slice, -p.size))
    found: list[tuple[Placement, ...]] = []

    def extend(chosen: tuple[Placement, ...], next_free: int) -> None:
        if next_free >= slice_count:
            found.append(chosen)
            return
        for placement in ordered:
            if placement.first_slice == next_free:
                extend((*chosen, placement), next_free + placement.span)

    extend((), 0)
    return tuple(found)


def _tree(
    edges: Mapping[tuple[int, int], tuple[tuple[int, int], ...]],
    placements: Mapping[tuple[int, int], Placement],
    root: tuple[int, int],
) -> tuple[TreeNode, ...]:
    """Number the tree breadth-first, so parents always come before their children."""
    order = [root]
    for key in order:
        order.extend(edges.get(key, ()))
    index = {key: i for i, key in enumerate(order)}
    parents: dict[tuple[int, int], int] = {}
    for parent, children in edges.items():
        for child in children:
            parents[child] = index[parent]
    return tuple(
        TreeNode(
            placement=placements[key],
            parent=parents.get(key),
            children=tuple(index[c] for c in edges.get(key, ())),
        )
        for key in order
    )


def _geometry(
    name: str,
    slice_count: int,
    placement_spans: Mapping[tuple[int, int], int],
    edges: Mapping[tuple[int, int], tuple[tuple[int, int], ...]],
    root: tuple[int, int],
    create_s: Mapping[int, float],
    destroy_s: Mapping[int, float],
) -> MigGeometry:
    placements = {
        key: Placement(size=key[0], first_slice=key[1], span=span)
        for key, span in placement_spans.items()
    }
    ordered = tuple(sorted(placements.values(), key=lambda p: (-p.size, p.first_slice)))
    return MigGeometry(
        name=name,
        slice_count=slice_count,
        sizes=tuple(sorted({p.size for p in ordered})),
        placements=ordered,
        tree=_tree(edges, placements, root),
        reconfig=ReconfigTimes(MappingProxyType(dict(create_s)), MappingProxyType(dict(destroy_s))),
        partitions=valid_partitions(ordered, slice_count),
    )


# (size, first slice) -> footprint in slices.
_A30_PLACEMENTS = {(4, 0): 4, (2, 0): 2, (2, 2): 2, **{(1, s): 1 for s in range(4)}}
_A30_TREE = {
    (4, 0): ((2, 0), (2, 2)),
    (2, 0): ((1, 0), (1, 1)),
    (2, 2): ((1, 2), (1, 3)),
}

_SEVEN_SLICE_PLACEMENTS = {
    (7, 0): 7,
    (4, 0): 4,
    (3, 0): 4,
    (3, 4): 3,
    (2, 0): 2,
    (2, 2): 2,
    (2, 4): 2,
    **{(1, s): 1 for s in range(7)},
}
# Figure 4: the first four slices host 4-slice tasks, then 3-slice tasks, then split in halves.
_SEVEN_SLICE_TREE = {
    (7, 0): ((4, 0), (3, 4)),
    (4, 0): ((3, 0),),
    (3, 0): ((2, 0), (2, 2)),
    (2, 0): ((1, 0), (1, 1)),
    (2, 2): ((1, 2), (1, 3)),
    (3, 4): ((2, 4), (1, 6)),
    (2, 4): ((1, 4), (1, 5)),
}

# Table 1 of the FAR paper (seconds, NVML, one operation at a time).
_TABLE1 = {
    "A30": ({1: 0.11, 2: 0.12, 4: 0.13}, {1: 0.10, 2: 0.10, 4: 0.10}),
    "A100": (
        {1: 0.16, 2: 0.17, 3: 0.20, 4: 0.21, 7: 0.24},
        {1: 0.20, 2: 0.20, 3: 0.21, 4: 0.21, 7: 0.22},
    ),
    "H100": (
        {1: 0.16, 2: 0.21, 3: 0.33, 4: 0.38, 7: 0.42},
        {1: 0.21, 2: 0.23, 3: 0.25, 4: 0.26, 7: 0.26},
    ),
}

A30 = _geometry("A30", 4, _A30_PLACEMENTS, _A30_TREE, (4, 0), *_TABLE1["A30"])
A100 = _geometry("A100", 7, _SEVEN_SLICE_PLACEMENTS, _SEVEN_SLICE_TREE, (7, 0), *_TABLE1["A100"])
H100 = _geometry("H100", 7, _SEVEN_SLICE_PLACEMENTS, _SEVEN_SLICE_TREE, (7, 0), *_TABLE1["H100"])
# Same MIG rules as the A100/H100; no published reconfiguration times yet, so H100's stand in.
B200 = dataclasses.replace(H100, name="B200")

GEOMETRIES: Mapping[str, MigGeometry] = MappingProxyType(
    {g.name: g for g in (A30, A100, H100, B200)}
)


def get_geometry(name: str) -> MigGeometry:
    """The geometry of a GPU model by name, case-insensitive ("a100" works)."""
    for known, geometry in GEOMETRIES.items():
        if known.lower() == name.strip().lower():
            return geometry
    raise UnknownGpuError(f"unknown GPU {name!r}; known: {', '.join(GEOMETRIES)}")
