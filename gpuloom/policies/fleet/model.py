"""The fleet model of the trace simulator: nodes with CPU (milli), memory (MiB) and whole GPUs
of one model, pods that ask for CPU, memory and either N whole GPUs on one node or a share
(gpu_milli < 1000) of one GPU, optionally restricted to some GPU models.

`FleetState` holds the free resources of every node in numpy arrays so that a policy scores all
nodes at once; it is plain data plus `fits` and `commit`, no I/O. Pod shapes are interned: every
distinct (cpu, memory, num_gpu, gpu_milli, models) is one index `q`, which lets policies cache
per-shape work (FGD does).

Two published rules of the FGD paper's simulator live here because every policy shares them:

- ties: node names carry a prefix from a seeded permutation and the scheduler takes the
  lexicographically smallest of the best-scored nodes, so ties follow a fixed random node order
  per run: `FleetState.rank` (0 first; the identity unless the simulator draws one), read by
  `pick_best`;
- the workload FGD weighs ("typical pods", `typical_workload`): the most frequent pod shapes,
  keyed by CPU, GPU milli, GPU count and GPU model as the list writes it (memory is not part
  of the key, nor of fragmentation), taken in decreasing frequency until they cover
  TYPICAL_SHARE of the pods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

WHOLE_GPU = 1000  # milli of one GPU
TYPICAL_SHARE = 0.95  # the FGD workload: the most frequent shapes up to this share of pods


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class PodShape:
    """What one pod asks for. `gpu_milli` is per GPU: 1000 for whole GPUs (num_gpu >= 1), less
    for a share of one GPU (num_gpu == 1), 0 for a CPU-only pod (num_gpu == 0). `models` is
    None when any GPU model will do; `spec` is the model list as the pod list writes it
    (`V100M16|V100M32|V100M32`, empty entries dropped), which FGD's workload keys by: two
    spellings of the same models are two typical pods there (empty: `models` sorted)."""

    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    models: frozenset[str] | None = None
    spec: str = ""

    @property
    def gpu_request(self) -> int:
        """GPU milli the pod takes in all."""
        return self.num_gpu * self.gpu_milli


@dataclass(frozen=True, slots=True)
class TypicalShape:
    """A pod shape as FGD's workload keys it: no memory, the models as written (`spec`)."""

    cpu_milli: int
    num_gpu: int
    gpu_milli: int
    models: frozenset[str] | None
    spec: str = ""


def _model_key(models: frozenset[str] | None) -> str:
    return "|".join(sorted(models)) if models else ""


def typical_workload(
    shapes: Sequence[PodShape], weights: Sequence[float], share: float = TYPICAL_SHARE
) -> tuple[tuple[TypicalShape, ...], np.ndarray]:
    """FGD's workload from pod shapes and their counts: shapes keyed without memory and with
    the models as written, sorted by count, then CPU, GPU milli, GPU count and the models'
    text, all descending (the published list is sorted by `sort.Reverse` of count, then those
    keys ascending, so its equal counts come in descending order too), taken one at a time
    until they cover `share` of the pods, their weights normalised to sum to 1 (in the published
    order of operations, below)."""
    counts: dict[TypicalShape, float] = {}
    for shape, weight in zip(shapes, weights, strict=True):
        spec = (shape.spec or _model_key(shape.models)) if shape.num_gpu else ""
        key = TypicalShape(shape.cpu_milli, shape.num_gpu, shape.gpu_milli, shape.models, spec)
        counts[key] = counts.get(key, 0.0) + float(weight)
    total = sum(counts.values())
    ranked = sorted(
        counts.items(),
        key=lambda kv: (kv[1], kv[0].cpu_milli, kv[0].gpu_milli, kv[0].num_gpu, kv[0].spec),
        reverse=True,
    )
    chosen: list[tuple[TypicalShape, float]] = []
    covered = 0.0
    # The published threshold is a percent: percent * total / 100 (0.95 * total differs from it
    # in the last bit for some totals).
    threshold = round(share * 100, 9) * total / 100
    for key, count in ranked:
        if covered >= threshold:
            break
        chosen.append((key, count))
        covered += count
    w = np.array([c for _, c in chosen], dtype=np.float64)
    if covered <= 0:
        return tuple(k for k, _ in chosen), w
    # Normalised in the published order of operations, (count / total) / (covered / total),
    # not count / covered: the last bit of a weight can tip an integer FGD score.
    return tuple(k for k, _ in chosen), (w / total) / (covered / total)


