"""FGD-fates (ours, `best`): shares go where the free space they leave is likeliest to be
filled; everything else as `fgd-pack`.

- A pod that takes a share of one GPU goes to the GPU where the expected final waste grows
  least (`GapFates.growth`: what becomes of the gap it leaves, measured on the fleet with pods
  drawn from the workload, less what became of the gap it fills; a free GPU is charged the
  opening cost; a gap on a node left without the CPU of any share that fits it ends as it
  is). Among the nodes with that least growth: FGD's top score, then the node left
  with the least free GPU, then the run's node order; on the node, FGD's GPU when it is one of
  the least growth, else the first that is.
- Whole-GPU pods and CPU-only pods go where `fgd-pack` puts them (FGD's top score; CPU-only
  pods packed among its ties).
- When `fgd-pack` places every pod as FGD does (a workload heavy in multi-GPU pods or in
  CPU), so does this policy: the table is not even measured.

Why: FGD scores a share by the fragmentation it adds now, blind to whether the gap it leaves
will be filled. On the default list a 320 share next to a 470 leaves 210 free, which only the
rare shares of 210 milli or less fill (and the 810s' 190 gaps wait for those too), while next
to a 650 it leaves 30, and alone it leaves 680, which later shares fill. Measured (default
list, seeds 42-51): +0.3 points over `fgd-pack`, docs/placement.md.

Online and honest: the table comes from the workload's distribution and the fleet's nodes,
never from the pods still to come.
"""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.fgd import FragDeltas
from gpuloom.policies.fleet.fgd_pack import FgdPackPolicy, as_fgd, gpu_left
from gpuloom.policies.fleet.gap_fates import CALIBRATION_PODS, GapFates
from gpuloom.policies.fleet.model import WHOLE_GPU, Choice, FleetState, pick_best


def _by_fates(state: FleetState, q: int) -> bool:
    """Whether a pod of shape q is placed by the gap table: a share, unless the workload
    places every pod as FGD does."""
    return int(state.s_k[q]) == 1 and int(state.s_d[q]) < WHOLE_GPU and not as_fgd(state, q)


def _growth(
    fates: GapFates, state: FleetState, q: int, rows: np.ndarray | None, score: np.ndarray
) -> np.ndarray:
    """Per GPU of each node of `rows` (all when None): the expected final waste's growth if the
    share goes there; inf where it does not fit or the node's score is -inf."""
    free = state.gpu_free if rows is None else state.gpu_free[rows]
    cpu = state.cpu_free if rows is None else state.cpu_free[rows]
    growth = fates.growth(free, int(state.s_d[q]), cpu - state.s_cpu[q])
    return np.where(np.isfinite(score)[:, None], growth, np.inf)


def _gpu_on(growth_row: np.ndarray, fgd_gpu: int) -> int:
    """The GPU of one node a share takes: FGD's when it has the node's least growth."""
    least = growth_row.min()
    if fgd_gpu >= 0 and growth_row[fgd_gpu] == least:
        return fgd_gpu
    return int(np.flatnonzero(growth_row == least)[0])


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
        deltas = FragDeltas.of(state)
        score = state.only_allowed(deltas.scores(q))
        growth = _growth(self._fates(state), state, q, None, score)
        least = growth.min(axis=1)
        top = least.min(initial=np.inf)
        if top == np.inf:
            return None
        tied = least == top
        best_score = np.where(tied, score, -np.inf)
        tied &= best_score == best_score.max()
        n = pick_best(np.where(tied, -gpu_left(state, q, None), -np.inf), state.rank)
        assert n is not None  # some node reaches the least growth
        return Choice(n, (_gpu_on(growth[n], int(deltas.gpu[q, n])),))

    def keys(self, state: FleetState, q: int, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """For a share: minus the least growth, then FGD's score, then minus the free GPU left
        (`choose` takes the highest, in that order); any other pod: `fgd-pack`'s keys."""
        if not _by_fates(state, q):
            return self._pack.keys(state, q, rows)
        score = state.only_allowed(FragDeltas.of(state).scores(q))[rows]
        least = _growth(self._fates(state), state, q, rows, score).min(axis=1)
        return (np.where(np.isfinite(least), -least, -np.inf), score, -gpu_left(state, q, rows))

    def share_gpus(self, state: FleetState, q: int, rows: np.ndarray) -> np.ndarray:
        """The GPU `choose` gives a share on each node of `rows` (which it fits)."""
        deltas = FragDeltas.of(state)
        if not _by_fates(state, q):
            return deltas.gpu[q, rows]
        score = state.only_allowed(deltas.scores(q))[rows]
        growth = _growth(self._fates(state), state, q, rows, score)
        fgd = deltas.gpu[q, rows]
        return np.array([_gpu_on(growth[i], int(fgd[i])) for i in range(len(rows))], dtype=np.int64)
