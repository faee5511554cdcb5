"""The training-cluster simulator (`gpuloom sim training`): Gavel's Philly-derived job traces
run on a cluster of servers by a training policy (gpuloom.policies.training), discrete-event.

Inputs, checked before anything runs (TrainingInputError names the file and line):

- a trace, one job per line, tab-separated as Gavel writes them: job type, command, the
  command's steps option, needs-data-dir (0/1), steps, arrival (s), scale (GPUs);
- Gavel's `simulation_throughputs.json`: per GPU type, per (job type, scale) the steps/s of the
  job alone (key "null") and, for one-GPU jobs, of the pair when co-located with another
  (`[own, other]`, 0 when the pair does not fit one GPU);
- a cluster spec: `TYPE:COUNT[/PER_SERVER]`, comma-separated (`v100:32`, `v100:16,p100:16`).

The model (docs/training.md): a job progresses at its throughput in steps/s until its steps
are done. Alone: the table's solo throughput (a scale the table lacks: the largest measured
scale below it, scaled linearly). Time-sliced h ways: solo x SLICE_EFFICIENCY / h. Packed: the
table's co-located pair throughput. A migration stalls the job MIGRATION_S. A job runs only
on GPU types where the table gives it a throughput above 0; jobs that fit none (wider than
every such type's total) are not run and are counted as `unschedulable`.
"""

from __future__ import annotations

import ast
import heapq
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar

import numpy as np

from gpuloom.policies.training.gandiva import GROW_IDLE_S  # grow-shrink: the idle period
from gpuloom.policies.training.model import (
    Action,
    ClusterView,
    Group,
    Job,
    Pack,
    Place,
    Resize,
    Server,
    ServiceHistory,
    Slice,
    Slot,
    Suspend,
    TrainingPolicy,
    Unpack,
    packed_gain,
    slice_efficiency,
)

# Mechanism costs (docs/training.md says where they come from).
QUANTUM_S = 60.0  # a time slice: each job of a round-robin runs this long in turn
SWITCH_S = 1.0  # one suspend + resume at a low-memory point of the mini-batch cycle
SLICE_EFFICIENCY = slice_efficiency(QUANTUM_S, SWITCH_S)
MIGRATION_S = 30.0  # checkpoint, stop, restart on new GPUs: progress lost per migration
PACK_TRIAL_S = 600.0  # packed this long before the packed mini-batch times are compared
SERVER_GPUS = 4  # GPUs per server unless the cluster spec says /N
ELASTIC_FACTOR = 2  # grow-shrink: a job may grow to this many times its GPUs (measured scales)
THROUGHPUTS_NAME = "simulation_throughputs.json"
TRACE_FIELDS = 7
N = TypeVar("N", int, float)


class TrainingInputError(ValueError):
    """A trace, throughput table or cluster spec that cannot be simulated."""


class PolicyError(RuntimeError):
    """A policy answered an action the cluster cannot take (a bug in the policy)."""


@dataclass(frozen=True, slots=True)
class TraceJob:
    line: int
    job_type: str
    gpus: int
    steps: int
    arrival_s: float


