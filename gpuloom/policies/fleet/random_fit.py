"""Random: any node where the pod fits, uniformly (the FGD paper's floor)."""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.model import Choice, FleetState


class RandomPolicy:
    name = "random"

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        nodes = np.flatnonzero(state.fits(q))
        if not nodes.size:
            return None
        n = int(rng.choice(nodes))
        return Choice(n, state.bestfit_gpus(n, q))