class FleetState:
    """Free resources of every node, updated by `commit`. Node arrays are indexed by node, shape
    arrays by shape index; `version[n]` takes a number never used before whenever node n changes
    (`touch`), so a policy cache keyed by it is never wrong, even for a row put back as it was
    with its old version (the live adapter does that)."""

    def __init__(
        self,
        nodes: Sequence[NodeSpec],
        shapes: Sequence[PodShape],
        weights: Sequence[float],
        typical_share: float = TYPICAL_SHARE,
    ) -> None:
        """`weights[q]`: how often shape q occurs in the workload (the distribution policies
        may know in advance; normalised here). FGD weighs the most frequent shapes up to
        `typical_share` of the pods (`typical_workload`)."""
        self.nodes = tuple(nodes)
        self.shapes = tuple(shapes)
        w = np.asarray(weights, dtype=np.float64)
        self.s_weight = w / w.sum() if w.sum() > 0 else w
        self.models = tuple(sorted({n.model for n in self.nodes}))
        model_index = {m: i for i, m in enumerate(self.models)}
        n_nodes = len(self.nodes)
        width = max((n.gpus for n in self.nodes), default=0)
        self.cpu_cap = np.array([n.cpu_milli for n in self.nodes], dtype=np.int64)
        self.mem_cap = np.array([n.memory_mib for n in self.nodes], dtype=np.int64)
        self.gpu_count = np.array([n.gpus for n in self.nodes], dtype=np.int64)
        self.model_idx = np.array([model_index[n.model] for n in self.nodes], dtype=np.int64)
        self.cpu_free = self.cpu_cap.copy()
        self.mem_free = self.mem_cap.copy()
        # GPU slots a node lacks stay at 0 free: to every rule that is a fully used GPU.
        self.gpu_free = np.zeros((n_nodes, width), dtype=np.int64)
        for i, node in enumerate(self.nodes):
            self.gpu_free[i, : node.gpus] = WHOLE_GPU
        self.version = np.zeros(n_nodes, dtype=np.int64)
        self._clock = 0  # the last version handed out
        self.s_cpu = np.array([s.cpu_milli for s in self.shapes], dtype=np.int64)
        self.s_mem = np.array([s.memory_mib for s in self.shapes], dtype=np.int64)
        self.s_k = np.array([s.num_gpu for s in self.shapes], dtype=np.int64)
        self.s_d = np.array([s.gpu_milli for s in self.shapes], dtype=np.int64)
        # model_allows[m, q]: shape q may run on GPU model m.
        self.model_allows = np.array(
            [[s.models is None or m in s.models for s in self.shapes] for m in self.models],
            dtype=bool,
        ).reshape(len(self.models), len(self.shapes))
        # GPU clustering's affinity tag per shape: 0 no GPU, 1 a share, 1 + k for k whole GPUs;
        # hosted[n, tag]: the pods of each tag on node n.
        self.s_tag = np.where(self.s_d == WHOLE_GPU, 1 + self.s_k, np.where(self.s_k > 0, 1, 0))
        self.hosted = np.zeros((n_nodes, int(self.s_tag.max(initial=0)) + 1), dtype=np.int64)
        # The FGD workload (typical pods), as arrays: t_* per typical shape.
        typical, t_weight = typical_workload(self.shapes, w, typical_share)
        self.typical = typical
        self.t_weight = t_weight
        self.t_cpu = np.array([t.cpu_milli for t in typical], dtype=np.int64)
        self.t_k = np.array([t.num_gpu for t in typical], dtype=np.int64)
        self.t_d = np.array([t.gpu_milli for t in typical], dtype=np.int64)
        self.t_allows = np.array(
            [[t.models is None or m in t.models for t in typical] for m in self.models],
            dtype=bool,
        ).reshape(len(self.models), len(typical))
        self.t_demands = np.unique(self.t_d)
        self.t_demand_idx = np.searchsorted(self.t_demands, self.t_d)
        # Tie order: rank[n] (lowest first), as the published simulator's node-name prefixes.
        self.rank = np.arange(n_nodes, dtype=np.int64)
        # A caller's own limits for the pod being decided, beyond what the model knows (the live
        # adapter's GPU memory and free rectangles), never applied by `fits_rows` (what policies
        # cache per node): the GPUs it may take (`usable`, [node, GPU]; None: every GPU), read
        # by `fits`, `open_gpus` and the policies' choice of GPU, and the nodes it may use at
        # all (`allowed`; None: every node), read by `fits` and `only_allowed`. A GPU it may
        # not take still counts in its node's state as it is (its free milli, fragmentation).
        self.usable: np.ndarray | None = None
        self.allowed: np.ndarray | None = None
        # Derived data policies keep for this state (by the policy's key), such as FGD's cache.
        self.memo: dict[str, object] = {}

    def add_shape(self, shape: PodShape) -> int:
        """Intern one more pod shape, weighing nothing in the workload (which stays as it
        is, typical pods included), and return its index; policies' per-shape caches grow
        with it."""
        self.shapes = (*self.shapes, shape)
        self.s_weight = np.append(self.s_weight, 0.0)
        self.s_cpu = np.append(self.s_cpu, shape.cpu_milli)
        self.s_mem = np.append(self.s_mem, shape.memory_mib)
        self.s_k = np.append(self.s_k, shape.num_gpu)
        self.s_d = np.append(self.s_d, shape.gpu_milli)
        allows = [shape.models is None or m in shape.models for m in self.models]
        self.model_allows = np.hstack(
            [self.model_allows, np.array(allows, dtype=bool).reshape(-1, 1)]
        )
        tag = 1 + shape.num_gpu if shape.gpu_milli == WHOLE_GPU else int(shape.num_gpu > 0)
        self.s_tag = np.append(self.s_tag, tag)
        if tag >= self.hosted.shape[1]:
            grow = tag + 1 - self.hosted.shape[1]
            self.hosted = np.hstack([self.hosted, np.zeros((len(self.nodes), grow), np.int64)])
        return len(self.shapes) - 1

    @property
    def gpu_capacity(self) -> int:
        return int(self.gpu_count.sum()) * WHOLE_GPU

    @property
    def gpu_allocated(self) -> int:
        return self.gpu_capacity - int(self.gpu_free.sum())

    def fits(self, q: int) -> np.ndarray:
        """Boolean mask of the nodes where a pod of shape q fits now."""
        ok = (
            (self.cpu_free >= self.s_cpu[q])
            & (self.mem_free >= self.s_mem[q])
            & self.model_allows[self.model_idx, q]
        )
        k = self.s_k[q]
        if k:
            ok &= self.open_gpus(int(self.s_d[q])).sum(axis=1) >= k
        if self.allowed is not None:
            ok &= self.allowed
        return ok

    def open_gpus(self, d: int) -> np.ndarray:
        """Per GPU ([node, GPU]): whether it has `d` milli free and the pod being decided may
        take it (`usable`)."""
        room = self.gpu_free >= d
        return room if self.usable is None else room & self.usable

    def only_allowed(self, scores: np.ndarray) -> np.ndarray:
        """`scores` with the nodes the pod may not use at -inf (`allowed`)."""
        return scores if self.allowed is None else np.where(self.allowed, scores, -np.inf)

    def fits_rows(self, q: int, rows: np.ndarray) -> np.ndarray:
        """`fits(q)` for the nodes `rows` only."""
        ok = (
            (self.cpu_free[rows] >= self.s_cpu[q])
            & (self.mem_free[rows] >= self.s_mem[q])
            & self.model_allows[self.model_idx[rows], q]
        )
        k = self.s_k[q]
        if k:
            ok &= (self.gpu_free[rows] >= self.s_d[q]).sum(axis=1) >= k
        return ok

    def bestfit_gpus(self, n: int, q: int) -> tuple[int, ...]:
        """The GPUs of node n a pod of shape q takes by default: k fully free GPUs, or for a
        share the GPU with the least free milli that still fits (packs shares tightly); of
        those it may take (`usable`)."""
        k, d = int(self.s_k[q]), int(self.s_d[q])
        if k == 0:
            return ()
        free = self.gpu_free[n]
        room = free >= d if self.usable is None else (free >= d) & self.usable[n]
        if d == WHOLE_GPU:
            return tuple(int(j) for j in np.flatnonzero(room)[:k])
        slack = np.where(room, free - d, WHOLE_GPU + 1)
        return (int(np.argmin(slack)),)

    def commit(self, n: int, q: int, gpus: tuple[int, ...]) -> None:
        self.cpu_free[n] -= self.s_cpu[q]
        self.mem_free[n] -= self.s_mem[q]
        for j in gpus:
            self.gpu_free[n, j] -= self.s_d[q]
        self.hosted[n, self.s_tag[q]] += 1
        self.touch(n)

    def release(self, n: int, q: int, gpus: tuple[int, ...]) -> None:
        """Give back what `commit(n, q, gpus)` took (a pod leaving, in trace replay)."""
        self.cpu_free[n] += self.s_cpu[q]
        self.mem_free[n] += self.s_mem[q]
        for j in gpus:
            self.gpu_free[n, j] += self.s_d[q]
        self.hosted[n, self.s_tag[q]] -= 1
        self.touch(n)

    def touch(self, n: int) -> None:
        """Mark node n changed: a version no node has had before."""
        self._clock += 1
        self.version[n] = self._clock

    def touch_rows(self, rows: np.ndarray) -> None:
        """`touch` each node of `rows` (distinct)."""
        self.version[rows] = np.arange(self._clock + 1, self._clock + 1 + len(rows))
        self._clock += len(rows)

    def fits_node(self, n: int, q: int) -> bool:
        """Whether a pod of shape q fits node n now (`fits` for one node, without numpy's
        per-call cost)."""
        if self.cpu_free[n] < self.s_cpu[q] or self.mem_free[n] < self.s_mem[q]:
            return False
        if not self.model_allows[self.model_idx[n], q]:
            return False
        k = int(self.s_k[q])
        return not k or int((self.gpu_free[n] >= self.s_d[q]).sum()) >= k


