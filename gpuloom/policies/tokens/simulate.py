"""A small discrete-event driver of the token scheduler, in virtual time.

It is the scheduler's second driver beside the live dispatcher and uses only the public
calls. Each client has a workload: "saturating" always has work, holds every lease to its end,
then reports usage (the lease plus a configurable overrun: a kernel that ran past the lease)
and a burst length, and asks again at once; "idle" never asks; "on/off" is saturating inside
given intervals and has no work outside them (it releases a lease it holds when its work stops
and hands back at once one granted while it has none). An open-ended lease (exclusive) is
held until `max_hold_s` of work is done, or for good without it.

GPU time is what the clients report, laid out from each lease's start: the lease (or the part
held) plus the overrun, split over the scheduler's windows.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from gpuloom.policies.tokens.model import ClientShare, Decision, Lease, TokenConfig, TokenPolicy
from gpuloom.policies.tokens.scheduler import TokenScheduler

WorkloadKind = Literal["saturating", "idle", "onoff"]


@dataclass(frozen=True, slots=True)
class Workload:
    kind: WorkloadKind = "saturating"
    burst_s: float | None = None  # reported with each usage report; None reports no burst
    overrun_s: float = 0.0  # GPU time past the end of each lease held to its end
    on: tuple[tuple[float, float], ...] = ()  # "onoff": [start, end) seconds from the start
    max_hold_s: float | None = None  # work done per open-ended lease before releasing it

    @staticmethod
    def saturating(
        burst_s: float | None = None, overrun_s: float = 0.0, max_hold_s: float | None = None
    ) -> Workload:
        return Workload("saturating", burst_s, overrun_s, (), max_hold_s)

    @staticmethod
    def idle() -> Workload:
        return Workload("idle")

    @staticmethod
    def on_off(
        intervals: Iterable[tuple[float, float]],
        burst_s: float | None = None,
        overrun_s: float = 0.0,
        max_hold_s: float | None = None,
    ) -> Workload:
        return Workload("onoff", burst_s, overrun_s, tuple(intervals), max_hold_s)

    def intervals(self) -> tuple[tuple[float, float], ...]:
        if self.kind == "saturating":
            return ((0.0, math.inf),)
        if self.kind == "idle":
            return ()
        return self.on


@dataclass(frozen=True, slots=True)
class SimClient:
    share: ClientShare
    workload: Workload = field(default_factory=Workload)


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    window_s: float
    duration_s: float
    per_window: Mapping[str, tuple[float, ...]] = field(hash=False)  # GPU seconds per window
    total: Mapping[str, float] = field(hash=False)  # GPU seconds within the run
    leases: Mapping[str, int] = field(hash=False)  # leases granted

    def share(self, client_id: str) -> float:
        """The client's GPU time as a fraction of the run's length."""
        return self.total[client_id] / self.duration_s


@dataclass(slots=True)
class _Client:
    workload: Workload
    on: bool = False
    lease: Lease | None = None
    reported: set[int] = field(default_factory=set)  # leases whose usage it already sent


def simulate(
    clients: Sequence[SimClient],
    duration_s: float,
    policy: TokenPolicy | str = "spatiotemporal",
    config: TokenConfig | None = None,
    start_s: float = 0.0,
) -> SimResult:
    """Run `clients` for `duration_s` virtual seconds from `start_s` (the first window's start)."""
    config = config or TokenConfig()
    if not duration_s > 0 or not math.isfinite(duration_s):
        raise ValueError(f"duration_s must be a positive finite number, got {duration_s!r}")
    end = start_s + duration_s
    scheduler = TokenScheduler(policy, config, start_s)
    state: dict[str, _Client] = {}
    events: list[tuple[float, int, str, str, int]] = []  # (time, seq, what, client, lease)
    for sim in clients:
        client_id = sim.share.client_id
        scheduler.add_client(sim.share, start_s)
        state[client_id] = _Client(sim.workload)
        for begin, stop in sim.workload.intervals():
            heapq.heappush(events, (start_s + begin, len(events), "on", client_id, 0))
            if math.isfinite(stop):
                heapq.heappush(events, (start_s + stop, len(events), "off", client_id, 0))
    seq = len(events)

    windows = max(1, math.ceil(duration_s / config.window_s - 1e-9))
    gpu = {client_id: [0.0] * windows for client_id in state}
    leases = dict.fromkeys(state, 0)

    def record(client_id: str, begin: float, seconds: float) -> None:
        # Split [begin, begin + seconds) over the windows, ignoring time past the run.
        stop = min(begin + seconds, end)
        row = gpu[client_id]
        while begin < stop:
            index = min(int((begin - start_s) // config.window_s), windows - 1)
            edge = min(stop, start_s + (index + 1) * config.window_s)
            if index == windows - 1:
                edge = stop
            row[index] += edge - begin
            begin = edge

    def release(client_id: str, client: _Client, now: float) -> Decision:
        lease = client.lease
        assert lease is not None
        used = now - lease.granted_at
        record(client_id, lease.granted_at, used)
        client.reported.add(lease.lease_id)
        return scheduler.release(client_id, lease.lease_id, used, client.workload.burst_s, now)

    def handle(decision: Decision, now: float) -> None:
        nonlocal seq
        pending = deque([decision])  # in the order the calls were made
        while pending:
            d = pending.popleft()
            asks: list[str] = []
            for lease in d.ended:
                client = state[lease.client_id]
                if client.lease is not None and client.lease.lease_id == lease.lease_id:
                    client.lease = None
                if lease.lease_id in client.reported:
                    client.reported.discard(lease.lease_id)
                    continue
                # Expired: the client worked to its end, and a kernel may have overrun it.
                used = lease.expires_at - lease.granted_at + client.workload.overrun_s
                record(lease.client_id, lease.granted_at, used)
                scheduler.report_usage(
                    lease.client_id, lease.lease_id, used, client.workload.burst_s, now
                )
                if client.on:
                    asks.append(lease.client_id)
            for lease in d.granted:
                client = state[lease.client_id]
                client.lease = lease
                leases[lease.client_id] += 1
                if not client.on:
                    pending.append(release(lease.client_id, client, now))
                elif lease.expires_at == math.inf and client.workload.max_hold_s is not None:
                    at = now + client.workload.max_hold_s
                    heapq.heappush(events, (at, seq, "hold", lease.client_id, lease.lease_id))
                    seq += 1
            pending.extend(scheduler.request(client_id, now) for client_id in asks)

    now = start_s
    stuck = 0
    while True:
        deadline = scheduler.next_deadline()
        upcoming = min(
            deadline if deadline is not None else math.inf, events[0][0] if events else math.inf
        )
        if upcoming >= end:
            break
        stuck = stuck + 1 if upcoming <= now else 0
        if stuck > 10_000:
            raise RuntimeError(f"the simulation makes no progress at t={now}")
        now = max(now, upcoming)
        handle(scheduler.advance(now), now)
        while events and events[0][0] <= now:
            _, _, what, client_id, lease_id = heapq.heappop(events)
            client = state[client_id]
            if what == "on":
                client.on = True
                if client.lease is None:
                    handle(scheduler.request(client_id, now), now)
            elif what == "off":
                client.on = False
                if client.lease is not None:
                    handle(release(client_id, client, now), now)
            elif client.lease is not None and client.lease.lease_id == lease_id:  # "hold"
                decision = release(client_id, client, now)
                handle(decision, now)
                if client.on:
                    handle(scheduler.request(client_id, now), now)

    # Leases still held at the end count up to the end.
    for client_id, client in state.items():
        if client.lease is not None:
            lease = client.lease
            record(client_id, lease.granted_at, min(lease.expires_at, end) - lease.granted_at)

    return SimResult(
        policy=scheduler.policy_name,
        window_s=config.window_s,
        duration_s=duration_s,
        per_window=MappingProxyType({k: tuple(v) for k, v in gpu.items()}),
        total=MappingProxyType({k: sum(v) for k, v in gpu.items()}),
        leases=MappingProxyType(leases),
    )
