"""The shim channel's suspension (SuspendClient, ResumeClient) and the memory sample rings it
waits on: a part of ShimChannel (server.py), run on its thread."""

from __future__ import annotations

import concurrent.futures
import time

from gpuloom.services.dispatcher import metrics
from gpuloom.services.dispatcher.channel.model import (
    _Connection,
    _PendingSuspend,
    _suspend_deadline_ns,
    log,
)
from gpuloom.services.dispatcher.domain import (
    SuspendOutcome,
    Suspension,
)
from gpuloom.services.dispatcher.introspection import low_point_threshold
from gpuloom.shimwire import (
    KernelPeriod,
    ShimMode,
)


class SuspensionPart:
    """Methods of ShimChannel; its state is ShimChannel's (server.py)."""

    def kernel_period(self, assignment_id: str) -> KernelPeriod | None:
        """The training loop's period its shim found in its kernel stream (None: none)."""
        connection = self._by_assignment.get(assignment_id)
        if connection is None or connection.region is None:
            return None
        return connection.region.read_kernel_period()

    def suspensions(self) -> dict[str, Suspension]:
        """assignment id -> its suspension, for every suspended client."""
        return dict(self._suspended)

    # ---- suspend and resume (run on the channel thread via submit) ----

    def begin_suspend(
        self, assignment_id: str, max_wait_s: float, reason: str
    ) -> concurrent.futures.Future[Suspension | None]:
        """Suspend the client at its next low-memory point, waiting at most `max_wait_s` for it
        (at once without a detected cycle or a connected process). The future holds the
        suspension, or None if the client was resumed or released before it was reached.
        Idempotent: a suspended client's suspension, a pending one's future."""
        future: concurrent.futures.Future[Suspension | None] = concurrent.futures.Future()
        if assignment_id in self._suspended:
            future.set_result(self._suspended[assignment_id])
            return future
        pending = self._pending.get(assignment_id)
        if pending is not None:
            return pending.future
        now = time.monotonic()
        connection = self._by_assignment.get(assignment_id)
        cycle = None if self._introspector is None else self._introspector.cycle(assignment_id)
        if connection is None or connection.region is None:
            future.set_result(
                self._suspend_now(assignment_id, reason, now, SuspendOutcome.NOT_RUNNING)
            )
        elif cycle is None or cycle.minibatch_s <= 0:
            future.set_result(
                self._suspend_now(assignment_id, reason, now, SuspendOutcome.NO_CYCLE)
            )
        else:
            self._pending[assignment_id] = _PendingSuspend(
                reason, now, now + max_wait_s, low_point_threshold(cycle), future
            )
            self._check_pending(now)
        return future

    def resume(self, assignment_id: str) -> bool:
        """Admit the client's kernels again; False when it was not suspended. A suspension still
        waiting for its low point is called off."""
        pending = self._pending.pop(assignment_id, None)
        if pending is not None:
            pending.future.set_result(None)
        suspension = self._suspended.pop(assignment_id, None)
        if suspension is None:
            return pending is not None
        connection = self._by_assignment.get(assignment_id)
        # Before the region: its first launch after the resume is the engine's again.
        self._set_fikit_suspended(connection, False)
        if connection is not None and connection.region is not None:
            connection.region.publish_resumed(
                open_ended=connection.mode not in (ShimMode.SHARE, ShimMode.FIKIT)
            )
        if self._introspector is not None:
            self._introspector.set_frozen(assignment_id, False)
        metrics.SUSPENDED.labels(self._gpu).set(len(self._suspended))
        log.info(
            "client resumed",
            gpu=self._gpu,
            assignment=assignment_id,
            suspended_s=round(time.monotonic() - suspension.at_monotonic_s, 3),
        )
        return True

    def _set_fikit_suspended(self, connection: _Connection | None, suspended: bool) -> None:
        """Take a FIKIT client out of the engine's FIKIT decisions (the next priority then holds
        the GPU) or back in; other clients have no slot."""
        if connection is not None and connection.fikit_slot is not None:
            self._engine.set_suspended(connection.fikit_slot, suspended)

    def _check_pending(self, now: float) -> None:
        """Suspend the pending clients whose memory is at its low point, or whose wait is up."""
        for assignment_id, pending in list(self._pending.items()):
            connection = self._by_assignment.get(assignment_id)
            if connection is None or connection.region is None:
                outcome = SuspendOutcome.NOT_RUNNING
            else:
                self._collect_from(connection)
                assert self._introspector is not None
                held = self._introspector.current_bytes(assignment_id)
                if held is not None and held <= pending.threshold:
                    outcome = SuspendOutcome.LOW_POINT
                elif now >= pending.deadline:
                    outcome = SuspendOutcome.TIMEOUT
                else:
                    continue
            del self._pending[assignment_id]
            pending.future.set_result(
                self._suspend_now(assignment_id, pending.reason, pending.asked_at, outcome)
            )

    def _suspend_now(
        self, assignment_id: str, reason: str, asked_at: float, outcome: SuspendOutcome
    ) -> Suspension:
        now = time.monotonic()
        connection = self._by_assignment.get(assignment_id)
        if self._scheduler_serves(assignment_id):
            # No lease and no standing terms while suspended: withdraw them all first (the
            # others get theirs back at the end of this round), then its lease.
            self._quiesce()
            self._apply(self._scheduler.withdraw(assignment_id, now))
        if connection is not None and connection.region is not None:
            connection.region.publish_suspended(_suspend_deadline_ns())
        # After the region: the shim parks at its next launch; the others' roles follow.
        self._set_fikit_suspended(connection, True)
        held = (
            None if self._introspector is None else self._introspector.current_bytes(assignment_id)
        )
        suspension = Suspension(
            reason=reason,
            at_unix_s=time.time(),
            at_monotonic_s=now,
            wait_s=now - asked_at,
            outcome=outcome,
            memory_bytes=held or 0,
        )
        self._suspended[assignment_id] = suspension
        if self._introspector is not None:
            self._introspector.set_frozen(assignment_id, True)
        metrics.SUSPENSIONS.labels(self._gpu, outcome.value).inc()
        metrics.SUSPENDED.labels(self._gpu).set(len(self._suspended))
        log.info(
            "client suspended",
            gpu=self._gpu,
            assignment=assignment_id,
            outcome=outcome.value,
            waited_ms=round(suspension.wait_s * 1e3, 3),
            memory_bytes=suspension.memory_bytes,
            reason=reason,
        )
        return suspension

    def _scheduler_serves(self, assignment_id: str) -> bool:
        """The token scheduler leases this client's GPU time (SHARE, not under FIKIT)."""
        reservation = self._book.get(assignment_id)
        return (
            (not self._fikit or self._composed)
            and reservation is not None
            and reservation.mode is ShimMode.SHARE
        )

    # ---- memory samples ----

    def _collect_samples(self) -> None:
        for connection in self._by_assignment.values():
            self._collect_from(connection)

    def _collect_from(self, connection: _Connection) -> None:
        region, assignment_id = connection.region, connection.assignment_id
        if region is None or assignment_id is None or self._introspector is None:
            return
        samples, lost = region.read_samples()
        if not lost and len(samples) == 1 and samples[0] == region.last_sample:
            return  # nothing new (the latest entry, read again, has not changed)
        if samples:
            region.last_sample = samples[-1]
        if samples or lost:
            self._introspector.feed(assignment_id, samples, lost)
            held = self._introspector.current_bytes(assignment_id)
            if held is not None:
                connection.allocated_bytes = held
