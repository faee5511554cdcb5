"""The GPU of the kernel simulator: streams, SM partitions and co-running kernels.

Each context (a task: one process) has one stream; its kernels run in launch order, one at a
time. Between contexts the device works in one of two ways (docs/harvest.md, "Device model"):

- time-sliced (a GPU without MPS; the `sharing` baseline, and `mps: false`): one context holds
  the GPU at a time. A context with no submitted kernel yields at once; while others wait, the
  holder keeps the GPU for at most `timeslice` and is then preempted mid-kernel (compute
  preemption; its kernel resumes where it stopped). Loading another context costs `switch`,
  during which nothing runs. Contexts take turns round-robin.
- concurrent (MPS): the head kernels of every stream run at once. A kernel asks for
  `demand = min(SM usage, SM partition, SMs)` SMs; one whose partition holds fewer SMs than its
  launch shape would use (`min(SM usage, SMs)`) runs slower in that proportion, alone too. When
  the demands exceed the GPU's SMs, every kernel gets the same share of its demand
  (`SMs / total demand`). Beside that, a kernel is
  slowed by what its co-runners use of the resources it is bound by: its rate is divided by
  `1 + sum over co-runners j of (F(mine, j's) - 1) * (SMs j holds / SMs)`, where F is the
  interference factor of the pair of bound classes (same, other, unknown; each >= 1).

A kernel's work is its duration alone; it progresses at its rate (at most 1), so no kernel
finishes sooner co-running than alone and every kernel does exactly its work. Pure: integer
ns, no clock, no randomness.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

ProfileClass = Literal["compute", "memory", "unknown"]
PROFILE_CLASSES: tuple[str, ...] = ("compute", "memory", "unknown")
# The orion lists' Profile column: 1 compute-bound, 0 memory-bound, -1 neither/unknown.
ORION_PROFILE: Mapping[str, ProfileClass] = {"1": "compute", "0": "memory", "-1": "unknown"}
_EPS = 1e-6  # ns of work left that count as done (float rounding)


class DeviceConfigError(ValueError):
    """A bad `gpu` object; the message names the key (the scenario reader adds the file)."""


@dataclass(frozen=True, slots=True)
class Interference:
    """Slowdown of a kernel beside a co-runner that holds every SM, by bound class.

    Calibrated in docs/harvest.md ("Calibration"); every factor is >= 1 (co-running never
    speeds a kernel up)."""

    same_profile: float = 2.5  # compute beside compute, memory beside memory
    other_profile: float = 1.5  # compute beside memory
    unknown_profile: float = 2.0  # either class unknown

    def factor(self, mine: str, theirs: str) -> float:
        if mine == "unknown" or theirs == "unknown":
            return self.unknown_profile
        return self.same_profile if mine == theirs else self.other_profile


@dataclass(frozen=True, slots=True)
class GpuConfig:
    """The simulated GPU. Defaults: a V100 (80 SMs; the orion lists were measured on one)
    without MPS, its contexts time-sliced, as the default deployment runs its real GPUs (policy
    composed runs no MPS: docs/deploy.md, "MPS"); `mps=True` co-runs kernels under MPS, where
    spatial harvesting applies (docs/harvest.md)."""

    sms: int = 80
    mps: bool = False
    timeslice_ns: int = 1_000_000  # calibrated: docs/harvest.md
    switch_ns: int = 10_000
    interference: Interference = field(default_factory=Interference)


_GPU_KEYS = {"sms", "mps", "timeslice_us", "switch_us", "interference"}
_INTERFERENCE_KEYS = {"same_profile", "other_profile", "unknown_profile"}


def parse_gpu(value: Any, where: str = "$.gpu") -> GpuConfig:
    """Validate a scenario's `gpu` object; DeviceConfigError names the bad key."""
    if not isinstance(value, dict):
        raise DeviceConfigError(f"{where}: must be an object")
    for key in value:
        if key not in _GPU_KEYS:
            raise DeviceConfigError(f"{where}.{key}: unknown field (known: {sorted(_GPU_KEYS)})")
    default = GpuConfig()
    sms = value.get("sms", default.sms)
    if isinstance(sms, bool) or not isinstance(sms, int) or not 1 <= sms <= 1024:
        raise DeviceConfigError(f"{where}.sms: must be an integer in 1..1024, got {sms!r}")
    mps = value.get("mps", default.mps)
    if not isinstance(mps, bool):
        raise DeviceConfigError(f"{where}.mps: must be true or false, got {mps!r}")
    timeslice = _number(value, "timeslice_us", where, default.timeslice_ns / 1e3, 1.0, 1e6)
    switch = _number(value, "switch_us", where, default.switch_ns / 1e3, 0.0, 1e6)
    raw = value.get("interference", {})
    at = f"{where}.interference"
    if not isinstance(raw, dict):
        raise DeviceConfigError(f"{at}: must be an object")
    for key in raw:
        if key not in _INTERFERENCE_KEYS:
            raise DeviceConfigError(
                f"{at}.{key}: unknown field (known: {sorted(_INTERFERENCE_KEYS)})"
            )
    base = default.interference
    factors = {
        key: _number(raw, key, at, getattr(base, key), 1.0, 100.0)
        for key in sorted(_INTERFERENCE_KEYS)
    }
    return GpuConfig(
        sms=sms,
        mps=mps,
        timeslice_ns=round(timeslice * 1e3),
        switch_ns=round(switch * 1e3),
        interference=Interference(**factors),
    )