class Throughputs:
    """Gavel's throughput table, by GPU type (the `_unconsolidated` variants are not used)."""

    def __init__(self, text: str, source: str) -> None:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise TrainingInputError(f"{source}, line {error.lineno}: {error.msg}") from None
        if not isinstance(raw, dict):
            raise TrainingInputError(f"{source}, line 1: not an object of GPU types")
        self.solo: dict[tuple[str, str, int], float] = {}
        self.pair: dict[tuple[str, str, str], tuple[float, float]] = {}
        for gpu, entries in raw.items():
            if "_" in gpu:
                continue
            if not isinstance(entries, dict):
                raise TrainingInputError(f"{source}, line 1: {gpu}: not an object of jobs")
            for key, row in entries.items():
                job_type, scale = _job_key(key, source, gpu)
                solo = row.get("null") if isinstance(row, dict) else None
                if not isinstance(solo, int | float) or solo < 0:
                    raise TrainingInputError(
                        f"{source}, line 1: {gpu} {key}: no solo throughput (key null)"
                    )
                self.solo[(gpu, job_type, scale)] = float(solo)
                for other, both in row.items():
                    if other == "null":
                        continue
                    other_type, other_scale = _job_key(other, source, gpu)
                    if scale == other_scale == 1 and _pair(both) and min(both) > 0:
                        self.pair[(gpu, job_type, other_type)] = (float(both[0]), float(both[1]))
        self._utilisation: dict[tuple[str, str], float] = {}
        self.gpu_types = tuple(sorted({g for g, _, _ in self.solo}))
        self.job_types = frozenset(t for _, t, _ in self.solo)

    def solo_rate(self, gpu: str, job_type: str, scale: int) -> float | None:
        """Steps/s of the job alone on `scale` GPUs of type `gpu`; None if unmeasured."""
        exact = self.solo.get((gpu, job_type, scale))
        if exact is not None:
            return exact
        below = [s for (g, t, s) in self.solo if g == gpu and t == job_type and s < scale]
        if not below:
            return None
        measured = max(below)
        return self.solo[(gpu, job_type, measured)] * scale / measured

    def utilisation(self, gpu: str, job_type: str) -> float:
        """Stand-in for the GPU utilisation the profiler would measure: the mean share of its
        throughput a partner loses when co-located with this job (1 when none can be)."""
        known = self._utilisation.get((gpu, job_type))
        if known is not None:
            return known
        losses = [
            1 - both[1] / self.solo[(gpu, other, 1)]
            for (g, t, other), both in self.pair.items()
            if g == gpu and t == job_type and self.solo.get((gpu, other, 1))
        ]
        value = min(1.0, max(0.0, sum(losses) / len(losses))) if losses else 1.0
        self._utilisation[(gpu, job_type)] = value
        return value


def find_throughputs(trace: Path) -> Path:
    """Gavel's table beside a trace: in its folder or the folder above (Gavel's layout)."""
    for folder in (trace.parent, trace.parent.parent):
        if (folder / THROUGHPUTS_NAME).is_file():
            return folder / THROUGHPUTS_NAME
    raise TrainingInputError(
        f"{trace}, line 0: no {THROUGHPUTS_NAME} in its folder or the one above"
        " (pass --throughputs)"
    )


def _job_key(key: str, source: str, gpu: str) -> tuple[str, int]:
    try:
        value = ast.literal_eval(key)
    except (ValueError, SyntaxError):
        value = None
    if not (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], int)
    ):
        raise TrainingInputError(f"{source}, line 1: {gpu}: bad job key {key!r}")
    return value[0], value[1]


def _pair(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int | float) for v in value)
    )


def parse_cluster(spec: str, known: Sequence[str]) -> tuple[Server, ...]:
    """Servers of a `TYPE:COUNT[/PER_SERVER],...` spec, in order; the last server of a type
    holds the remainder when COUNT is not a multiple of PER_SERVER."""
    servers: list[Server] = []
    for part in spec.split(","):
        gpu, colon, rest = part.strip().partition(":")
        count_text, _, per_text = rest.partition("/")
        gpu = gpu.strip().lower()
        if not colon or not gpu:
            raise TrainingInputError(f"--cluster {spec!r}: {part.strip()!r} is not TYPE:COUNT")
        if gpu not in known:
            raise TrainingInputError(
                f"--cluster {spec!r}: unknown GPU type {gpu!r} (known: {', '.join(known)})"
            )
        try:
            count = int(count_text)
            per = int(per_text) if per_text else SERVER_GPUS
        except ValueError:
            raise TrainingInputError(
                f"--cluster {spec!r}: {part.strip()!r}: COUNT and PER_SERVER are integers"
            ) from None
        if count < 1 or per < 1:
            raise TrainingInputError(f"--cluster {spec!r}: {part.strip()!r}: below 1")
        full, rest_gpus = divmod(count, per)
        servers.extend(Server(gpu, per) for _ in range(full))
        if rest_gpus:
            servers.append(Server(gpu, rest_gpus))
    return tuple(servers)


