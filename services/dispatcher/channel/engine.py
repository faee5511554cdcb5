"""The shim channel's side of admission: the token scheduler's leases (asked for over the socket,
or renewed by the native admission engine from standing terms and journaled), the engine's
metrics, and decisions written into the regions: a part of ShimChannel (server.py), run on its
thread. The engine itself (admission_engine.py) is the same for every policy."""

from __future__ import annotations

import collections
import math
import time

from gpuloom.policies.admission.levels import LevelScheduler
from gpuloom.policies.tokens.scheduler import (
    ClientShare,
    Decision,
    Lease,
    StandingTerms,
)
from gpuloom.services.dispatcher import metrics
from gpuloom.services.dispatcher.admission_engine import (
    FOREVER,
    DeskEvent,
    DeskEventKind,
)
from gpuloom.services.dispatcher.channel.model import (
    _MAX_REPORTED_SECONDS,
    FIKIT_ARBITER_EVENTS,
    FIKIT_CORE_EVENTS,
    ProtocolViolation,
    _Connection,
    _deadline_ns,
    log,
)
from gpuloom.services.dispatcher.domain import (
    EventKind,
    Reservation,
)
from gpuloom.shimwire import (
    ShimMode,
)
from gpuloom.v1 import shim_pb2


class EnginePart:
    """Methods of ShimChannel; its state is ShimChannel's (server.py)."""

    def _lease_request(self, connection: _Connection, request: shim_pb2.LeaseRequest) -> None:
        assignment_id = connection.assignment_id
        assert assignment_id is not None
        if not self._leased(connection):
            return  # admitted open; nothing to queue for
        self._quiesce()
        now = time.monotonic()
        ended = None
        report = request.report
        if request.HasField("report") and report.lease_id:
            connection.allocated_bytes = report.allocated_bytes
            ended = self._charge(
                assignment_id, report.lease_id, report.gpu_time_ns, report.longest_burst_ns,
                now, ending=True,
            )  # fmt: skip
        if assignment_id in self._suspended:  # it waits for ResumeClient, then asks again
            self._apply(ended)
            return
        if connection.requested_at is None:
            connection.requested_at = now
        self._apply(ended, self._scheduler.request(assignment_id, now))

    def _usage(self, connection: _Connection, report: shim_pb2.UsageReport) -> None:
        assert connection.assignment_id is not None
        if not self._leased(connection):
            return
        if report.release:  # ends its lease: its lease words are written here
            self._quiesce()
        else:  # a charge only; the lease it is for may be in the engine's journal
            self._take_lease_events()
        connection.allocated_bytes = report.allocated_bytes
        assignment_id, now = connection.assignment_id, time.monotonic()
        self._apply(
            self._charge(
                assignment_id,
                report.lease_id,
                report.gpu_time_ns,
                report.longest_burst_ns,
                now,
                report.release,
            )
        )
        self._refresh_terms()  # the engine's budgets count this usage from now on

    def _charge(
        self,
        assignment_id: str,
        lease_id: int,
        gpu_time_ns: int,
        longest_burst_ns: int,
        now: float,
        ending: bool,
    ) -> Decision | None:
        used_s = gpu_time_ns / 1e9
        burst_s = longest_burst_ns / 1e9 if longest_burst_ns else None
        if used_s > _MAX_REPORTED_SECONDS or (burst_s or 0.0) > _MAX_REPORTED_SECONDS:
            raise ProtocolViolation(
                f"usage report of {used_s:.3g} s GPU time in one lease is not plausible"
            )
        if ending:
            return self._scheduler.release(assignment_id, lease_id, used_s, burst_s, now)
        self._scheduler.report_usage(assignment_id, lease_id, used_s, burst_s, now)
        return None

    def _fikit_metrics(self) -> None:
        if not self._fikit:
            return
        stats, core = self._engine.fikit_stats(), self._engine.core_counters()
        seen, core_seen = self._fikit_seen, self._fikit_core_seen
        for event in FIKIT_ARBITER_EVENTS:
            delta = getattr(stats, event) - getattr(seen, event)
            if delta:
                metrics.FIKIT_EVENTS.labels(self._gpu, event).inc(delta)
        for event in FIKIT_CORE_EVENTS:
            delta = getattr(core, event) - getattr(core_seen, event)
            if delta:
                metrics.FIKIT_EVENTS.labels(self._gpu, event).inc(delta)
        metrics.FIKIT_WAITING.labels(self._gpu).set(stats.waiting)
        self._fikit_seen, self._fikit_core_seen = stats, core

    # ---- leases renewed by the engine ----

    def _next_wakeup(self) -> float | None:
        scheduler = self._scheduler
        if not scheduler.has_waiting:
            # Nobody waits, so leases that expire free nothing anyone needs now: they are ended
            # at the next call. Windows need nobody either: the engine rolls budgets itself.
            return None
        return scheduler.next_deadline()

    def _quiesce(self) -> None:
        """Before this thread writes lease words or the scheduler may grant: withdraw every
        term (after this the engine writes no lease word) and take its journal into the
        books."""
        if not self._terms_revoked:
            self._engine.revoke_all()
            self._terms_revoked = True
        self._take_lease_events()

    def _take_lease_events(self) -> None:
        engine = self._engine
        forwarded: collections.deque[DeskEvent] = collections.deque()
        self._import(engine.take(), forwarded)
        while forwarded:
            event = forwarded.popleft()
            connection = self._by_lease_slot.get(event.slot)
            if connection is None or connection.assignment_id is None:
                continue
            try:
                if not self._terms_revoked and self._grant_beside_terms(connection, event):
                    continue
                if not self._terms_revoked:
                    # It may have to wait, or displace terms: withdraw them all first, and take
                    # the renewals made meanwhile into the books before deciding.
                    engine.revoke_all()
                    self._terms_revoked = True
                    self._import(engine.take(), forwarded)
                self._forwarded_request(connection, event)
            except ProtocolViolation as error:
                self._refuse(connection, str(error))

    def _before_departure(self) -> None:
        """A client's lease ends for good (it left, or its reservation did): the others keep
        their terms, since fewer leases only leave more room, unless somebody waits, who may
        now be granted."""
        if self._scheduler.has_waiting:
            self._quiesce()
        else:
            self._take_lease_events()

    def _import(self, events: list[DeskEvent], forwarded: collections.deque[DeskEvent]) -> None:
        """Renewals into the books at once: each was granted while nobody waited, before any
        forwarded request reached the scheduler (a forwarded request never precedes a renewal
        it could block). Forwarded requests are queued for the caller."""
        for event in events:
            if event.kind is DeskEventKind.RENEWED:
                self._import_renewal(event)
            else:
                forwarded.append(event)

    def _grant_beside_terms(self, connection: _Connection, event: DeskEvent) -> bool:
        """A forwarded request the standing terms already leave room for (a client that had
        none yet, with everyone's terms and leases counted as running) is granted without
        withdrawing anyone's terms; then it gets terms too. False: not such a request."""
        scheduler, client_id = self._scheduler, connection.assignment_id
        assert client_id is not None
        if (
            event.invalid
            or scheduler.has_waiting
            or scheduler.lease_of(client_id) is not None
            or client_id in self._suspended
        ):
            return False
        now = time.monotonic()
        terms = scheduler.standing_terms(now, self._lease_clients())
        if client_id not in terms or not self._termed <= terms.keys():
            return False
        self._forwarded_request(connection, event)  # writes only this client's region
        terms = scheduler.standing_terms(now, self._lease_clients())
        if terms.keys() == self._termed | {client_id}:
            self._set_terms(terms)
        else:
            self._quiesce()  # new terms for all after this round
        return True

    def _import_renewal(self, event: DeskEvent) -> None:
        connection = self._by_lease_slot.get(event.slot)
        if connection is None or connection.assignment_id is None:
            return
        report = None
        if event.report is not None and event.report[0]:
            lease_id, gpu_ns, burst_ns, _release = event.report
            report = (lease_id, gpu_ns / 1e9, burst_ns / 1e9 if burst_ns else None)
            connection.allocated_bytes = event.allocated_bytes
        expires = math.inf if event.until_ns == FOREVER else event.until_ns / 1e9
        try:
            decision = self._scheduler.renewed(
                connection.assignment_id, event.lease_id, expires, event.at_ns / 1e9, report
            )
        except (KeyError, ValueError) as error:  # a client removed meanwhile; a bad report
            log.warning("engine lease renewal not taken", gpu=self._gpu, error=str(error))
            return
        self._granted_since_flush += 1
        self._waits.append(max(event.at_ns - event.posted_ns, 0) / 1e9)
        connection.requested_at = None
        if self.lease_events_wanted:
            for lease in decision.granted:
                self._emit_granted(lease)
            for lease in decision.ended:
                self._emit(EventKind.LEASE_ENDED, lease.client_id, lease_id=lease.lease_id)

    def _forwarded_request(self, connection: _Connection, event: DeskEvent) -> None:
        """A request the engine had no terms for: answered as a LeaseRequest frame is."""
        assignment_id = connection.assignment_id
        assert assignment_id is not None
        if event.invalid:
            raise ProtocolViolation("lease request words in the region are not plausible")
        now = time.monotonic()
        ended = given_up = None
        if event.report is not None and event.report[0]:
            lease_id, gpu_ns, burst_ns, _release = event.report
            connection.allocated_bytes = event.allocated_bytes
            ended = self._charge(assignment_id, lease_id, gpu_ns, burst_ns, now, ending=True)
        if self._scheduler.lease_of(assignment_id) is not None:
            # A shim posts only without a usable lease: the one it held is over (given back
            # early; its report may still be on the way over the socket, which is slower).
            given_up = self._scheduler.withdraw(assignment_id, now)
        if assignment_id in self._suspended:  # it waits for ResumeClient, then asks again
            self._apply(ended, given_up)
            return
        if connection.requested_at is None:
            connection.requested_at = min(event.posted_ns / 1e9, now)
        self._apply(ended, given_up, self._scheduler.request(assignment_id, now))

    def _give_terms(self) -> None:
        """After this thread's decisions: the policy's standing terms to every engine client."""
        if not self._terms_revoked:
            return
        self._set_terms(self._scheduler.standing_terms(time.monotonic(), self._lease_clients()))
        self._terms_revoked = False

    def _refresh_terms(self) -> None:
        """New lease lengths (q follows the reported bursts) and budgets for the clients that
        hold terms. In place, without withdrawing them, when the same clients get terms (their
        SMs fit together as before); otherwise through a full withdrawal."""
        if self._terms_revoked:
            return
        self._take_lease_events()
        if self._terms_revoked:  # a forwarded request came: new terms follow its decision
            return
        terms = self._scheduler.standing_terms(time.monotonic(), self._lease_clients())
        if set(terms) == self._termed:
            self._set_terms(terms)
        else:
            self._quiesce()

    def _lease_clients(self) -> set[str]:
        """The clients the engine renews leases for (a process asking over the socket, or a
        suspended one, gets no terms)."""
        return {
            c.assignment_id
            for c in self._by_lease_slot.values()
            if c.assignment_id and c.assignment_id not in self._suspended
        }

    def _set_terms(self, terms: dict[str, StandingTerms]) -> None:
        engine, config = self._engine, self._scheduler.config
        self._termed = set()
        for slot, connection in self._by_lease_slot.items():
            given = terms.get(connection.assignment_id or "")
            if given is None:
                continue
            engine.set_terms(
                slot, given.lease_s, given.budget_s, config.lease_min_s, given.limit_s,
                config.window_s, given.window_end,
            )  # fmt: skip
            self._termed.add(connection.assignment_id or "")

    def _lease_metrics(self) -> None:
        stats, seen = self._engine.lease_stats(), self._lease_seen
        for event in ("renewed", "forwarded", "invalid_writes", "throttled"):
            delta = getattr(stats, event) - getattr(seen, event)
            if delta:
                metrics.DESK_EVENTS.labels(self._gpu, event).inc(delta)
        self._lease_seen = stats

    # ---- decisions -> shared memory ----

    def _leased(self, connection: _Connection) -> bool:
        """Its process asks for leases: SHARE, or FIKIT under the composed policy."""
        return connection.mode is ShimMode.SHARE or (
            self._composed and connection.mode is ShimMode.FIKIT
        )

    def _admit_to_scheduler(self, reservation: Reservation, now: float) -> Decision | None:
        if reservation.mode is not ShimMode.SHARE or (self._fikit and not self._composed):
            return None
        share = ClientShare(reservation.assignment_id, reservation.share)
        if isinstance(self._scheduler, LevelScheduler):
            return self._scheduler.add_client(share, now, reservation.priority)
        self._scheduler.add_client(share, now)
        return None

    def _apply(self, *decisions: Decision | None) -> None:
        """Write decisions into the regions: grants first, so the woken shim runs while the
        bookkeeping is done; a lease ended and replaced in the same breath is then no longer
        the region's lease and is left alone."""
        if not any(decisions):
            return
        now = time.monotonic()
        stray: list[Lease] = []
        for decision in decisions:
            if not decision:
                continue
            for lease in decision.granted:
                connection = self._by_assignment.get(lease.client_id)
                if connection is None or connection.region is None:
                    stray.append(lease)  # nobody to use it: hand it straight back below
                    continue
                connection.region.publish_lease(lease.lease_id, _deadline_ns(lease))
                self._granted_since_flush += 1
                if connection.requested_at is not None:
                    self._waits.append(lease.granted_at - connection.requested_at)
                    connection.requested_at = None
                if self.lease_events_wanted:
                    self._emit_granted(lease)
        for decision in decisions:
            if not decision:
                continue
            for lease in decision.ended:
                connection = self._by_assignment.get(lease.client_id)
                region = None if connection is None else connection.region
                # A lease that ran to its end needs no write: its deadline already says so,
                # and its id stays visible, so a shim that woke too late can report it. One
                # that ended early (released, withdrawn) is revoked.
                if (
                    region is not None
                    and region.lease_id == lease.lease_id
                    and lease.expires_at > now
                ):
                    region.publish_waiting()
                if self.lease_events_wanted:
                    self._emit(EventKind.LEASE_ENDED, lease.client_id, lease_id=lease.lease_id)
        for lease in stray:
            self._apply(self._scheduler.withdraw(lease.client_id, now))

    # ---- sending, closing ----

    def _emit_granted(self, lease: Lease) -> None:
        length_ms = (lease.expires_at - lease.granted_at) * 1e3
        self._emit(
            EventKind.LEASE_GRANTED,
            lease.client_id,
            lease_id=lease.lease_id,
            lease_ms=length_ms if math.isfinite(length_ms) else 0.0,
        )