def _number(obj: dict, key: str, where: str, default: float, low: float, high: float) -> float:
    value = obj.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        hint = " (an interference factor below 1 would speed kernels up)" if low == 1.0 else ""
        raise DeviceConfigError(
            f"{where}.{key}: must be a number in {low:g}..{high:g}, got {value!r}{hint}"
        )
    return float(value)


@dataclass(slots=True)
class _Kernel:
    ctx: int
    tag: Any
    work: float  # ns of work left at rate 1
    demand: int  # SMs it asks for (within its partition)
    want: int  # SMs its launch shape would use on the whole GPU (>= demand)
    cls: str
    start: int | None = None  # when it first ran
    segment: int | None = None  # start of the running stretch (time-sliced)
    ran: int = 0  # ns it held the GPU in the stretches before the current one
    rate: float = 0.0


@dataclass(frozen=True, slots=True)
class Completion:
    ctx: int
    tag: Any
    start: int
    end: int
    # ns the kernel held the GPU: `end - start` less the slices other contexts held while it
    # was preempted (time-sliced); under MPS all of `end - start` (it held SMs throughout).
    ran: int


class Device:
    """One GPU; `concurrent` selects MPS co-running (else time slicing between contexts).

    The caller submits kernels, asks `next_time()` for the next moment something happens on
    the device, and calls `advance(t)` at that moment (or later) to collect completions."""

    def __init__(self, config: GpuConfig, contexts: int, concurrent: bool) -> None:
        self.config = config
        self.concurrent = concurrent
        self.streams: list[deque[_Kernel]] = [deque() for _ in range(contexts)]
        self.now = 0
        self.segments: list[tuple[int, int, int]] = []  # (start, end, ctx): what ran when
        self.active: int | None = None  # time-sliced: the context holding the GPU
        self.loaded: int | None = None  # whose state is on the GPU
        self.slice_start = 0
        self.switch_until: int | None = None
        self.switches = 0
        self.preemptions = 0

    # -- the caller's side -------------------------------------------------------------
    def submit(
        self,
        now: int,
        ctx: int,
        tag: Any,
        duration_ns: int,
        demand: int,
        cls: str,
        want: int | None = None,
    ) -> None:
        """Queue a kernel on its context's stream at `now` (>= every earlier call's time).
        `want`: the SMs its launch shape would use without a partition (default `demand`); a
        kernel held to fewer runs at `demand / want` of its speed under MPS."""
        self._progress(now)
        if not 1 <= demand <= self.config.sms:
            raise ValueError(f"demand {demand} outside 1..{self.config.sms}")
        want = demand if want is None else want
        if not demand <= want <= self.config.sms:
            raise ValueError(f"want {want} outside {demand}..{self.config.sms}")
        self.streams[ctx].append(_Kernel(ctx, tag, float(duration_ns), demand, want, cls))
        self._schedule(now)

    def busy(self, ctx: int) -> bool:
        return bool(self.streams[ctx])

    def running(self) -> list[tuple[int, Any, int, str, int]]:
        """(ctx, tag, demand, class, first start) of the kernels running now."""
        return [(k.ctx, k.tag, k.demand, k.cls, k.start) for k in self._running()]

    def next_time(self) -> int | None:
        times = []
        for k in self._running():
            if k.rate > 0:
                times.append(self.now + max(0, math.ceil(k.work / k.rate - _EPS)))
        if not self.concurrent:
            if self.switch_until is not None:
                times.append(self.switch_until)
            elif self.active is not None and self._others_waiting():
                times.append(max(self.now, self.slice_start + self.config.timeslice_ns))
        return min(times) if times else None

    def advance(self, now: int) -> list[Completion]:
        """Run the device to `now`; the kernels that completed, in completion order."""
        done: list[Completion] = []
        while True:
            t = self.next_time()
            if t is None or t > now:
                break
            self._progress(t)
            done.extend(self._settle(t))
        self._progress(now)
        return done

    # -- inside ------------------------------------------------------------------------
    def _running(self) -> list[_Kernel]:
        if self.concurrent:
            return [s[0] for s in self.streams if s]
        if self.active is None or self.switch_until is not None or not self.streams[self.active]:
            return []
        return [self.streams[self.active][0]]

    def _others_waiting(self) -> bool:
        return any(s for i, s in enumerate(self.streams) if i != self.active)

    def _progress(self, t: int) -> None:
        if t < self.now:
            raise ValueError(f"time went back: {t} < {self.now}")
        dt = t - self.now
        if dt:
            for k in self._running():
                k.work -= k.rate * dt
        self.now = t

    def _settle(self, t: int) -> list[Completion]:
        done = []
        for k in self._running():
            if k.work <= _EPS:
                self.streams[k.ctx].popleft()
                self.segments.append((k.segment, t, k.ctx))
                done.append(Completion(k.ctx, k.tag, k.start, t, k.ran + t - k.segment))
        if not self.concurrent:
            if self.switch_until is not None and t >= self.switch_until:
                self.switch_until = None
                self.slice_start = t
            elif (
                self.active is not None
                and self.switch_until is None
                and self.streams[self.active]
                and self._others_waiting()
                and t >= self.slice_start + self.config.timeslice_ns
            ):
                k = self.streams[self.active][0]
                if k.segment is not None and t > k.segment:
                    self.segments.append((k.segment, t, k.ctx))
                    k.ran += t - k.segment
                k.segment = None
                self.preemptions += 1
                self.active = None  # its slice is over: the next context's turn
                self._pick(t, after=k.ctx)
        self._schedule(t)
        return done

    def _pick(self, t: int, after: int | None) -> None:
        n = len(self.streams)
        first = 0 if after is None else after + 1
        for step in range(n):
            i = (first + step) % n
            if self.streams[i]:  # the others first, `after` itself last
                self.active = i
                break
        else:
            return
        if self.loaded is not None and self.loaded != self.active and self.config.switch_ns:
            self.switch_until = t + self.config.switch_ns
            self.switches += 1
        else:
            self.switch_until = None
            self.slice_start = t
        self.loaded = self.active

    def _schedule(self, t: int) -> None:
        """Decide who runs from `t` and at what rates."""
        if not self.concurrent:
            idle = self.active is not None and not self.streams[self.active]
            if idle and self.switch_until is None:
                self.active = None  # out of work: yields
            if self.active is None:
                self._pick(t, after=self.loaded)
        running = self._running()
        for k in running:
            if k.start is None:
                k.start = t
            if k.segment is None:
                k.segment = t
        if not running:
            return
        if not self.concurrent:
            running[0].rate = 1.0
            return
        sms = self.config.sms
        total = sum(k.demand for k in running)
        share = min(1.0, sms / total)
        held = {id(k): k.demand * share / sms for k in running}
        for k in running:
            slow = 1.0
            for j in running:
                if j is not k:
                    f = self.config.interference.factor(k.cls, j.cls)
                    slow += (f - 1.0) * held[id(j)]
            k.rate = share / slow * k.demand / k.want
