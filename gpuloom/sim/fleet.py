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
import heapq
import io
import json
import math
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass

import numpy as np

from gpuloom.policies.fleet.frag import Fragmentation
from gpuloom.policies.fleet.model import WHOLE_GPU, FleetPolicy, FleetState, NodeSpec, PodShape

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
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
    optional gpu_spec such as `V100M16|V100M32`, kept as written in `PodShape.spec`; other
    columns are ignored)."""
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
                spec="|".join(m for m in spec.split("|") if m),
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
    """Shape indices in arrival order, as the published simulator tunes a list to `inflate` x
    `capacity` (GPU milli): the list shuffled; if its GPU request is above the target, pods
    removed at random until it is not; else clones drawn uniformly from the list appended while
    the request so far plus the drawn pod's GPU milli *per GPU* stays within the target (the
    first draw that would pass ends the list, unadded)."""
    per_gpu = np.array([s.gpu_milli for s in workload.shapes], dtype=np.int64)
    request = np.array([s.gpu_request for s in workload.shapes], dtype=np.int64)
    pods = np.array(workload.pods, dtype=np.int64)
    order = rng.permutation(pods)
    target = inflate * capacity
    total = int(request[order].sum())
    if total > target:
        kept = order.tolist()
        while total > target and kept:
            total -= int(request[kept.pop(int(rng.integers(len(kept))))])
        return np.array(kept, dtype=np.int64)
    if request[pods].sum() == 0:
        return order  # nothing to inflate with
    clones: list[int] = []
    while True:
        for q in rng.choice(pods, size=1024).tolist():
            if total + per_gpu[q] > target:
                return np.concatenate([order, np.array(clones, dtype=np.int64)])
            clones.append(q)
            total += int(request[q])


@dataclass(frozen=True, slots=True)
class FleetRun:
    policy: str
    seed: int
    inflate: float
    alloc_pct_at_100: float | None
    alloc_pct_at_130: float | None  # the published figure: mean from `inflate` - 0.5% on
    frag_pct_at_130: float | None  # after the last arrival
    failed_pods: int
    wall_s: float
    decisions_per_s: float
    curve: tuple[tuple[float, float], ...]  # (arrived % of capacity, allocated %)

    def summary(self) -> dict[str, object]:
        """The fields of `--json` (all but the curve)."""
        fields = asdict(self)
        del fields["curve"]
        return fields


FINAL_WINDOW = 0.005  # the figure: mean allocation over arrivals from inflate - 0.5% on


@dataclass(frozen=True, slots=True)
class Draws:
    """A run's random draws given instead of drawn from its seed, to replay another
    simulator's run exactly (the published simulator's, from Go's `math/rand`:
    tests/sim/data/published_draws.go). `pods`: the pod list's rows (0-based, in list order) in
    arrival order, a clone repeating its pod's row; `rank`: each node's place in the tie order
    (0 first), in node-list order."""

    pods: tuple[int, ...]
    rank: tuple[int, ...]

    def check(self, pods: int, nodes: int, source: str = "draws") -> None:
        """Raises FleetInputError, naming `source` and the key, unless these draws fit a pod
        list of `pods` rows and a node list of `nodes` nodes."""
        if not self.pods:
            raise FleetInputError(f"{source}, key pods: must be a non-empty list of integers")
        bad = next((i for i, row in enumerate(self.pods) if not 0 <= row < pods), None)
        if bad is not None:
            raise FleetInputError(
                f"{source}, key pods[{bad}]: {self.pods[bad]} is not a row: draws must name "
                f"rows of the pod list (0 to {pods - 1})"
            )
        if sorted(self.rank) != list(range(nodes)):
            raise FleetInputError(
                f"{source}, key rank: must rank every node once, each of the node list's "
                f"{nodes} (0 to {nodes - 1}); it has {len(self.rank)} entries"
            )


def parse_draws(text: str, source: str, pods: int, nodes: int) -> tuple[int, Draws]:
    """A draws file (tests/sim/data/published_draws.go writes them): a JSON object with
    `seed` (an integer), `pods` (rows of a pod list of `pods` rows, in arrival order) and
    `rank` (each of `nodes` nodes' place in the tie order, every place once). Returns the seed
    and the draws; a bad file raises FleetInputError naming the file and the key."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise FleetInputError(f"{source}: not JSON: {error.msg} (line {error.lineno})") from None
    if not isinstance(data, dict):
        raise FleetInputError(f"{source}: must be a JSON object with seed, pods and rank")
    unknown = sorted(set(data) - {"seed", "pods", "rank"})
    if unknown:
        raise FleetInputError(f"{source}, key {unknown[0]}: unknown (seed, pods, rank)")

    def integers(key: str) -> list[int]:
        value = data.get(key)
        if not isinstance(value, list) or not value:
            raise FleetInputError(f"{source}, key {key}: must be a non-empty list of integers")
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int):
                raise FleetInputError(f"{source}, key {key}[{i}]: not an integer: {item!r}")
        return value

    seed = data.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise FleetInputError(f"{source}, key seed: must be an integer, got {seed!r}")
    draws = Draws(tuple(integers("pods")), tuple(integers("rank")))
    draws.check(pods, nodes, source)
    return seed, draws


