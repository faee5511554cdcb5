"""The shim channel of one GPU: a Unix-socket server on a dedicated thread.

The thread owns the token scheduler, every connection and every admission region, so a lease
request it answers (a LeaseRequest frame in, a lease written to shared memory) takes no lock and
never waits for the asyncio loop that serves gRPC. The control plane reaches the thread through
`submit`, which queues a function and wakes the thread with an eventfd.

Admission itself runs in the GPU's native admission engine (admission_engine.py), one thread
for every policy. A shim's lease request (mode SHARE, or mode FIKIT under policy composed) does
not come here at all while the token policy has given it standing terms: the engine renews the
lease from them, and this thread takes the engine's journal into the scheduler's books
afterwards. Requests without terms are forwarded here and answered as before; then every term
is withdrawn (so only this thread writes lease words) until the decision is made and new terms
are given. Kernels (mode FIKIT) are admitted by the engine's FIKIT half; this thread only adds
and removes its tasks.

The thread also reads every shim's memory sample ring (every SAMPLE_POLL_S) into the training
introspector, and suspends and resumes clients (SuspendClient, ResumeClient): a suspension
waits, bounded, for the client's memory to reach its cycle's low point, then withdraws its lease
(a SHARE client gets no lease and no standing terms while suspended) and writes the suspension
word of its region, which it renews while the suspension lasts (docs/training.md).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from gpuloom.policies.admission.levels import LevelScheduler
from gpuloom.policies.fikit.core import FikitCounters
from gpuloom.policies.tokens.scheduler import (
    SchedulerSnapshot,
    TokenScheduler,
)
from gpuloom.services.dispatcher import metrics
from gpuloom.services.dispatcher.admission_engine import (
    AdmissionEngine,
    ArbiterStats,
    DeskStats,
)
from gpuloom.services.dispatcher.channel.engine import EnginePart
from gpuloom.services.dispatcher.channel.model import (
    _RECV_BYTES,
    SAMPLE_POLL_S,
    SUSPEND_POLL_S,
    ChannelLimits,
    ConnectedProcess,
    MeasurementSink,
    ProtocolViolation,
    _Connection,
    _PendingSuspend,
    _reason_label,
    _remove_stale_socket,
    _suspend_deadline_ns,
    log,
)
from gpuloom.services.dispatcher.channel.registration import RegistrationPart
from gpuloom.services.dispatcher.channel.suspension import SuspensionPart
from gpuloom.services.dispatcher.domain import (
    DispatcherEvent,
    EventKind,
    Reservation,
    Suspension,
)
from gpuloom.services.dispatcher.harvest_gauge import HarvestGauge, HarvestWindow
from gpuloom.services.dispatcher.heartbeat import Heartbeat
from gpuloom.services.dispatcher.introspection import TrainingIntrospector
from gpuloom.services.dispatcher.kernel_tables import KernelTables
from gpuloom.services.dispatcher.refusal_log import RefusalLog
from gpuloom.services.dispatcher.reservations import ReservationBook
from gpuloom.services.dispatcher.timer import DeadlineTimer
from gpuloom.shimwire import (
    FrameError,
    ShimMode,
    encode_frame,
)
from gpuloom.v1 import shim_pb2

T = TypeVar("T")


class ShimChannel(SuspensionPart, RegistrationPart, EnginePart):
    def __init__(
        self,
        gpu_label: str,
        socket_path: Path,
        book: ReservationBook,
        scheduler: TokenScheduler | LevelScheduler,
        on_event: Callable[[DispatcherEvent], None],
        measurements: MeasurementSink,
        engine: AdmissionEngine,
        limits: ChannelLimits | None = None,
        window_s: float = 1.0,
        choose_mode: Callable[[Reservation, str], ShimMode] | None = None,
        fikit: bool = False,
        composed: bool = False,
        kernel_tables: KernelTables | None = None,
        introspector: TrainingIntrospector | None = None,
        harvest_window_s: float = 10.0,
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
        # The GPU's admission engine, for every policy (its owner stops it after the channel).
        # Policy fikit: shares are admitted kernel by kernel by its FIKIT half, not leased.
        # Policy composed: by the FIKIT half too, each after a lease of its priority level (the
        # scheduler is then a LevelScheduler), renewed by its lease half as a token policy's.
        self._engine = engine
        self._fikit = fikit or composed
        self._composed = composed
        self._kernel_tables = kernel_tables
        # The harvest gauge: FIKIT processes' launches per job (docs/harvest.md).
        self._harvest = HarvestGauge(gpu_label, harvest_window_s) if self._fikit else None
        self._fikit_seen = ArbiterStats(*[0] * len(dataclasses.fields(ArbiterStats)))
        self._fikit_core_seen = FikitCounters(*[0] * len(dataclasses.fields(FikitCounters)))
        self._lease_seen = DeskStats(*[0] * len(dataclasses.fields(DeskStats)))
        self._by_lease_slot: dict[int, _Connection] = {}
        # Every term withdrawn (so this thread may write lease words); new ones are due.
        self._terms_revoked = True
        self._termed: set[str] = set()  # the clients whose terms the engine holds
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
            self._engine.notify_fd: "engine",
        }
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
        if self._heart is not None:
            self._heart.stop()
        if self._harvest is not None:
            self._harvest.close()

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
        if mode is ShimMode.SHARE and (not self._fikit or self._composed):
            self._before_departure()
            self._apply(self._scheduler.remove_client(assignment_id, now))
            with contextlib.suppress(KeyError):  # never reported yet
                metrics.CLIENT_USED.remove(self._gpu, assignment_id)
                for bound in ("request", "limit"):
                    metrics.CLIENT_QUOTA.remove(self._gpu, assignment_id, bound)

    def move_client(self, assignment_id: str, socket_path: str, token: str) -> bool:
        """Tell a connected process it now runs on another GPU: it registers with that GPU's
        dispatcher (`socket_path`, under `token`) and closes this connection. False: no process
        is connected under the assignment."""
        connection = self._by_assignment.get(assignment_id)
        if connection is None:
            return False
        move = shim_pb2.DispatcherMessage(
            move_to=shim_pb2.MoveTo(socket_path=socket_path, token=token)
        )
        self._send(connection, move)
        return True

    def connected(self) -> dict[str, ConnectedProcess]:
        """assignment id -> the process of every registered connection."""
        return {
            assignment: ConnectedProcess(
                connection.peer[0], connection.requested_at, connection.allocated_bytes
            )
            for assignment, connection in self._by_assignment.items()
        }

    def scheduler_snapshot(self) -> SchedulerSnapshot:
        self._take_lease_events()
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
        elif kind == "engine":
            self._engine.clear_notification()
            self._take_lease_events()

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
        if self._harvest is not None and connection.assignment_id is not None:
            region = connection.region
            seq = (
                None
                if region is None or connection.mode is not ShimMode.FIKIT
                else region.fikit_seq
            )
            self._harvest.remove(connection.assignment_id, seq, time.monotonic_ns())
        current = self._by_assignment.get(connection.assignment_id or "") is connection
        if current and self._introspector is not None:
            # No process, no new samples: the last cycle stands (until one registers again).
            self._introspector.set_frozen(connection.assignment_id or "", True)
        if connection.lease_slot is not None:
            # Its journaled renewals go into the books before the engine forgets them.
            self._take_lease_events()
            self._engine.remove_leased(connection.lease_slot)
            del self._by_lease_slot[connection.lease_slot]
            self._termed.discard(connection.assignment_id or "")
            connection.lease_slot = None
        assignment_id = connection.assignment_id
        if assignment_id is not None and self._by_assignment.get(assignment_id) is connection:
            del self._by_assignment[assignment_id]
            if self._leased(connection):
                # A dead client's lease ends now; it is charged the time it held it.
                self._before_departure()
                self._apply(self._scheduler.withdraw(assignment_id, time.monotonic()))
            self._emit(EventKind.DISCONNECTED, assignment_id, reason)
        if connection.fikit_slot is not None:
            self._engine.remove_task(connection.fikit_slot)
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
        self._harvest_counts()
        self._refresh_terms()
        self._lease_metrics()
        self._leases_granted.inc(self._granted_since_flush)
        self._granted_since_flush = 0
        waits, self._waits = self._waits, []
        for wait in waits:
            self._lease_wait.observe(wait)
        snapshot = self._scheduler.snapshot(now)
        metrics.QUEUE_DEPTH.labels(self._gpu).set(len(snapshot.waiting))
        metrics.CONNECTIONS.labels(self._gpu).set(len(self._connections))
        used_total = 0.0
        levels = self._scheduler if isinstance(self._scheduler, LevelScheduler) else None
        by_level: dict[int, float] = {}
        for client_id, client in snapshot.clients.items():
            used = client.used_s / self._scheduler.config.window_s
            used_total += used
            if levels is not None:
                level = levels.priority_of(client_id)
                by_level[level] = by_level.get(level, 0.0) + used
            metrics.CLIENT_USED.labels(self._gpu, client_id).set(used)
            quota = metrics.CLIENT_QUOTA
            quota.labels(self._gpu, client_id, "request").set(client.share.quota_request)
            quota.labels(self._gpu, client_id, "limit").set(client.share.quota_limit)
        metrics.QUOTA_USED.labels(self._gpu).set(used_total)
        for level, used in by_level.items():
            metrics.LEVEL_USED.labels(self._gpu, str(level)).set(used)
        metrics.QUOTA_RESERVED.labels(self._gpu).set(self._book.quota_reserved_percent() / 100)
        metrics.MEMORY_RESERVED.labels(self._gpu).set(self._book.memory_reserved_bytes())

    def harvest_windows(self) -> list[HarvestWindow]:
        """The harvest gauge's latest windows, oldest first (none under a token policy). Call
        it on the channel thread (`submit`)."""
        return [] if self._harvest is None else list(self._harvest.recent)

    def _harvest_counts(self) -> None:
        """Each FIKIT process's launches since the last read into the harvest gauge; at a
        window's end, the gauge's estimates exported."""
        if self._harvest is None:
            return
        now = time.monotonic_ns()
        for assignment_id, connection in self._by_assignment.items():
            if connection.mode is ShimMode.FIKIT and connection.region is not None:
                self._harvest.observe(assignment_id, connection.region.fikit_seq, now)
        self._harvest.roll(now)

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
