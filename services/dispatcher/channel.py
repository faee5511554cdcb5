"""The shim channel of one GPU: a Unix-socket server on a dedicated thread.

The thread owns the token scheduler, every connection and every admission region, so a lease
request it answers (a LeaseRequest frame in, a lease written to shared memory) takes no lock and
never waits for the asyncio loop that serves gRPC. The control plane reaches the thread through
`submit`, which queues a function and wakes the thread with an eventfd.

With the lease desk (the default for token policies), a shim's lease request does not come here
at all while the token policy has given it standing terms: the desk's native thread renews the
lease from them, and this thread takes the desk's journal into the scheduler's books afterwards.
Requests without terms are forwarded here and answered as before; then every term is withdrawn
(so only this thread writes lease words) until the decision is made and new terms are given.

The thread also reads every shim's memory sample ring (every SAMPLE_POLL_S) into the training
introspector, and suspends and resumes clients (SuspendClient, ResumeClient): a suspension
waits, bounded, for the client's memory to reach its cycle's low point, then withdraws its lease
(a SHARE client gets no lease and no standing terms while suspended) and writes the suspension
word of its region, which it renews while the suspension lasts (docs/training.md).
"""

from __future__ import annotations

import array
import collections
import concurrent.futures
import contextlib
import dataclasses
import math
import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog
from google.protobuf.message import DecodeError

from gpuloom.domain.errors import DomainError
from gpuloom.policies.fikit.core import FikitCounters
from gpuloom.policies.tokens.scheduler import (
    ClientShare,
    Decision,
    Lease,
    SchedulerSnapshot,
    StandingTerms,
    TokenScheduler,
)
from gpuloom.services.dispatcher import metrics
from gpuloom.services.dispatcher.arbiter import Arbiter, ArbiterFull, ArbiterStats
from gpuloom.services.dispatcher.domain import (
    BoundProcess,
    DispatcherEvent,
    EventKind,
    Reservation,
    SuspendOutcome,
    Suspension,
    derive_task_key,
)
from gpuloom.services.dispatcher.heartbeat import Heartbeat
from gpuloom.services.dispatcher.introspection import TrainingIntrospector, low_point_threshold
from gpuloom.services.dispatcher.kernel_tables import KernelTable, KernelTables
from gpuloom.services.dispatcher.leasedesk import (
    FOREVER,
    DeskEvent,
    DeskEventKind,
    DeskFull,
    DeskStats,
    LeaseDesk,
)
from gpuloom.services.dispatcher.refusal_log import RefusalLog
from gpuloom.services.dispatcher.reservations import ReservationBook
from gpuloom.services.dispatcher.timer import DeadlineTimer
from gpuloom.shimwire import (
    OPEN_ENDED_NS,
    PROTOCOL_VERSION,
    REGION_BYTES,
    AdmissionRegion,
    FrameError,
    FrameReader,
    KernelPeriod,
    ShimMode,
    encode_frame,
)
from gpuloom.v1 import shim_pb2

log = structlog.get_logger("gpuloom.dispatcher.channel")

T = TypeVar("T")
_PEERCRED = struct.Struct("3i")
_RECV_BYTES = 256 * 1024
# Usage numbers beyond this are garbage, not measurements (a lease lasts milliseconds).
_MAX_REPORTED_SECONDS = 3600.0
# How often the memory sample rings are read (a ring holds 224 entries: at the shortest sample
# period of 1 ms, 224 ms of allocations).
SAMPLE_POLL_S = 0.025
# While a suspension waits for its low point, the process's memory is looked at this often.
SUSPEND_POLL_S = 0.001
# FIKIT counters exported as gpuloom_dispatcher_fikit_events_total{event=...}: the arbiter's own,
# then the decision core's (where the fill kernels went: windows or idle time).
FIKIT_ARBITER_EVENTS = (
    "requests",
    "grants",
    "unknown_kernels",
    "invalid_writes",
    "role_races",
    "arms",
    "fired",
    "late_releases",
)
FIKIT_CORE_EVENTS = (
    "granted_window",
    "granted_idle",
    "granted_starved",
    "windows_opened",
    "windows_closed_early",
)
# A suspension word holds this long unless renewed (every housekeeping round, 0.5 s): a hung
# dispatcher frees its suspended processes after it.
SUSPEND_HOLD_S = 5.0


@dataclass(slots=True)
class _PendingSuspend:
    reason: str
    asked_at: float  # monotonic
    deadline: float  # monotonic
    threshold: int  # suspend once the process holds at most this many bytes
    future: concurrent.futures.Future[Suspension | None]


@dataclass(frozen=True, slots=True)
class ChannelLimits:
    max_frame_bytes: int = 1 << 20
    max_connections: int = 1024
    # One local user cannot take every connection: at most this many per peer uid ...
    max_connections_per_uid: int = 64
    # ... and the last ones go only to users whose processes hold a reservation here.
    reserved_connections: int = 64
    # A connection must register within this long, or it is closed (a shim registers at once).
    register_timeout_s: float = 1.0
    # A client that does not read its socket gets this much buffered before it is dropped.
    max_unsent_bytes: int = 256 * 1024
    max_records_per_batch: int = 100_000


