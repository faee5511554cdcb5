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

from typing import TypeVar

import numpy as np

from gpuloom.policies.fleet.model import WHOLE_GPU, FleetState

_T = TypeVar("_T")


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


# The published FragAmount's buckets in its index order, Q3 left out: a pod that fits adds the
# milli it cannot use to Q2 and the rest (usable, so not fragmentation) to Q3, never summed.
Q1_LACK_BOTH, Q2_LACK_GPU, Q4_LACK_CPU, XL_SATISFIED, XR_LACK_CPU, NO_ACCESS = range(6)
_BUCKETS = np.arange(6)[None, :, None]


def _memoised(state: FleetState, key: str, make: type[_T]) -> _T:
    """The one `make(state)` kept in the state's memo under `key` (made on first use)."""
    value = state.memo.get(key)
    if not isinstance(value, make):
        value = state.memo[key] = make(state)
    return value


class _Typical:
    """The typical pods' arrays as columns ([T, 1]) for `_weigh`, made once per state (its
    typical pods never change). A CPU-only pod is let on every model and needs no GPU, so it
    reaches the buckets of a pod with its CPU (XL) or without (XR) as a GPU pod reaches Q2
    or Q4."""

    def __init__(self, state: FleetState) -> None:
        gpu_pod = state.t_k > 0
        self.cpu = state.t_cpu[:, None]
        self.k = state.t_k[:, None]
        self.weight = state.t_weight[:, None]
        self.gpu_pod = gpu_pod[:, None]
        self.allows = np.ascontiguousarray((state.t_allows | ~gpu_pod).T)  # [T, models]
        self.with_cpu = np.where(gpu_pod, Q2_LACK_GPU, XL_SATISFIED)[:, None]
        self.lacks_cpu = np.where(gpu_pod, Q4_LACK_CPU, XR_LACK_CPU)[:, None]

    @classmethod
    def of(cls, state: FleetState) -> _Typical:
        return _memoised(state, "typical_columns", cls)


def _weigh(
    state: FleetState,
    total: np.ndarray,
    count: np.ndarray,
    usable: np.ndarray,
    cpu_free: np.ndarray,
    model_idx: np.ndarray,
) -> np.ndarray:
    """The weighed sum in the published order of floating-point operations: per typical pod in
    order, weight x milli (one product) added to the bucket of why the pod cannot use that
    milli, then the buckets added in index order. Any other order can differ in the last bit,
    and a last bit can tip FGD's integer score. A row's figure does not depend on the rows
    beside it. Arrays are [typical pod, node] here, so that the pods are the slow axis."""
    t = _Typical.of(state)
    di = state.t_demand_idx
    cpu_ok = cpu_free >= t.cpu  # [T, M]
    gpu_ok = count.T[di] >= t.k
    access = t.allows[:, model_idx]
    # A GPU pod that fits cannot use the free milli of the GPUs too full for it; any other pod
    # none of the node's free milli.
    fits = cpu_ok & gpu_ok & access & t.gpu_pod
    amount = np.where(fits, total - usable.T[di], total) * t.weight
    if len(amount) == 1:  # one term (the live adapter's one typical pod): no order to keep
        return amount[0]
    bucket = np.where(
        access,
        np.where(cpu_ok, t.with_cpu, np.where(gpu_ok, t.lacks_cpu, Q1_LACK_BOTH)),
        NO_ACCESS,
    )
    # [T, bucket, M], C-ordered: numpy sums an axis that is not the fast one in memory term by
    # term, in order (the fast one it sums pairwise), and the zeros that stand for the other
    # buckets' terms add nothing. The buckets then one after the other (accumulate adds in
    # order whatever the layout; a [6, 1] sum would be summed pairwise).
    sums = np.add.reduce((bucket[:, None, :] == _BUCKETS) * amount[:, None, :], axis=0)
    return np.add.accumulate(sums, axis=0)[-1]


class Fragmentation:
    """The fragmentation of every node of a state, refreshed for the nodes that changed."""

    def __init__(self, state: FleetState) -> None:
        self.state = state
        self._frag = np.zeros(len(state.nodes))
        self._version = np.full(len(state.nodes), -1, dtype=np.int64)

    @classmethod
    def of(cls, state: FleetState) -> Fragmentation:
        """The one tracker of this state (made on first use)."""
        return _memoised(state, "fragmentation", cls)

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
