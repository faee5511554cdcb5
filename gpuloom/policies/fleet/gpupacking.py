"""GPU packing as the FGD paper's simulator scores it (integer tiers, highest wins, ties to the
first node in the run's node order; a CPU-only pod scores 0 everywhere, so it takes the first
node it fits). For a GPU pod on a node, with the GPUs it would take chosen least free first:

- every GPU of the node idle: max(33 - idle GPUs, idle GPUs);
- it has to take an idle GPU on a node in use: max(50 - idle GPUs it takes, 33);
- it fits on GPUs already in use: max(100 - (sum over them of free milli * 100 // 1000) // 10,
  50).

GPUs: best fit (`bestfit_gpus`)."""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.model import WHOLE_GPU, Choice, FleetState, pick_best

MAX_SCORE = 100


def gpupacking_score(state: FleetState, q: int) -> np.ndarray:
    """The published GPU packing score of every node where shape q fits (others: anything)."""
    k, d = int(state.s_k[q]), int(state.s_d[q])
    n = len(state.nodes)
    if k == 0 or d == 0:
        return np.zeros(n)
    free = state.gpu_free
    idle = (free == WHOLE_GPU).sum(axis=1)
    all_idle = idle == state.gpu_count
    score = np.maximum(MAX_SCORE // 3 - idle, idle).astype(np.float64)
    if d == WHOLE_GPU:  # on a node in use it takes k idle GPUs
        used = np.maximum(MAX_SCORE // 2 - k, MAX_SCORE // 3)
        return np.where(all_idle, score, used)
    # A share takes the least free GPU it fits on: a used one if any fits.
    used_fit = np.where(state.open_gpus(d) & (free < WHOLE_GPU), free, WHOLE_GPU + 1).min(axis=1)
    on_used = used_fit <= WHOLE_GPU - 1
    ratio = used_fit * 100 // WHOLE_GPU
    shared = np.maximum(MAX_SCORE - ratio // 10, MAX_SCORE // 2)
    idle_gpu = np.maximum(MAX_SCORE // 2 - 1, MAX_SCORE // 3)
    return np.where(all_idle, score, np.where(on_used, shared, idle_gpu))


class GpuPackingPolicy:
    name = "gpupacking"

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        n = pick_best(np.where(state.fits(q), gpupacking_score(state, q), -np.inf), state.rank)
        return None if n is None else Choice(n, state.bestfit_gpus(n, q))
