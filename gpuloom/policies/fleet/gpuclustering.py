"""GPU clustering: pods asking the same GPU amount go together. A pod goes first to a node that
already hosts pods of its per-GPU demand, then to a node hosting no GPU pod, then anywhere;
within a tier at random."""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.model import Choice, FleetState, pick_lowest


class GpuClusteringPolicy:
    name = "gpuclustering"

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        hosted = state.hosted
        gpu_pods = hosted[:, state.demands > 0].sum(axis=1)
        tier = np.where(hosted[:, state.s_demand_idx[q]] > 0, 0.0, np.where(gpu_pods, 2.0, 1.0))
        n = pick_lowest(np.where(state.fits(q), tier, np.inf), rng)
        return None if n is None else Choice(n, state.bestfit_gpus(n, q))