def simulate(
    nodes: list[NodeSpec],
    workload: Workload,
    policy: FleetPolicy,
    seed: int,
    inflate: float = 1.3,
    draws: Draws | None = None,
) -> FleetRun:
    """One run of `policy` on a fresh fleet, the published protocol: the seed draws the
    arrivals (`arrivals`), then the node order that breaks ties (`FleetState.rank`); random
    policies draw from it too. The order comes after the arrivals, as the published
    simulator draws its node-name permutation after shuffling and tuning the list, so that
    each list has its own node orders for a seed: drawn first, the same ten orders would serve
    every list and their luck would move all lists' means together (with the arrivals fixed,
    the order alone moves `gpupacking` on `cpu250` by 0.5, one standard deviation).
    With `draws`, the arrivals and the node order are those given (`inflate` then only
    places the final window); the seed still serves `random`."""
    rng = np.random.default_rng(seed)
    state = FleetState(nodes, workload.shapes, workload.weights)
    capacity = state.gpu_capacity
    if draws is None:
        stream = arrivals(workload, capacity, inflate, rng)
        state.rank = rng.permutation(len(nodes)).astype(np.int64)
    else:
        draws.check(len(workload.pods), len(nodes))
        rows = np.asarray(draws.pods, dtype=np.int64)
        stream = np.asarray(workload.pods, dtype=np.int64)[rows]
        state.rank = np.asarray(draws.rank, dtype=np.int64)
    request = state.s_k * state.s_d
    arrived = np.cumsum(request[stream]) / max(capacity, 1)
    allocated = np.empty(len(stream), dtype=np.int64)
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
    wall = time.perf_counter() - start
    frag_end = Fragmentation.of(state).total()
    pct = 100 * allocated / max(capacity, 1)

    def pct_at(mark: float) -> float | None:
        i = int(np.searchsorted(arrived, mark - 1e-12))
        return None if i >= len(stream) else round(float(pct[i]), 3)

    # A small fleet may stop short of the window: then the last arrival is the figure.
    tail = arrived >= min(inflate - FINAL_WINDOW, float(arrived[-1])) - 1e-12 if len(stream) else []
    final = round(float(pct[tail].mean()), 3) if len(stream) else None
    steps = np.arange(CURVE_STEP, arrived[-1] + 1e-12, CURVE_STEP) if len(stream) else []
    at = np.minimum(np.searchsorted(arrived, np.asarray(steps) - 1e-12), len(stream) - 1)
    return FleetRun(
        policy=policy.name,
        seed=seed,
        inflate=inflate,
        alloc_pct_at_100=pct_at(1.0),
        alloc_pct_at_130=final,
        frag_pct_at_130=round(100 * frag_end / max(capacity, 1), 3),
        failed_pods=failed,
        wall_s=round(wall, 3),
        decisions_per_s=round(len(stream) / wall, 1) if wall > 0 else 0.0,
        curve=tuple(
            (round(100 * float(s), 2), round(float(pct[j]), 3))
            for s, j in zip(steps, at, strict=True)
        ),
    )


