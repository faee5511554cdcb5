"""Time leases per priority level, for the live dispatcher under the `composed` policy: one
token scheduler per level behind the calls the dispatcher makes of one (`TokenScheduler`'s),
so the clients of one level share their time by their quotas and SM partitions while the
levels never wait for each other's leases (the FIKIT arbiter decides between levels).

Every level's windows start at the same origin, so a window means the same time everywhere.
Lease ids are per level (a client's lease is always its own level's).

**A level of one leases until further notice.** The only client of its level, with a quota
limit of the whole window (100%), has nothing to share and no limit to keep: its lease is
open-ended, so its launches pay no lease renewals (the shims of this policy ask for leases over
the socket). When a second client joins the level, that lease is ended at once (withdrawn: the
shim asks again at its next launch) and the level's policy leases by quota from then on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from gpuloom.policies.tokens import (
    ClientShare,
    Decision,
    Lease,
    SchedulerSnapshot,
    StandingTerms,
    TokenConfig,
    TokenScheduler,
    get_policy,
)
from gpuloom.policies.tokens.model import NOTHING, ClientView, SchedulerView, TokenPolicy


@dataclass(frozen=True, slots=True)
class _LevelPolicy:
    """The level's token policy, but an open-ended lease for the level's only client when its
    limit is 100%."""

    inner: TokenPolicy
    alone: Callable[[], bool]  # the level has one client

    @property
    def name(self) -> str:
        return self.inner.name

    def order(self, view: SchedulerView) -> list[ClientView]:
        return self.inner.order(view)

    def select(self, view: SchedulerView) -> Sequence[tuple[str, float]]:
        picks = self.inner.select(view)
        if view.holders == 0 and len(picks) == 1 and len(view.waiting) == 1 and self.alone():
            client = next(iter(view.waiting))
            if client.limit_s >= view.config.window_s:
                return ((picks[0][0], math.inf),)
        return picks


def _merge(decisions: list[Decision]) -> Decision:
    decisions = [d for d in decisions if d]
    if not decisions:
        return NOTHING
    if len(decisions) == 1:
        return decisions[0]
    granted = tuple(lease for d in decisions for lease in d.granted)
    ended = tuple(lease for d in decisions for lease in d.ended)
    return Decision(granted, ended)


class LevelScheduler:
    """TokenScheduler's calls, routed to the scheduler of each client's priority level."""

    def __init__(self, policy: str, config: TokenConfig, now: float) -> None:
        config.validate()
        self._policy = policy
        self._config = config
        self._origin = now
        self._now = now
        self._levels: dict[int, TokenScheduler] = {}
        self._level_of: dict[str, TokenScheduler] = {}
        self._priority_of: dict[str, int] = {}
        self._clients: dict[int, set[str]] = {}  # by level
        get_policy(policy)  # an unknown policy fails here, by name

    @property
    def policy_name(self) -> str:
        return self._policy

    @property
    def config(self) -> TokenConfig:
        return self._config

    def add_client(self, share: ClientShare, now: float, priority: int = 0) -> Decision:
        """Add a client at its level; the decision ends an open-ended lease of the level's
        former only client."""
        if share.client_id in self._level_of:
            raise ValueError(f"client {share.client_id!r} already exists")
        level = self._levels.get(priority)
        if level is None:
            clients = self._clients.setdefault(priority, set())
            policy = _LevelPolicy(get_policy(self._policy), lambda: len(clients) == 1)
            level = TokenScheduler(policy, self._config, self._origin)
        level.add_client(share, now)
        self._levels[priority] = level
        self._level_of[share.client_id] = level
        self._priority_of[share.client_id] = priority
        decisions = []
        for other in self._clients[priority]:
            lease = level.lease_of(other)
            if lease is not None and lease.expires_at == math.inf:
                # The level has two clients now: its open-ended lease ends, quotas apply.
                decisions.append(level.withdraw(other, now))
        self._clients[priority].add(share.client_id)
        return _merge(decisions)

    def priority_of(self, client_id: str) -> int:
        return self._priority_of[client_id]

    def _level(self, client_id: str) -> TokenScheduler:
        try:
            return self._level_of[client_id]
        except KeyError:
            raise KeyError(f"unknown client {client_id!r}") from None

    def remove_client(self, client_id: str, now: float) -> Decision:
        decision = self._level(client_id).remove_client(client_id, now)
        del self._level_of[client_id]
        self._clients[self._priority_of.pop(client_id)].discard(client_id)
        return decision

    def withdraw(self, client_id: str, now: float) -> Decision:
        return self._level(client_id).withdraw(client_id, now)

    def request(self, client_id: str, now: float) -> Decision:
        return self._level(client_id).request(client_id, now)

    def release(
        self, client_id: str, lease_id: int, used_gpu_s: float, burst_s: float | None, now: float
    ) -> Decision:
        return self._level(client_id).release(client_id, lease_id, used_gpu_s, burst_s, now)

    def report_usage(
        self, client_id: str, lease_id: int, used_gpu_s: float, burst_s: float | None, now: float
    ) -> None:
        self._level(client_id).report_usage(client_id, lease_id, used_gpu_s, burst_s, now)

    def renewed(
        self,
        client_id: str,
        lease_id: int,
        expires_at: float,
        now: float,
        report: tuple[int, float, float | None] | None = None,
    ) -> Decision:
        return self._level(client_id).renewed(client_id, lease_id, expires_at, now, report)

    def advance(self, now: float) -> Decision:
        self._now = max(self._now, now)
        return _merge([level.advance(now) for level in self._levels.values()])

    @property
    def has_waiting(self) -> bool:
        return any(level.has_waiting for level in self._levels.values())

    def lease_of(self, client_id: str) -> Lease | None:
        return self._level(client_id).lease_of(client_id)

    def standing_terms(
        self, now: float, candidates: Collection[str] | None = None
    ) -> dict[str, StandingTerms]:
        terms: dict[str, StandingTerms] = {}
        for level in self._levels.values():
            terms.update(level.standing_terms(now, candidates))
        return terms

    def next_deadline(self) -> float | None:
        deadlines = (level.next_deadline() for level in self._levels.values())
        return min((d for d in deadlines if d is not None), default=None)

    def snapshot(self, now: float) -> SchedulerSnapshot:
        """One snapshot of every level: the clients of all, the waiting best level first."""
        self._now = max(self._now, now)
        snapshots = [self._levels[p].snapshot(now) for p in sorted(self._levels)]
        if not snapshots:
            window = self._config.window_s
            index = math.floor((self._now - self._origin) / window)
            start = self._origin + index * window
            return SchedulerSnapshot(
                self._policy, self._now, start, start + window, 0, MappingProxyType({}), ()
            )
        first = snapshots[0]
        clients = {k: v for s in snapshots for k, v in s.clients.items()}
        return SchedulerSnapshot(
            policy=self._policy,
            now=max(s.now for s in snapshots),
            window_start=first.window_start,
            window_end=first.window_end,
            running_sm_percent=sum(s.running_sm_percent for s in snapshots),
            clients=MappingProxyType(clients),
            waiting=tuple(c for s in snapshots for c in s.waiting),
        )