@dataclass(frozen=True, slots=True)
class Choice:
    node: int
    gpus: tuple[int, ...]


class FleetPolicy(Protocol):
    """Chooses a node (and its GPUs) for one pod of shape q, or None when it fits nowhere.
    Decides only: the caller commits. `rng` breaks ties (as kube-scheduler picks at random
    among the best-scored nodes)."""

    @property
    def name(self) -> str: ...

    def choose(self, state: FleetState, q: int, rng: np.random.Generator) -> Choice | None: ...


def pick_best(scores: np.ndarray, rank: np.ndarray) -> int | None:
    """The node of the highest score (-inf: does not fit), ties to the lowest `rank` (the
    published simulator's lexicographically smallest node name); None when none fits."""
    best = scores.max(initial=-np.inf)
    if best == -np.inf:
        return None
    tied = np.flatnonzero(scores == best)
    return int(tied[0]) if len(tied) == 1 else int(tied[np.argmin(rank[tied])])


def pick_lowest(scores: np.ndarray, rng: np.random.Generator) -> int | None:
    """Index of the lowest finite score, ties broken at random; None when none is finite."""
    best = scores.min(initial=np.inf)
    if not np.isfinite(best):
        return None
    tied = np.flatnonzero(scores <= best + 1e-9 * max(1.0, abs(best)))
    return int(tied[0]) if len(tied) == 1 else int(rng.choice(tied))
