"""GPU fragmentation as the FGD paper defines it ("Beware of Fragmentation", ATC'23): the
workload is the distribution of pod shapes weighted by frequency, and a node's fragmentation
is the expected free GPU capacity (milli) that a pod drawn from it could not use:

- a pod that does not fit the node at all (CPU, memory, GPU model, too few usable GPUs) can use
  none of it: all free GPU milli count;
- a pod that fits uses only the GPUs with at least its per-GPU demand free: the free milli of
  the other GPUs count;
- a CPU-only pod uses no GPU: all free GPU milli count.
"""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.model import WHOLE_GPU, FleetState


def measure(
    state: FleetState,
    gpu_free: np.ndarray,
    cpu_free: np.ndarray,
    mem_free: np.ndarray,
    model_idx: np.ndarray,
) -> np.ndarray:
    """Fragmentation (milli) of M node states given as arrays ([M, G] GPU free, [M] others)."""
    total = gpu_free.sum(axis=1)
    usable_gpu = gpu_free[:, None, :] >= state.demands[None, :, None]  # [M, D, G]
    count = usable_gpu.sum(axis=2)
    usable = (gpu_free[:, None, :] * usable_gpu).sum(axis=2)  # [M, D]
    di = state.s_demand_idx
    fits = (
        (cpu_free[:, None] >= state.s_cpu)
        & (mem_free[:, None] >= state.s_mem)
        & state.model_allows[model_idx]
        & (count[:, di] >= state.s_k)
    )  # [M, Q]
    used = np.where(fits & (state.s_k > 0), usable[:, di], 0)
    return total - used @ state.s_weight


class Fragmentation:
    """The fragmentation of every node of a state, refreshed for the nodes that changed."""

    def __init__(self, state: FleetState) -> None:
        self.state = state
        self._frag = np.zeros(len(state.nodes))
        self._version = np.full(len(state.nodes), -1, dtype=np.int64)

    @classmethod
    def of(cls, state: FleetState) -> Fragmentation:
        """The one tracker of this state (made on first use)."""
        tracker = state.memo.get("fragmentation")
        if not isinstance(tracker, Fragmentation):
            tracker = state.memo["fragmentation"] = cls(state)
        return tracker

    def nodes(self) -> np.ndarray:
        """Fragmentation (milli) per node, now."""
        s = self.state
        stale = np.flatnonzero(self._version != s.version)
        if stale.size:
            self._frag[stale] = measure(
                s, s.gpu_free[stale], s.cpu_free[stale], s.mem_free[stale], s.model_idx[stale]
            )
            self._version[stale] = s.version[stale]
        return self._frag

    def total(self) -> float:
        return float(self.nodes().sum())


def frag_after(state: FleetState, q: int, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a pod of shape q on each of `nodes` (where it fits): the least fragmentation the
    node can be left with, and the GPU that achieves it (-1 for whole GPUs or none: any fully
    free GPUs are alike). A share is tried on every GPU it fits on."""
    s = state
    k, d = int(s.s_k[q]), int(s.s_d[q])
    gpu_free = s.gpu_free[nodes]
    cpu = s.cpu_free[nodes] - s.s_cpu[q]
    mem = s.mem_free[nodes] - s.s_mem[q]
    models = s.model_idx[nodes]
    if k == 0 or d == WHOLE_GPU:
        if k:
            full = gpu_free == WHOLE_GPU
            gpu_free = np.where(full & (np.cumsum(full, axis=1) <= k), 0, gpu_free)
        return measure(s, gpu_free, cpu, mem, models), np.full(len(nodes), -1)
    rows, cols = np.nonzero(gpu_free >= d)
    after = gpu_free[rows]
    after[np.arange(len(rows)), cols] -= d
    frag = measure(s, after, cpu[rows], mem[rows], models[rows])
    # The least per node: sort by (row, frag) and keep each row's first option.
    order = np.lexsort((frag, rows))
    first = order[np.r_[True, rows[order][1:] != rows[order][:-1]]]
    return frag[first], cols[first]