def parse_trace(
    text: str, source: str, table: Throughputs, gpu_types: Sequence[str]
) -> list[TraceJob]:
    """The jobs of a Gavel trace in file order; every job's type needs a one-GPU throughput on
    every GPU type of the cluster (wider scales are derived from it when unmeasured)."""
    jobs = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        fields = raw.split("\t")
        where = f"{source}, line {number}"
        if len(fields) != TRACE_FIELDS:
            raise TrainingInputError(
                f"{where}: {len(fields)} tab-separated fields, expected {TRACE_FIELDS}"
                " (type, command, steps option, needs data dir, steps, arrival s, scale)"
            )
        job_type = fields[0].strip()
        if job_type not in table.job_types:
            raise TrainingInputError(f"{where}: unknown job type {job_type!r}")
        steps = _number(fields[4], int, where, "steps")
        arrival = _number(fields[5], float, where, "arrival")
        scale = _number(fields[6], int, where, "scale")
        if steps < 1 or scale < 1 or not math.isfinite(arrival) or arrival < 0:
            raise TrainingInputError(
                f"{where}: steps and scale must be at least 1, arrival a time >= 0"
            )
        for gpu in gpu_types:
            if (gpu, job_type, 1) not in table.solo:
                raise TrainingInputError(
                    f"{where}: missing throughput entry for {job_type!r} on one {gpu}"
                )
        jobs.append(TraceJob(number, job_type, scale, steps, arrival))
    if not jobs:
        raise TrainingInputError(f"{source}, line 1: the trace has no jobs")
    return jobs


def _number(text: str, kind: Callable[[str], N], where: str, name: str) -> N:
    try:
        return kind(text.strip())
    except ValueError:
        raise TrainingInputError(f"{where}: {name} is not a number: {text.strip()!r}") from None


@dataclass(slots=True)
class _Running:
    spec: TraceJob
    remaining: float
    rate: float = 0.0
    solo: float = 0.0  # steps/s alone on the GPUs it runs on now (0: on none)
    served: float = 0.0  # the seconds alone its progress so far is worth (attained service)
    stalled_until: float = 0.0
    suspended: bool = False  # back in the queue after it ran: it resumes through a migration
    first_s: float | None = None
    end_s: float | None = None
    group: int | None = None


@dataclass(slots=True)
class _Group:
    slots: tuple[Slot, ...]
    jobs: list[int]
    packed: bool = False
    packed_since: float = 0.0
    gain: float | None = None


@dataclass(frozen=True, slots=True)
class TrainingRun:
    policy: str
    trace: str
    jobs: int
    unschedulable: int
    avg_jct_h: float
    p95_jct_h: float
    avg_first_feedback_h: float
    makespan_h: float
    gpu_util: float
    packings: int
    undone: int
    migrations: int
    wall_s: float
    resizes: int = 0  # grow-shrink: jobs grown or shrunk (each a restart from its checkpoint)
    suspensions: int = 0  # jobs suspended back to the queue (demoted or preempted)
    jct_h: tuple[float, ...] = field(default=(), repr=False)
    in_use: tuple[tuple[float, int], ...] = field(default=(), repr=False)  # (hours, in use)

    def summary(self) -> dict[str, object]:
        """The fields of `--json`."""
        return {
            "policy": self.policy,
            "trace": self.trace,
            "jobs": self.jobs,
            "unschedulable": self.unschedulable,
            "avg_jct_h": self.avg_jct_h,
            "p95_jct_h": self.p95_jct_h,
            "avg_first_feedback_h": self.avg_first_feedback_h,
            "makespan_h": self.makespan_h,
            "gpu_util": self.gpu_util,
            "packings": self.packings,
            "undone": self.undone,
            "migrations": self.migrations,
            "resizes": self.resizes,
            "suspensions": self.suspensions,
            "wall_s": self.wall_s,
        }


