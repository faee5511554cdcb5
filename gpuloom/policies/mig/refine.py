"""Phase 3 of FAR: improve a schedule by moving and swapping tasks between instances of the
same size (Section 3.3 of the paper); also used to tighten batch concatenation (Section 4.3).

The paper's rules pick the candidates: look at the slices that reach the makespan, walk the
instances on those slices from the last one executed backwards (Algorithm 2 opens the parent
when a node cannot improve), and for an alternative instance of the same size whose slices end
`gap` seconds before the makespan, move the task closest to gap/2 (shorter than gap), or swap
the pair whose time difference is closest to gap/2 (positive, under gap).

Where this goes beyond the paper: every candidate is timed exactly (reconfigurations
included) instead of with the slice-end estimate, all same-size alternatives are tried (not
only the earliest-ending one), the two best moves and swaps per alternative are tried, and a
change is kept when it lowers the sorted vector of slice end times, so a step that fixes one
of several critical slices counts even before the makespan itself drops.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

CANDIDATES_PER_ALTERNATIVE = 2


@dataclass
class SearchStats:
    moves: int = 0
    swaps: int = 0
    evaluations: int = 0


@dataclass(frozen=True)
class SearchSpace:
    """The fixed shape of the search: per node, its slices, the run time of every task on it
    (inf: cannot run there) and the nodes its tasks may move to; per slice, the nodes
    covering it from the last executed to the first."""

    node_slices: Sequence[range]
    node_times: Sequence[Sequence[float]]
    alternatives: Sequence[Sequence[int]]
    chains: Sequence[Sequence[int]]


# A task on a node: (seconds it takes there, task index). A node keeps them ascending.
Entry = tuple[float, int]
NodeTasks = list[Entry]
SliceEnds = Callable[[Sequence[float | None]], Sequence[float]]


def improve(
    nodes: list[NodeTasks],
    space: SearchSpace,
    slice_ends_of: SliceEnds,
    max_evaluations: int,
) -> SearchStats:
    """Move and swap tasks in `nodes` (changed in place) while the schedule gets better.

    `slice_ends_of(loads)` times the schedule whose node i runs loads[i] seconds of tasks
    (None: no tasks) and returns when each slice is last busy.
    """
    search = _Search(nodes, space, slice_ends_of)
    while search.stats.evaluations < max_evaluations and search.step(max_evaluations):
        pass
    return search.stats


class _Search:
    def __init__(self, nodes: list[NodeTasks], space: SearchSpace, slice_ends_of: SliceEnds):
        self.nodes = nodes
        self.space = space
        self.slice_ends_of = slice_ends_of
        self.loads: list[float | None] = [
            sum(seconds for seconds, _ in tasks) if tasks else None for tasks in nodes
        ]
        self.ends = slice_ends_of(self.loads)
        self.best = sorted(self.ends, reverse=True)
        self.stats = SearchStats(evaluations=1)
        # Task times per node as arrays for the swap search, rebuilt after a node changes.
        self.arrays: list[np.ndarray | None] = [None] * len(nodes)

    def step(self, max_evaluations: int) -> bool:
        """Make one improving move or swap; False when there is none (or out of budget).

        Slices are tried from the one ending last down: lowering a slice below the makespan
        also counts, and often opens the room a later move of a critical task needs."""
        eps = 1e-9 * max(1.0, self.best[0])
        tried: set[int] = set()
        for level, slice_ in sorted(((end, s) for s, end in enumerate(self.ends)), reverse=True):
            for node in self.space.chains[slice_]:
                if node in tried or not self.nodes[node]:
                    continue
                tried.add(node)
                if self.improve_node(node, level, eps, max_evaluations):
                    return True
                if self.stats.evaluations >= max_evaluations:
                    return False
        return False

    def improve_node(self, node: int, makespan: float, eps: float, budget: int) -> bool:
        space = self.space

        def slice_end(n: int) -> float:
            return max(self.ends[s] for s in space.node_slices[n])

        for alt in sorted(space.alternatives[node], key=slice_end):
            gap = makespan - slice_end(alt)
            if gap <= eps:
                break
            same_size = space.node_times[alt] is space.node_times[node]
            for moved in _moves(self.nodes[node], space.node_times[alt], same_size, gap):
                arrived = (space.node_times[alt][moved[1]], moved[1])
                if self.try_exchange(node, [moved], alt, [arrived]):
                    self.stats.moves += 1
                    return True
            if same_size:
                for out, back in self.swaps(node, alt, gap):
                    if self.try_exchange(node, [out, back], alt, [out, back]):
                        self.stats.swaps += 1
                        return True
            if self.stats.evaluations >= budget:
                return False
        return False

    def try_exchange(
        self, node: int, leaving: list[Entry], alt: int, arriving: list[Entry]
    ) -> bool:
        """Move leaving[0] from node to alt, where it runs as arriving[0]; for a swap also move
        leaving[1] from alt to node, where it runs as arriving[1]. Keep the change if the
        schedule improves, else undo it."""
        self._exchange(node, leaving, alt, arriving)
        candidate_ends = self.slice_ends_of(self.loads)
        self.stats.evaluations += 1
        candidate = sorted(candidate_ends, reverse=True)
        if _better(candidate, self.best):
            self.ends, self.best = candidate_ends, candidate
            self.arrays[node] = self.arrays[alt] = None
            return True
        self._exchange(alt, arriving, node, leaving)
        return False

    def _exchange(self, node: int, leaving: list[Entry], alt: int, arriving: list[Entry]) -> None:
        self.nodes[node].remove(leaving[0])
        insort(self.nodes[alt], arriving[0])
        if len(leaving) == 2:
            self.nodes[alt].remove(leaving[1])
            insort(self.nodes[node], arriving[1])
        for changed in (node, alt):
            tasks = self.nodes[changed]
            self.loads[changed] = sum(seconds for seconds, _ in tasks) if tasks else None

    def swaps(self, node: int, alt: int, gap: float) -> list[tuple[Entry, Entry]]:
        """Pairs (from node, from alt) with 0 < difference < gap, closest to gap/2."""
        source, target = self.nodes[node], self.nodes[alt]
        if not target:
            return []
        out_times, back_times = self._array(node), self._array(alt)
        half = gap / 2
        right = np.searchsorted(back_times, out_times - half).clip(max=len(target) - 1)
        pairs = np.concatenate([(right - 1).clip(min=0), right])
        outs = np.tile(np.arange(len(source)), 2)
        difference = out_times[outs] - back_times[pairs]
        score = np.where((difference > 0) & (difference < gap), np.abs(difference - half), np.inf)
        chosen = np.argsort(score, kind="stable")[:CANDIDATES_PER_ALTERNATIVE]
        return [
            (source[outs[c]], target[pairs[c]]) for c in chosen.tolist() if np.isfinite(score[c])
        ]

    def _array(self, node: int) -> np.ndarray:
        cached = self.arrays[node]
        if cached is None:
            cached = np.array([seconds for seconds, _ in self.nodes[node]])
            self.arrays[node] = cached
        return cached


def _moves(
    tasks: NodeTasks, times_there: Sequence[float], same_size: bool, gap: float
) -> list[Entry]:
    """The tasks that would run shorter than `gap` on the other node, closest to gap/2."""
    half = gap / 2
    if same_size:
        i = bisect_left(tasks, (half, -1))
        around = tasks[max(i - CANDIDATES_PER_ALTERNATIVE, 0) : i + CANDIDATES_PER_ALTERNATIVE]
    else:
        around = tasks
    fitting = [t for t in around if times_there[t[1]] < gap]
    fitting.sort(key=lambda t: abs(times_there[t[1]] - half))
    return fitting[:CANDIDATES_PER_ALTERNATIVE]


def _better(candidate: Sequence[float], best: Sequence[float]) -> bool:
    """Lexicographically smaller sorted slice ends, ignoring float noise."""
    eps = 1e-9 * max(1.0, best[0])
    for new, old in zip(candidate, best, strict=True):
        if new < old - eps:
            return True
        if new > old + eps:
            return False
    return False