# ---- replay: the trace's own arrival and departure times ----

TIME_COLUMNS = ("creation_time", "deletion_time")
REPLAY_SAMPLES = 100  # points of the allocation-over-time curve


def parse_lifetimes(text: str, source: str) -> list[tuple[int, int]]:
    """(creation_time, deletion_time) of every pod of a pod list, in its order, for replay."""
    lifetimes = []
    for line, row in _rows(text, source, TIME_COLUMNS):
        created = _int(row, "creation_time", source, line)
        deleted = _int(row, "deletion_time", source, line)
        if deleted < created:
            raise FleetInputError(
                f"{source}, line {line}, column deletion_time: {deleted} is before its "
                f"creation_time {created}"
            )
        lifetimes.append((created, deleted))
    return lifetimes


@dataclass(frozen=True, slots=True)
class ReplayRun:
    """One replay of a pod list's own times. Times are the trace's (seconds)."""

    policy: str
    seed: int
    compress: float
    pods: int
    placed_pods: int
    failed_pods: int  # fit on no node even when the fleet is empty (every other pod is placed)
    queued_pods: int  # placed, after waiting
    delay_mean_s: float  # over the placed pods (those placed on arrival count 0)
    delay_p50_s: float
    delay_p99_s: float
    delay_max_s: float
    alloc_pct_mean: float  # time-weighted, from the first arrival to the last
    alloc_pct_peak: float
    wall_s: float
    decisions_per_s: float
    # (time s, allocated % of GPU capacity) from the first arrival to the last
    curve: tuple[tuple[float, float], ...]

    def summary(self) -> dict[str, object]:
        """The fields of `--json` (all but the curve)."""
        fields = asdict(self)
        del fields["curve"]
        return fields


