"""A discrete-event model of one GPU running launched kernels, under each admission policy.

The GPU is gpuloom.sim.device's model: one stream per task; between tasks it time-slices
(`sharing`, and any mode with `gpu.mps` false) or co-runs kernels under MPS with an explicit
interference model (docs/harvest.md). A launched kernel reaches its stream `launch_latency`
after its launch. Each task's host runs its
kernel list once per request: it launches a kernel, then (host "sync") waits for it to finish
or (host "async") goes on at once, spends the kernel's host gap, and launches the next. The
request completes when its last kernel does. Modes:

- exclusive: each task alone on the GPU (its baseline);
- every policy of gpuloom.policies.admission, by name: composed (the dispatcher's default:
  FIKIT across priority levels, time-quota leases within one), fikit, token, fifo, sharing.
  A launch asks the policy; one told to wait launches when a later decision grants it;
  kernel ends and idle hosts are reported to it; its wake time is a timer. Under MPS a
  policy with `beside` (composed) is also asked whether a waiting lower-priority kernel may
  run beside the holder's running kernel (spatial harvesting, docs/harvest.md);
- mps (calibration, not in `all`): every host launches freely under MPS (co-running whatever
  `gpu.mps` says, as `sharing` always time-slices).

Pure: an injected seeded RNG, virtual time in integer ns, no wall clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpuloom.policies.admission import (
    DEFAULT_ADMISSION,
    Kernel,
    KernelAdmission,
    SharingAdmission,
    TaskShare,
    make_admission,
)
from gpuloom.policies.harvest import Candidate, Running
from gpuloom.policies.tokens import TokenConfig
from gpuloom.sim.device import Device
from gpuloom.sim.scenario import Scenario, TaskSpec

# The dispatcher's default policy first, then the baselines.
DEFAULT_MODE = DEFAULT_ADMISSION
MODES = ("exclusive", "sharing", "token", "fifo", "fikit", "composed")
# Modes whose policy predicts kernels from a profile measured alone.
PROFILED = ("fikit", "composed")
EXTRA_MODES = ("mps",)  # every host launches freely under MPS (calibration; not in `all`)
NS = 1_000_000_000


@dataclass(frozen=True, slots=True)
class Profile:
    """What the profiler measured of a task alone: per kernel ID mean duration and mean gap
    after it (None: never measured, so unknown to the core)."""

    duration_ns: Mapping[str, int]
    gap_ns: Mapping[str, int | None]


@dataclass(frozen=True, slots=True)
class TaskResult:
    name: str
    priority: int
    jct_ns: tuple[int, ...]  # requests completed within the run, in completion order
    device_share: float = 0.0  # of the run, the share its kernels ran on the device

    def stats(self) -> dict[str, float | int | None]:
        jct = sorted(self.jct_ns)
        if not jct:
            return {
                "priority": self.priority,
                "completed": 0,
                "jct_mean_ms": None,
                "jct_p50_ms": None,
                "jct_p99_ms": None,
                "jct_cv": None,
                "device_share": round(self.device_share, 4),
            }
        mean = sum(jct) / len(jct)
        var = sum((x - mean) ** 2 for x in jct) / len(jct)
        return {
            "priority": self.priority,
            "completed": len(jct),
            "jct_mean_ms": round(mean / 1e6, 4),
            "jct_p50_ms": round(_quantile(jct, 0.5) / 1e6, 4),
            "jct_p99_ms": round(_quantile(jct, 0.99) / 1e6, 4),
            "jct_cv": round(math.sqrt(var) / mean, 4) if mean > 0 else 0.0,
            "device_share": round(self.device_share, 4),
        }


@dataclass(frozen=True, slots=True)
class ModeResult:
    mode: str
    tasks: tuple[TaskResult, ...]
    gpu_busy: float  # busy share of the run (exclusive: the sum of each task's share alone)
    fill_efficiency: float  # share of the holder's in-request idle time others' kernels ran
    kernels: tuple[tuple[int, int, int], ...] = field(repr=False)  # (start, end, task index)
    counters: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "tasks": {t.name: t.stats() for t in self.tasks},
            "gpu_busy": round(self.gpu_busy, 4),
            "fill_efficiency": round(self.fill_efficiency, 4),
        }


def _quantile(sorted_values: Sequence[int], q: float) -> float:
    # Linear interpolation between the closest ranks (numpy's default).
    position = (len(sorted_values) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


class _Program:
    """A task's kernel list with the host gaps its program has (the gap model, docs/fikit.md):
    a base gap per kernel ID or per launch position, drawn once from an exponential with mean
    host_gap_us, or the inline gap_after_us; each launch jitters durations and gaps."""

    def __init__(self, spec: TaskSpec, rng: random.Random) -> None:
        self.spec = spec
        mean = spec.host_gap_us * 1e3
        by_id: dict[str, float] = {}
        gaps = []
        for kernel in spec.kernels:
            if kernel.gap_after_ns is not None:
                gaps.append(float(kernel.gap_after_ns))
            elif spec.gap_model == "per_kernel_id":
                if kernel.kernel_id not in by_id:
                    by_id[kernel.kernel_id] = rng.expovariate(1 / mean) if mean > 0 else 0.0
                gaps.append(by_id[kernel.kernel_id])
            else:
                gaps.append(rng.expovariate(1 / mean) if mean > 0 else 0.0)
        self.base_gap = gaps
        self._sd = _lognormal_sigma(spec.duration_jitter)
        self._sg = _lognormal_sigma(spec.gap_jitter)

    def duration(self, i: int, rng: random.Random) -> int:
        return round(self.spec.kernels[i].duration_ns * _jitter(rng, self._sd))

    def gap(self, i: int, rng: random.Random) -> int:
        return round(self.base_gap[i] * _jitter(rng, self._sg))


def _lognormal_sigma(cv: float) -> float:
    return math.sqrt(math.log1p(cv * cv))


def _jitter(rng: random.Random, sigma: float) -> float:
    # Mean 1, coefficient of variation cv.
    return rng.lognormvariate(-sigma * sigma / 2, sigma) if sigma > 0 else 1.0


@dataclass(slots=True)
class _Task:
    index: int
    spec: TaskSpec
    program: _Program
    rng: random.Random  # its kernels' durations and gaps, launch by launch
    arrivals: random.Random
    pending: deque[int] = field(default_factory=deque)  # arrival times of queued requests
    busy: bool = False  # a request in progress
    arrived: int = 0
    next_kernel: int = 0  # index of the next kernel to launch
    waiting: bool = False  # its host is blocked on admission
    in_flight: int = 0  # launched, not finished
    blocked: bool = False  # an async host waiting for room under launch_depth
    jct: list[int] = field(default_factory=list)
    request_spans: list[tuple[int, int]] = field(default_factory=list)


class _Engine:
    ARRIVE, HOST, ENQUEUE, DEVICE, WAKE = range(5)

    def __init__(
        self,
        scenario: Scenario,
        tasks: Sequence[tuple[TaskSpec, int]],
        mode: str,
        profiles: Mapping[str, Profile] | None = None,
        requests_limit: int | None = None,
    ) -> None:
        self.scenario = scenario
        self.mode = mode
        # A profiling run ends after its requests, not at the scenario's end.
        self.end = round(scenario.duration_s * NS) if requests_limit is None else 2**62
        self.latency = scenario.launch_latency_ns
        self.grant_latency = scenario.grant_latency_ns
        self.requests_limit = requests_limit
        self.events: list[tuple[int, int, int, int, object]] = []  # time, seq, kind, task, arg
        self.seq = 0
        # Per task: its program from its seed; a profiling run (requests_limit) draws its
        # launches and arrivals from other streams than the measured runs do.
        salt = 0 if requests_limit is None else 2
        self.tasks = [
            _Task(
                i,
                spec,
                _Program(spec, random.Random(seed)),
                random.Random(seed + 1 + salt),
                random.Random(seed + 2 + salt),
            )
            for i, (spec, seed) in enumerate(tasks)
        ]
        # `sharing` is the plain GPU (time slices) and `mps` plain MPS, whatever `gpu.mps` says.
        self.concurrent = mode == "mps" or (scenario.gpu.mps and mode != "sharing")
        self.device = Device(scenario.gpu, len(self.tasks), self.concurrent)
        self.device_generation = 0  # a DEVICE event of an older generation is stale
        self.kernels = self.device.segments  # (start, end, task): what ran when
        self.profiles = profiles or {}
        self.policy: KernelAdmission = (
            SharingAdmission()
            if mode in ("exclusive", "mps")
            else make_admission(
                mode, scenario.fikit, TokenConfig(), scenario.token_policy, scenario.harvest
            )
        )
        beside = getattr(self.policy, "beside", None)
        self.beside = beside if self.concurrent else None
        self.timers: set[int] = set()  # times of WAKE events pending
        self.measured_d: dict[str, list[int]] = defaultdict(list)
        self.measured_g: dict[str, list[int]] = defaultdict(list)
        self.last_end: dict[int, tuple[int, str]] = {}

    def push(self, at: int, kind: int, task: int = 0, arg: object = None) -> None:
        heapq.heappush(self.events, (at, self.seq, kind, task, arg))
        self.seq += 1

    def timer(self, at: int) -> None:
        if at < self.end and at not in self.timers:
            self.timers.add(at)
            self.push(at, self.WAKE)

    def run(self) -> None:
        for t in self.tasks:
            spec = t.spec
            # No request given: the limit, as a reservation's (oversubscribed: no guarantee).
            request = spec.quota_limit if spec.quota_request is None else spec.quota_request
            share = TaskShare(spec.priority, spec.sm_percent, request, spec.quota_limit)
            self.policy.add_task(t.index, share, round(spec.start_s * NS))
        for t in self.tasks:
            self.schedule_arrival(t, round(t.spec.start_s * NS))
        while self.events:
            at, _, kind, index, arg = heapq.heappop(self.events)
            if at > self.end:
                break
            task = self.tasks[index]
            if kind == self.DEVICE:
                if arg == self.device_generation:
                    for done in self.device.advance(at):
                        self.kernel_end(self.tasks[done.ctx], done.tag, at, done.start, done.ran)
                    self.device_timer()
                    self.harvest_waiting(at)
            elif kind == self.ENQUEUE:
                self.submit(task, *arg, at)
            elif kind == self.HOST:
                self.launch_next(task, at)
            elif kind == self.ARRIVE:
                self.arrive(task, at)
            else:
                self.timers.discard(at)
                self.settle(at)

    def schedule_arrival(self, task: _Task, at: int) -> None:
        if self.requests_limit is not None and task.arrived >= self.requests_limit:
            return
        task.arrived += 1
        self.push(at, self.ARRIVE, task.index)

    def arrive(self, task: _Task, now: int) -> None:
        task.pending.append(now)
        rate = task.spec.rate_per_s
        if rate is not None:
            self.schedule_arrival(task, now + round(task.arrivals.expovariate(rate) * NS))
        if not task.busy:
            self.start_request(task, now)

    def start_request(self, task: _Task, now: int) -> None:
        task.busy = True
        task.next_kernel = 0
        self.launch_next(task, now)

    # -- host side -----------------------------------------------------------------------
    def launch_next(self, task: _Task, now: int) -> None:
        """The host wants to launch its next kernel now."""
        if task.in_flight >= task.spec.launch_depth:
            task.blocked = True  # the launch queue is full: wait for a kernel to finish
            return
        kernel = Kernel(None, None)
        profile = self.profiles.get(task.spec.name)
        if profile is not None:
            kernel_id = task.spec.kernels[task.next_kernel].kernel_id
            kernel = Kernel(profile.duration_ns.get(kernel_id), profile.gap_ns.get(kernel_id))
        if self.policy.launch(task.index, kernel, now):
            self.launch(task, now)
        else:
            task.waiting = True
            if not self.try_harvest(task, now):
                self.settle(now)

    def launch(self, task: _Task, now: int) -> None:
        task.waiting = False
        task.in_flight += 1
        i = task.next_kernel
        self.push(
            now + self.latency, self.ENQUEUE, task.index, (i, task.program.duration(i, task.rng))
        )
        task.next_kernel = i + 1
        if task.spec.host == "async" and task.next_kernel < len(task.spec.kernels):
            self.push(now + task.program.gap(i, task.rng), self.HOST, task.index)

    # -- device side ---------------------------------------------------------------------
    def demand(self, task: _Task, i: int) -> int:
        """The SMs kernel i of the task asks for: its launch shape within its SM partition."""
        sms = self.scenario.gpu.sms
        partition = max(1, sms * task.spec.sm_percent // 100)
        return min(task.spec.kernels[i].sm_usage or sms, partition, sms)

    def submit(self, task: _Task, i: int, duration: int, now: int) -> None:
        profile = task.spec.kernels[i].profile
        sms = self.scenario.gpu.sms
        want = min(task.spec.kernels[i].sm_usage or sms, sms)
        self.device.submit(now, task.index, i, duration, self.demand(task, i), profile, want)
        self.device_timer()
        self.harvest_waiting(now)

    def device_timer(self) -> None:
        at = self.device.next_time()
        if at is not None:
            self.device_generation += 1
            self.push(at, self.DEVICE, 0, self.device_generation)

    # -- spatial harvesting (a policy with `beside`, under MPS) ---------------------------
    def harvest_waiting(self, now: int) -> None:
        if self.beside is not None:
            for task in self.tasks:
                if task.waiting:
                    self.try_harvest(task, now)

    def try_harvest(self, task: _Task, now: int) -> bool:
        """Launch the task's waiting kernel beside the holder's if the policy admits it."""
        if self.beside is None or task.in_flight:
            return False  # (with kernels in flight its stream is busy: it would wait there)
        running, next_launch = [], None
        for ctx, i, demand, cls, start in self.device.running():
            other = self.tasks[ctx]
            running.append(Running(other.spec.priority, demand, cls))
            if other.spec.priority < task.spec.priority:
                kernel_id = other.spec.kernels[i].kernel_id
                profile = self.profiles[other.spec.name]
                d, g = profile.duration_ns.get(kernel_id), profile.gap_ns.get(kernel_id)
                sync = other.spec.host == "sync" and other.in_flight == 1
                if d is None or (sync and g is None):
                    return False  # the holder's next launch cannot be predicted
                at = start + d + (g if sync else 0)
                next_launch = at if next_launch is None else min(next_launch, at)
        i = task.next_kernel
        kernel = task.spec.kernels[i]
        duration = self.profiles[task.spec.name].duration_ns.get(kernel.kernel_id)
        candidate = Candidate(task.spec.priority, self.demand(task, i), kernel.profile, duration)
        sms = self.scenario.gpu.sms
        if not self.beside(task.index, candidate, running, next_launch, sms, now):
            return False
        self.launch(task, now)
        return True

    def kernel_end(self, task: _Task, i: int, now: int, start: int, ran: int) -> None:
        if self.requests_limit is not None:
            self.measure(task, i, start, now)
        task.in_flight -= 1
        # Charged the time the kernel held the GPU, not the slices another context held while
        # it was preempted (time-sliced): those are the other's time, charged to the other.
        self.policy.completed(task.index, ran, now)
        if task.blocked:
            task.blocked = False
            self.launch_next(task, now)
        if i == len(task.spec.kernels) - 1:
            self.finish_request(task, now)
        elif task.spec.host == "sync":
            self.push(now + task.program.gap(i, task.rng), self.HOST, task.index)
        self.settle(now)

    def measure(self, task: _Task, i: int, start: int, end: int) -> None:
        # As the profiler does alone: duration per kernel ID, and the idle time between a
        # kernel's end and the next kernel's start of the same request.
        kernel_id = task.spec.kernels[i].kernel_id
        self.measured_d[kernel_id].append(end - start)
        previous = self.last_end.get(task.index)
        if previous is not None and i > 0:
            self.measured_g[previous[1]].append(start - previous[0])
        self.last_end[task.index] = (end, kernel_id)

    def finish_request(self, task: _Task, now: int) -> None:
        arrived = task.pending.popleft()
        task.jct.append(now - arrived)
        task.request_spans.append((arrived, now))
        task.busy = False
        if task.spec.rate_per_s is None:
            last = len(task.spec.kernels) - 1
            self.schedule_arrival(task, now + task.program.gap(last, task.rng))
        if task.pending:
            self.start_request(task, now)
        else:
            self.policy.idle(task.index, now)
            self.settle(now)

    # -- the policy's decisions ----------------------------------------------------------
    def settle(self, now: int) -> None:
        """Launch whom the policy grants now; wake up again when it says."""
        granted, wake = self.policy.decide(now)
        # A filler granted natively wakes, then launches (live: its futex wake).
        at = now + self.grant_latency if getattr(self.policy, "delayed_grants", False) else now
        for index in granted:
            task = self.tasks[index]
            if task.waiting:
                self.launch(task, at)
        if wake is not None:
            self.timer(max(wake, now))


def _merge(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _overlap(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> int:
    """Total length of the intersection of two sorted lists of disjoint spans."""
    total = i = j = 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if high > low:
            total += high - low
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _fill_efficiency(engine: _Engine) -> float:
    best = min(t.spec.priority for t in engine.tasks)
    holders = {t.index for t in engine.tasks if t.spec.priority == best}
    if len(holders) == len(engine.tasks):
        return 0.0
    requests = _merge(
        [s for t in engine.tasks if t.index in holders for s in t.request_spans]
        + [(t.pending[0], engine.end) for t in engine.tasks if t.index in holders and t.busy]
    )
    mine = _merge([(s, e) for s, e, i in engine.kernels if i in holders])
    others = _merge([(s, e) for s, e, i in engine.kernels if i not in holders])
    in_request = sum(e - s for s, e in requests)
    idle = in_request - _overlap(requests, mine)
    # Others' kernels in the holder's idle time only (not beside its own kernels, under MPS).
    beside = _overlap(_intersect(requests, mine), others)
    return (_overlap(requests, others) - beside) / idle if idle > 0 else 0.0


def _intersect(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The intersection of two sorted lists of disjoint spans, as such a list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if high > low:
            out.append((low, high))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _busy(engine: _Engine) -> int:
    spans = _merge([(s, min(e, engine.end)) for s, e, _ in engine.kernels if s < engine.end])
    return sum(e - s for s, e in spans)


def _device_share(engine: _Engine, index: int) -> float:
    ran = sum(min(e, engine.end) - s for s, e, i in engine.kernels if i == index and s < engine.end)
    return ran / (engine.scenario.duration_s * NS)


def figures(result: ModeResult, alone: ModeResult) -> dict[str, float | None]:
    """The two figures every comparison reports: the high-priority p99 as a multiple of its
    p99 alone (the worst task of the best priority), and the best-effort work done (device
    time of the other priorities' tasks) as a share of what they do alone. None when the
    scenario has a single priority level or a task completed nothing."""
    best = min(t.priority for t in result.tasks)
    if all(t.priority == best for t in result.tasks):
        return {"hp_p99_x_alone": None, "be_work_share": None}
    alone_by_name = {t.name: t for t in alone.tasks}
    ratios = []
    for task in result.tasks:
        if task.priority != best:
            continue
        mine, base = task.stats()["jct_p99_ms"], alone_by_name[task.name].stats()["jct_p99_ms"]
        if mine is None or not base:
            ratios = []
            break
        ratios.append(mine / base)
    done = sum(t.device_share for t in result.tasks if t.priority != best)
    base = sum(alone_by_name[t.name].device_share for t in result.tasks if t.priority != best)
    return {
        "hp_p99_x_alone": round(max(ratios), 4) if ratios else None,
        "be_work_share": round(done / base, 4) if base > 0 else None,
    }


def measure_profiles(scenario: Scenario, seeds: Sequence[int]) -> dict[str, Profile]:
    """Each task alone for `profile_requests` requests, measured as the profiler would."""
    profiles = {}
    for spec, seed in zip(scenario.tasks, seeds, strict=True):
        engine = _Engine(
            scenario, [(spec, seed)], "exclusive", requests_limit=scenario.profile_requests
        )
        engine.run()
        profiles[spec.name] = Profile(
            duration_ns={k: round(sum(v) / len(v)) for k, v in engine.measured_d.items()},
            gap_ns={k: round(sum(v) / len(v)) for k, v in engine.measured_g.items()},
        )
    return profiles


def simulate(scenario: Scenario, mode: str, rng: random.Random | None = None) -> ModeResult:
    """Run one mode of the scenario; the same seed gives the same result."""
    if mode not in MODES and mode not in EXTRA_MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES + EXTRA_MODES)}")
    rng = rng or random.Random(scenario.seed)
    # Every mode sees the same programs, arrivals and kernel durations: each task's
    # randomness comes from streams seeded the same way in each mode.
    seeds = [rng.getrandbits(48) * 4 for _ in scenario.tasks]
    if mode == "exclusive":
        results, kernels, busy = [], [], 0
        for index, spec in enumerate(scenario.tasks):
            engine = _Engine(scenario, [(spec, seeds[index])], mode)
            engine.run()
            results.append(
                TaskResult(
                    spec.name, spec.priority, tuple(engine.tasks[0].jct), _device_share(engine, 0)
                )
            )
            kernels.extend((s, e, index) for s, e, _ in engine.kernels)
            busy += _busy(engine)
        return ModeResult(
            mode, tuple(results), busy / (scenario.duration_s * NS), 0.0, tuple(sorted(kernels))
        )
    profiles = measure_profiles(scenario, seeds) if mode in PROFILED else None
    engine = _Engine(scenario, list(zip(scenario.tasks, seeds, strict=True)), mode, profiles)
    engine.run()
    return ModeResult(
        mode,
        tuple(
            TaskResult(t.spec.name, t.spec.priority, tuple(t.jct), _device_share(engine, t.index))
            for t in engine.tasks
        ),
        _busy(engine) / (scenario.duration_s * NS),
        _fill_efficiency(engine),
        tuple(engine.kernels),
        counters=engine.policy.counters(),
    )
