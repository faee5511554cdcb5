"""Kernel IDs and the per-kernel statistics of FIKIT's measurement phase (Section 3.2).

A task is measured over T runs; each record is one kernel launch (kernel ID, start and end on
the GPU clock in ns, run index in [0, T)). Per kernel ID this module computes the sample count,
the mean / p50 / p95 duration and the mean idle gap after the kernel. The gap after a kernel
is the next kernel's start minus this kernel's end, "next" in (start, end, kernel ID) order
within the same run: the last kernel of a run has no gap, gaps never cross runs, and a negative
gap (kernels overlapping on concurrent streams) counts as 0. Percentiles interpolate linearly
between order statistics (numpy's default "linear" method).

Kernel ID (the C shim computes the same, shim/src/names.c): 64-bit FNV-1a, offset basis
0xcbf29ce484222325, prime 0x100000001b3, over the bytes of

    UTF-8(name) || u32le(grid.x) u32le(grid.y) u32le(grid.z) u32le(block.x) u32le(block.y)
    u32le(block.z)

with no separator and no terminating NUL: for each byte, h ^= byte, then h *= prime mod 2^64.

A CUDA graph is measured and admitted as one unit (shim/src/graphs.c): its structure hash is
64-bit FNV-1a (same basis and prime) over, for each node in the driver's order,
u32le(node type) followed, for a kernel node (type 0), by u64le(the node's kernel ID); its
record is named "<graph:HHHHHHHHHHHHHHHH>" (the hash, 16 lowercase hex digits) with all six
dimensions 0, and its ID is that name's kernel ID.

Everything is numpy-vectorised (sorts, reduceat, bincount; no Python loop per record): the
profiler service has to digest >= 300,000 records/s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1
_U32 = 1 << 32
_INT64_MAX = (1 << 63) - 1

Dim3 = tuple[int, int, int]


def kernel_id(name: str, grid: Dim3, block: Dim3) -> int:
    """The 64-bit kernel ID of a launch (definition in the module docstring)."""
    data = name.encode("utf-8")
    # The shim hashes a C string: a NUL would end the name there.
    if b"\0" in data:
        raise ValueError("kernel name must not contain NUL")
    dims = (*grid, *block)
    if len(dims) != 6:
        raise ValueError(f"grid and block need three dimensions each, got {grid!r}, {block!r}")
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or not 0 <= dim < _U32:
            raise ValueError(f"grid/block dimensions must be uint32, got {dim!r}")
        data += int(dim).to_bytes(4, "little")
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & _MASK64
    return h


GRAPH_NODE_KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
NO_DIMS: Dim3 = (0, 0, 0)


def _fnv(h: int, value: int, size: int) -> int:
    for byte in value.to_bytes(size, "little"):
        h = ((h ^ byte) * FNV_PRIME) & _MASK64
    return h


def graph_name(nodes: Sequence[tuple[int, int | None]]) -> str:
    """The record name of a graph whose nodes are (node type, kernel ID or None), in the
    driver's order (definition in the module docstring)."""
    h = FNV_OFFSET
    for node_type, kernel in nodes:
        h = _fnv(h, node_type, 4)
        if node_type == GRAPH_NODE_KERNEL:
            if kernel is None:
                raise ValueError("a kernel node needs its kernel ID")
            h = _fnv(h, kernel, 8)
    return f"<graph:{h:016x}>"