class _Cluster:
    """The simulated cluster: jobs, groups, and the rules every action must follow."""

    def __init__(
        self, servers: tuple[Server, ...], table: Throughputs, jobs: Sequence[TraceJob]
    ) -> None:
        self.servers = servers
        self.table = table
        self.runs = [_Running(j, float(j.steps)) for j in jobs]
        self.views: dict[int, Job] = {}
        self.groups: dict[int, _Group] = {}
        self.used: set[Slot] = set()
        self.waiting: dict[int, None] = {}  # insertion-ordered set
        self.next_gid = 0
        self.trials: list[tuple[float, int, float]] = []
        self.counts: Counter[str] = Counter()
        self.packable = frozenset(table.pair)
        self.idle_since: dict[Slot, float] = {}  # free GPUs: since when (grow-shrink)
        self.ended = ServiceHistory()

    def arrive(self, i: int, now: float) -> None:
        spec = self.runs[i].spec
        kinds = runs_on(spec, self.servers, self.table)
        util = min(self.table.utilisation(g, spec.job_type) for g in kinds)
        every = kinds == {s.gpu_type for s in self.servers}
        speed = {g: self.table.solo_rate(g, spec.job_type, spec.gpus) or 0.0 for g in kinds}
        self.views[i] = Job(
            i,
            spec.job_type,
            spec.gpus,
            spec.arrival_s,
            util,
            None if every else kinds,
            elastic_range(spec, kinds, self.table),
            tuple(sorted(kinds, key=lambda g: (-speed[g], g))),
        )
        self.waiting[i] = None

    def view(self, now: float) -> ClusterView:
        return ClusterView(
            now_s=now,
            servers=self.servers,
            jobs=MappingProxyType(self.views),
            groups=tuple(
                Group(gid, g.slots, tuple(g.jobs), g.packed, g.gain)
                for gid, g in self.groups.items()
            ),
            waiting=tuple(self.waiting),
            slice_efficiency=SLICE_EFFICIENCY,
            packable=self.packable,
            idle_since=MappingProxyType(self.idle_since),
            grow_idle_s=GROW_IDLE_S,
            attained_s=_Attained(self.runs, self.views),
            ended=self.ended,
        )

    def _take(self, slots: Sequence[Slot]) -> None:
        self.used |= set(slots)
        for slot in slots:
            self.idle_since.pop(slot, None)

    def _free(self, slots: Sequence[Slot], now: float) -> None:
        self.used -= set(slots)
        for slot in slots:
            self.idle_since[slot] = now

    def _leave(self, i: int, now: float) -> None:
        run = self.runs[i]
        gid = run.group
        if gid is None:
            return
        group = self.groups[gid]
        group.jobs.remove(i)
        run.group = None
        if len(group.jobs) < 2:
            group.packed, group.gain = False, None
        if not group.jobs:
            self._free(group.slots, now)
            del self.groups[gid]

    def _move(self, i: int, now: float) -> None:
        """Take job i off its GPUs or out of the queue. A job that has run migrates: it stalls
        MIGRATION_S; one still waiting for its first turn has no state to move."""
        run = self.runs[i]
        if run.group is None:
            self.waiting.pop(i)
            if run.suspended:
                run.suspended = False
                run.stalled_until = now + MIGRATION_S
                self.counts["migrations"] += 1
            return
        self._leave(i, now)
        if run.first_s is not None and run.first_s < now:
            run.stalled_until = now + MIGRATION_S
            self.counts["migrations"] += 1

    def _sizes(self, i: int) -> tuple[int, ...]:
        """The GPU counts job i may run on: what it asked for, and its elastic range."""
        return (self.runs[i].spec.gpus, *self.views[i].grow_to)

    def _resize(self, action: Resize, now: float) -> None:
        group = self._group(action.group, action)
        slots = action.slots
        if len(group.jobs) != 1:
            raise PolicyError(f"{action}: only a job running alone is resized")
        i = group.jobs[0]
        run = self.runs[i]
        types = {self.servers[s].gpu_type for s, _ in slots if 0 <= s < len(self.servers)}
        gained = set(slots) - set(group.slots)
        if (
            not all(0 <= s < len(self.servers) and 0 <= g < self.servers[s].gpus for s, g in slots)
            or len(set(slots)) != len(slots)
            or len(slots) not in self._sizes(i)
            or types != {self.servers[group.slots[0][0]].gpu_type}
            or self.used & gained
        ):
            raise PolicyError(f"{action}: not free GPUs of its type in its elastic range")
        self._free([s for s in group.slots if s not in slots], now)
        self._take(sorted(gained))
        group.slots = tuple(slots)
        if run.first_s is not None and run.first_s < now:
            run.stalled_until = now + MIGRATION_S  # through its checkpoint, as a migration
        self.counts["resizes"] += 1

    def grow_at(self, now: float) -> float:
        """When a free GPU will have been idle long enough for a job alone below its elastic
        range to grow onto it (inf: no such job, or a job waits)."""
        if self.waiting or not any(
            len(g.jobs) == 1 and len(g.slots) < max(self._sizes(g.jobs[0])) and not g.packed
            for g in self.groups.values()
        ):
            return math.inf
        later = [t + GROW_IDLE_S for t in self.idle_since.values() if t + GROW_IDLE_S > now]
        return min(later, default=math.inf)

    def apply(self, action: Action, now: float) -> None:
        if isinstance(action, Resize):
            self._resize(action, now)
            return
        if isinstance(action, Unpack):
            group = self._group(action.group, action)
            if not group.packed:
                raise PolicyError(f"{action}: the group is not packed")
            group.packed, group.gain = False, None
            self.counts["undone"] += 1
            return
        i = action.job
        if i not in self.views:
            raise PolicyError(f"{action}: no such job running or waiting")
        run = self.runs[i]
        if isinstance(action, Place):
            slots = action.slots
            types = {self.servers[s].gpu_type for s, _ in slots if 0 <= s < len(self.servers)}
            valid = all(
                0 <= s < len(self.servers) and 0 <= g < self.servers[s].gpus for s, g in slots
            )
            if (
                not valid
                or len(set(slots)) != len(slots)
                or len(slots) not in self._sizes(i)
                or len(types) != 1
                or not self.views[i].allows(next(iter(types)))
            ):
                raise PolicyError(f"{action}: not {run.spec.gpus} GPUs of one type it runs on")
            self._move(i, now)
            if self.used & set(slots):
                raise PolicyError(f"{action}: GPUs in use")
            self.groups[self.next_gid] = _Group(tuple(slots), [i])
            run.group = self.next_gid
            self.next_gid += 1
            self._take(slots)
            if run.first_s is None or run.first_s > now:
                run.first_s = now  # alone (a job moved before its first turn: now too)
        elif isinstance(action, Slice):
            group = self._group(action.group, action)
            if (
                group.packed
                or len(group.slots) != run.spec.gpus
                or i in group.jobs
                or not self.views[i].allows(self.servers[group.slots[0][0]].gpu_type)
            ):
                raise PolicyError(f"{action}: cannot time-slice there")
            self._move(i, now)
            group.jobs.append(i)
            run.group = action.group
            if run.first_s is None:
                run.first_s = now + QUANTUM_S  # its turn comes when the current slice ends
        elif isinstance(action, Suspend):
            group = self._group(run.group, action) if run.group is not None else None
            if group is None or group.packed:
                raise PolicyError(f"{action}: not on GPUs, or packed")
            self._leave(i, now)
            run.suspended = True
            self.waiting = dict.fromkeys(sorted([*self.waiting, i]))  # ids: arrival order
            self.counts["suspensions"] += 1
        elif isinstance(action, Pack):
            group = self._group(action.group, action)
            in_place = run.group == action.group and len(group.jobs) == 2
            if (
                group.packed
                or len(group.slots) != 1
                or run.spec.gpus != 1
                or not (in_place or len(group.jobs) == 1)
            ):
                raise PolicyError(f"{action}: cannot pack there")
            other = next(j for j in group.jobs if j != i) if in_place else group.jobs[0]
            gpu = self.servers[group.slots[0][0]].gpu_type
            if (gpu, run.spec.job_type, self.runs[other].spec.job_type) not in self.packable:
                raise PolicyError(f"{action}: the pair does not fit one {gpu}")
            if not in_place:
                self._move(i, now)
                group.jobs.append(i)
                run.group = action.group
            if run.first_s is None or run.first_s > now:
                run.first_s = now  # packed, it runs at once (no turn to wait for)
            group.packed, group.packed_since, group.gain = True, now, None
            heapq.heappush(self.trials, (now + PACK_TRIAL_S, action.group, now))
            self.counts["packings"] += 1
        else:
            raise PolicyError(f"unknown action {action!r}")

    def _group(self, gid: int, action: Action) -> _Group:
        group = self.groups.get(gid)
        if group is None:
            raise PolicyError(f"{action}: no group {gid}")
        return group

    def end_trial(self, gid: int, since: float) -> bool:
        group = self.groups.get(gid)
        if group is None or not group.packed or group.packed_since != since:
            return False
        gpu = self.servers[group.slots[0][0]].gpu_type
        a, b = (self.runs[j].spec.job_type for j in group.jobs)
        both = self.table.pair[(gpu, a, b)]
        solo = (self.table.solo[(gpu, a, 1)], self.table.solo[(gpu, b, 1)])
        group.gain = packed_gain([1 / r for r in solo], [1 / r for r in both])
        return True

    def rerate(self) -> None:
        for group in self.groups.values():
            gpu = self.servers[group.slots[0][0]].gpu_type
            jobs = [self.runs[j] for j in group.jobs]
            if group.packed:
                a, b = jobs
                both = self.table.pair[(gpu, a.spec.job_type, b.spec.job_type)]
                a.rate, b.rate = both
                a.solo = self.table.solo[(gpu, a.spec.job_type, 1)]
                b.solo = self.table.solo[(gpu, b.spec.job_type, 1)]
                continue
            share = 1.0 if len(jobs) == 1 else SLICE_EFFICIENCY / len(jobs)
            for run in jobs:
                # Alone, on as many GPUs as its group has (more when grown).
                gpus = len(group.slots) if len(jobs) == 1 else run.spec.gpus
                solo = self.table.solo_rate(gpu, run.spec.job_type, gpus)
                run.solo = solo or 0.0
                run.rate = run.solo * share

    def finish_time(self, run: _Running, now: float) -> float:
        if run.rate <= 0:
            return math.inf
        return max(now, run.stalled_until) + run.remaining / run.rate

    def finish(self, i: int, now: float) -> None:
        self._leave(i, now)
        run = self.runs[i]
        run.end_s, run.remaining, run.rate = now, 0.0, 0.0
        del self.views[i]
        self.ended.add(run.spec.gpus, run.served)


