"""What becomes of the free space a share leaves on a GPU: a table, measured on the fleet itself
with pods drawn from the workload, that `fgd-fates` (`best`) places shares by.

A share that leaves g milli free on a GPU does not waste g: later shares may fill the gap, or
part of it. Whether they do depends on the workload (a 350-milli gap takes the frequent 320
shares; a 210 gap only the rare shares of 210 or less, which the lone 810-milli shares' 190
gaps also wait for) and on how many gaps of that size compete for them. `final[g]` is the
mean free milli that a GPU a share left with g free still had when the fleet was full,
measured by filling a copy of the fleet with pods drawn from the workload's distribution and
placed by `fgd-pack` (the reference: a fixed policy, so the table does not chase its own
placements). A gap seen fewer than MIN_SAMPLES times (one `fgd-pack` rarely leaves, such as a
230 share alone) is taken to be filled by the next share that fits, drawn from the workload,
and to end as the gap that share leaves does (`_fill_unseen`).

A gap on a node left without the CPU that any share fitting the gap asks for is never filled:
it ends as it is (`growth` says so), and the table is measured over the other gaps only.

Opening a free GPU for a share is charged OPENING_COST: the share could have joined a used GPU
instead, and a GPU it takes is one fewer for the whole-GPU pods that leave nothing free
(measured on the default list, seeds 42-51 and 52-61: 70-90 milli give the same figures
within noise, 60 about 0.05 points less; at 100 and 120, with an earlier table, the policy
spread shares over free GPUs and lost 0.3 and 1.9 points: docs/placement.md). Opening is
never a gain, though: where the gap left ends below the opening cost, its growth is 0, not
negative (+0.4 to +0.7 points on the `gpushare` lists, where shares otherwise went to free
GPUs first; live, on a workload whose gaps fill, every GPU was opened and whole-GPU jobs were
refused).

Only the workload's distribution and the fleet's nodes go in, as FGD's typical pods do: the
policy stays online. The table is computed once per fleet (its nodes) and workload (FGD's
typical pod shapes) and kept in a small cache, so the runs of one list, and live decisions
while the workload's shapes hold, share it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from gpuloom.policies.fleet.fgd_pack import FgdPackPolicy
from gpuloom.policies.fleet.model import WHOLE_GPU, FleetState, NodeSpec, PodShape

CALIBRATION_RUNS = 3  # fills of the fleet the table is measured on
CALIBRATION_PODS = 50_000  # at most this many pods over the fills: larger fleets are sampled
CALIBRATION_SEED = 20261206  # their draws: fixed, so a table is the same on every call
CALIBRATION_FILL = 1.3  # each fill draws pods until their GPU request reaches 1.3 x capacity
MIN_SAMPLES = 10  # a gap seen fewer times is filled in from the workload (`_fill_unseen`)
OPENING_COST = 80  # milli charged for opening a free GPU for a share
CACHE_SIZE = 8


@dataclass(frozen=True, slots=True)
class GapFates:
    """`final[g]` (g = 0..1000): the expected free milli left in the end on a GPU a share
    leaves with g free; `samples[g]`: how many placements it was measured on; `least_cpu[g]`:
    the least CPU (milli) a share of the workload that fits in g asks for (inf: none fits)."""

    final: np.ndarray
    samples: np.ndarray
    least_cpu: np.ndarray
    opening_cost: float = OPENING_COST
    # Per share size: `growth` per free milli 0..1000, alive and dead, and the CPU a gap needs
    # to stay alive (filled on first use: a share size's three lookups replace a dozen steps).
    _by_milli: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def growth(self, free: np.ndarray, milli: int, cpu_left: np.ndarray) -> np.ndarray:
        """The growth of the expected final waste if a share of `milli` goes on GPUs with
        `free` milli free (nodes x GPUs, each 0..1000) of nodes left with `cpu_left` CPU after
        it: the gap it leaves ends at final[gap], or as it is where the node is left without
        the CPU of any share that fits it; less what the GPU had: final[free], or for a free
        GPU the opening cost, and then never below 0. A gap that ends smaller than the opening
        cost does not make opening a GPU a gain: charged less than joining a used GPU at no
        growth, shares spread over every free GPU of a workload whose gaps fill, and whole-GPU
        pods find none. inf where the share does not fit."""
        alive, dead, need = self._tables(milli)
        return np.where(cpu_left[:, None] < need[free], dead[free], alive[free])

    def _tables(self, milli: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tables = self._by_milli.get(milli)
        if tables is None:
            free = np.arange(WHOLE_GPU + 1)
            fits = free >= milli
            gap = np.where(fits, free - milli, 0)
            before = np.where(free >= WHOLE_GPU, self.opening_cost, self.final[free])
            alive = np.where(fits, self.final[gap] - before, np.inf)
            dead = np.where(fits, gap - before, np.inf)
            alive[WHOLE_GPU], dead[WHOLE_GPU] = max(alive[WHOLE_GPU], 0), max(dead[WHOLE_GPU], 0)
            tables = self._by_milli[milli] = (alive, dead, self.least_cpu[gap])
        return tables

    @classmethod
    def of(cls, state: FleetState, max_pods: int = CALIBRATION_PODS) -> GapFates:
        """The table for this state's nodes and workload: from the state's memo, the cache, or
        measured now (`calibrate`, on at most `max_pods` pods). The cache knows a workload by
        FGD's typical pod shapes, not their weights: the live adapter weighs its workload
        again now and then (and builds a state per decision for some fleets), and a table is
        measured again when the shapes change, not at every shift of their counts."""
        fates = state.memo.get("gap_fates")
        if isinstance(fates, GapFates):
            return fates
        key = (state.nodes, state.typical, max_pods)
        fates = _CACHE.get(key)
        if fates is None:
            fates = calibrate(state.nodes, state.shapes, state.s_weight, max_pods=max_pods)
            _CACHE[key] = fates
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
        else:
            _CACHE.move_to_end(key)
        state.memo["gap_fates"] = fates
        return fates


_CACHE: OrderedDict[tuple[object, ...], GapFates] = OrderedDict()


def draw_pods(
    weights: np.ndarray, request: np.ndarray, target: float, rng: np.random.Generator
) -> list[int]:
    """Shape indices drawn from `weights` (normalised) until the next pod's GPU request would
    take the total past `target` (nothing when the workload asks for no GPU)."""
    if weights.sum() <= 0 or float((weights * request).sum()) <= 0:
        return []
    p = weights / weights.sum()
    pods: list[int] = []
    total = 0
    while True:
        for q in rng.choice(len(p), size=1024, p=p).tolist():
            if total + int(request[q]) > target:
                return pods
            pods.append(q)
            total += int(request[q])


def calibrate(
    nodes: tuple[NodeSpec, ...],
    shapes: tuple[PodShape, ...],
    weights: np.ndarray,
    runs: int = CALIBRATION_RUNS,
    seed: int = CALIBRATION_SEED,
    max_pods: int = CALIBRATION_PODS,
) -> GapFates:
    """Measure `final` on `runs` fills of a fresh copy of the fleet (pods drawn from the
    workload, placed by `fgd-pack`, the node order drawn as a run's is), over the gaps left
    on nodes with CPU for a share that fits them (the others `growth` takes as they are).
    When the fills would draw more than `max_pods` pods, they fill every k-th node only (the
    smallest k that keeps them within it): the cost stays bounded on any fleet."""
    nodes = sample_nodes(nodes, shapes, weights, runs, max_pods)
    total = np.zeros(WHOLE_GPU + 1)
    count = np.zeros(WHOLE_GPU + 1, dtype=np.int64)
    least = least_cpu(shapes, weights)
    reference = FgdPackPolicy()
    for run in range(runs):
        rng = np.random.default_rng(seed + run)
        state = FleetState(nodes, shapes, weights)
        state.rank = rng.permutation(len(nodes)).astype(np.int64)
        request = state.s_k * state.s_d
        left: list[tuple[int, int, int]] = []  # (node, GPU, free milli the share left)
        for q in draw_pods(state.s_weight, request, CALIBRATION_FILL * state.gpu_capacity, rng):
            choice = reference.choose(state, q, rng)
            if choice is None:
                continue
            state.commit(choice.node, q, choice.gpus)
            if state.s_k[q] == 1 and state.s_d[q] < WHOLE_GPU:
                n, j = choice.node, choice.gpus[0]
                gap = int(state.gpu_free[n, j])
                if state.cpu_free[n] >= least[gap]:  # a dead gap is `growth`'s to charge
                    left.append((n, j, gap))
        if left:
            rows = np.array(left, dtype=np.int64)
            np.add.at(total, rows[:, 2], state.gpu_free[rows[:, 0], rows[:, 1]])
            np.add.at(count, rows[:, 2], 1)
    final = _fill_unseen(total, count, shapes, weights)
    return GapFates(final=final, samples=count, least_cpu=least)


def sample_nodes(
    nodes: tuple[NodeSpec, ...],
    shapes: tuple[PodShape, ...],
    weights: np.ndarray,
    runs: int,
    max_pods: int,
) -> tuple[NodeSpec, ...]:
    """Every k-th node, k the smallest that keeps `runs` fills within `max_pods` pods (a fill
    draws about CALIBRATION_FILL x the GPU capacity over the mean GPU milli a pod asks)."""
    w = np.asarray(weights, dtype=np.float64)
    request = np.array([s.gpu_request for s in shapes], dtype=np.float64)
    per_pod = float((w * request).sum() / w.sum()) if w.sum() > 0 else 0.0
    if per_pod <= 0:
        return nodes
    capacity = sum(n.gpus for n in nodes) * WHOLE_GPU
    pods = runs * CALIBRATION_FILL * capacity / per_pod
    step = max(1, int(np.ceil(pods / max(max_pods, 1))))
    return nodes[::step]


def least_cpu(shapes: tuple[PodShape, ...], weights: np.ndarray) -> np.ndarray:
    """Per gap size 0..1000: the least CPU asked by a share of the workload that fits in it
    (inf where none does)."""
    least = np.full(WHOLE_GPU + 1, np.inf)
    for shape, weight in zip(shapes, np.asarray(weights).tolist(), strict=True):
        if weight > 0 and shape.num_gpu == 1 and shape.gpu_milli < WHOLE_GPU:
            least[shape.gpu_milli :] = np.minimum(least[shape.gpu_milli :], shape.cpu_milli)
    return least


def _fill_unseen(
    total: np.ndarray, count: np.ndarray, shapes: tuple[PodShape, ...], weights: np.ndarray
) -> np.ndarray:
    """The measured means where a gap was seen MIN_SAMPLES times; elsewhere, from the smallest
    gap up: filled by the next share that fits, drawn from the workload, and ending as the gap
    that share leaves ends (a gap no share fits stays as it is)."""
    final = np.where(count >= MIN_SAMPLES, total / np.maximum(count, 1), np.nan)
    share = np.array([s.num_gpu == 1 and s.gpu_milli < WHOLE_GPU for s in shapes], dtype=bool) & (
        np.asarray(weights) > 0
    )
    sizes = np.array([s.gpu_milli for s in shapes], dtype=np.int64)[share]
    odds = np.asarray(weights, dtype=np.float64)[share]
    for gap in np.flatnonzero(np.isnan(final)).tolist():
        fit = (sizes <= gap) & (sizes > 0)
        if not fit.any():
            final[gap] = gap
        else:
            p = odds[fit] / odds[fit].sum()
            final[gap] = float((p * final[gap - sizes[fit]]).sum())
    return final