def graph_kernel_id(name: str) -> int:
    """The ID a graph named `name` is measured and admitted under."""
    return kernel_id(name, NO_DIMS, NO_DIMS)


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise: a fixed, well-spread hash of uint64 values."""
    z = np.asarray(x, dtype=np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@dataclass(frozen=True, slots=True, eq=False)
class Runs:
    """Measured runs in launch order, runs concatenated: run t is the slice
    offsets[t]:offsets[t + 1] of every array. gaps_ns[i] is the idle gap after kernel i, NaN
    after the last kernel of its run (there is none)."""

    kernel_ids: np.ndarray  # uint64
    durations_ns: np.ndarray  # int64
    gaps_ns: np.ndarray  # float64
    offsets: np.ndarray  # int64, T + 1 entries

    @property
    def count(self) -> int:
        """T, empty runs included."""
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def run(self, t: int) -> np.ndarray:
        """The kernel IDs of run t."""
        return self.kernel_ids[self.offsets[t] : self.offsets[t + 1]]

    def positions(self) -> np.ndarray:
        """Each kernel's launch index within its run."""
        n = len(self.kernel_ids)
        return np.arange(n, dtype=np.int64) - np.repeat(self.offsets[:-1], self.lengths)

    def select(self, runs: Sequence[int] | np.ndarray) -> Runs:
        """The given runs, in the given order, renumbered 0, 1, ..."""
        runs = np.asarray(runs, dtype=np.int64)
        lengths = self.lengths[runs]
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        # Index of every kept record: its run's old start plus its position in the run.
        index = np.repeat(self.offsets[runs] - offsets[:-1], lengths) + np.arange(offsets[-1])
        return Runs(self.kernel_ids[index], self.durations_ns[index], self.gaps_ns[index], offsets)

    @classmethod
    def from_sequences(
        cls,
        kernel_ids: Sequence[Sequence[int]],
        gaps_ns: Sequence[Sequence[float]],
        durations_ns: Sequence[Sequence[int]] | None = None,
    ) -> Runs:
        """Runs from per-run lists: a run of n kernels has n - 1 gaps (or n with the last one
        ignored). Durations default to 0. For tests and callers that hold sequences."""
        ids, gaps, durations, offsets = [], [], [], [0]
        for t, run in enumerate(kernel_ids):
            n = len(run)
            run_gaps = np.full(n, np.nan)
            given = np.asarray(gaps_ns[t], dtype=np.float64)[: max(n - 1, 0)]
            if len(given) != max(n - 1, 0):
                raise ValueError(f"run {t}: {n} kernels need {max(n - 1, 0)} gaps")
            run_gaps[: len(given)] = given
            ids.append(np.asarray(run, dtype=np.uint64).reshape(n))
            gaps.append(run_gaps)
            durations.append(
                np.zeros(n, np.int64)
                if durations_ns is None
                else np.asarray(durations_ns[t], dtype=np.int64).reshape(n)
            )
            offsets.append(offsets[-1] + n)
        return cls(
            np.concatenate(ids) if ids else np.zeros(0, np.uint64),
            np.concatenate(durations) if durations else np.zeros(0, np.int64),
            np.concatenate(gaps) if gaps else np.zeros(0, np.float64),
            np.asarray(offsets, dtype=np.int64),
        )


@dataclass(frozen=True, slots=True)
class KernelSummary:
    """The statistics of one kernel ID. mean_gap_after_ns is 0.0 when gap_count is 0 (the
    kernel only ever ran last in its run)."""

    kernel_id: int
    sample_count: int
    mean_duration_ns: float
    p50_duration_ns: float
    p95_duration_ns: float
    gap_count: int
    mean_gap_after_ns: float