class _Attained(Mapping[int, float]):
    """`ClusterView.attained_s` over the jobs present, read when the policy asks."""

    def __init__(self, runs: Sequence[_Running], present: Mapping[int, Job]) -> None:
        self._runs = runs
        self._present = present

    def __getitem__(self, job: int) -> float:
        if job not in self._present:
            raise KeyError(job)
        return self._runs[job].served

    def __iter__(self) -> Iterator[int]:
        return iter(self._present)

    def __len__(self) -> int:
        return len(self._present)


def elastic_range(job: TraceJob, kinds: frozenset[str], table: Throughputs) -> tuple[int, ...]:
    """Grow-shrink: the GPU counts above its own a job may grow to, up to ELASTIC_FACTOR
    times its own: those the table measures above 0 on every GPU type it runs on (no
    extrapolation: a job grows only where its speed-up is known)."""
    counts = {
        n
        for n in range(job.gpus + 1, ELASTIC_FACTOR * job.gpus + 1)
        if all(table.solo.get((kind, job.job_type, n), 0.0) > 0 for kind in kinds)
    }
    return tuple(sorted(counts))


def runs_on(job: TraceJob, servers: Sequence[Server], table: Throughputs) -> frozenset[str]:
    """The cluster's GPU types where the table gives the job a throughput above 0."""
    return frozenset(
        t for t in {s.gpu_type for s in servers} if table.solo_rate(t, job.job_type, job.gpus)
    )


