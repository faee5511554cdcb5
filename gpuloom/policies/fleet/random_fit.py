"""Random: any node where the pod fits, uniformly (the FGD paper's floor); a share takes a GPU
it fits on at random, whole GPUs the node's first free ones (the published simulator's random
GPU selection)."""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.model import WHOLE_GPU, Choice, FleetState


class RandomPolicy:
    name = "random"

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        nodes = np.flatnonzero(state.fits(q))
        if not nodes.size:
            return None
        n = int(rng.choice(nodes))
        d = int(state.s_d[q])
        if state.s_k[q] and d < WHOLE_GPU:
            return Choice(n, (int(rng.choice(np.flatnonzero(state.open_gpus(d)[n]))),))
        return Choice(n, state.bestfit_gpus(n, q))