def replay(
    nodes: list[NodeSpec],
    workload: Workload,
    lifetimes: list[tuple[int, int]],
    policy: FleetPolicy,
    seed: int,
    compress: float = 1.0,
) -> ReplayRun:
    """Replay the pod list's own times on a fresh fleet: each pod arrives at its creation time
    and, once placed, holds its resources for its lifetime in the trace (deletion - creation):
    a pod placed on arrival leaves at its deletion time, one that waited leaves that much later.
    `compress` > 1 divides the creation times (arrivals come that many times faster, lifetimes
    stay): the load grows by that factor.
    A pod that does not fit waits; whenever pods leave, the waiting pods that may fit on the
    nodes they freed are tried again, oldest first. Waiting pods are kept by shape: a pod is
    tried only if the freed nodes could hold its shape, and a shape whose oldest waiting pod
    does not fit is not tried further in that round (the others ask exactly the same). A pod
    whose shape fits no node of an empty fleet fails on arrival; every other pod is placed in
    the end (the fleet is empty once the last pod leaves). The seed breaks ties."""
    if len(lifetimes) != len(workload.pods):
        raise ValueError("one lifetime per pod of the workload")
    if not compress > 0:
        raise ValueError(f"compress must be > 0, got {compress}")
    arrive_at = [created / compress for created, _ in lifetimes]
    rng = np.random.default_rng(seed)
    state = FleetState(nodes, workload.shapes, workload.weights)
    capacity = max(state.gpu_capacity, 1)
    possible = [bool(state.fits(q).any()) for q in range(len(workload.shapes))]
    order = sorted(range(len(lifetimes)), key=lambda i: (arrive_at[i], i))
    waiting: dict[int, deque[int]] = {}  # shape -> pods waiting, oldest first
    leaving: list[tuple[float, int, int, int, tuple[int, ...]]] = []  # (time, pod, node, q, gpus)
    delays: list[float] = []
    steps: list[tuple[float, int]] = []  # (time, GPU milli allocated from then on)
    failed = tried = 0
    start = time.perf_counter()

    def place(pod: int, q: int, now: float) -> bool:
        nonlocal tried
        tried += 1
        choice = policy.choose(state, q, rng)
        if choice is None:
            return False
        state.commit(choice.node, q, choice.gpus)
        created, deleted = lifetimes[pod]
        heapq.heappush(leaving, (now + deleted - created, pod, choice.node, q, choice.gpus))
        delays.append(now - arrive_at[pod])
        return True

    def retry(freed: set[int], now: float) -> None:
        heads = [
            (queue[0], q)
            for q, queue in waiting.items()
            if any(state.fits_node(n, q) for n in freed)
        ]
        heapq.heapify(heads)
        while heads:
            _, q = heapq.heappop(heads)
            queue = waiting[q]
            if not place(queue[0], q, now):
                continue  # the rest of this shape cannot fit either
            queue.popleft()
            if queue:
                heapq.heappush(heads, (queue[0], q))
            else:
                del waiting[q]

    arrival = 0
    while arrival < len(order) or leaving:
        now = min(
            arrive_at[order[arrival]] if arrival < len(order) else math.inf,
            leaving[0][0] if leaving else math.inf,
        )
        freed: set[int] = set()
        while leaving and leaving[0][0] == now:
            _, _, n, q, gpus = heapq.heappop(leaving)
            state.release(n, q, gpus)
            freed.add(n)
        if freed and waiting:
            retry(freed, now)
        while arrival < len(order) and arrive_at[order[arrival]] == now:
            pod = order[arrival]
            arrival += 1
            q = workload.pods[pod]
            if not possible[q]:
                failed += 1
            elif q in waiting:  # its elders of the same shape wait: so does it
                waiting[q].append(pod)
            elif not place(pod, q, now):
                waiting[q] = deque([pod])
        steps.append((now, state.gpu_allocated))
    wall = time.perf_counter() - start

    assert not waiting, "the last pod to leave emptied the fleet: every pod that fits waits no more"
    times = np.array([t for t, _ in steps], dtype=np.float64)
    allocated = np.array([a for _, a in steps], dtype=np.float64) / capacity * 100
    first = arrive_at[order[0]] if order else 0.0
    last = arrive_at[order[-1]] if order else 0.0
    mean = _time_mean(times, allocated, first, last)
    # The curve covers the arrivals, as the mean does (what follows is the fleet draining).
    samples = np.linspace(first, last, REPLAY_SAMPLES) if len(times) else np.array([])
    at = np.maximum(np.searchsorted(times, samples, side="right") - 1, 0)
    d = np.array(delays, dtype=np.float64)
    return ReplayRun(
        policy=policy.name,
        seed=seed,
        compress=compress,
        pods=len(lifetimes),
        placed_pods=len(delays),
        failed_pods=failed,
        queued_pods=int((d > 0).sum()),
        delay_mean_s=round(float(d.mean()), 1) if len(d) else 0.0,
        delay_p50_s=round(float(np.percentile(d, 50)), 1) if len(d) else 0.0,
        delay_p99_s=round(float(np.percentile(d, 99)), 1) if len(d) else 0.0,
        delay_max_s=round(float(d.max()), 1) if len(d) else 0.0,
        alloc_pct_mean=round(mean, 3),
        alloc_pct_peak=round(float(allocated.max()), 3) if len(allocated) else 0.0,
        wall_s=round(wall, 3),
        decisions_per_s=round(tried / wall, 1) if wall > 0 else 0.0,
        curve=tuple(
            (round(float(t), 1), round(float(allocated[j]), 3))
            for t, j in zip(samples, at, strict=True)
        ),
    )


def _time_mean(times: np.ndarray, values: np.ndarray, first: float, last: float) -> float:
    """The time-weighted mean over [first, last] of a step function that takes values[i] from
    times[i] on; the value at `first` when the span is empty."""
    if not len(times):
        return 0.0
    if last <= first:
        return float(values[max(int(np.searchsorted(times, first, side="right")) - 1, 0)])
    edges = np.clip(np.append(times, last), first, last)
    return float((values * np.diff(edges)).sum() / (last - first))
