"""Phase 3 of FAR: improve a schedule by moving and swapping tasks between instances
(Section 3.3 of the paper); also used to tighten batch concatenation (Section 4.3).

The paper's rules (`SearchRules.paper()`): look at the slices that reach the makespan, walk
the instances on those slices from the last one executed backwards (Algorithm 2 opens the
parent when a node cannot improve), and for the instance of the same size whose slices end
first, `gap` seconds before the makespan, move the task closest to gap/2 (shorter than gap),
or else swap the pair whose time difference is closest to gap/2 (positive, under gap).

Always: every candidate is timed exactly (reconfigurations included) rather than with the
slice-end estimate, and a change is kept when it lowers the sorted vector of slice end times,
so fixing one of several critical slices counts before the makespan itself drops. The default
rules go further: moves to instances of other sizes (at their speed), every alternative
instance, the two best moves and swaps per alternative, and slices below the makespan too.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# Nodes with this many tasks or more search swap partners with numpy; below, plain Python is
# faster.
VECTORISE_FROM = 48


@dataclass(frozen=True)
class SearchRules:
    """How widely phase 3 looks for a better schedule."""

    # Moves may go to an instance of another size, the task taking that size's time.
    any_size: bool = True
    # Try every alternative instance, not only the same-size one whose slices end first.
    every_alternative: bool = True
    # Moves and swaps tried per alternative, best first.
    candidates: int = 2
    # Also try to lower slices that end before the makespan.
    below_makespan: bool = True

    @classmethod
    def paper(cls) -> SearchRules:
        return cls(any_size=False, every_alternative=False, candidates=1, below_makespan=False)


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

    node_slices: Sequence[Sequence[int]]
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
    rules: SearchRules,
) -> SearchStats:
    """Move and swap tasks in `nodes` (changed in place) while the schedule gets better.

    `slice_ends_of(loads)` times the schedule whose node i runs loads[i] seconds of tasks
    (None: no tasks) and returns when each slice is last busy. Whether tasks may change size
    is the `space`'s business (its alternatives); the other rules apply here.
    """
    search = _Search(nodes, space, slice_ends_of, rules)
    while search.stats.evaluations < max_evaluations and search.step(max_evaluations):
        pass
    return search.stats


class _Search:
    def __init__(
        self,
        nodes: list[NodeTasks],
        space: SearchSpace,
        slice_ends_of: SliceEnds,
        rules: SearchRules,
    ) -> None:
        self.nodes = nodes
        self.space = space
        self.rules = rules
        self.slice_ends_of = slice_ends_of
        self.loads: list[float | None] = [
            sum(seconds for seconds, _ in tasks) if tasks else None for tasks in nodes
        ]
        self.ends = slice_ends_of(self.loads)
        self.best = sorted(self.ends, reverse=True)
        self.stats = SearchStats(evaluations=1)
        # Each node's task times (ascending) for the swap search, rebuilt after it changes.
        self.times: list[list[float] | None] = [None] * len(nodes)

    def step(self, max_evaluations: int) -> bool:
        """Make one improving move or swap; False when there is none (or out of budget).

        Slices are tried from the one ending last down. Lowering a slice below the makespan
        often opens the room a later move of a critical task needs."""
        makespan = self.best[0]
        eps = 1e-9 * max(1.0, makespan)
        tried: set[int] = set()
        for level, slice_ in sorted(((end, s) for s, end in enumerate(self.ends)), reverse=True):
            if level < makespan - eps and not self.rules.below_makespan:
                break
            for node in self.space.chains[slice_]:
                if node in tried or not self.nodes[node]:
                    continue
                tried.add(node)
                if self.improve_node(node, level, eps, max_evaluations):
                    return True
                if self.stats.evaluations >= max_evaluations:
                    return False
        return False

    def improve_node(self, node: int, level: float, eps: float, budget: int) -> bool:
        """Lower the end of `node`'s slices below `level` by one move or swap."""
        space, ends = self.space, self.ends
        alternatives = sorted(
            (max(ends[s] for s in space.node_slices[alt]), alt) for alt in space.alternatives[node]
        )
        if not self.rules.every_alternative:
            alternatives = alternatives[:1]
        count = self.rules.candidates
        for alt_end, alt in alternatives:
            gap = level - alt_end
            if gap <= eps:
                break
            same_size = space.node_times[alt] is space.node_times[node]
            for moved in _moves(self.nodes[node], space.node_times[alt], same_size, gap, count):
                arrived = (space.node_times[alt][moved[1]], moved[1])
                if self.try_exchange(node, [moved], alt, [arrived]):
                    self.stats.moves += 1
                    return True
            if same_size:
                for out, back in self.swaps(node, alt, gap, count):
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
            self.times[node] = self.times[alt] = None
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

    def swaps(self, node: int, alt: int, gap: float, count: int) -> list[tuple[Entry, Entry]]:
        """Pairs (from node, from alt) with 0 < difference < gap, closest to gap/2."""
        source, target = self.nodes[node], self.nodes[alt]
        if not target:
            return []
        if len(source) < VECTORISE_FROM:
            return _closest_pairs(source, target, self._times(alt), gap, count)
        out_times, back_times = self._array(node), self._array(alt)
        half = gap / 2
        right = np.searchsorted(back_times, out_times - half)
        best_score = np.full(len(source), np.inf)
        best_back = np.zeros(len(source), dtype=int)
        for pick in (right - 1, right):
            inside = (pick >= 0) & (pick < len(target))
            pick = pick.clip(0, len(target) - 1)
            difference = out_times - back_times[pick]
            score = np.where(
                inside & (difference > 0) & (difference < gap), np.abs(difference - half), np.inf
            )
            better = score < best_score
            best_score = np.where(better, score, best_score)
            best_back = np.where(better, pick, best_back)
        chosen = np.argsort(best_score, kind="stable")[:count].tolist()
        return [(source[o], target[best_back[o]]) for o in chosen if best_score[o] < np.inf]

    def _times(self, node: int) -> list[float]:
        cached = self.times[node]
        if cached is None:
            cached = [seconds for seconds, _ in self.nodes[node]]
            self.times[node] = cached
        return cached

    def _array(self, node: int) -> np.ndarray:
        return np.array(self._times(node))