@dataclass(frozen=True, slots=True)
class ConnectedProcess:
    """A registered process, as GetGpuStatus shows it."""

    pid: int
    asked_at: float | None  # monotonic time of the lease request it waits on; None: not waiting
    allocated_bytes: int  # device memory, as its shim's last usage report said


class ProtocolViolation(Exception):
    """The peer broke the shim protocol; its connection is closed, nobody else notices."""


MeasurementSink = Callable[[str, Sequence[shim_pb2.KernelRecord]], None]


class _Connection:
    __slots__ = (
        "allocated_bytes",
        "assignment_id",
        "beat_slot",
        "deadline",
        "desk_slot",
        "fikit_slot",
        "mode",
        "out",
        "peer",
        "reader",
        "region",
        "requested_at",
        "sock",
    )

    def __init__(self, sock: socket.socket, peer: tuple[int, int, int], reader: FrameReader):
        self.sock = sock
        self.peer = peer  # pid, uid, gid from SO_PEERCRED
        self.reader = reader
        self.out = bytearray()
        self.assignment_id: str | None = None
        self.mode: ShimMode | None = None  # set at registration
        self.region: AdmissionRegion | None = None
        self.deadline = 0.0
        self.requested_at: float | None = None
        self.fikit_slot: int | None = None  # the arbiter's slot (mode FIKIT)
        self.desk_slot: int | None = None  # the lease desk's slot (mode SHARE)
        self.beat_slot: int | None = None  # the heartbeat's slot (every mode)
        self.allocated_bytes = 0  # device memory, as the shim's last usage report said


