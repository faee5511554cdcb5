"""GPU packing with best-fit tiers (ours, `gpupacking-tiers`; the published rule is
gpupacking.py): a share goes first to a GPU already partly used, then to an idle GPU of a node
already in use, then to an idle node; whole GPUs and CPU-only pods to a node in use before an
idle one. Within a tier at random."""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.model import WHOLE_GPU, Choice, FleetState, pick_lowest


class GpuPackingTiersPolicy:
    name = "gpupacking-tiers"

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        free = state.gpu_free
        in_use = free.sum(axis=1) < state.gpu_count * WHOLE_GPU
        tier = np.where(in_use, 1.0, 2.0)
        d = state.s_d[q]
        if 0 < d < WHOLE_GPU:
            shared_fits = ((free >= d) & (free < WHOLE_GPU)).any(axis=1)
            tier = np.where(shared_fits, 0.0, tier)
        n = pick_lowest(np.where(state.fits(q), tier, np.inf), rng)
        return None if n is None else Choice(n, state.bestfit_gpus(n, q))
