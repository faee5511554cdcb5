"""The cluster model of the training schedulers: servers of one GPU type, jobs that ask for a
number of GPUs (a gang), and groups, the jobs that share one set of GPUs:

- one job alone (exclusive);
- several jobs time-sliced round-robin by suspend/resume (Gandiva's "height" above one), each
  getting 1/height of the GPUs' time less the switching overhead (`slice_efficiency`);
- two one-GPU jobs packed, running at once on one GPU. `packed_gain` is what the trial
  measured: the sum over both jobs of packed / solo throughput (2 would be perfect sharing,
  `slice_efficiency` is what time-slicing them gives), None until the trial window has passed.

A policy reads a `ClusterView` and answers actions; the caller (the simulator, later the live
dispatcher) applies them in order, so later actions see the effect of earlier ones. Plain data,
no I/O, no clock but `now_s`.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

Slot = tuple[int, int]  # (server index, GPU index on that server)


@dataclass(frozen=True, slots=True)
class Server:
    gpu_type: str
    gpus: int


@dataclass(frozen=True, slots=True)
class Job:
    id: int
    job_type: str
    gpus: int
    arrival_s: float
    utilisation: float  # estimated GPU utilisation alone, 0..1 (profiling's answer)
    runs_on: frozenset[str] | None = None  # the GPU types it can run on; None: any
    # Grow-shrink: the larger GPU counts it may also run on (its elastic range, only counts
    # it is known to run well at); empty: it runs on `gpus` only.
    grow_to: tuple[int, ...] = ()
    # Its GPU types, fastest first, where its speed on them is known (the simulator: the
    # throughput table); empty: no preference.
    fastest_on: tuple[str, ...] = ()

    def allows(self, gpu_type: str) -> bool:
        return self.runs_on is None or gpu_type in self.runs_on

    def speed_rank(self, gpu_type: str) -> int:
        """0 for its fastest GPU type, then 1, ...; the same for every type when unknown."""
        order = self.fastest_on
        return order.index(gpu_type) if gpu_type in order else len(order)


@dataclass(frozen=True, slots=True)
class Group:
    id: int
    slots: tuple[Slot, ...]
    jobs: tuple[int, ...]  # in round-robin order
    packed: bool = False
    packed_gain: float | None = None

    @property
    def height(self) -> int:
        return len(self.jobs)

    @property
    def server(self) -> int:
        return self.slots[0][0]


# The ended jobs per GPU count a ServiceHistory keeps: more than any trace of the folder has
# (2,000 jobs at most), so the simulator's estimates use them all.
SERVICE_HISTORY_WINDOW = 4096


class ServiceHistory:
    """The service (seconds alone, as `ClusterView.attained_s` counts it) the jobs that ended
    had in all, per GPU count: the empirical distribution of job lengths from which a policy
    estimates how soon a running job is likely to end, knowing only how long it has run.
    Only the `window` latest of each GPU count are kept: a long-lived placement service stays
    bounded in memory, and the estimate follows the workload as it changes."""

    def __init__(self, window: int = SERVICE_HISTORY_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"a service history keeps at least 1 job per GPU count, not {window}")
        self.window = window
        self._totals: dict[int, list[float]] = {}  # sorted
        self._order: dict[int, deque[float]] = {}  # the same, oldest first
        self._prefix: dict[int, list[float]] = {}  # running sums of _totals, rebuilt lazily

    def add(self, gpus: int, service_s: float) -> None:
        """A job of `gpus` GPUs ended after `service_s` of service (the oldest of its count
        is forgotten once `window` are kept)."""
        if gpus < 1 or not math.isfinite(service_s) or service_s < 0:
            raise ValueError(
                f"an ended job needs gpus >= 1 and a service >= 0, not {gpus}, {service_s}"
            )
        totals = self._totals.setdefault(gpus, [])
        order = self._order.setdefault(gpus, deque())
        if len(order) == self.window:
            del totals[bisect.bisect_left(totals, order.popleft())]
        bisect.insort(totals, service_s)
        order.append(service_s)
        self._prefix.pop(gpus, None)

    def ended(self, gpus: int) -> int:
        """How many jobs of `gpus` GPUs have ended."""
        return len(self._totals.get(gpus, ()))

    def gittins_index(self, gpus: int, attained_s: float) -> float:
        """The Gittins index of a job of `gpus` GPUs that has had `attained_s` of service:
        the best, over every further amount of service D, of the chance to end within D over
        the service expected to be spent trying (E[min(remaining, D)]), among the ended jobs
        that ran longer than it has. Higher: more likely to end soon for what it is given.
        0 when no ended job ran longer (nothing says it will end soon); raises when none of
        its GPU count ended."""
        totals = self._totals.get(gpus)
        if not totals:
            raise ValueError(f"no job of {gpus} GPU(s) has ended")
        prefix = self._prefix.get(gpus)
        if prefix is None:
            prefix = self._prefix[gpus] = [0.0, *itertools.accumulate(totals)]
        first = bisect.bisect_right(totals, attained_s)
        longer = len(totals) - first
        best = 0.0
        # The maximum is at a D that ends one of the longer jobs: between two such ends the
        # chance stays and the expected spend grows.
        for k in range(1, longer + 1):
            end = totals[first + k - 1]
            spent = (prefix[first + k] - prefix[first]) - k * attained_s
            spent += (longer - k) * (end - attained_s)
            if spent > 0:
                best = max(best, k / spent)
        return best


@dataclass(frozen=True, slots=True)
class ClusterView:
    now_s: float
    servers: tuple[Server, ...]
    jobs: Mapping[int, Job]  # every job that has arrived and not finished
    groups: tuple[Group, ...]
    waiting: tuple[int, ...]  # jobs on no GPU, in arrival order
    slice_efficiency: float  # share of GPU time time-slicing leaves to the jobs (0..1]
    packable: frozenset[tuple[str, str, str]]  # (GPU type, job type, job type) fitting one GPU
    # Grow-shrink: since when each free GPU has been free, and how long before it may be
    # given to a job that grows (inf: never).
    idle_since: Mapping[Slot, float] = field(default_factory=dict)
    grow_idle_s: float = math.inf
    # Per job, the service it has had so far: the seconds alone on its GPUs its progress is
    # worth (mini-batches done x mini-batch time alone; the past, not its length; live, the
    # seconds it was seen running). A job not in it counts as 0.
    attained_s: Mapping[int, float] = field(default_factory=dict)
    # The service the jobs that ended had, per GPU count (live: those the driver saw end).
    ended: ServiceHistory = field(default_factory=ServiceHistory)
    # Pack only two jobs already time-sliced on one GPU (the live driver moves no job onto a
    # busy GPU): a job alone on its GPU is no packing target.
    pack_in_place: bool = False
    # A job running alone may be preempted, suspended back to the queue off its GPUs
    # (`Suspend`, reason "preempt"); live, it stays suspended where it is while the head runs
    # in its time-slice group (gpuloom/policies/training/live.py).
    preempt: bool = True

    def can_pack(self, gpu_type: str, a: str, b: str) -> bool:
        return (gpu_type, a, b) in self.packable


@dataclass(frozen=True, slots=True)
class Place:
    """Run `job` alone on `slots` (free GPUs); a job that was running elsewhere migrates."""

    job: int
    slots: tuple[Slot, ...]
    reason: str = "place"


@dataclass(frozen=True, slots=True)
class Slice:
    """Add `job` to the round-robin of `group` (not a packed one)."""

    job: int
    group: int
    reason: str = "slice"


@dataclass(frozen=True, slots=True)
class Suspend:
    """Take `job` back to the queue, suspended at a low-memory point with its state kept: out
    of its round-robin ("demote"), or off the GPUs it runs on alone, which free ("preempt");
    it resumes where a later `Place` or `Slice` puts it (through its checkpoint, as a
    migration, since that may be on other GPUs)."""

    job: int
    reason: str = "demote"


@dataclass(frozen=True, slots=True)
class Pack:
    """Run `job` (one GPU) at once with the single one-GPU job of `group`; when `job` already
    time-slices with it in that group, the group turns packed in place."""

    job: int
    group: int


@dataclass(frozen=True, slots=True)
class Unpack:
    """Undo a packing: `group` goes back to time-slicing its two jobs."""

    group: int


@dataclass(frozen=True, slots=True)
class Resize:
    """Grow-shrink: the job running alone in `group` runs on `slots` from now on (more GPUs
    than it asked for, idle ones, or back to what it asked for when others need them); it
    restarts through its checkpoint, as a migration."""

    group: int
    slots: tuple[Slot, ...]
    reason: str = "grow"


Action = Place | Slice | Suspend | Pack | Unpack | Resize


def slice_efficiency(quantum_s: float, switch_s: float) -> float:
    """The share of GPU time a round-robin of `quantum_s` turns leaves to its jobs when each
    switch (a suspend and a resume) costs `switch_s`."""
    return quantum_s / (quantum_s + switch_s)


def packed_gain(solo_s: Sequence[float], packed_s: Sequence[float]) -> float:
    """A packing trial's result: the sum over the packed jobs of their mini-batch time alone
    over their mini-batch time packed (the same as packed / solo throughput). 2 is perfect
    sharing; a gain below time-slicing's `slice_efficiency` means the packing loses. The
    simulator feeds it the table's throughputs (as times, 1 / rate), the live driver the
    mini-batch times the dispatchers measure."""
    if len(solo_s) != len(packed_s) or not solo_s:
        raise ValueError("one solo and one packed time per job")
    if min(*solo_s, *packed_s) <= 0:
        raise ValueError("mini-batch times must be > 0")
    return sum(s / p for s, p in zip(solo_s, packed_s, strict=True))


def round_robin_turn(jobs: Sequence[int], priorities: Mapping[int, int], turn: int) -> int:
    """Which job of a time-sliced group runs in round `turn`: the round-robin goes over the
    jobs of the highest priority present (the lowest level) only, in group order, so a job is
    never suspended to run one of lower priority."""
    top = min(priorities[j] for j in jobs)
    eligible = [j for j in jobs if priorities[j] == top]
    return eligible[turn % len(eligible)]


class TrainingPolicy(Protocol):
    """Decides what to run where; called on every arrival, departure and end of a packing
    trial. A policy object serves one run (it may remember what it learned, such as pairs that
    packed badly)."""

    @property
    def name(self) -> str: ...

    def decide(self, view: ClusterView) -> list[Action]: ...

    def review_at(self, view: ClusterView) -> float:
        """When to be called again with no arrival, departure or trial end in between: the
        first time a rule of time (a wait, a job's service) may change the decision; inf when
        none can. A driver that ticks calls `decide` on its own period anyway; the simulator,
        which jumps from event to event, calls it again then."""
        ...


class FreeMap:
    """Free GPUs per server, updated as a policy plans its actions (scratch state)."""

    def __init__(self, servers: Sequence[Server], groups: Sequence[Group]) -> None:
        self.servers = tuple(servers)
        used: set[Slot] = {s for g in groups for s in g.slots}
        self.free: list[list[int]] = [
            [i for i in range(server.gpus) if (n, i) not in used]
            for n, server in enumerate(self.servers)
        ]

    def count(self, server: int) -> int:
        return len(self.free[server])

    def take(self, server: int, k: int) -> tuple[Slot, ...]:
        gpus, self.free[server] = self.free[server][:k], self.free[server][k:]
        return tuple((server, i) for i in gpus)

    def take_exact(self, slots: Sequence[Slot]) -> None:
        """Mark these free slots used."""
        for server, i in slots:
            self.free[server].remove(i)

    def give(self, slots: Sequence[Slot]) -> None:
        for server, i in slots:
            self.free[server].append(i)
            self.free[server].sort()

    def fitting(self, k: int, job: Job) -> list[int]:
        """Servers of a GPU type the job runs on with at least k free GPUs."""
        return [
            n
            for n, server in enumerate(self.servers)
            if len(self.free[n]) >= k and job.allows(server.gpu_type)
        ]

    def wider_than_servers(self, k: int, job: Job) -> bool:
        """Whether k GPUs exceed every server of a GPU type the job runs on."""
        return all(k > s.gpus for s in self.servers if job.allows(s.gpu_type))

    def whole(self, k: int, job: Job) -> tuple[Slot, ...] | None:
        """Slots for a job wider than a server: fully free servers of one GPU type it runs
        on, in server order, enough of them for k GPUs; None when there are too few. Taken
        when found."""
        by_type: dict[str, list[int]] = {}
        for n, server in enumerate(self.servers):
            if self.count(n) == server.gpus and job.allows(server.gpu_type):
                by_type.setdefault(server.gpu_type, []).append(n)
        for servers in by_type.values():
            chosen, total = [], 0
            for n in servers:
                if total >= k:
                    break
                chosen.append(n)
                total += self.servers[n].gpus
            if total >= k:
                slots: list[Slot] = []
                for n in chosen:
                    slots.extend(self.take(n, min(self.servers[n].gpus, k - len(slots))))
                return tuple(slots)
        return None
