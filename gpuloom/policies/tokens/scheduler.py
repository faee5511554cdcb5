"""The token scheduler of one GPU: the state machine every token policy shares.

A dispatcher owns one GPU; its clients ask it for time leases (tokens) before launching
kernels. This module keeps the windows, the charging, the lease lengths and the lease
bookkeeping; a `TokenPolicy` only says who gets a lease now and for how long. It is pure: no
I/O, no threads, no clock. Every call takes `now` (seconds, monotonic); a `now` earlier than
the latest one seen is taken as the latest one, so a clock that steps back corrupts nothing.
The live dispatcher and the simulator drive the same instance type through the same calls.

Windows tumble every `window_s` seconds from the `now` given at construction. At a window
boundary each client's used time drops by its limit (quota_limit * W) per window passed, not
below 0: kernels that ran past a limit are charged to their owner in the next window.

Charging follows Gemini: clients measure their own GPU time. A lease of length q is charged
in full when granted, so a client cannot collect leases before reporting; the usage it
reports for that lease (release or report_usage) replaces that provisional charge, once. An
open-ended lease is charged nothing at grant and its elapsed time when it ends unreported.
Usage reported for a lease this scheduler does not know (never granted to that client, or
forgotten because it ended more than a window before the current one began) is measured GPU
time all the same and is charged in full.

Lease lengths follow each client's kernel bursts: q <- clamp(q + s * (burst - q), q_min,
q_max), from lease_initial_s; a lease is never longer than what is left of the client's limit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuloom.policies.tokens.model import (
    NOTHING,
    ClientShare,
    ClientState,
    ClientView,
    Decision,
    Lease,
    TokenConfig,
    TokenPolicy,
)
from gpuloom.policies.tokens.registry import get_policy

__all__ = [
    "ClientShare",
    "ClientSnapshot",
    "Decision",
    "Lease",
    "SchedulerSnapshot",
    "StandingTerms",
    "TokenConfig",
    "TokenScheduler",
]


@dataclass(frozen=True, slots=True)
class ClientSnapshot:
    share: ClientShare
    state: ClientState
    used_s: float  # charged this window, carried overrun included
    q_s: float  # length of its next lease before the limit caps it
    lease: Lease | None
    leases_granted: int
    total_gpu_s: float  # charged since it was added


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    policy: str
    now: float
    window_start: float
    window_end: float
    running_sm_percent: int
    clients: Mapping[str, ClientSnapshot] = field(hash=False)
    waiting: tuple[str, ...]  # the clients the policy would serve next, in its order


@dataclass(frozen=True, slots=True)
class StandingTerms:
    """What a client would be granted if it asked now, decided ahead of its request: a lease
    of min(lease_s, what is left of budget_s). The budget is what is left of its limit in the
    window ending at window_end; at each window's end it grows as used_s falls (by limit_s per
    window, to at most limit_s). The live dispatcher's lease desk renews leases natively from
    these (docs/dispatcher.md)."""

    lease_s: float  # math.inf: open-ended
    budget_s: float  # lease time it may still be granted this window (math.inf: no bound)
    limit_s: float  # its quota limit per window
    window_end: float


@dataclass(slots=True, eq=False)
class _Client:
    # Read by policies through ClientView; written only by the scheduler.
    client_id: str
    share: ClientShare
    sm_percent: int
    request_s: float
    limit_s: float
    used_s: float
    q_s: float
    requested_at: float = 0.0
    charge: _Charge | None = None  # of the lease it holds
    leases_granted: int = 0
    total_gpu_s: float = 0.0


@dataclass(slots=True, eq=False)
class _Charge:
    """What a lease has cost its client so far, until its usage is reported."""

    lease: Lease
    client: _Client
    provisional: float
    ended_at: float = math.inf
    reported: bool = False


class _View:
    """The SchedulerView a policy reads: live, read-only, no copies."""

    __slots__ = ("_s",)

    def __init__(self, scheduler: TokenScheduler) -> None:
        self._s = scheduler

    @property
    def config(self) -> TokenConfig:
        return self._s._config

    @property
    def now(self) -> float:
        return self._s._now

    @property
    def running_sm(self) -> int:
        return self._s._running_sm

    @property
    def holders(self) -> int:
        return len(self._s._holders)

    @property
    def waiting(self) -> Collection[ClientView]:
        return self._s._waiting.values()


class _AloneView:
    """A SchedulerView in which one client asks alone, with the given SMs and holders running:
    what the policy would grant it now."""

    __slots__ = ("config", "holders", "now", "running_sm", "waiting")

    def __init__(
        self, scheduler: TokenScheduler, client: _Client, running_sm: int, holders: int
    ) -> None:
        self.config = scheduler._config
        self.now = scheduler._now
        self.running_sm = running_sm
        self.holders = holders
        self.waiting = (client,)


def _check_report(used_gpu_s: float, burst_s: float | None) -> None:
    _check_measure("used_gpu_s", used_gpu_s)
    if burst_s is not None:
        _check_measure("burst_s", burst_s)


def _check_measure(name: str, value: float) -> None:
    if not value >= 0.0 or value == math.inf:  # also rejects NaN
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


class TokenScheduler:
    """The scheduling core of one GPU's dispatcher; see the module docstring."""

    def __init__(self, policy: TokenPolicy | str, config: TokenConfig, now: float) -> None:
        if isinstance(policy, str):
            policy = get_policy(policy)
        config.validate()
        if not math.isfinite(now):
            raise ValueError(f"now must be a finite number, got {now!r}")
        self._policy = policy
        self._config = config
        self._window_s = float(config.window_s)
        self._origin = float(now)
        self._window_index = 0
        self._window_start = self._origin
        self._window_end = self._origin + self._window_s
        self._now = float(now)
        self._clients: dict[str, _Client] = {}
        self._waiting: dict[str, _Client] = {}  # in request order
        self._holders: dict[str, _Charge] = {}
        self._running_sm = 0
        self._next_expiry = math.inf
        self._next_lease_id = 1
        self._charges: dict[int, _Charge] = {}
        self._charge_order: deque[_Charge] = deque()  # grant order, for forgetting old ones
        # Something changed that may let a waiting client in; cleared by each decision.
        self._dirty = False
        self._view = _View(self)

    @property
    def policy_name(self) -> str:
        return self._policy.name

    @property
    def config(self) -> TokenConfig:
        return self._config

    # -- the calls a driver makes ------------------------------------------------------------

    def add_client(self, share: ClientShare, now: float) -> None:
        if not isinstance(share, ClientShare):
            raise ValueError(f"share must be a ClientShare, got {type(share).__name__}")
        share.validate()
        if share.sm_percent > self._config.sm_global_limit:
            # It could never run, and at the head of the queue it would block everyone.
            raise ValueError(
                f"sm_percent ({share.sm_percent}) exceeds sm_global_limit "
                f"({self._config.sm_global_limit})"
            )
        if share.client_id in self._clients:
            raise ValueError(f"client {share.client_id!r} already exists")
        self._tick(now)
        window = self._window_s
        self._clients[share.client_id] = _Client(
            client_id=share.client_id,
            share=share,
            sm_percent=share.sm_percent,
            request_s=share.quota_request * window,
            limit_s=share.quota_limit * window,
            used_s=0.0,
            q_s=float(self._config.lease_initial_s),
        )

    def remove_client(self, client_id: str, now: float) -> Decision:
        client, ended = self._begin(client_id, now)
        del self._clients[client_id]
        self._let_go(client, ended)
        return self._decide(ended)

    def withdraw(self, client_id: str, now: float) -> Decision:
        """The client is gone for now (its process died or disconnected) but keeps its share:
        its lease ends, charged the time it was held unless usage was reported, and it leaves
        the queue. Unlike remove_client, its used quota stays, so a reconnect resets nothing."""
        client, ended = self._begin(client_id, now)
        self._let_go(client, ended)
        return self._decide(ended)

    def request(self, client_id: str, now: float) -> Decision:
        client, ended = self._begin(client_id, now)
        if client.charge is None and client_id not in self._waiting:
            client.requested_at = self._now
            self._waiting[client_id] = client
            self._dirty = True
        return self._decide(ended)

    def release(
        self,
        client_id: str,
        lease_id: int,
        used_gpu_s: float,
        burst_s: float | None,
        now: float,
    ) -> Decision:
        _check_report(used_gpu_s, burst_s)
        client, ended = self._begin(client_id, now)
        charge = client.charge
        if charge is not None and charge.lease.lease_id == lease_id:
            ended.append(self._end(charge, self._now))
        self._report(client, lease_id, used_gpu_s, burst_s)
        return self._decide(ended)

    def report_usage(
        self,
        client_id: str,
        lease_id: int,
        used_gpu_s: float,
        burst_s: float | None,
        now: float,
    ) -> None:
        _check_report(used_gpu_s, burst_s)
        client = self._client(client_id)
        self._tick(now)
        # No decision here (there is no one to hand leases to): if the report frees quota for
        # a waiting client, next_deadline() says to advance() at once.
        self._report(client, lease_id, used_gpu_s, burst_s)

    def advance(self, now: float) -> Decision:
        self._tick(now)
        ended: list[Lease] = []
        if self._now >= self._next_expiry:
            self._expire(ended)
        return self._decide(ended)

    @property
    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def lease_of(self, client_id: str) -> Lease | None:
        """The lease the client holds (one due but not yet ended by advance() included)."""
        charge = self._client(client_id).charge
        return None if charge is None else charge.lease

    def standing_terms(
        self, now: float, candidates: Collection[str] | None = None
    ) -> dict[str, StandingTerms]:
        """For each client, the lease the policy would grant it if it alone asked now, with the
        leases held and the terms already given counted as running: so that any of them may
        take its lease without asking, together, within every limit. Nothing while somebody
        waits: then every lease goes through request() and the policy's order. A holder's
        terms renew its own lease (its SMs stay counted once). A window's end only makes a
        policy more willing (quota comes back), so terms stay good across windows. Only
        `candidates` (default: every client) get terms; the others' leases count all the same."""
        self._tick(now)
        if self._waiting:
            return {}
        terms: dict[str, StandingTerms] = {}
        running, holders = self._running_sm, len(self._holders)
        for client_id, charge in self._holders.items():
            if candidates is not None and client_id not in candidates:
                continue
            client = charge.client
            view = _AloneView(self, client, running - client.sm_percent, holders - 1)
            granted = self._alone_terms(client, view)
            if granted is not None:
                terms[client_id] = granted
        for client_id, client in self._clients.items():
            if client.charge is not None or (
                candidates is not None and client_id not in candidates
            ):
                continue
            granted = self._alone_terms(client, _AloneView(self, client, running, holders))
            if granted is not None:
                terms[client_id] = granted
                running += client.sm_percent
                holders += 1
        return terms

    def _alone_terms(self, client: _Client, view: _AloneView) -> StandingTerms | None:
        picks = self._policy.select(view)  # type: ignore[arg-type]
        # A lease shorter than lease_min_s is never renewed natively: no terms for it.
        if len(picks) != 1 or picks[0][0] != client.client_id:
            return None
        if not picks[0][1] >= self._config.lease_min_s:
            return None
        length = picks[0][1]
        budget = math.inf if length == math.inf else max(client.limit_s - client.used_s, 0.0)
        return StandingTerms(length, budget, client.limit_s, self._window_end)

    def renewed(
        self,
        client_id: str,
        lease_id: int,
        expires_at: float,
        now: float,
        report: tuple[int, float, float | None] | None = None,
    ) -> Decision:
        """A lease granted outside this scheduler from the client's standing terms (the live
        dispatcher's lease desk), taken into the books as if granted here at `now`: the report
        (lease id, used GPU s, burst s) of the lease it replaces first, as release() takes it;
        a lease the client still held ends. `lease_id` must be one this scheduler never
        issued (the desk's ids have bit 62 set)."""
        if lease_id in self._charges or lease_id < self._next_lease_id:
            raise ValueError(f"lease id {lease_id} collides with this scheduler's own")
        if report is not None:
            _check_report(report[1], report[2])
        client, ended = self._begin(client_id, now)
        if report is not None:
            charge = client.charge
            if charge is not None and charge.lease.lease_id == report[0]:
                ended.append(self._end(charge, self._now))
            self._report(client, *report)
        if client.charge is not None:
            ended.append(self._end(client.charge, self._now))
        if self._waiting.pop(client_id, None) is not None:
            self._dirty = True
        length = math.inf if expires_at == math.inf else max(expires_at - self._now, 0.0)
        lease = self._install(client, lease_id, expires_at, length)
        decided = self._decide(ended)
        return Decision((lease, *decided.granted), decided.ended)

    def next_deadline(self) -> float | None:
        now = self._now
        if self._waiting:
            if self._dirty:
                return now
            # The window end changes every client's standing, so a waiting client may go then.
            deadline = min(self._next_expiry, self._window_end)
        else:
            deadline = self._next_expiry
            if deadline == math.inf:
                return None
        return deadline if deadline > now else now

    def snapshot(self, now: float) -> SchedulerSnapshot:
        """A frozen view at `now`. Leases due at `now` still show until advance() ends them."""
        self._tick(now)
        order = self._policy.order(self._view)
        ready = {c.client_id for c in order}
        clients: dict[str, ClientSnapshot] = {}
        for c in self._clients.values():
            state: ClientState
            if c.charge is not None:
                state = "holding"
            elif c.client_id in self._waiting:
                state = "waiting" if c.client_id in ready else "blocked"
            else:
                state = "idle"
            clients[c.client_id] = ClientSnapshot(
                share=c.share,
                state=state,
                used_s=c.used_s,
                q_s=c.q_s,
                lease=None if c.charge is None else c.charge.lease,
                leases_granted=c.leases_granted,
                total_gpu_s=c.total_gpu_s,
            )
        return SchedulerSnapshot(
            policy=self._policy.name,
            now=self._now,
            window_start=self._window_start,
            window_end=self._window_end,
            running_sm_percent=self._running_sm,
            clients=MappingProxyType(clients),
            waiting=tuple(c.client_id for c in order),
        )

    # -- the state machine ---------------------------------------------------------------------

    def _begin(self, client_id: str, now: float) -> tuple[_Client, list[Lease]]:
        """Every client call starts here: the client, the clock moved on, due leases ended."""
        client = self._client(client_id)
        self._tick(now)
        ended: list[Lease] = []
        if self._now >= self._next_expiry:
            self._expire(ended)
        return client, ended

    def _client(self, client_id: str) -> _Client:
        try:
            return self._clients[client_id]
        except KeyError:
            raise KeyError(f"unknown client {client_id!r}") from None

    def _tick(self, now: float) -> None:
        if now > self._now:
            if now == math.inf:
                raise ValueError("now must be a finite number, got inf")
            self._now = now
            if now >= self._window_end:
                self._roll(now)
        elif now != now:
            raise ValueError("now must be a finite number, got nan")

    def _roll(self, now: float) -> None:
        window = self._window_s
        # Window bounds are origin + k * W, never a running sum, so they do not drift.
        index = math.floor((now - self._origin) / window)
        if self._origin + index * window > now:
            index -= 1
        while self._origin + (index + 1) * window <= now:
            index += 1
        passed = index - self._window_index
        self._window_index = index
        self._window_start = self._origin + index * window
        self._window_end = self._origin + (index + 1) * window
        for c in self._clients.values():
            if c.used_s > 0.0:
                used = c.used_s - passed * c.limit_s
                c.used_s = used if used > 0.0 else 0.0
        # Forget leases that ended before the previous window began; reports are due within
        # milliseconds, and one that late would adjust a window long closed.
        horizon = self._window_start - window
        order = self._charge_order
        while order and order[0].ended_at < horizon:
            del self._charges[order.popleft().lease.lease_id]
        self._dirty = True

    def _expire(self, ended: list[Lease]) -> None:
        now = self._now
        due = [h for h in self._holders.values() if h.lease.expires_at <= now]
        if len(due) > 1:
            due.sort(key=lambda h: (h.lease.expires_at, h.lease.lease_id))
        for charge in due:
            ended.append(self._end(charge, charge.lease.expires_at, recompute=False))
        self._next_expiry = self._earliest_expiry()

    def _earliest_expiry(self) -> float:
        return min((h.lease.expires_at for h in self._holders.values()), default=math.inf)

    def _let_go(self, client: _Client, ended: list[Lease]) -> None:
        """End the lease of a client that is gone and take it out of the queue."""
        charge = client.charge
        if charge is not None:
            ended.append(self._end(charge, self._now))
            if not charge.reported:
                # It ran for the time it held the lease, no longer.
                elapsed = self._now - charge.lease.granted_at
                self._bill(client, elapsed - charge.provisional)
                charge.provisional = elapsed
        if self._waiting.pop(client.client_id, None) is not None:
            self._dirty = True  # it may have been the head that did not fit

    def _end(self, charge: _Charge, at: float, recompute: bool = True) -> Lease:
        client = charge.client
        lease = charge.lease
        client.charge = None
        charge.ended_at = at
        del self._holders[client.client_id]
        self._running_sm -= client.sm_percent
        if recompute and lease.expires_at <= self._next_expiry:
            self._next_expiry = self._earliest_expiry()
        self._dirty = True
        return lease

    def _bill(self, client: _Client, delta: float) -> None:
        used = client.used_s + delta
        client.used_s = used if used > 0.0 else 0.0
        total = client.total_gpu_s + delta
        client.total_gpu_s = total if total > 0.0 else 0.0

    def _report(self, client: _Client, lease_id: int, used: float, burst: float | None) -> None:
        if burst is not None:
            config = self._config
            q = client.q_s + config.smoothing * (burst - client.q_s)
            client.q_s = min(max(q, config.lease_min_s), config.lease_max_s)
        charge = self._charges.get(lease_id)
        if charge is None or charge.client is not client:
            self._bill(client, used)
        elif not charge.reported:
            charge.reported = True
            self._bill(client, used - charge.provisional)
            charge.provisional = used
        else:
            return
        self._dirty = True  # less used may unblock it, more may reorder the queue

    def _decide(self, ended: list[Lease]) -> Decision:
        granted: tuple[Lease, ...] = ()
        if self._dirty:
            self._dirty = False
            if self._waiting:
                picks = self._policy.select(self._view)
                if picks:
                    granted = self._grant(picks)
        if not ended and not granted:
            return NOTHING
        return Decision(granted, tuple(ended))

    def _grant(self, picks: Sequence[tuple[str, float]]) -> tuple[Lease, ...]:
        now = self._now
        leases: list[Lease] = []
        for client_id, length in picks:
            client = self._waiting.pop(client_id, None)
            expires = now + length
            if client is None or not expires > now:
                raise RuntimeError(
                    f"policy {self._policy.name!r} granted {client_id!r} a lease of "
                    f"{length!r} s, but it is not waiting or the length is not positive"
                )
            lease_id = self._next_lease_id
            self._next_lease_id = lease_id + 1
            leases.append(self._install(client, lease_id, expires, length))
        return tuple(leases)

    def _install(self, client: _Client, lease_id: int, expires: float, length: float) -> Lease:
        now = self._now
        lease = Lease(lease_id, client.client_id, now, expires, client.used_s >= client.request_s)
        provisional = 0.0 if expires == math.inf else length
        charge = _Charge(lease, client, provisional)
        self._charges[lease_id] = charge
        self._charge_order.append(charge)
        client.charge = charge
        client.leases_granted += 1
        if provisional:
            self._bill(client, provisional)
        self._holders[client.client_id] = charge
        self._running_sm += client.sm_percent
        if expires < self._next_expiry:
            self._next_expiry = expires
        return lease
