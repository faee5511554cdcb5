"""FGD-fates (ours, `best`): shares go where the free space they leave is likeliest to be
filled; everything else as `fgd-pack`.

- A pod that takes a share of one GPU goes to the GPU where the expected final waste grows
  least (`GapFates.growth`: what becomes of the gap it leaves, measured on the fleet with pods
  drawn from the workload, less what became of the gap it fills; a free GPU is charged the
  opening cost, and opening it is never a gain; a gap on a node left without the CPU of any
  share that fits it ends as it is). Among the nodes with that least growth: FGD's top score,
  then the node left with the least free GPU, then the run's node order; on the node, FGD's
  GPU when it is one of the least growth, else the first that is.
- Whole-GPU pods and CPU-only pods go where `fgd-pack` puts them (FGD's top score; CPU-only
  pods packed among its ties).
- When `fgd-pack` places every pod as FGD does (a workload heavy in multi-GPU pods or in
  CPU), so does this policy: the table is not even measured.

Why: FGD scores a share by the fragmentation it adds now, blind to whether the gap it leaves
will be filled. On the default list a 320 share next to a 470 leaves 210 free, which only the
rare shares of 210 milli or less fill (and the 810s' 190 gaps wait for those too), while next
to a 650 it leaves 30, and alone it leaves 680, which later shares fill. Measured (default
list, seeds 42-51): +0.38 points over `fgd-pack`, +0.51 over the published FGD
(docs/placement.md).

Online and honest: the table comes from the workload's distribution and the fleet's nodes,
never from the pods still to come.
"""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.fgd import FragDeltas, pad_rows
from gpuloom.policies.fleet.fgd_pack import FgdPackPolicy, as_fgd, gpu_left
from gpuloom.policies.fleet.gap_fates import CALIBRATION_PODS, GapFates
from gpuloom.policies.fleet.model import WHOLE_GPU, Choice, FleetState


def _by_fates(state: FleetState, q: int) -> bool:
    """Whether a pod of shape q is placed by the gap table: a share, unless the workload
    places every pod as FGD does."""
    return int(state.s_k[q]) == 1 and int(state.s_d[q]) < WHOLE_GPU and not as_fgd(state, q)


class _LeastGrowth:
    """Per (shape, node): the least growth of the expected final waste over the node's GPUs
    for a share of that shape (inf: it fits none), refreshed for the nodes that changed since
    the shape was last read (three table lookups a GPU: cheaper than keeping it by node
    state). FGD's score, the first tie-break, is read only for the nodes of the least growth
    (`FragDeltas.read` of those rows), so most nodes are never weighed over FGD's workload."""

    def __init__(self, state: FleetState, fates: GapFates) -> None:
        self.state = state
        self.fates = fates
        self.least = np.full((len(state.shapes), len(state.nodes)), np.inf)
        self.version = np.full(self.least.shape, -1, dtype=np.int64)

    @classmethod
    def of(cls, state: FleetState, fates: GapFates) -> _LeastGrowth:
        kept = state.memo.get("least_growth")
        if not isinstance(kept, cls) or kept.fates is not fates:
            kept = state.memo["least_growth"] = cls(state, fates)
        elif kept.least.shape[0] < len(state.shapes):  # shapes added since (add_shape)
            more = max(len(state.shapes) - kept.least.shape[0], kept.least.shape[0])
            kept.least = pad_rows(kept.least, more, np.inf)
            kept.version = pad_rows(kept.version, more, -1)
        return kept

    def growth(self, q: int, rows: np.ndarray, usable: np.ndarray | None) -> np.ndarray:
        """The growth of a share of shape q on each GPU of the nodes `rows` (inf where it
        does not fit the GPU, or `usable` of those rows, when given, is False)."""
        s = self.state
        d, cpu_left = int(s.s_d[q]), s.cpu_free[rows] - s.s_cpu[q]
        growth = self.fates.growth(s.gpu_free[rows], d, cpu_left)
        return growth if usable is None else np.where(usable, growth, np.inf)

    def read(self, q: int) -> np.ndarray:
        """The least growth per node for shape q (inf: the pod does not go there), as the pod
        being decided sees it (`FleetState.usable` and `allowed`)."""
        s = self.state
        stale = np.flatnonzero(self.version[q] != s.version)
        if s.allowed is not None:  # the others read inf: left for later
            stale = stale[s.allowed[stale]]
        if stale.size:
            self.version[q, stale] = s.version[stale]
            fits = s.fits_rows(q, stale)
            self.least[q, stale[~fits]] = np.inf
            where = stale[fits]
            if where.size:  # kept as the node is, whatever the pod may take
                self.least[q, where] = self.growth(q, where, None).min(axis=1)
        least = self.least[q]
        if s.usable is not None:
            # Nodes with a GPU the share fits on but may not take: over the others.
            lost = (least < np.inf) & ((s.gpu_free >= s.s_d[q]) & ~s.usable).any(axis=1)
            at = np.flatnonzero(lost)
            if at.size:
                least = least.copy()
                least[at] = self.growth(q, at, s.usable[at]).min(axis=1)
        return least if s.allowed is None else np.where(s.allowed, least, np.inf)


def _least_gpu(growth: np.ndarray, fgd: int) -> int:
    """The GPU of a node's least growth (`growth` per GPU, inf where the share does not go):
    FGD's GPU `fgd` when it is one of them, else the first."""
    least = growth == growth.min()
    return fgd if fgd >= 0 and least[fgd] else int(least.argmax())


class FgdFatesPolicy:
    name = "fgd-fates"

    def __init__(self, calibration_pods: int = CALIBRATION_PODS) -> None:
        """`calibration_pods`: the most pods the table of a fleet and workload is measured on
        (`GapFates.of`); the live adapter asks for fewer, so that a decision that weighs the
        workload again does not stall the service for seconds."""
        self._pack = FgdPackPolicy()
        self.calibration_pods = calibration_pods

    def _fates(self, state: FleetState) -> GapFates:
        return GapFates.of(state, self.calibration_pods)

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        if not _by_fates(state, q):
            return self._pack.choose(state, q, rng)
        kept = _LeastGrowth.of(state, self._fates(state))
        least = kept.read(q)
        top = least.min(initial=np.inf)
        if top == np.inf:
            return None
        tied = np.flatnonzero(least == top)
        fgd = FragDeltas.of(state).read(q, tied)
        score, fgd_gpu = fgd["score"], fgd["gpu"]
        if len(tied) > 1:
            best = score == score.max()
            tied, fgd_gpu = tied[best], fgd_gpu[best]
        if len(tied) > 1:
            left = gpu_left(state, q, tied)
            best = left == left.min()
            tied, fgd_gpu = tied[best], fgd_gpu[best]
        at = int(np.argmin(state.rank[tied]))
        n = int(tied[at])
        row = np.array([n])
        usable = None if state.usable is None else state.usable[row]
        return Choice(n, (_least_gpu(kept.growth(q, row, usable)[0], int(fgd_gpu[at])),))