@dataclass(frozen=True, slots=True, eq=False)
class KernelTable:
    """Statistics per kernel ID as columns, kernel IDs ascending."""

    kernel_ids: np.ndarray  # uint64
    sample_count: np.ndarray  # int64
    mean_duration_ns: np.ndarray  # float64
    p50_duration_ns: np.ndarray
    p95_duration_ns: np.ndarray
    gap_count: np.ndarray  # int64
    mean_gap_after_ns: np.ndarray  # float64

    def __len__(self) -> int:
        return len(self.kernel_ids)

    def index_of(self, kernel_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Row of each kernel ID, -1 where the table has none."""
        return lookup(self.kernel_ids, np.asarray(kernel_ids, dtype=np.uint64))

    def get(self, kernel_id: int) -> KernelSummary | None:
        row = int(self.index_of([kernel_id])[0])
        return None if row < 0 else self._row(row)

    def rows(self) -> tuple[KernelSummary, ...]:
        return tuple(self._row(i) for i in range(len(self)))

    def _row(self, i: int) -> KernelSummary:
        return KernelSummary(
            kernel_id=int(self.kernel_ids[i]),
            sample_count=int(self.sample_count[i]),
            mean_duration_ns=float(self.mean_duration_ns[i]),
            p50_duration_ns=float(self.p50_duration_ns[i]),
            p95_duration_ns=float(self.p95_duration_ns[i]),
            gap_count=int(self.gap_count[i]),
            mean_gap_after_ns=float(self.mean_gap_after_ns[i]),
        )


def lookup(sorted_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Index of each id in the ascending array sorted_ids, -1 where absent."""
    if len(sorted_ids) == 0:
        return np.full(len(ids), -1, dtype=np.int64)
    at = np.searchsorted(sorted_ids, ids)
    clipped = np.minimum(at, len(sorted_ids) - 1)
    return np.where(sorted_ids[clipped] == ids, clipped, -1).astype(np.int64)


@dataclass(frozen=True, slots=True, eq=False)
class _Records:
    kernel_ids: np.ndarray  # uint64
    start_ns: np.ndarray  # int64
    end_ns: np.ndarray  # int64
    run_index: np.ndarray  # int64


def _as_int64(name: str, values: object) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integers, got dtype {array.dtype}")
    if array.size and array.dtype.kind == "u" and int(array.max()) > _INT64_MAX:
        raise ValueError(f"{name} exceeds 2^63 - 1 ns")
    return array.astype(np.int64, copy=False)


def _record(i: int, first_index: int | None) -> str:
    if first_index is None:
        return f"record {i}"
    return f"record {i} of the batch ({first_index + i} overall)"


def _validate(
    kernel_ids: object,
    start_ns: object,
    end_ns: object,
    run_index: object,
    runs: int | None,
    first_index: int | None = None,
) -> _Records:
    ids = np.asarray(kernel_ids)
    arrays = [ids, np.asarray(start_ns), np.asarray(end_ns), np.asarray(run_index)]
    if any(a.ndim != 1 for a in arrays):
        raise ValueError("records must be 1-D arrays")
    if len({len(a) for a in arrays}) != 1:
        raise ValueError(
            "kernel_ids, start_ns, end_ns and run_index must have the same length, got "
            + ", ".join(str(len(a)) for a in arrays)
        )
    if ids.dtype.kind not in "iu":
        raise ValueError(f"kernel_ids must be integers, got dtype {ids.dtype}")
    if ids.dtype.kind == "i" and ids.size and int(ids.min()) < 0:
        raise ValueError("kernel_ids must be unsigned 64-bit values")
    start = _as_int64("start_ns", start_ns)
    end = _as_int64("end_ns", end_ns)
    run = _as_int64("run_index", run_index)
    bad = np.flatnonzero(end < start)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{_record(i, first_index)}: end_ns {int(end[i])} < start_ns {int(start[i])}"
        )
    limit = runs if runs is not None else _INT64_MAX
    bad = np.flatnonzero((run < 0) | (run >= limit))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{_record(i, first_index)}: run_index {int(run[i])} is outside [0, {runs})"
        )
    return _Records(ids.astype(np.uint64, copy=False), start, end, run)


def _in_order(r: _Records) -> bool:
    """Already sorted by (run, start, end, kernel ID)? The shim usually sends them so."""
    if len(r.run_index) < 2:
        return True
    keys = (r.run_index, r.start_ns, r.end_ns, r.kernel_ids)
    ordered = np.zeros(len(r.run_index) - 1, dtype=bool)
    tied = np.ones(len(r.run_index) - 1, dtype=bool)
    for key in keys:
        ordered |= tied & (key[1:] > key[:-1])
        tied &= key[1:] == key[:-1]
    return bool(np.all(ordered | tied))


