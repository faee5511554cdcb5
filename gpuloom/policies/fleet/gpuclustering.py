"""GPU clustering as the FGD paper's simulator scores it. A pod's affinity is "share" for a
share of one GPU, "k-gpu" for k whole GPUs, none for a CPU-only pod (which scores 0
everywhere: the first node it fits). A GPU pod scores a node by tier plus how full the node's
GPUs are, fill = 25 * (8000 - free GPU milli of the node) // 8000:

- the node hosts pods of its affinity and no other: 75 + fill;
- it hosts its affinity among others: 50 + fill;
- it hosts no GPU pod: 25 + fill;
- it hosts only other affinities: fill.

Highest wins, ties to the first node in the run's node order. GPUs: best fit."""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.model import Choice, FleetState, pick_best

MAX_GPU_MILLI = 8000
QUARTER = 25  # MaxNodeScore / 4


def gpuclustering_score(state: FleetState, q: int) -> np.ndarray:
    """The published GPU clustering score of every node for shape q."""
    tag = int(state.s_tag[q])
    if tag == 0:
        return np.zeros(len(state.nodes))
    hosted = state.hosted[:, 1:] > 0  # the GPU affinities present on each node
    kinds = hosted.sum(axis=1)
    fill = QUARTER * (MAX_GPU_MILLI - state.gpu_free.sum(axis=1)) // MAX_GPU_MILLI
    mine = state.hosted[:, tag] > 0
    tier = np.where(mine, np.where(kinds == 1, 3, 2), np.where(kinds == 0, 1, 0))
    return (QUARTER * tier + fill).astype(np.float64)


class GpuClusteringPolicy:
    name = "gpuclustering"

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None:
        scores = np.where(state.fits(q), gpuclustering_score(state, q), -np.inf)
        n = pick_best(scores, state.rank)
        return None if n is None else Choice(n, state.bestfit_gpus(n, q))
