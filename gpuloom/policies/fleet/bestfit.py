"""BestFit: the node left with the least resources, CPU and GPU each as a share of the node's
capacity, summed (lowest wins, ties at random)."""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.model import WHOLE_GPU, Choice, FleetState, pick_lowest


def left_after(state: FleetState, q: int) -> np.ndarray:
    """CPU and GPU left on each node after the pod, as shares of the node's capacity."""
    gpu_cap = np.maximum(state.gpu_count * WHOLE_GPU, 1)
    gpu_left = state.gpu_free.sum(axis=1) - state.s_k[q] * state.s_d[q]
    return (state.cpu_free - state.s_cpu[q]) / state.cpu_cap + gpu_left / gpu_cap


class BestFitPolicy:
    name = "bestfit"

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        scores = np.where(state.fits(q), left_after(state, q), np.inf)
        n = pick_lowest(scores, rng)
        return None if n is None else Choice(n, state.bestfit_gpus(n, q))