def _launch_order(r: _Records) -> np.ndarray:
    """The permutation sorting records by (run, start, end, kernel ID)."""
    first = int(r.start_ns.min())
    span = int(r.start_ns.max()) - first
    shift = max(int(r.run_index.max()).bit_length(), 1)
    if span < 1 << (62 - shift):
        # Usually one int64 key (run above, start below) orders everything: a single sort.
        keys = (r.run_index << (62 - shift)) | (r.start_ns - first)
        order = np.argsort(keys)
        ordered = keys[order]
        if not np.any(ordered[1:] == ordered[:-1]):
            return order
    # Equal starts within a run: break the ties by end, then kernel ID, so that the order
    # (and every gap) does not depend on how the records arrived.
    return np.lexsort((r.kernel_ids, r.end_ns, r.start_ns, r.run_index))


def _order(r: _Records, runs: int | None) -> Runs:
    if not _in_order(r):
        order = _launch_order(r)
        r = _Records(r.kernel_ids[order], r.start_ns[order], r.end_ns[order], r.run_index[order])
    count = runs if runs is not None else (int(r.run_index[-1]) + 1 if len(r.run_index) else 0)
    offsets = np.searchsorted(r.run_index, np.arange(count + 1)).astype(np.int64)
    gaps = np.full(len(r.kernel_ids), np.nan)
    if len(gaps) > 1:
        same_run = r.run_index[1:] == r.run_index[:-1]
        raw = np.maximum(r.start_ns[1:] - r.end_ns[:-1], 0).astype(np.float64)
        gaps[:-1] = np.where(same_run, raw, np.nan)
    return Runs(r.kernel_ids, r.end_ns - r.start_ns, gaps, offsets)


def order_runs(
    kernel_ids: np.ndarray,
    start_ns: np.ndarray,
    end_ns: np.ndarray,
    run_index: np.ndarray,
    runs: int | None = None,
) -> Runs:
    """Records in any order -> Runs in launch order. runs is T (default: the largest run
    index + 1); ValueError names the first record with end < start or a run index outside
    [0, T)."""
    return _order(_validate(kernel_ids, start_ns, end_ns, run_index, runs), runs)


def _group_quantile(
    values: np.ndarray, starts: np.ndarray, counts: np.ndarray, q: float
) -> np.ndarray:
    """q-quantile of each group of `values` (each group sorted ascending, groups contiguous),
    linear interpolation between order statistics."""
    position = starts + q * (counts - 1)
    low = np.floor(position).astype(np.int64)
    high = np.minimum(low + 1, starts + counts - 1)
    fraction = position - low
    return values[low] + (values[high] - values[low]) * fraction


