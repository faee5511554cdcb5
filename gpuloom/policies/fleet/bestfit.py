"""BestFit as the FGD paper's simulator scores it: over the global maxima of a node (128 cores,
8 GPUs), the resources a node is left with,

    left = 0.5 * (cpu_free - cpu) / 128000 + 0.5 * (gpu_free - gpu) / 8000
    score = int((1 - left) * 100)

(GPU milli summed over the node's GPUs), highest wins, ties to the first node in the run's node
order. The published plugin then rescales the scores min-max to 0-100, which keeps their order
and ties (at most 101 integer values), so it is left out. GPUs: best fit (`bestfit_gpus`)."""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.model import Choice, FleetState, pick_best

MAX_CPU_MILLI = 128_000.0  # the published MaxSpecCpu
MAX_GPU_MILLI = 8_000.0  # the published MaxSpecGpu
WEIGHT = 0.5  # CPU and GPU alike


def bestfit_score(state: FleetState, q: int) -> np.ndarray:
    """The published BestFit score of every node for shape q (fitting or not)."""
    cpu_left = (state.cpu_free - state.s_cpu[q]) / MAX_CPU_MILLI * WEIGHT
    gpu_left = (state.gpu_free.sum(axis=1) - state.s_k[q] * state.s_d[q]) / MAX_GPU_MILLI * WEIGHT
    return np.trunc((1.0 - (cpu_left + gpu_left)) * 100.0)


class BestFitPolicy:
    name = "bestfit"

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        n = pick_best(np.where(state.fits(q), bestfit_score(state, q), -np.inf), state.rank)
        return None if n is None else Choice(n, state.bestfit_gpus(n, q))
