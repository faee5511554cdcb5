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

from gpuloom.policies.fleet.fgd import ByState, FragDeltas, pad_rows
from gpuloom.policies.fleet.fgd_pack import FgdPackPolicy, as_fgd, gpu_left
from gpuloom.policies.fleet.gap_fates import CALIBRATION_PODS, GapFates
from gpuloom.policies.fleet.model import WHOLE_GPU, Choice, FleetState


def _by_fates(state: FleetState, q: int) -> bool:
    """Whether a pod of shape q is placed by the gap table: a share, unless the workload
    places every pod as FGD does."""
    return int(state.s_k[q]) == 1 and int(state.s_d[q]) < WHOLE_GPU and not as_fgd(state, q)


class _FatesDeltas(FragDeltas):
    """FGD's scores and GPUs (`FragDeltas`) and with them, per (shape, node), the least growth
    of the expected final waste over the node's GPUs for a share of that shape (inf: it fits
    none) and the GPU it takes there (FGD's when it has the least growth, else the first that
    has). Computed with FGD's results, once per node state and pod class, and refreshed with
    them for the nodes that changed: a decision reads both for the price of one lookup. Where
    the pod may not take some GPUs, the growth is looked up again over the others (three
    table lookups a GPU, `_leave_out`)."""

    FIELDS = {**FragDeltas.FIELDS, "least": np.nan, "least_gpu": -1}

    def __init__(self, state: FleetState, fates: GapFates) -> None:
        super().__init__(state)
        self.fates = fates
        self.least = np.full(self.score.shape, np.inf)
        self.least_gpu = np.full(self.score.shape, -1, dtype=np.int64)

    @classmethod
    def of_fates(cls, state: FleetState, fates: GapFates) -> _FatesDeltas:
        """The state's deltas, made (in place of FGD's own) when they do not yet keep this
        table's least growth."""
        deltas = state.memo.get("frag_deltas")
        if not isinstance(deltas, cls) or deltas.fates is not fates:
            state.memo["frag_deltas"] = cls(state, fates)
        deltas = FragDeltas.of(state)  # grown to the shapes added since
        assert isinstance(deltas, cls)
        return deltas

    def _grow(self, more: int) -> None:
        super()._grow(more)
        self.least = pad_rows(self.least, more, np.inf)
        self.least_gpu = pad_rows(self.least_gpu, more, -1)

    def _compute(self, q: int, where: np.ndarray) -> dict[str, np.ndarray]:
        out = super()._compute(q, where)
        s = self.state
        if not _by_fates(s, q):
            out["least"], out["least_gpu"] = np.full(len(where), np.inf), out["gpu"]
            return out
        growth = self.fates.growth(s.gpu_free[where], int(s.s_d[q]), s.cpu_free[where] - s.s_cpu[q])
        out["least"], out["least_gpu"] = _least(growth, out["gpu"])
        return out

    def _store(self, q: int, where: np.ndarray, results: ByState, ids: np.ndarray) -> None:
        super()._store(q, where, results, ids)
        self.least[q, where] = results["least"][ids]
        self.least_gpu[q, where] = results["least_gpu"][ids]

    def _fields(self, q: int) -> dict[str, np.ndarray]:
        return {**super()._fields(q), "least": self.least[q], "least_gpu": self.least_gpu[q]}

    def _leave_out(self, q: int, fields: dict[str, np.ndarray]) -> np.ndarray:
        at = super()._leave_out(q, fields)
        s = self.state
        assert s.usable is not None
        if not at.size:
            return at
        if not _by_fates(s, q):
            fields["least_gpu"][at] = fields["gpu"][at]
            return at
        growth = self.fates.growth(s.gpu_free[at], int(s.s_d[q]), s.cpu_free[at] - s.s_cpu[q])
        least, gpu = _least(np.where(s.usable[at], growth, np.inf), fields["gpu"][at])
        fields["least"][at], fields["least_gpu"][at] = least, gpu
        return at


def _least(growth: np.ndarray, fgd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per node (a row of `growth`, inf where the share does not go), the least growth and its
    GPU: FGD's GPU `fgd` when it has the least, else the first that has."""
    least = growth.min(axis=1)
    at = growth == least[:, None]
    keep_fgd = (fgd >= 0) & at[np.arange(len(growth)), np.maximum(fgd, 0)]
    return least, np.where(keep_fgd, fgd, at.argmax(axis=1))


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
        kept = _FatesDeltas.of_fates(state, self._fates(state)).read(q)
        score = state.only_allowed(kept["score"])
        least, gpu = np.where(score > -np.inf, kept["least"], np.inf), kept["least_gpu"]
        top = least.min(initial=np.inf)
        if top == np.inf:
            return None
        tied = np.flatnonzero(least == top)
        if len(tied) > 1:
            tied = tied[score[tied] == score[tied].max()]
        if len(tied) > 1:
            left = gpu_left(state, q, tied)
            tied = tied[left == left.min()]
        n = int(tied[np.argmin(state.rank[tied])])
        return Choice(n, (int(gpu[n]),))
