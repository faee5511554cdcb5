"""The default admission policy of a GPU: priority across levels, time quotas within a level.

- **Across priority levels: FIKIT** (`gpuloom.policies.fikit`, the native decision core the
  dispatcher's arbiter runs): the best active level holds the GPU and launches at once; a lower
  level's kernel goes only into a holder's predicted gap (BestPrioFit, early stop) or while
  the holders idle.
- **Within a level: time leases** (`gpuloom.policies.tokens`): each level has its own token
  scheduler (FaST-GShare's multi-token by missing quota, Gemini's adaptive lease lengths), so
  tasks of one level share their time by their quotas and SM partitions, and a task launches
  (or asks the core) only while it holds a lease of its level. Leases are charged the device
  time the task's kernels ran, as a shim measures it.
- **Every job is bounded by its own quota limit**, a filler included: a task whose limit is
  spent gets no lease until the next window, whatever its priority.
- **A quota request is a guarantee** when the GPU's requests together fit in it (sum <= 1;
  oversubscribed requests guarantee nothing across levels, and priority decides). A task below
  the holders' level that has fallen behind its request's pace this window (device time run <
  request * time elapsed in the window - `guarantee_slack`) is promoted: its kernels go at once
  as the holders' do (reported to the core, which counts them in its predicted tail) until it
  is back on pace. So best-effort work is not starved below its request by a busy high
  priority; the high priority then pays for exactly that time.

- **A filler's kernels queue back to back while the holders idle:** the core lets up to
  `idle_backlog_ns` (150 us, or the FIKIT config's idle backlog if larger) of granted fill work
  be outstanding, so a filler's next kernel is granted before its last one ends and no launch
  gap opens between them (FIKIT alone grants one at a time; docs/harvest.md measures both).
- **Beside the holder (spatial harvesting, under MPS):** a request queued behind the holders
  may go at once, beside the holder's running kernel, when the harvest rule
  (`gpuloom.policies.harvest`, default `spatial`: SMs left free, no profile clash, ends before
  the holder's next launch) admits it: `beside`, which the caller asks with what runs on the
  GPU. Only a queued request can go, so one its level's lease (and its quota limit) allows.

With every task at one level this is token sharing (FIKIT admits every holder kernel at once);
with one task per level and limits of 1 it is FIKIT.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpuloom.policies.admission.leases import NS, Leases
from gpuloom.policies.admission.model import Kernel, TaskShare
from gpuloom.policies.fikit.core import UNKNOWN, FikitConfig, FikitCore
from gpuloom.policies.harvest import Candidate, HarvestPolicy, Running, SpatialHarvest
from gpuloom.policies.tokens import TokenConfig

IDLE_BACKLOG_NS = 150_000  # docs/harvest.md, "Why the harvest is low"


def _known(value: int | None) -> int:
    return UNKNOWN if value is None else value


@dataclass(slots=True)
class _Task:
    share: TaskShare
    kernel: Kernel | None = None  # the launch waiting for its lease
    queued: bool = False  # a request waits in the core
    window: int = -1  # the window device_ns counts in
    window_ns: int = 0  # device time completed in that window


class ComposedAdmission:
    name = "composed"
    delayed_grants = True

    def __init__(
        self,
        fikit: FikitConfig | None = None,
        tokens: TokenConfig | None = None,
        token_policy: str = "spatiotemporal",
        guarantee: bool = True,
        guarantee_slack: float = 0.02,
        harvest: HarvestPolicy | None = None,
        idle_backlog_ns: int = IDLE_BACKLOG_NS,
    ) -> None:
        """`guarantee_slack`: how far (a fraction of the window) a task may fall behind its
        request's pace before it is promoted. `idle_backlog_ns`: the least fill work the core
        lets be outstanding while the holders idle (the FIKIT config's if larger)."""
        fikit = fikit or FikitConfig()
        backlog = max(fikit.idle_backlog_ns, idle_backlog_ns)
        self.core = FikitCore(replace(fikit, idle_backlog_ns=backlog))
        self.token_config = tokens or TokenConfig()
        self.token_policy = token_policy
        self.guarantee = guarantee
        if not 0 <= guarantee_slack <= 1:
            raise ValueError(f"guarantee_slack must lie in [0, 1], got {guarantee_slack!r}")
        self._window_ns = round(self.token_config.window_s * NS)
        self._slack_ns = guarantee_slack * self._window_ns
        self._requested = 0.0  # the tasks' quota requests together
        self._levels: dict[int, Leases] = {}
        self._tasks: dict[int, _Task] = {}
        self._ready: list[int] = []
        self._promoted = 0
        self.harvest: HarvestPolicy = harvest if harvest is not None else SpatialHarvest()
        self._harvested = 0

    def add_task(self, task: int, share: TaskShare, now_ns: int) -> None:
        share.validate()
        if task in self._tasks:
            raise ValueError(f"task {task} already exists")
        level = self._levels.get(share.priority)
        if level is None:
            level = Leases(self.token_policy, self.token_config, "device")
            self._levels[share.priority] = level
        if not self.core.add_task(task, share.priority, now_ns):
            raise ValueError(f"the FIKIT core refused task {task}")
        level.add(task, share.sm_percent, share.quota_request, share.quota_limit, now_ns)
        self._tasks[task] = _Task(share)
        self._requested += share.quota_request

    def launch(self, task: int, kernel: Kernel, now_ns: int) -> bool:
        state = self._tasks[task]
        level = self._levels[state.share.priority]
        if not level.want(task, now_ns):
            state.kernel = kernel
            return False
        return self._gate(task, state, kernel, now_ns)

    def completed(self, task: int, device_ns: int, now_ns: int) -> None:
        state = self._tasks[task]
        self._levels[state.share.priority].completed(task, device_ns)
        window = now_ns // self._window_ns
        if window != state.window:
            state.window, state.window_ns = window, 0
        state.window_ns += device_ns
        self.core.completed(task, 1, now_ns)

    def idle(self, task: int, now_ns: int) -> None:
        self._levels[self._tasks[task].share.priority].idle(task, now_ns)

    def decide(self, now_ns: int) -> tuple[Sequence[int], int | None]:
        wake: int | None = None
        for level in self._levels.values():
            level.advance(now_ns)
            for task in level.take_granted():
                state = self._tasks[task]
                kernel, state.kernel = state.kernel, None
                if kernel is not None and self._gate(task, state, kernel, now_ns):
                    self._ready.append(task)
            at = level.wake(now_ns)
            if at is not None and (wake is None or at < wake):
                wake = at
        for task, state in self._tasks.items():
            if not state.queued:
                continue
            # A request queued behind the holders goes once its task falls behind its pace.
            if self.promoted(task, now_ns) and self.core.release(task, now_ns):
                self._promoted += 1
                state.queued = False
                self._ready.append(task)
                continue
            at = self._behind_at(state, now_ns)
            if at is not None and (wake is None or at < wake):
                wake = at
        while True:
            granted, at = self.core.decide(now_ns)
            for task in granted:
                state = self._tasks[task]
                if state.queued:
                    state.queued = False
                    self._ready.append(task)
            if at is None or at > now_ns:
                break
        if at is not None and (wake is None or at < wake):
            wake = at
        ready, self._ready = self._ready, []
        return ready, wake

    def counters(self) -> dict[str, int]:
        counters = self.core.counters()
        result = {name: getattr(counters, name) for name in counters.__slots__}
        result["promoted"] = self._promoted
        result["harvested"] = self._harvested
        return result

    def beside(
        self,
        task: int,
        candidate: Candidate,
        running: Sequence[Running],
        holder_next_launch_ns: int | None,
        sms: int,
        now_ns: int,
    ) -> bool:
        """Whether the task's request queued behind the holders goes now, beside what runs on
        the GPU (spatial harvesting); if so the core counts it as fill work."""
        state = self._tasks.get(task)
        if state is None or not state.queued:
            return False
        if not self.harvest.admit(now_ns, candidate, running, holder_next_launch_ns, sms):
            return False
        if not self.core.release(task, now_ns):
            return False
        state.queued = False
        self._harvested += 1
        return True

    def promoted(self, task: int, now_ns: int) -> bool:
        """Whether the task's next kernel goes as the holders' do, to meet its request."""
        if not self.guarantee or self._requested > 1 + 1e-9:
            return False
        state = self._tasks[task]
        holder = self.core.holder_priority()
        if holder is None or state.share.priority <= holder:
            return False
        window = now_ns // self._window_ns
        used = state.window_ns if state.window == window else 0
        elapsed = now_ns - window * self._window_ns
        return used < state.share.quota_request * elapsed - self._slack_ns

    def _behind_at(self, state: _Task, now_ns: int) -> int | None:
        """When a task that completes nothing more falls behind its pace (None: not this
        window, or no guarantee)."""
        if not self.guarantee or self._requested > 1 + 1e-9:
            return None
        window = now_ns // self._window_ns
        used = state.window_ns if state.window == window else 0
        start = window * self._window_ns
        at = start + math.floor((used + self._slack_ns) / state.share.quota_request) + 1
        end = start + self._window_ns
        # A new window starts everyone at zero: decide again then.
        return max(at, now_ns + 1) if at < end else end

    def _gate(self, task: int, state: _Task, kernel: Kernel, now_ns: int) -> bool:
        duration, gap = _known(kernel.duration_ns), _known(kernel.gap_after_ns)
        if self.promoted(task, now_ns):
            self._promoted += 1
            self.core.launched(task, duration, gap, now_ns)
            return True
        verdict = self.core.request(task, duration, gap, now_ns)
        if verdict == 1:
            return True
        if verdict < 0:
            raise ValueError(f"the FIKIT core refused a request of task {task}")
        state.queued = True
        return False
