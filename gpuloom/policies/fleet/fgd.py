"""FGD, Fragmentation Gradient Descent (Weng et al., ATC'23), as its published simulator scores
it: a node's score for a pod is

    int(100 * sigmoid((frag_before - frag_after) / 1000))

(fragmentation in milli of a GPU, frag.py; not normalised across nodes), the highest score wins
and ties go to the first node in the run's node order (`FleetState.rank`). A share is tried on
every GPU of the node it fits on and takes the first GPU with the top integer score; whole GPUs
are the node's first fully free ones.

A node's score for a shape only changes when the node does, so scores are cached per (node,
shape) and recomputed for the nodes whose version moved since that shape was last placed.
"""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.frag import Fragmentation, frag_options
from gpuloom.policies.fleet.model import Choice, FleetState, pick_best

MAX_SCORE = 100  # kube-scheduler's MaxNodeScore
SCALE_MILLI = 1000.0  # the published divisor inside the sigmoid


def fgd_score(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """The published integer score of a move from fragmentation `before` to `after` (milli),
    in the published order of operations: int(sigmoid((before - after) / 1000) * 100)."""
    return np.trunc(1.0 / (1.0 + np.exp(-((before - after) / SCALE_MILLI))) * MAX_SCORE)


def _first_per_row(rows: np.ndarray, *keys: np.ndarray) -> np.ndarray:
    """Indices of each row's first option when sorted by `keys` (most significant first)."""
    order = np.lexsort((*reversed(keys), rows))
    return order[np.r_[True, rows[order][1:] != rows[order][:-1]]]


class FragDeltas:
    """Per (node, shape), cached: the published FGD score (-inf where the shape does not fit)
    and its GPU for a share; and the least fragmentation growth over the node's options with
    the GPU that reaches it (for our variants)."""

    def __init__(self, state: FleetState) -> None:
        n, q = len(state.nodes), len(state.shapes)
        self.state = state
        self.frag = Fragmentation.of(state)
        self.score = np.full((n, q), -np.inf)
        self.gpu = np.full((n, q), -1, dtype=np.int64)
        self.growth = np.full((n, q), np.inf)
        self.growth_gpu = np.full((n, q), -1, dtype=np.int64)
        self.tight_gpu = np.full((n, q), -1, dtype=np.int64)
        self.version = np.full((n, q), -1, dtype=np.int64)
        self._memo: list[dict[tuple[int, int, bytes], tuple[float, int, float, int, int]]] = [
            {} for _ in range(q)
        ]

    @classmethod
    def of(cls, state: FleetState) -> FragDeltas:
        deltas = state.memo.get("frag_deltas")
        if not isinstance(deltas, FragDeltas):
            deltas = state.memo["frag_deltas"] = cls(state)
        elif deltas.score.shape[1] < len(state.shapes):  # shapes added since (add_shape)
            deltas._grow(len(state.shapes) - deltas.score.shape[1])
        return deltas

    def _grow(self, more: int) -> None:
        n = self.score.shape[0]

        def pad(a: np.ndarray, fill: float) -> np.ndarray:
            return np.hstack([a, np.full((n, more), fill, dtype=a.dtype)])

        self.score, self.growth = pad(self.score, -np.inf), pad(self.growth, np.inf)
        self.gpu, self.growth_gpu = pad(self.gpu, -1), pad(self.growth_gpu, -1)
        self.tight_gpu, self.version = pad(self.tight_gpu, -1), pad(self.version, -1)
        self._memo.extend({} for _ in range(more))

    def refresh(self, q: int) -> None:
        """Recompute shape q's column for the nodes that changed since it was last read. A
        node's results depend only on its GPU model, free CPU and free GPUs (not memory, which
        only decides whether it fits), so they are memoised by that state: nodes alike, or a
        node back in a state it was in, cost a dictionary lookup."""
        s = self.state
        stale = np.flatnonzero(self.version[:, q] != s.version)
        if not stale.size:
            return
        fits = s.fits_rows(q, stale)
        self.version[stale, q] = s.version[stale]
        self.score[stale[~fits], q] = -np.inf
        self.growth[stale[~fits], q] = np.inf
        where = stale[fits]
        if not where.size:
            return
        memo = self._memo[q]
        keys = [
            (m, c, g.tobytes())
            for m, c, g in zip(
                s.model_idx[where].tolist(),
                s.cpu_free[where].tolist(),
                s.gpu_free[where],
                strict=True,
            )
        ]
        found = [memo.get(key) for key in keys]
        missing = [i for i, hit in enumerate(found) if hit is None]
        if missing:
            for i, result in zip(missing, self._compute(q, where[missing]), strict=True):
                memo[keys[i]] = found[i] = result
        self.score[where, q], self.gpu[where, q], self.growth[where, q] = (
            np.array([f[0] for f in found]),
            np.array([f[1] for f in found]),
            np.array([f[2] for f in found]),
        )
        self.growth_gpu[where, q] = [f[3] for f in found]
        self.tight_gpu[where, q] = [f[4] for f in found]

    def _compute(self, q: int, where: np.ndarray) -> list[tuple[float, int, float, int, int]]:
        """(score, GPU, least growth, its GPU, tightest GPU of the top score) per node of
        `where` (all fit shape q)."""
        s = self.state
        rows, cols, after = frag_options(s, q, where)
        before = self.frag.nodes()[where][rows]
        growth = after - before
        score = fgd_score(before, after)
        top = _first_per_row(rows, -score, cols)
        least = _first_per_row(rows, growth, cols)
        if cols.size and cols[0] >= 0:  # a share: also the tightest GPU of the top score
            left = s.gpu_free[where[rows], cols] - s.s_d[q]
            tight = cols[_first_per_row(rows, -score, left, cols)].tolist()
        else:
            tight = [-1] * len(where)
        return list(
            zip(
                score[top].tolist(),
                cols[top].tolist(),
                growth[least].tolist(),
                cols[least].tolist(),
                tight,
                strict=True,
            )
        )

    def scores(self, q: int) -> np.ndarray:
        """The published FGD score per node for shape q (-inf: does not fit), refreshed."""
        self.refresh(q)
        return self.score[:, q]

    def growths(self, q: int) -> np.ndarray:
        """The least fragmentation growth per node for shape q (inf: does not fit), refreshed."""
        self.refresh(q)
        return self.growth[:, q]

    def choice(self, n: int, q: int) -> Choice:
        """Node n with the GPU of the published rule (a share) or its first free GPUs."""
        gpu = int(self.gpu[n, q])
        return Choice(n, (gpu,) if gpu >= 0 else self.state.bestfit_gpus(n, q))


class FgdPolicy:
    name = "fgd"

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        deltas = FragDeltas.of(state)
        n = pick_best(state.only_allowed(deltas.scores(q)), state.rank)
        return None if n is None else deltas.choice(n, q)
