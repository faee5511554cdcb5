"""FGD, Fragmentation Gradient Descent (Weng et al., ATC'23): place each pod on the node (and
GPU) where the fragmentation of the workload (frag.py) grows least; ties at random.

A node's score for a shape only changes when the node does, so scores are cached per (node,
shape) and recomputed for the nodes whose version moved since that shape was last placed.
"""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.frag import Fragmentation, frag_after
from gpuloom.policies.fleet.model import Choice, FleetState, pick_lowest


class FragDeltas:
    """Per (node, shape): how much placing the shape there grows the node's fragmentation
    (inf where it does not fit), and the GPU for a share."""

    def __init__(self, state: FleetState) -> None:
        n, q = len(state.nodes), len(state.shapes)
        self.state = state
        self.frag = Fragmentation.of(state)
        self.delta = np.full((n, q), np.inf)
        self.gpu = np.full((n, q), -1, dtype=np.int64)
        self.version = np.full((n, q), -1, dtype=np.int64)

    @classmethod
    def of(cls, state: FleetState) -> FragDeltas:
        deltas = state.memo.get("frag_deltas")
        if not isinstance(deltas, FragDeltas):
            deltas = state.memo["frag_deltas"] = cls(state)
        return deltas

    def column(self, q: int) -> np.ndarray:
        """The growth of fragmentation per node for shape q, refreshed."""
        s = self.state
        stale = np.flatnonzero(self.version[:, q] != s.version)
        if stale.size:
            fits = s.fits(q)[stale]
            self.delta[stale, q] = np.inf
            where = stale[fits]
            if where.size:
                after, gpu = frag_after(s, q, where)
                self.delta[where, q] = after - self.frag.nodes()[where]
                self.gpu[where, q] = gpu
            self.version[stale, q] = s.version[stale]
        return self.delta[:, q]

    def choice(self, n: int, q: int) -> Choice:
        gpu = int(self.gpu[n, q])
        return Choice(n, (gpu,) if gpu >= 0 else self.state.bestfit_gpus(n, q))


class FgdPolicy:
    name = "fgd"

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        deltas = FragDeltas.of(state)
        n = pick_lowest(deltas.column(q), rng)
        return None if n is None else deltas.choice(n, q)
