"""The shim channel's registration: a connection accepted, its peer identified, its token bound,
its region made and its admission set up (in the admission engine: its leases, its kernels under
FIKIT; the heartbeat): a part of ShimChannel (server.py), run on its thread."""

from __future__ import annotations

import array
import contextlib
import os
import select
import socket
import time

from gpuloom.domain.errors import DomainError
from gpuloom.services.dispatcher import metrics
from gpuloom.services.dispatcher.admission_engine import ArbiterFull, DeskFull
from gpuloom.services.dispatcher.channel.model import (
    _PEERCRED,
    ProtocolViolation,
    _Connection,
    _deadline_ns,
    _process_start_ticks,
    _still_runs,
    _suspend_deadline_ns,
    log,
)
from gpuloom.services.dispatcher.domain import (
    BoundProcess,
    EventKind,
    derive_task_key,
)
from gpuloom.services.dispatcher.harvest_gauge import launch_profile_of
from gpuloom.services.dispatcher.kernel_tables import KernelTable
from gpuloom.shimwire import (
    PROTOCOL_VERSION,
    REGION_BYTES,
    AdmissionRegion,
    FrameReader,
    ShimMode,
    encode_frame,
)
from gpuloom.v1 import shim_pb2


class RegistrationPart:
    """Methods of ShimChannel; its state is ShimChannel's (server.py)."""

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
        if mode is ShimMode.SHARE and self._fikit:
            mode = ShimMode.FIKIT
        region, fd = AdmissionRegion.create(f"gpuloom-{assignment_id}", self._sample_period_us)
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
                    assignment_id, fd, reservation.priority, reservation.share.sm_percent, task_key
                )
                if self._composed:  # its level's leases: renewed by the engine too
                    self._add_leased(connection, fd)
            except (ArbiterFull, DeskFull, OSError) as error:
                region.close()
                os.close(fd)
                self._refuse(connection, str(error), assignment_id)
                return False
            if self._composed:
                region.publish_leased()  # before the shim sees it
                lease = self._scheduler.lease_of(assignment_id)
                if lease is not None and not suspended:  # reconnected while holding a lease
                    region.publish_lease(lease.lease_id, _deadline_ns(lease))
            fds.append(self._engine.doorbell_fd)
            fds.extend(self._engine.board_fds(reservation.priority))
        elif mode is ShimMode.SHARE:
            snapshot = self.scheduler_snapshot()
            lease = snapshot.clients[assignment_id].lease
            if lease is not None and not suspended:  # reconnected while holding a lease
                region.publish_lease(lease.lease_id, _deadline_ns(lease))
            try:
                self._add_leased(connection, fd)
            except (DeskFull, OSError) as error:
                # Served all the same: without the doorbell it asks over the socket.
                log.warning("admission engine refused a process", gpu=self._gpu, error=str(error))
            else:
                fds.append(self._engine.doorbell_fd)
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
        if mode is ShimMode.FIKIT and self._harvest is not None:
            self._harvest.add(
                assignment_id, task_key, reservation.priority, region.fikit_seq,
                time.monotonic_ns(),
            )  # fmt: skip
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

    def _add_leased(self, connection: _Connection, region_fd: int) -> None:
        """Its leases renewed by the engine from standing terms (raises DeskFull, OSError). No
        terms yet: its first request is forwarded, and granted beside the others' terms when
        they leave room for it."""
        connection.lease_slot = self._engine.add_leased(region_fd)
        self._by_lease_slot[connection.lease_slot] = connection

    def _add_fikit_task(
        self, assignment_id: str, region_fd: int, priority: int, sm_percent: int, task: str
    ) -> int:
        table: KernelTable | None = None
        if self._kernel_tables is not None:

            def loaded(table: KernelTable) -> None:  # on the event loop: hop to this thread
                self.submit(lambda: self._install_kernels(assignment_id, table, task))

            table = self._kernel_tables.lookup(task, loaded)
        if table is not None and self._harvest is not None:
            self._harvest.set_profile(task, launch_profile_of(table))
        slot = self._engine.add_task(region_fd, priority, table or (), sm_percent)
        log.info(
            "fikit task admitted",
            gpu=self._gpu,
            assignment=assignment_id,
            task=task,
            priority=priority,
            kernels=None if table is None else len(table),
        )
        return slot

    def _install_kernels(self, assignment_id: str, table: KernelTable, task: str) -> None:
        connection = self._by_assignment.get(assignment_id)
        if connection is None or connection.fikit_slot is None:
            return  # gone meanwhile
        self._engine.set_kernels(connection.fikit_slot, table)
        if self._harvest is not None:
            self._harvest.set_profile(task, launch_profile_of(table))
        log.info("fikit kernel profile installed", assignment=assignment_id, kernels=len(table))

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
