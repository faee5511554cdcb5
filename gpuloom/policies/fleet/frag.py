"""GPU fragmentation as the FGD paper and its simulator define it ("Beware of Fragmentation",
ATC'23): the workload is FGD's typical pods (model.typical_workload: the most frequent shapes,
keyed without memory), and a node's fragmentation is the expected free GPU capacity (milli) that
a pod drawn from it could not use:

- a GPU pod that does not fit the node (CPU, GPU model, too few GPUs with its per-GPU demand
  free) can use none of it: all free GPU milli count;
- a GPU pod that fits uses only the GPUs with at least its per-GPU demand free: the free milli
  of the other GPUs count;
- a CPU-only pod uses no GPU: all free GPU milli count.

Memory plays no part (the simulator's `NodeResource` has none).
"""

from __future__ import annotations

import numpy as np

from gpuloom.policies.fleet.model import WHOLE_GPU, FleetState


def measure(
    state: FleetState, gpu_free: np.ndarray, cpu_free: np.ndarray, model_idx: np.ndarray
) -> np.ndarray:
    """Fragmentation (milli) of M node states given as arrays ([M, G] GPU free, [M] others)."""
    total = gpu_free.sum(axis=1)
    if not len(state.t_weight):
        return total.astype(np.float64)
    count, usable = _gpu_counts(state, gpu_free)
    return _weigh(state, total, count, usable, cpu_free, model_idx)


def _gpu_counts(state: FleetState, gpu_free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per node state and distinct per-GPU demand of the typical pods: how many GPUs have at
    least that free, and their free milli summed ([M, D] each)."""
    usable_gpu = gpu_free[:, None, :] >= state.t_demands[None, :, None]  # [M, D, G]
    return usable_gpu.sum(axis=2), (gpu_free[:, None, :] * usable_gpu).sum(axis=2)


def _weigh(
    state: FleetState,
    total: np.ndarray,
    count: np.ndarray,
    usable: np.ndarray,
    cpu_free: np.ndarray,
    model_idx: np.ndarray,
) -> np.ndarray:
    di = state.t_demand_idx
    fits = (
        (cpu_free[:, None] >= state.t_cpu) & state.t_allows[model_idx] & (count[:, di] >= state.t_k)
    )  # [M, T]
    # Per typical pod the milli it cannot use, an exact integer, then weighed (as the published
    # sum of frequency x milli: a node no pod is kept from is exactly 0).
    unusable = np.where(fits & (state.t_k > 0), total[:, None] - usable[:, di], total[:, None])
    # Summed row by row (not a matrix product, whose rounding depends on how many rows go in):
    # a node's figure is the same whichever nodes it is computed with.
    return (unusable * state.t_weight).sum(axis=1)


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
            self._frag[stale] = measure(s, s.gpu_free[stale], s.cpu_free[stale], s.model_idx[stale])
            self._version[stale] = s.version[stale]
        return self._frag

    def total(self) -> float:
        return float(self.nodes().sum())


def frag_options(
    state: FleetState, q: int, nodes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every way a pod of shape q can go on each of `nodes` (where it fits), with the node's
    fragmentation after it: (row into `nodes`, GPU or -1, fragmentation after). Whole GPUs or
    none: one option per node (which fully free GPUs does not change the fragmentation). A
    share: one option per GPU it fits on, in GPU order."""
    rows, cols, after, _ = frag_moves(state, q, nodes)
    return rows, cols, after


def frag_moves(
    state: FleetState, q: int, nodes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`frag_options` and each node's fragmentation now (`measure`), computed together: the
    options and the nodes as they are are rows of one weighing (a row's figure does not
    depend on the rows beside it)."""
    s = state
    k, d = int(s.s_k[q]), int(s.s_d[q])
    gpu_free = s.gpu_free[nodes]
    cpu_now = s.cpu_free[nodes]
    cpu = cpu_now - s.s_cpu[q]
    models = s.model_idx[nodes]
    n = len(nodes)
    if k == 0 or d == WHOLE_GPU:
        after_free = gpu_free
        if k:
            full = gpu_free == WHOLE_GPU
            after_free = np.where(full & (np.cumsum(full, axis=1) <= k), 0, gpu_free)
        both = measure(
            s,
            np.concatenate([after_free, gpu_free]),
            np.concatenate([cpu, cpu_now]),
            np.concatenate([models, models]),
        )
        return np.arange(n), np.full(n, -1), both[:n], both[n:]
    rows, cols = np.nonzero(gpu_free >= d)
    total = gpu_free.sum(axis=1)
    if not len(s.t_weight):
        return rows, cols, (total[rows] - d).astype(np.float64), total.astype(np.float64)
    # Only the share's GPU changes: each option's counts are the node's, that GPU's part
    # taken out and its part after the share put in ([options, D], not [options, D, G]).
    count, usable = _gpu_counts(s, gpu_free)
    dem = s.t_demands[None, :]
    g = gpu_free[rows, cols][:, None]
    was, now = g >= dem, (g - d) >= dem
    count_after = count[rows] - was + now
    usable_after = usable[rows] - g * was + (g - d) * now
    m = len(rows)
    both = _weigh(
        s,
        np.concatenate([total[rows] - d, total]),
        np.concatenate([count_after, count]),
        np.concatenate([usable_after, usable]),
        np.concatenate([cpu[rows], cpu_now]),
        np.concatenate([models[rows], models]),
    )
    return rows, cols, both[:m], both[m:]
