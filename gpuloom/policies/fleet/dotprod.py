"""DotProduct (Tetris' alignment) as the FGD paper's simulator runs it (GPU dimensions merged,
normalised by the global maxima of a node, 128 cores and 8 GPUs): the dot product of the
node's free (CPU, GPU milli summed over its GPUs) and the pod's demand, each over the maxima,
averaged over the two dimensions,

    dot = (cpu_free / 128000) * (cpu / 128000) + (gpu_free / 8000) * (gpu / 8000)
    score = int((1 - dot / 2) * 100)

highest wins (the smallest product: the pod goes where what it needs is scarcest), ties to the
first node in the run's node order. GPUs: best fit (`bestfit_gpus`)."""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.bestfit import MAX_CPU_MILLI, MAX_GPU_MILLI
from gpuloom.policies.fleet.model import Choice, FleetState, pick_best


def dotprod_score(state: FleetState, q: int) -> np.ndarray:
    """The published DotProduct score of every node for shape q (fitting or not)."""
    cpu = (state.cpu_free / MAX_CPU_MILLI) * (state.s_cpu[q] / MAX_CPU_MILLI)
    gpu_req = state.s_k[q] * state.s_d[q]
    gpu = (state.gpu_free.sum(axis=1) / MAX_GPU_MILLI) * (gpu_req / MAX_GPU_MILLI)
    return np.trunc(100.0 * (1.0 - (cpu + gpu) / 2.0))


class DotProductPolicy:
    name = "dotprod"

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        n = pick_best(np.where(state.fits(q), dotprod_score(state, q), -np.inf), state.rank)
        return None if n is None else Choice(n, state.bestfit_gpus(n, q))