def _closest_pairs(
    source: NodeTasks, target: NodeTasks, target_times: list[float], gap: float, count: int
) -> list[tuple[Entry, Entry]]:
    half = gap / 2
    scored: list[tuple[float, Entry, Entry]] = []
    for out in source:
        i = bisect_left(target_times, out[0] - half)
        for back in target[max(i - 1, 0) : i + 1]:
            difference = out[0] - back[0]
            if 0 < difference < gap:
                scored.append((abs(difference - half), out, back))
    scored.sort(key=lambda item: item[0])
    return [(out, back) for _, out, back in scored[:count]]


def _moves(
    tasks: NodeTasks, times_there: Sequence[float], same_size: bool, gap: float, count: int
) -> list[Entry]:
    """The tasks that would run shorter than `gap` on the other node, closest to gap/2."""
    half = gap / 2
    if same_size:
        i = bisect_left(tasks, (half, -1))
        around = tasks[max(i - count, 0) : i + count]
    else:
        around = tasks
    fitting = [t for t in around if times_there[t[1]] < gap]
    fitting.sort(key=lambda t: abs(times_there[t[1]] - half))
    return fitting[:count]


def _better(candidate: Sequence[float], best: Sequence[float]) -> bool:
    """Lexicographically smaller sorted slice ends, ignoring float noise."""
    eps = 1e-9 * max(1.0, best[0])
    for new, old in zip(candidate, best, strict=True):
        if new < old - eps:
            return True
        if new > old + eps:
            return False
    return False
