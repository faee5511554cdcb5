"""DotProduct (Tetris-style alignment, as the FGD paper's baseline): the dot product of the
pod's demand and the node's free resources, CPU and GPU each normalised by the node's
capacity; the smallest product wins (the pod goes where what it needs is scarcest, which
packs), ties at random."""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.model import WHOLE_GPU, Choice, FleetState, pick_lowest


class DotProductPolicy:
    name = "dotprod"

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        gpu_cap = np.maximum(state.gpu_count * WHOLE_GPU, 1)
        cpu = (state.s_cpu[q] / state.cpu_cap) * (state.cpu_free / state.cpu_cap)
        gpu_req = state.s_k[q] * state.s_d[q]
        gpu = (gpu_req / gpu_cap) * (state.gpu_free.sum(axis=1) / gpu_cap)
        n = pick_lowest(np.where(state.fits(q), cpu + gpu, np.inf), rng)
        return None if n is None else Choice(n, state.bestfit_gpus(n, q))