def group(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct values ascending, each value's index among them): np.unique with
    return_inverse, without its slower stable sort."""
    if len(values) == 0:
        return values[:0], np.zeros(0, np.int64)
    order = np.argsort(values)
    ordered = values[order]
    new = np.empty(len(values), dtype=bool)
    new[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    inverse = np.empty(len(values), dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return ordered[new], inverse


def _sorted_within_groups(inverse: np.ndarray, values: np.ndarray, groups: int) -> np.ndarray:
    """`values` sorted by (group, value)."""
    shift = max(int(groups - 1).bit_length(), 1)
    if values.size and values.min() >= 0 and int(values.max()) < 1 << (62 - shift):
        # One int64 key (group above, value below) sorts several times faster than lexsort.
        keys = np.sort((inverse << (62 - shift)) | values)
        return keys & ((1 << (62 - shift)) - 1)
    return values[np.lexsort((values, inverse))]


def summarise(runs: Runs) -> KernelTable:
    """Statistics per kernel ID over all runs."""
    ids, inverse = group(runs.kernel_ids)
    groups = len(ids)
    counts = np.bincount(inverse, minlength=groups)
    starts = np.cumsum(counts) - counts
    durations = _sorted_within_groups(inverse, runs.durations_ns, groups).astype(np.float64)
    has_gap = ~np.isnan(runs.gaps_ns)
    gap_count = np.bincount(inverse[has_gap], minlength=groups)
    gap_sum = np.bincount(inverse[has_gap], weights=runs.gaps_ns[has_gap], minlength=groups)
    return KernelTable(
        kernel_ids=ids,
        sample_count=counts.astype(np.int64),
        mean_duration_ns=np.bincount(
            inverse, weights=runs.durations_ns.astype(np.float64), minlength=groups
        )
        / counts,
        p50_duration_ns=_group_quantile(durations, starts, counts, 0.50),
        p95_duration_ns=_group_quantile(durations, starts, counts, 0.95),
        gap_count=gap_count.astype(np.int64),
        mean_gap_after_ns=np.divide(gap_sum, gap_count, out=np.zeros(groups), where=gap_count > 0),
    )


def aggregate(
    kernel_ids: np.ndarray,
    start_ns: np.ndarray,
    end_ns: np.ndarray,
    run_index: np.ndarray,
    runs: int | None = None,
) -> KernelTable:
    """Statistics per kernel ID from the records of one task's T runs, in any order."""
    return summarise(order_runs(kernel_ids, start_ns, end_ns, run_index, runs))


class KernelAccumulator:
    """Collects one task's records batch by batch, in any order and any split, for T runs.

    A batch is checked whole before any of it is kept (ValueError names the record by its
    index in the batch and overall). The caller marks a run complete once all its records are
    in; records of runs never completed are left out of the result (a run cut short would
    bias the gaps), and a record for a completed run is refused."""

    def __init__(self, runs: int) -> None:
        if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
            raise ValueError(f"runs must be an integer >= 1, got {runs!r}")
        self._runs = runs
        self._batches: list[_Records] = []
        self._records = 0
        self._complete = np.zeros(runs, dtype=bool)

    @property
    def runs(self) -> int:
        return self._runs

    @property
    def records(self) -> int:
        return self._records

    @property
    def completed_runs(self) -> int:
        return int(self._complete.sum())

    def add(
        self,
        kernel_ids: np.ndarray,
        start_ns: np.ndarray,
        end_ns: np.ndarray,
        run_index: np.ndarray,
    ) -> None:
        batch = _validate(kernel_ids, start_ns, end_ns, run_index, self._runs, self._records)
        done = np.flatnonzero(self._complete[batch.run_index])
        if done.size:
            i = int(done[0])
            raise ValueError(
                f"{_record(i, self._records)}: run {int(batch.run_index[i])} is already complete"
            )
        if len(batch.run_index):
            self._batches.append(batch)
            self._records += len(batch.run_index)

    def complete(self, run: int) -> None:
        """All records of `run` are in."""
        if not 0 <= run < self._runs:
            raise ValueError(f"run {run} is outside [0, {self._runs})")
        self._complete[run] = True

    def measured_runs(self) -> Runs:
        """The completed runs' records in launch order (incomplete runs are empty)."""
        if not self._batches:
            merged = _Records(*(np.zeros(0, t) for t in (np.uint64, *[np.int64] * 3)))
        elif len(self._batches) == 1:
            merged = self._batches[0]
        else:
            merged = _Records(
                *(np.concatenate([getattr(b, f) for b in self._batches]) for f in _FIELDS)
            )
            # Keep one array per field: a later call does not concatenate everything again.
            self._batches = [merged]
        keep = self._complete[merged.run_index]
        if not keep.all():
            merged = _Records(*(getattr(merged, f)[keep] for f in _FIELDS))
        return _order(merged, self._runs)

    def result(self) -> KernelTable:
        """Statistics over the completed runs."""
        return summarise(self.measured_runs())


_FIELDS = ("kernel_ids", "start_ns", "end_ns", "run_index")
