"""The shim channel of one GPU: a Unix-socket server on a dedicated thread.

The thread owns the token scheduler, every connection and every admission region, so the hot
path (a LeaseRequest frame in, a lease written to shared memory) takes no lock and never waits
for the asyncio loop that serves gRPC. The control plane reaches the thread through `call`,
which queues a function and wakes the thread with an eventfd.
"""

from __future__ import annotations

import array
import collections
import concurrent.futures
import contextlib
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
from gpuloom.policies.tokens.scheduler import (
    ClientShare,
    Decision,
    Lease,
    SchedulerSnapshot,
    TokenScheduler,
)
from gpuloom.services.dispatcher import metrics
from gpuloom.services.dispatcher.arbiter import Arbiter, ArbiterFull, ArbiterStats
from gpuloom.services.dispatcher.domain import (
    BoundProcess,
    DispatcherEvent,
    EventKind,
    Reservation,
    derive_task_key,
)
from gpuloom.services.dispatcher.kernel_tables import KernelTable, KernelTables
from gpuloom.services.dispatcher.reservations import ReservationBook
from gpuloom.services.dispatcher.timer import DeadlineTimer
from gpuloom.shimwire import (
    OPEN_ENDED_NS,
    PROTOCOL_VERSION,
    REGION_BYTES,
    AdmissionRegion,
    FrameError,
    FrameReader,
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
        "deadline",
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
    ) -> None:
        self._gpu = gpu_label
        self._socket_path = socket_path
        self._book = book
        self._scheduler = scheduler
        self._on_event = on_event
        self._measurements = measurements
        self._limits = limits or ChannelLimits()
        # Which mode a registering process of a task gets (the profiler link turns SHARE into
        # MEASURE while its task is being measured).
        self._choose_mode = choose_mode or (lambda reservation, task_key: reservation.mode)
        self._window_ns = int(window_s * 1e9)
        # Policy fikit: shares are admitted kernel by kernel by the native arbiter, not leased.
        self._arbiter = arbiter
        self._kernel_tables = kernel_tables
        self._fikit_seen = ArbiterStats(0, 0, 0, 0, 0, 0, 0, 0)
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
        log.info("shim channel listening", gpu=self._gpu, socket=str(path))

    def stop(self) -> None:
        if self._thread is None:
            return
        self._running = False
        os.eventfd_write(self._wake_fd, 1)
        self._thread.join(timeout=10)
        self._thread = None
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
        connection = self._by_assignment.get(assignment_id)
        if connection is not None:
            if connection.region is not None:
                connection.region.publish_evicted()
            evicted = shim_pb2.DispatcherMessage(evicted=shim_pb2.Evicted(reason=reason))
            self._send(connection, evicted)
            self._close(connection, "evicted", quiet=True, flush=True)
        if mode is ShimMode.SHARE and self._arbiter is None:
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

    def scheduler_snapshot(self) -> SchedulerSnapshot:
        return self._scheduler.snapshot(time.monotonic())

    # ---- the thread ----

    def _run(self) -> None:
        housekeeping_at = 0.0
        scheduler, timer, poll = self._scheduler, self._timer, self._epoll.poll
        while self._running:
            timer.arm(scheduler.next_deadline())
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
                self._apply(scheduler.advance(now))
            if now >= housekeeping_at:
                housekeeping_at = now + 0.5
                self._housekeeping(now)

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
                log.warning("connection refused", gpu=self._gpu, pid=peer[0], uid=peer[1],
                            reason=refusal)  # fmt: skip
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
                reservation.assignment_id, BoundProcess(pid, start_ticks, uid)
            )
        except DomainError as error:
            self._refuse(connection, error.message, reservation.assignment_id)
            return False
        assignment_id = reservation.assignment_id
        previous = self._by_assignment.get(assignment_id)
        if previous is not None:
            self._close(previous, "replaced by a new connection of the same process")
        task_key = reservation.task_key or derive_task_key(register.process_name, register.argv)
        mode = self._choose_mode(reservation, task_key)
        if mode is ShimMode.SHARE and self._arbiter is not None:
            mode = ShimMode.FIKIT
        region, fd = AdmissionRegion.create(
            f"gpuloom-{assignment_id}",
            reservation.memory_cap_bytes,
            reservation.share.sm_percent,
            mode,
        )
        fds = [fd]
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
        elif mode is ShimMode.SHARE:
            snapshot = self._scheduler.snapshot(time.monotonic())
            lease = snapshot.clients[assignment_id].lease
            if lease is not None:  # the same process reconnected while holding a lease
                region.publish_lease(lease.lease_id, _deadline_ns(lease))
        else:
            region.publish_open()
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
        now = time.monotonic()
        ended = None
        if request.HasField("report") and request.report.lease_id:
            connection.allocated_bytes = request.report.allocated_bytes
            ended = self._charge(assignment_id, request.report, now, ending=True)
        if connection.requested_at is None:
            connection.requested_at = now
        self._apply(ended, self._scheduler.request(assignment_id, now))

    def _usage(self, connection: _Connection, report: shim_pb2.UsageReport) -> None:
        assert connection.assignment_id is not None
        if connection.mode is not ShimMode.SHARE:
            return
        connection.allocated_bytes = report.allocated_bytes
        self._apply(
            self._charge(connection.assignment_id, report, time.monotonic(), report.release)
        )

    def _charge(
        self, assignment_id: str, report: shim_pb2.UsageReport, now: float, ending: bool
    ) -> Decision | None:
        used_s = report.gpu_time_ns / 1e9
        burst_s = report.longest_burst_ns / 1e9 if report.longest_burst_ns else None
        if used_s > _MAX_REPORTED_SECONDS or (burst_s or 0.0) > _MAX_REPORTED_SECONDS:
            raise ProtocolViolation(
                f"usage report of {used_s:.3g} s GPU time in one lease is not plausible"
            )
        if ending:
            return self._scheduler.release(assignment_id, report.lease_id, used_s, burst_s, now)
        self._scheduler.report_usage(assignment_id, report.lease_id, used_s, burst_s, now)
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
        stats, seen = self._arbiter.stats(), self._fikit_seen
        for event in ("requests", "grants", "unknown_kernels", "invalid_writes", "role_races"):
            delta = getattr(stats, event) - getattr(seen, event)
            if delta:
                metrics.FIKIT_EVENTS.labels(self._gpu, event).inc(delta)
        metrics.FIKIT_WAITING.labels(self._gpu).set(stats.waiting)
        self._fikit_seen = stats

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
                    length_ms = (lease.expires_at - lease.granted_at) * 1e3
                    self._emit(
                        EventKind.LEASE_GRANTED,
                        lease.client_id,
                        lease_id=lease.lease_id,
                        lease_ms=length_ms if math.isfinite(length_ms) else 0.0,
                    )
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
        self._close(connection, reason, flush=True)

    def _close(
        self, connection: _Connection, reason: str, quiet: bool = False, flush: bool = False
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
        assignment_id = connection.assignment_id
        if assignment_id is not None and self._by_assignment.get(assignment_id) is connection:
            del self._by_assignment[assignment_id]
            if connection.mode is ShimMode.SHARE:
                # A dead client's lease ends now; it is charged the time it held it.
                self._apply(self._scheduler.withdraw(assignment_id, time.monotonic()))
            self._emit(EventKind.DISCONNECTED, assignment_id, reason)
        if connection.fikit_slot is not None and self._arbiter is not None:
            self._arbiter.remove_task(connection.fikit_slot)
            connection.fikit_slot = None
        if connection.region is not None:
            connection.region.close()
            connection.region = None
        pid = connection.peer[0]
        if quiet:
            log.info("shim disconnected", gpu=self._gpu, pid=pid, reason=reason)
        else:
            log.warning("shim connection closed", gpu=self._gpu, pid=pid, reason=reason)
        metrics.CONNECTIONS_CLOSED.labels(self._gpu, _reason_label(reason)).inc()

    def _housekeeping(self, now: float) -> None:
        for connection in list(self._connections.values()):
            if connection.assignment_id is None and now > connection.deadline:
                self._refuse(connection, "no registration within the time limit")
        self._fikit_metrics()
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


def _deadline_ns(lease: Lease) -> int:
    return OPEN_ENDED_NS if math.isinf(lease.expires_at) else int(lease.expires_at * 1e9)


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
