"""The fleet-scale placement simulator on node and pod lists such as the Alibaba GPU trace
(v2023), following the evaluation protocol of the FGD paper's simulator:

- the pods of the list arrive in a seeded shuffled order, then clones of pods drawn uniformly
  from the list until the GPU milli requested in all reaches `inflate` x the cluster's GPU
  capacity (the arrival that crosses it is the last; a list that already crosses it is cut
  there);
- pods are placed one at a time by the policy and never leave; a pod that fits nowhere is
  counted as failed and skipped.

Parsing takes the files' text (the CLI reads them); a bad list raises FleetInputError naming
the file, the line and the column. Everything else is plain computation.
"""

from __future__ import annotations

import csv
import io
import time
from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from gpuloom.policies.fleet.frag import Fragmentation
from gpuloom.policies.fleet.model import WHOLE_GPU, FleetPolicy, FleetState, NodeSpec, PodShape

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
MARKS = (1.0, 1.3)  # arrived demand (x GPU capacity) at which allocation is reported
CURVE_STEP = 0.01  # the allocation curve is sampled every 1% of arrived demand


class FleetInputError(ValueError):
    """A node or pod list that cannot be simulated; the message names file, line, column."""


def _rows(text: str, source: str, columns: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    for column in columns:
        if column not in header:
            raise FleetInputError(f"{source}, line 1, column {column}: missing column")
    return [(reader.line_num, row) for row in reader]


def _int(row: dict[str, str], column: str, source: str, line: int, *, low: int = 0) -> int:
    raw = (row.get(column) or "").strip()
    try:
        value = int(raw)
    except ValueError:
        raise FleetInputError(
            f"{source}, line {line}, column {column}: not an integer: {raw!r}"
        ) from None
    if value < low:
        raise FleetInputError(f"{source}, line {line}, column {column}: below {low}: {value}")
    return value


def parse_nodes(text: str, source: str) -> list[NodeSpec]:
    """Nodes of a node list (sn, cpu_milli, memory_mib, gpu, model)."""
    nodes = []
    for line, row in _rows(text, source, NODE_COLUMNS):
        gpus = _int(row, "gpu", source, line)
        model = (row.get("model") or "").strip()
        if gpus and not model:
            raise FleetInputError(f"{source}, line {line}, column model: a GPU node needs one")
        nodes.append(
            NodeSpec(
                name=(row.get("sn") or "").strip(),
                cpu_milli=_int(row, "cpu_milli", source, line),
                memory_mib=_int(row, "memory_mib", source, line),
                gpus=gpus,
                model=model,
            )
        )
    if not nodes:
        raise FleetInputError(f"{source}, line 2, column sn: the node list is empty")
    return nodes


def parse_pods(text: str, source: str, known_models: set[str]) -> list[PodShape]:
    """Pods of a pod list in its order (name, cpu_milli, memory_mib, num_gpu, gpu_milli and an
    optional gpu_spec such as `V100M16|V100M32`; other columns are ignored)."""
    pods = []
    for line, row in _rows(text, source, POD_COLUMNS):
        num_gpu = _int(row, "num_gpu", source, line)
        milli = _int(row, "gpu_milli", source, line)
        whole_or_share = milli == WHOLE_GPU or (num_gpu == 1 and 0 < milli < WHOLE_GPU)
        if (num_gpu == 0 and milli != 0) or (num_gpu > 0 and not whole_or_share):
            raise FleetInputError(
                f"{source}, line {line}, column gpu_milli: {milli} with num_gpu {num_gpu}"
                f" (0 with 0 GPUs, 1000 per whole GPU, or 1-999 of one GPU)"
            )
        spec = (row.get("gpu_spec") or "").strip()
        models = frozenset(m.strip() for m in spec.split("|")) if spec else None
        unknown = sorted((models or set()) - known_models)
        if unknown:
            raise FleetInputError(
                f"{source}, line {line}, column gpu_spec: unknown GPU model {unknown[0]!r}"
                f" (the node list has {', '.join(sorted(known_models - {''}))})"
            )
        pods.append(
            PodShape(
                cpu_milli=_int(row, "cpu_milli", source, line),
                memory_mib=_int(row, "memory_mib", source, line),
                num_gpu=num_gpu,
                gpu_milli=milli,
                models=models,
            )
        )
    return pods


@dataclass(frozen=True, slots=True)
class Workload:
    """A pod list interned into shapes: `pods[i]` is the shape index of the list's i-th pod,
    `weights[q]` how many pods of the list have shape q."""

    shapes: tuple[PodShape, ...]
    pods: tuple[int, ...]
    weights: tuple[int, ...]

    @classmethod
    def of(cls, pods: list[PodShape]) -> Workload:
        index: dict[PodShape, int] = {}
        seq = tuple(index.setdefault(p, len(index)) for p in pods)
        counts = Counter(seq)
        return cls(tuple(index), seq, tuple(counts[q] for q in range(len(index))))


def arrivals(
    workload: Workload, capacity: int, inflate: float, rng: np.random.Generator
) -> np.ndarray:
    """Shape indices in arrival order: the list shuffled, then uniform clones, until the GPU
    request reaches `inflate` x `capacity` (milli)."""
    request = np.array([s.gpu_request for s in workload.shapes], dtype=np.int64)
    pods = np.array(workload.pods, dtype=np.int64)
    order = rng.permutation(pods)
    target = inflate * capacity
    if request[pods].sum() == 0:
        return order  # nothing to inflate with
    clones = [order]
    total = int(request[order].sum())
    while total < target:
        batch = rng.choice(pods, size=max(64, len(pods) // 8))
        clones.append(batch)
        total += int(request[batch].sum())
    stream = np.concatenate(clones)
    crossing = int(np.searchsorted(np.cumsum(request[stream]), target))
    return stream[: crossing + 1]


@dataclass(frozen=True, slots=True)
class FleetRun:
    policy: str
    seed: int
    inflate: float
    alloc_pct_at_100: float | None
    alloc_pct_at_130: float | None
    frag_pct_at_130: float | None
    failed_pods: int
    wall_s: float
    decisions_per_s: float
    curve: tuple[tuple[float, float], ...]  # (arrived % of capacity, allocated %)

    def summary(self) -> dict[str, object]:
        """The fields of `--json` (all but the curve)."""
        fields = asdict(self)
        del fields["curve"]
        return fields


def simulate(
    nodes: list[NodeSpec],
    workload: Workload,
    policy: FleetPolicy,
    seed: int,
    inflate: float = 1.3,
) -> FleetRun:
    """One run of `policy` on a fresh fleet; the seed draws the arrivals and breaks ties."""
    rng = np.random.default_rng(seed)
    state = FleetState(nodes, workload.shapes, workload.weights)
    capacity = state.gpu_capacity
    stream = arrivals(workload, capacity, inflate, rng)
    request = state.s_k * state.s_d
    arrived = np.cumsum(request[stream]) / max(capacity, 1)
    allocated = np.empty(len(stream), dtype=np.int64)
    frag_at: dict[float, float] = {}
    marks = [m for m in MARKS if m <= inflate + 1e-12]
    next_mark = 0
    failed = 0
    alloc = 0
    start = time.perf_counter()
    for i, q in enumerate(stream.tolist()):
        choice = policy.choose(state, q, rng)
        if choice is None:
            failed += 1
        else:
            state.commit(choice.node, q, choice.gpus)
            alloc += int(request[q])
        allocated[i] = alloc
        while next_mark < len(marks) and arrived[i] >= marks[next_mark] - 1e-12:
            frag_at[marks[next_mark]] = Fragmentation.of(state).total()
            next_mark += 1
    wall = time.perf_counter() - start

    def pct_at(mark: float) -> float | None:
        i = int(np.searchsorted(arrived, mark - 1e-12))
        return None if i >= len(stream) else round(100 * float(allocated[i]) / capacity, 3)

    steps = np.arange(CURVE_STEP, arrived[-1] + 1e-12, CURVE_STEP) if len(stream) else []
    at = np.minimum(np.searchsorted(arrived, np.asarray(steps) - 1e-12), len(stream) - 1)
    frag_130 = frag_at.get(1.3)
    return FleetRun(
        policy=policy.name,
        seed=seed,
        inflate=inflate,
        alloc_pct_at_100=pct_at(1.0),
        alloc_pct_at_130=pct_at(1.3),
        frag_pct_at_130=None if frag_130 is None else round(100 * frag_130 / capacity, 3),
        failed_pods=failed,
        wall_s=round(wall, 3),
        decisions_per_s=round(len(stream) / wall, 1) if wall > 0 else 0.0,
        curve=tuple(
            (round(100 * float(s), 2), round(100 * float(allocated[j]) / capacity, 3))
            for s, j in zip(steps, at, strict=True)
        ),
    )
