"""FGD-pack (ours): FGD, but the nodes whose fragmentation growth is within TOLERANCE_MILLI of
the least count as tied, and among them the pod goes where the least GPU stays free (packing),
random only after that.

Why: FGD's expected fragmentation is an estimate over the workload distribution; differences
of a few milli between nodes are noise of that estimate, while plain FGD breaks exact ties at
random and spreads pods over idle nodes, using up whole nodes that later multi-GPU and
whole-GPU pods need. Packing among near-equal nodes keeps idle nodes idle. Online and honest:
it sees only the fleet now and the workload's distribution, as FGD does.
"""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.fgd import FragDeltas
from gpuloom.policies.fleet.model import WHOLE_GPU, Choice, FleetState, pick_lowest

TOLERANCE_MILLI = 20.0  # 2% of one GPU


class FgdPackPolicy:
    name = "fgd-pack"

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        deltas = FragDeltas.of(state)
        growth = deltas.column(q)
        least = growth.min(initial=np.inf)
        if not np.isfinite(least):
            return None
        gpu_cap = np.maximum(state.gpu_count * WHOLE_GPU, 1)
        gpu_left = (state.gpu_free.sum(axis=1) - state.s_k[q] * state.s_d[q]) / gpu_cap
        n = pick_lowest(np.where(growth <= least + TOLERANCE_MILLI, gpu_left, np.inf), rng)
        return None if n is None else deltas.choice(n, q)