def schedulable(job: TraceJob, servers: Sequence[Server], table: Throughputs) -> bool:
    """Some GPU type the job runs on has its GPUs in all (a job never spans GPU types)."""
    kinds = runs_on(job, servers, table)
    totals = Counter[str]()
    for server in servers:
        if server.gpu_type in kinds:
            totals[server.gpu_type] += server.gpus
    return max(totals.values(), default=0) >= job.gpus


def simulate(
    jobs: Sequence[TraceJob],
    servers: tuple[Server, ...],
    table: Throughputs,
    policy: TrainingPolicy,
    trace: str = "",
    seed: int = 0,
) -> TrainingRun:
    """Run `policy` over the jobs until all end. Jobs queue in arrival order; those arriving
    at the same time in an order the seed draws."""
    rng = random.Random(seed)
    draw = [rng.random() for _ in jobs]
    runnable = [
        job
        for _, job in sorted(((j.arrival_s, draw[n]), j) for n, j in enumerate(jobs))
        if schedulable(job, servers, table)
    ]
    cluster = _Cluster(servers, table, runnable)
    total_gpus = sum(s.gpus for s in servers)
    start = time.perf_counter()
    now = runnable[0].arrival_s if runnable else 0.0
    cluster.idle_since = {(n, g): now for n, s in enumerate(servers) for g in range(s.gpus)}
    grows = bool(getattr(policy, "grow_shrink", False))
    t_grow = math.inf
    t_review = math.inf
    first_arrival = now
    next_arrival = 0
    running: set[int] = set()
    in_use: list[tuple[float, int]] = []
    busy_gpu_s = 0.0
    while True:
        finish_at = {i: cluster.finish_time(cluster.runs[i], now) for i in running}
        t_finish = min(finish_at.values(), default=math.inf)
        t_arrive = runnable[next_arrival].arrival_s if next_arrival < len(runnable) else math.inf
        t_trial = cluster.trials[0][0] if cluster.trials else math.inf
        t = min(t_finish, t_arrive, t_trial, t_grow, t_review)
        if t == math.inf:
            stuck = len(cluster.views)
            if stuck:
                raise PolicyError(f"{policy.name} left {stuck} job(s) unfinished with no event")
            break
        dt = t - now
        busy_gpu_s += len(cluster.used) * dt
        for i in running:
            run = cluster.runs[i]
            steps = run.rate * max(0.0, t - max(now, run.stalled_until))
            run.remaining -= steps
            if run.solo > 0:
                run.served += steps / run.solo
        now = t
        for i, at in finish_at.items():
            if at <= now + 1e-6:
                cluster.finish(i, now)
                running.discard(i)
        while next_arrival < len(runnable) and runnable[next_arrival].arrival_s <= now:
            cluster.arrive(next_arrival, now)
            next_arrival += 1
        while cluster.trials and cluster.trials[0][0] <= now:
            _, gid, since = heapq.heappop(cluster.trials)
            cluster.end_trial(gid, since)
        for action in policy.decide(cluster.view(now)):
            cluster.apply(action, now)
        running = {j for g in cluster.groups.values() for j in g.jobs}
        cluster.rerate()
        t_grow = cluster.grow_at(now) if grows else math.inf
        t_review = policy.review_at(cluster.view(now))
        in_use.append((now, len(cluster.used)))
    wall = time.perf_counter() - start
    ends = [r.end_s for r in cluster.runs if r.end_s is not None]
    jct = np.array([r.end_s - r.spec.arrival_s for r in cluster.runs], dtype=float) / 3600
    feedback = np.array([r.first_s - r.spec.arrival_s for r in cluster.runs], dtype=float)
    makespan = (max(ends) - first_arrival) if ends else 0.0
    return TrainingRun(
        policy=policy.name,
        trace=trace,
        jobs=len(runnable),
        unschedulable=len(jobs) - len(runnable),
        avg_jct_h=round(float(jct.mean()), 3) if len(jct) else 0.0,
        p95_jct_h=round(float(np.percentile(jct, 95)), 3) if len(jct) else 0.0,
        avg_first_feedback_h=round(float(feedback.mean()) / 3600, 3) if len(jct) else 0.0,
        makespan_h=round(makespan / 3600, 3),
        gpu_util=round(busy_gpu_s / (total_gpus * makespan), 4) if makespan > 0 else 0.0,
        packings=cluster.counts["packings"],
        undone=cluster.counts["undone"],
        migrations=cluster.counts["migrations"],
        wall_s=round(wall, 3),
        resizes=cluster.counts["resizes"],
        suspensions=cluster.counts["suspensions"],
        jct_h=tuple(float(x) for x in jct),
        in_use=tuple((round((t - first_arrival) / 3600, 4), n) for t, n in in_use),
    )