class ShimChannel:
    def __init__(
        self,
        gpu_label: str,
        socket_path: Path,
        book: ReservationBook,
        scheduler: TokenScheduler,
        on_event: Callable[[DispatcherEvent], None],
        measurements: MeasurementSink,
        limits: ChannelLimits | None = None,
        window_s: float = 1.0,
        choose_mode: Callable[[Reservation, str], ShimMode] | None = None,
        arbiter: Arbiter | None = None,
        kernel_tables: KernelTables | None = None,
        lease_desk: bool = False,
        introspector: TrainingIntrospector | None = None,
    ) -> None:
        self._gpu = gpu_label
        self._socket_path = socket_path
        self._book = book
        self._scheduler = scheduler
        self._on_event = on_event
        self._measurements = measurements
        self._limits = limits or ChannelLimits()
        self._refusals = RefusalLog()  # one user refused in a loop cannot fill the disk
        self._heart = Heartbeat.start(gpu_label)  # a shim asking nothing sees a hung dispatcher
        # Which mode a registering process of a task gets (the profiler link turns SHARE into
        # MEASURE while its task is being measured).
        self._choose_mode = choose_mode or (lambda reservation, task_key: reservation.mode)
        self._window_ns = int(window_s * 1e9)
        # Policy fikit: shares are admitted kernel by kernel by the native arbiter, not leased.
        self._arbiter = arbiter
        self._kernel_tables = kernel_tables
        self._fikit_seen = ArbiterStats(*[0] * len(dataclasses.fields(ArbiterStats)))
        self._fikit_core_seen = FikitCounters(*[0] * len(dataclasses.fields(FikitCounters)))
        # SHARE leases renewed natively from standing terms (not with FIKIT: nothing is leased).
        self._desk = LeaseDesk() if lease_desk and arbiter is None else None
        self._desk_seen = DeskStats(0, 0, 0, 0, 0, 0, 0, 0)
        self._by_desk_slot: dict[int, _Connection] = {}
        # Every term withdrawn (so this thread may write lease words); new ones are due.
        self._desk_revoked = True
        self._termed: set[str] = set()  # the clients whose terms the desk holds
        # Raw epoll: the loop runs once per lease request, so every layer counts.
        self._epoll = select.epoll()
        self._special: dict[int, str] = {}
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._timer = DeadlineTimer()
        self._commands: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]]
        self._commands = collections.deque()
        self._connections: dict[int, _Connection] = {}
        self._per_uid: dict[int, int] = {}  # open connections by peer uid
        self._by_assignment: dict[str, _Connection] = {}
        # Training introspection: the memory sample rings are read into it.
        self._introspector = introspector
        self._sample_period_us = (
            0 if introspector is None else max(1, round(introspector.config.sample_period_s * 1e6))
        )
        self._samples_at = 0.0
        self._suspended: dict[str, Suspension] = {}
        self._pending: dict[str, _PendingSuspend] = {}
        self._running = False
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        # Lease events are many; they are produced only while someone watches them.
        self.lease_events_wanted = False
        self._labels = {"gpu": gpu_label}
        self._leases_granted = metrics.LEASES_GRANTED.labels(gpu_label)
        self._lease_wait = metrics.LEASE_WAIT.labels(gpu_label)
        # Lease metrics are collected here and handed to Prometheus in housekeeping, off the
        # request path.
        self._granted_since_flush = 0
        self._waits: list[float] = []

    # ---- life cycle (called from the owner's thread) ----

    def start(self) -> None:
        path = self._socket_path
        if len(os.fsencode(path)) >= 108:
            raise OSError(f"socket path too long for a Unix socket (max 107 bytes): {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            _remove_stale_socket(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        # Any local user may connect: the assignment token, not the file mode, authenticates.
        os.chmod(path, 0o666)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._special = {
            listener.fileno(): "listener",
            self._wake_fd: "wake",
            self._timer.fd: "timer",
        }
        if self._desk is not None:
            self._special[self._desk.notify_fd] = "desk"
        for fd in self._special:
            self._epoll.register(fd, select.EPOLLIN)
        now = time.monotonic()
        for reservation in self._book.all():
            self._admit_to_scheduler(reservation, now)
        self._running = True
        self._thread = threading.Thread(
            target=self._run, name=f"shim-channel-{self._gpu}", daemon=True
        )
        self._thread.start()
        if self._introspector is not None:
            self._introspector.start()
        log.info("shim channel listening", gpu=self._gpu, socket=str(path))

    def stop(self) -> None:
        if self._thread is None:
            return
        if self._introspector is not None:
            self._introspector.stop()
        self._running = False
        os.eventfd_write(self._wake_fd, 1)
        self._thread.join(timeout=10)
        self._thread = None
        for pending in self._pending.values():
            pending.future.set_exception(RuntimeError("the dispatcher is stopping"))
        self._pending.clear()
        for connection in list(self._connections.values()):
            self._close(connection, "dispatcher stopping", quiet=True)
        if self._listener is not None:
            self._epoll.unregister(self._listener)
            self._listener.close()
            self._listener = None
            self._socket_path.unlink(missing_ok=True)
        self._epoll.close()
        os.close(self._wake_fd)
        self._timer.close()
        if self._desk is not None:
            self._desk.stop()
        if self._heart is not None:
            self._heart.stop()

    def submit(self, function: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `function` on the channel thread; the future holds its result or exception."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self._running:
            future.set_exception(RuntimeError("the shim channel is not running"))
            return future
        self._commands.append((function, future))
        os.eventfd_write(self._wake_fd, 1)
        return future

    # ---- control plane operations (run on the channel thread via submit) ----

    def add_reservation(self, reservation: Reservation) -> None:
        if self._kernel_tables is not None and reservation.task_key:
            # Fetched now, the kernel table is there before the task's first process.
            self._kernel_tables.lookup(reservation.task_key, lambda table: None)
        self._apply(self._admit_to_scheduler(reservation, time.monotonic()))

    def remove_reservation(self, assignment_id: str, reason: str, mode: ShimMode) -> None:
        """Tell a connected process its assignment ended, disconnect it, forget its share."""
        now = time.monotonic()
        pending = self._pending.pop(assignment_id, None)
        if pending is not None:
            pending.future.set_result(None)
        if self._suspended.pop(assignment_id, None) is not None:
            metrics.SUSPENDED.labels(self._gpu).set(len(self._suspended))
        if self._introspector is not None:
            self._introspector.forget(assignment_id)
        connection = self._by_assignment.get(assignment_id)
        if connection is not None:
            if connection.region is not None:
                connection.region.publish_evicted()
            evicted = shim_pb2.DispatcherMessage(evicted=shim_pb2.Evicted(reason=reason))
            self._send(connection, evicted)
            self._close(connection, "evicted", quiet=True, flush=True)
        if mode is ShimMode.SHARE and self._arbiter is None:
            self._before_departure()
            self._apply(self._scheduler.remove_client(assignment_id, now))
            with contextlib.suppress(KeyError):  # never reported yet
                metrics.CLIENT_USED.remove(self._gpu, assignment_id)
                for bound in ("request", "limit"):
                    metrics.CLIENT_QUOTA.remove(self._gpu, assignment_id, bound)

    def connected(self) -> dict[str, ConnectedProcess]:
        """assignment id -> the process of every registered connection."""
        return {
            assignment: ConnectedProcess(
                connection.peer[0], connection.requested_at, connection.allocated_bytes
            )
            for assignment, connection in self._by_assignment.items()
        }

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
        # Before the region: its first launch after the resume is the arbiter's again.
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
        """Take a FIKIT client out of the arbiter's decisions (the next priority then holds
        the GPU) or back in; other clients have no slot."""
        arbiter = self._arbiter
        if arbiter is not None and connection is not None and connection.fikit_slot is not None:
            arbiter.set_suspended(connection.fikit_slot, suspended)

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
            self._arbiter is None and reservation is not None and reservation.mode is ShimMode.SHARE
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

    def scheduler_snapshot(self) -> SchedulerSnapshot:
        self._take_desk_events()
        return self._scheduler.snapshot(time.monotonic())

    # ---- the thread ----

    def _run(self) -> None:
        housekeeping_at = 0.0
        scheduler, timer, poll = self._scheduler, self._timer, self._epoll.poll
        while self._running:
            timer.arm(self._next_wakeup())
            if self._pending:
                timer.arm(time.monotonic() + SUSPEND_POLL_S)
            elif self._sample_period_us and self._by_assignment:
                timer.arm(self._samples_at)
            try:
                ready = poll(0.5)
            except InterruptedError:
                continue
            for fd, mask in ready:
                try:
                    self._handle(fd, mask)
                except Exception:
                    # A bug in handling one connection must not take the channel down.
                    log.exception("shim channel handler failed", gpu=self._gpu)
                    connection = self._connections.get(fd)
                    if connection is not None:
                        self._close(connection, "internal error")
            now = time.monotonic()
            deadline = scheduler.next_deadline()
            if deadline is not None and deadline <= now:
                if scheduler.has_waiting:  # a grant may follow: lease words are written here
                    self._quiesce()
                self._apply(scheduler.advance(now))
            if self._sample_period_us and now >= self._samples_at:
                self._samples_at = now + SAMPLE_POLL_S
                self._collect_samples()
            if self._pending:
                self._check_pending(now)
            if now >= housekeeping_at:
                housekeeping_at = now + 0.5
                self._housekeeping(now)
            self._give_terms()

    def _handle(self, fd: int, mask: int) -> None:
        connection = self._connections.get(fd)
        if connection is not None:
            if mask & select.EPOLLOUT:
                self._flush(connection)
            readable = mask & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR)
            if readable and connection.sock.fileno() >= 0:  # _flush may have closed it
                self._read(connection)
            return
        kind = self._special.get(fd)
        if kind == "timer":
            self._timer.clear()  # the scheduler advances right after this round
        elif kind == "listener":
            self._accept()
        elif kind == "wake":
            self._run_commands()
        elif kind == "desk":
            assert self._desk is not None
            self._desk.clear_notification()
            self._take_desk_events()

    def _run_commands(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._wake_fd)
        while self._commands:
            function, future = self._commands.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function())
            except BaseException as error:  # handed to the caller, who re-raises it
                future.set_exception(error)

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            peer = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
            refusal = self._admission_refusal(peer[1])
            if refusal is not None:
                metrics.CONNECTIONS_REFUSED.labels(self._gpu, refusal).inc()
                self._log_refusal(peer[1], "connection refused", pid=peer[0], reason=refusal)
                sock.close()
                continue
            self._per_uid[peer[1]] = self._per_uid.get(peer[1], 0) + 1
            connection = _Connection(sock, peer, FrameReader(self._limits.max_frame_bytes))
            connection.deadline = time.monotonic() + self._limits.register_timeout_s
            self._connections[sock.fileno()] = connection
            self._epoll.register(sock.fileno(), select.EPOLLIN)

    def _admission_refusal(self, uid: int) -> str | None:
        """Why a new connection of `uid` is refused (a bounded metric label), or None."""
        limits = self._limits
        if self._per_uid.get(uid, 0) >= limits.max_connections_per_uid:
            return "per-uid limit"
        total = len(self._connections)
        if total >= limits.max_connections:
            return "connection limit"
        if total >= limits.max_connections - limits.reserved_connections:
            holders = {r.bound.uid for r in self._book.all() if r.bound is not None}
            if uid not in holders:
                return "kept for reservation holders"
        return None

    def _read(self, connection: _Connection) -> None:
        try:
            data = connection.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._close(connection, f"receive failed: {error.strerror}")
            return
        if not data:
            self._close(connection, "peer closed the connection", quiet=True)
            return
        try:
            for frame in connection.reader.feed(data):
                message = shim_pb2.ShimMessage.FromString(frame)
                if not self._dispatch(connection, message):
                    return
        except DecodeError:
            self._refuse(connection, "malformed message: not a ShimMessage")
        except (FrameError, ProtocolViolation) as error:
            self._refuse(connection, str(error))

    def _dispatch(self, connection: _Connection, message: shim_pb2.ShimMessage) -> bool:
        """Handle one message; False when the connection was closed by it."""
        kind = message.WhichOneof("body")
        if kind is None:
            raise ProtocolViolation("unknown or empty message type")
        if connection.assignment_id is None:
            if kind != "register":
                raise ProtocolViolation(f"first message must be register, got {kind}")
            return self._register(connection, message.register)
        if kind == "lease_request":
            self._lease_request(connection, message.lease_request)
        elif kind == "usage":
            self._usage(connection, message.usage)
        elif kind == "measurements":
            self._measurement_batch(connection, message.measurements)
        elif kind == "goodbye":
            self._close(connection, "goodbye", quiet=True)
            return False
        else:
            raise ProtocolViolation(f"unexpected {kind} after registration")
        return True

    # ---- messages ----

    def _register(self, connection: _Connection, register: shim_pb2.Register) -> bool:
        pid, uid, _gid = connection.peer
        if register.protocol_version != PROTOCOL_VERSION:
            raise ProtocolViolation(
                f"protocol version {register.protocol_version} not supported "
                f"(this dispatcher speaks {PROTOCOL_VERSION})"
            )
        reservation = self._book.by_token(register.assignment_token)
        if reservation is None:
            self._refuse(connection, "unknown assignment token")
            return False
        start_ticks = _process_start_ticks(pid)
        if start_ticks is None:
            self._refuse(connection, f"cannot identify peer process {pid}")
            return False
        try:
            reservation = self._book.bind(
                reservation.assignment_id, BoundProcess(pid, start_ticks, uid), _still_runs
            )
        except DomainError as error:
            self._refuse(connection, error.message, reservation.assignment_id)
            return False
        assignment_id = reservation.assignment_id
        previous = self._by_assignment.get(assignment_id)
        if previous is not None:
            same = previous.peer[0] == pid
            self._close(
                previous,
                "replaced by a new connection of the same process"
                if same
                else f"replaced by pid {pid}: the process it was bound to has exited",
            )
        task_key = reservation.task_key or derive_task_key(register.process_name, register.argv)
        mode = self._choose_mode(reservation, task_key)
        if mode is ShimMode.SHARE and self._arbiter is not None:
            mode = ShimMode.FIKIT
        region, fd = AdmissionRegion.create(
            f"gpuloom-{assignment_id}",
            reservation.memory_cap_bytes,
            reservation.share.sm_percent,
            mode,
            self._sample_period_us,
        )
        suspended = assignment_id in self._suspended
        fds = [fd]
        if self._heart is not None:
            with contextlib.suppress(OSError):  # full: its shim is not judged by a heartbeat
                connection.beat_slot = self._heart.add(fd)
        # The region is complete before the shim can see it.
        if mode is ShimMode.FIKIT:
            # No lease is ever published: admit_until stays 0, so every launch of the shim
            # takes its admission path (docs/fikit.md).
            try:
                connection.fikit_slot = self._add_fikit_task(
                    assignment_id, fd, reservation.priority, task_key
                )
            except (ArbiterFull, OSError) as error:
                region.close()
                os.close(fd)
                self._refuse(connection, str(error), assignment_id)
                return False
            assert self._arbiter is not None
            fds.append(self._arbiter.doorbell_fd)
            fds.extend(self._arbiter.board_fds(reservation.priority))
        elif mode is ShimMode.SHARE:
            snapshot = self.scheduler_snapshot()
            lease = snapshot.clients[assignment_id].lease
            if lease is not None and not suspended:  # reconnected while holding a lease
                region.publish_lease(lease.lease_id, _deadline_ns(lease))
            if self._desk is not None:
                try:
                    connection.desk_slot = self._desk.add(fd)
                except (DeskFull, OSError) as error:
                    # Served all the same: without the doorbell it asks over the socket.
                    log.warning("lease desk refused a process", gpu=self._gpu, error=str(error))
                else:
                    self._by_desk_slot[connection.desk_slot] = connection
                    fds.append(self._desk.doorbell_fd)
                    # No terms yet: its first request is forwarded, and granted beside the
                    # others' terms when they leave room for it.
        elif not suspended:
            region.publish_open()
        if suspended:  # it stays suspended across a reconnection
            region.publish_suspended(_suspend_deadline_ns())
        reply = shim_pb2.DispatcherMessage(
            registered=shim_pb2.Registered(
                protocol_version=PROTOCOL_VERSION,
                assignment_id=assignment_id,
                mode=int(mode),
                memory_cap_bytes=reservation.memory_cap_bytes,
                sm_percent=reservation.share.sm_percent,
                priority=reservation.priority,
                window_ns=self._window_ns,
                shared_memory_bytes=REGION_BYTES,
            )
        )
        try:
            frame = encode_frame(reply.SerializeToString())
            sent = connection.sock.sendmsg(
                [frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            )
            if sent < len(frame):
                connection.out += frame[sent:]
                self._epoll.modify(connection.sock.fileno(), select.EPOLLIN | select.EPOLLOUT)
        except OSError as error:
            region.close()
            self._close(connection, f"cannot send registration: {error}")
            return False
        finally:
            os.close(fd)
        connection.assignment_id = assignment_id
        connection.mode = mode
        connection.region = region
        self._by_assignment[assignment_id] = connection
        if self._introspector is not None:
            self._introspector.set_frozen(assignment_id, suspended)
        log.info(
            "shim registered",
            gpu=self._gpu,
            assignment=assignment_id,
            pid=pid,
            uid=uid,
            process=register.process_name[:128],
            task=task_key,
            mode=mode.name,
        )
        self._emit(EventKind.REGISTERED, assignment_id, f"pid {pid} uid {uid} task {task_key}")
        return True

    def _lease_request(self, connection: _Connection, request: shim_pb2.LeaseRequest) -> None:
        assignment_id = connection.assignment_id
        assert assignment_id is not None
        if connection.mode is not ShimMode.SHARE:
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
        if connection.mode is not ShimMode.SHARE:
            return
        if report.release:  # ends its lease: its lease words are written here
            self._quiesce()
        else:  # a charge only; the lease it is for may be in the desk's journal
            self._take_desk_events()
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
        self._refresh_terms()  # the desk's budgets count this usage from now on

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

    def _measurement_batch(self, connection: _Connection, batch: shim_pb2.MeasurementBatch) -> None:
        assert connection.assignment_id is not None
        records = batch.records
        if len(records) > self._limits.max_records_per_batch:
            raise ProtocolViolation(
                f"measurement batch of {len(records)} records, at most "
                f"{self._limits.max_records_per_batch}"
            )
        for index, record in enumerate(records):
            if record.end_ns < record.start_ns:
                raise ProtocolViolation(f"measurement record {index} ends before it starts")
        metrics.MEASUREMENT_RECORDS.labels(self._gpu).inc(len(records))
        self._measurements(connection.assignment_id, records)

    # ---- FIKIT ----

    def _add_fikit_task(self, assignment_id: str, region_fd: int, priority: int, task: str) -> int:
        assert self._arbiter is not None
        table: KernelTable | None = None
        if self._kernel_tables is not None:

            def loaded(table: KernelTable) -> None:  # on the event loop: hop to this thread
                self.submit(lambda: self._install_kernels(assignment_id, table))

            table = self._kernel_tables.lookup(task, loaded)
        slot = self._arbiter.add_task(region_fd, priority, table or ())
        log.info(
            "fikit task admitted",
            gpu=self._gpu,
            assignment=assignment_id,
            task=task,
            priority=priority,
            kernels=None if table is None else len(table),
        )
        return slot

    def _install_kernels(self, assignment_id: str, table: KernelTable) -> None:
        connection = self._by_assignment.get(assignment_id)
        if connection is None or connection.fikit_slot is None or self._arbiter is None:
            return  # gone meanwhile
        self._arbiter.set_kernels(connection.fikit_slot, table)
        log.info("fikit kernel profile installed", assignment=assignment_id, kernels=len(table))

    def _fikit_metrics(self) -> None:
        if self._arbiter is None:
            return
        stats, core = self._arbiter.stats(), self._arbiter.core_counters()
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

    # ---- the lease desk ----

    def _next_wakeup(self) -> float | None:
        scheduler = self._scheduler
        if self._desk is not None and not scheduler.has_waiting:
            # Nobody waits, so leases that expire free nothing anyone needs now: they are ended
            # at the next call. Windows need nobody either: the desk rolls budgets itself.
            return None
        return scheduler.next_deadline()

    def _quiesce(self) -> None:
        """Before this thread writes lease words or the scheduler may grant: withdraw every
        term (after this the desk writes nothing) and take the desk's journal into the books."""
        if self._desk is None:
            return
        if not self._desk_revoked:
            self._desk.revoke_all()
            self._desk_revoked = True
        self._take_desk_events()

    def _take_desk_events(self) -> None:
        desk = self._desk
        if desk is None:
            return
        forwarded: collections.deque[DeskEvent] = collections.deque()
        self._import(desk.take(), forwarded)
        while forwarded:
            event = forwarded.popleft()
            connection = self._by_desk_slot.get(event.slot)
            if connection is None or connection.assignment_id is None:
                continue
            try:
                if not self._desk_revoked and self._grant_beside_terms(connection, event):
                    continue
                if not self._desk_revoked:
                    # It may have to wait, or displace terms: withdraw them all first, and take
                    # the renewals made meanwhile into the books before deciding.
                    desk.revoke_all()
                    self._desk_revoked = True
                    self._import(desk.take(), forwarded)
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
            self._take_desk_events()

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
        terms = scheduler.standing_terms(now, self._desk_clients())
        if client_id not in terms or not self._termed <= terms.keys():
            return False
        self._forwarded_request(connection, event)  # writes only this client's region
        terms = scheduler.standing_terms(now, self._desk_clients())
        if terms.keys() == self._termed | {client_id}:
            self._set_terms(terms)
        else:
            self._quiesce()  # new terms for all after this round
        return True

    def _import_renewal(self, event: DeskEvent) -> None:
        connection = self._by_desk_slot.get(event.slot)
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
            log.warning("lease desk renewal not taken", gpu=self._gpu, error=str(error))
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
        """A request the desk had no terms for: answered as a LeaseRequest frame is."""
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
        """After this thread's decisions: the policy's standing terms to every desk client."""
        if self._desk is None or not self._desk_revoked:
            return
        self._set_terms(self._scheduler.standing_terms(time.monotonic(), self._desk_clients()))
        self._desk_revoked = False

    def _refresh_terms(self) -> None:
        """New lease lengths (q follows the reported bursts) and budgets for the clients that
        hold terms. In place, without withdrawing them, when the same clients get terms (their
        SMs fit together as before); otherwise through a full withdrawal."""
        if self._desk is None or self._desk_revoked:
            return
        self._take_desk_events()
        if self._desk_revoked:  # a forwarded request came: new terms follow its decision
            return
        terms = self._scheduler.standing_terms(time.monotonic(), self._desk_clients())
        if set(terms) == self._termed:
            self._set_terms(terms)
        else:
            self._quiesce()

    def _desk_clients(self) -> set[str]:
        """The clients the desk serves (a process asking over the socket, or a suspended one,
        gets no terms)."""
        return {
            c.assignment_id
            for c in self._by_desk_slot.values()
            if c.assignment_id and c.assignment_id not in self._suspended
        }

    def _set_terms(self, terms: dict[str, StandingTerms]) -> None:
        desk, config = self._desk, self._scheduler.config
        assert desk is not None
        self._termed = set()
        for slot, connection in self._by_desk_slot.items():
            given = terms.get(connection.assignment_id or "")
            if given is None:
                continue
            desk.set_terms(
                slot, given.lease_s, given.budget_s, config.lease_min_s, given.limit_s,
                config.window_s, given.window_end,
            )  # fmt: skip
            self._termed.add(connection.assignment_id or "")

    def _desk_metrics(self) -> None:
        if self._desk is None:
            return
        stats, seen = self._desk.stats(), self._desk_seen
        for event in ("renewed", "forwarded", "invalid_writes", "throttled"):
            delta = getattr(stats, event) - getattr(seen, event)
            if delta:
                metrics.DESK_EVENTS.labels(self._gpu, event).inc(delta)
        self._desk_seen = stats

    # ---- decisions -> shared memory ----

    def _admit_to_scheduler(self, reservation: Reservation, now: float) -> Decision | None:
        if reservation.mode is not ShimMode.SHARE or self._arbiter is not None:
            return None
        quota = reservation.share.quota
        self._scheduler.add_client(
            ClientShare(
                reservation.assignment_id,
                reservation.share.sm_percent,
                quota.request_percent / 100,
                quota.limit_percent / 100,
            ),
            now,
        )
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

    def _send(self, connection: _Connection, message: shim_pb2.DispatcherMessage) -> None:
        frame = encode_frame(message.SerializeToString())
        if connection.out:
            connection.out += frame
        else:
            try:
                sent = connection.sock.send(frame)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                return  # the read side will notice the dead peer
            if sent < len(frame):
                connection.out += frame[sent:]
                self._epoll.modify(connection.sock.fileno(), select.EPOLLIN | select.EPOLLOUT)
        if len(connection.out) > self._limits.max_unsent_bytes:
            self._close(connection, "client does not read its socket")

    def _flush(self, connection: _Connection) -> None:
        try:
            sent = connection.sock.send(connection.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._close(connection, f"send failed: {error.strerror}")
            return
        del connection.out[:sent]
        if not connection.out:
            self._epoll.modify(connection.sock.fileno(), select.EPOLLIN)

    def _refuse(self, connection: _Connection, reason: str, assignment_id: str = "") -> None:
        message = shim_pb2.DispatcherMessage(error=shim_pb2.ProtocolError(message=reason))
        self._send(connection, message)
        self._emit(EventKind.REFUSED, assignment_id or connection.assignment_id or "", reason)
        self._close(connection, reason, flush=True, refused=True)

    def _log_refusal(self, uid: int, event: str, **fields: object) -> None:
        """A refusal's warning, at the bounded rate of its user (refusal_log.py)."""
        left_out = self._refusals.admit(uid, time.monotonic())
        if left_out is None:
            metrics.REFUSALS_UNLOGGED.labels(self._gpu).inc()
            return
        if left_out:
            fields["not_logged_since"] = left_out
        log.warning(event, gpu=self._gpu, uid=uid, **fields)

    def _close(
        self,
        connection: _Connection,
        reason: str,
        quiet: bool = False,
        flush: bool = False,
        refused: bool = False,
    ) -> None:
        sock = connection.sock
        if sock.fileno() < 0:
            return
        if flush and connection.out:
            with contextlib.suppress(OSError):  # best effort: tell the peer why, then hang up
                sock.send(connection.out)
        if self._connections.pop(sock.fileno(), None) is not None:
            uid = connection.peer[1]
            self._per_uid[uid] -= 1
            if not self._per_uid[uid]:
                del self._per_uid[uid]
        self._epoll.unregister(sock.fileno())
        sock.close()
        self._collect_from(connection)  # its last memory samples, before the region goes
        current = self._by_assignment.get(connection.assignment_id or "") is connection
        if current and self._introspector is not None:
            # No process, no new samples: the last cycle stands (until one registers again).
            self._introspector.set_frozen(connection.assignment_id or "", True)
        if connection.desk_slot is not None and self._desk is not None:
            # Its journaled renewals go into the books before the desk forgets them.
            self._take_desk_events()
            self._desk.remove(connection.desk_slot)
            del self._by_desk_slot[connection.desk_slot]
            self._termed.discard(connection.assignment_id or "")
            connection.desk_slot = None
        assignment_id = connection.assignment_id
        if assignment_id is not None and self._by_assignment.get(assignment_id) is connection:
            del self._by_assignment[assignment_id]
            if connection.mode is ShimMode.SHARE:
                # A dead client's lease ends now; it is charged the time it held it.
                self._before_departure()
                self._apply(self._scheduler.withdraw(assignment_id, time.monotonic()))
            self._emit(EventKind.DISCONNECTED, assignment_id, reason)
        if connection.fikit_slot is not None and self._arbiter is not None:
            self._arbiter.remove_task(connection.fikit_slot)
            connection.fikit_slot = None
        if connection.beat_slot is not None and self._heart is not None:
            self._heart.remove(connection.beat_slot)
            connection.beat_slot = None
        if connection.region is not None:
            connection.region.close()
            connection.region = None
        pid = connection.peer[0]
        if quiet:
            log.info("shim disconnected", gpu=self._gpu, pid=pid, reason=reason)
        elif refused:
            self._log_refusal(connection.peer[1], "shim refused", pid=pid, reason=reason)
        else:
            log.warning("shim connection closed", gpu=self._gpu, pid=pid, reason=reason)
        metrics.CONNECTIONS_CLOSED.labels(self._gpu, _reason_label(reason)).inc()

    def _housekeeping(self, now: float) -> None:
        for connection in list(self._connections.values()):
            if connection.assignment_id is None and now > connection.deadline:
                self._refuse(connection, "no registration within the time limit")
        if self._suspended:
            until = _suspend_deadline_ns()
            for assignment_id in self._suspended:
                connection = self._by_assignment.get(assignment_id)
                if connection is not None and connection.region is not None:
                    connection.region.renew_suspension(until)
        self._fikit_metrics()
        self._refresh_terms()
        self._desk_metrics()
        self._leases_granted.inc(self._granted_since_flush)
        self._granted_since_flush = 0
        waits, self._waits = self._waits, []
        for wait in waits:
            self._lease_wait.observe(wait)
        snapshot = self._scheduler.snapshot(now)
        metrics.QUEUE_DEPTH.labels(self._gpu).set(len(snapshot.waiting))
        metrics.CONNECTIONS.labels(self._gpu).set(len(self._connections))
        used_total = 0.0
        for client_id, client in snapshot.clients.items():
            used = client.used_s / self._scheduler.config.window_s
            used_total += used
            metrics.CLIENT_USED.labels(self._gpu, client_id).set(used)
            quota = metrics.CLIENT_QUOTA
            quota.labels(self._gpu, client_id, "request").set(client.share.quota_request)
            quota.labels(self._gpu, client_id, "limit").set(client.share.quota_limit)
        metrics.QUOTA_USED.labels(self._gpu).set(used_total)
        metrics.QUOTA_RESERVED.labels(self._gpu).set(self._book.quota_reserved_percent() / 100)
        metrics.MEMORY_RESERVED.labels(self._gpu).set(self._book.memory_reserved_bytes())

    def _emit_granted(self, lease: Lease) -> None:
        length_ms = (lease.expires_at - lease.granted_at) * 1e3
        self._emit(
            EventKind.LEASE_GRANTED,
            lease.client_id,
            lease_id=lease.lease_id,
            lease_ms=length_ms if math.isfinite(length_ms) else 0.0,
        )

    def _emit(
        self,
        kind: EventKind,
        assignment_id: str,
        detail: str = "",
        lease_id: int = 0,
        lease_ms: float = 0.0,
    ) -> None:
        self._on_event(
            DispatcherEvent(kind, time.time(), assignment_id, detail, lease_id, lease_ms)
        )


def _suspend_deadline_ns() -> int:
    return time.monotonic_ns() + int(SUSPEND_HOLD_S * 1e9)


def _deadline_ns(lease: Lease) -> int:
    return OPEN_ENDED_NS if math.isinf(lease.expires_at) else int(lease.expires_at * 1e9)


def _still_runs(process: BoundProcess) -> bool:
    """Whether the process a token is bound to still runs (not a later one with its pid)."""
    return _process_start_ticks(process.pid) == process.start_ticks


def _process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat: when the process started, in clock ticks since boot."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as proc_stat:
            text = proc_stat.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; fields follow the last ')'.
    fields = text[text.rfind(b")") + 2 :].split()
    return int(fields[19])


def _remove_stale_socket(path: Path) -> None:
    """Remove a socket left by a dead dispatcher; refuse to touch anything else or a live one."""
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise OSError(f"{path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink()
        return
    except OSError as error:
        raise OSError(f"{path} exists and is not a usable socket: {error}") from None
    finally:
        probe.close()
    raise OSError(f"another dispatcher is listening on {path}")


_REASON_LABELS = ("peer closed", "goodbye", "evicted", "unknown assignment token", "frame")


def _reason_label(reason: str) -> str:
    """Bounded label values for the metric (reasons carry free text)."""
    for label in _REASON_LABELS:
        if reason.startswith(label):
            return label
    return "other"
