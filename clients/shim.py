"""The client side of the shim channel in Python: the reference the C shim must match.

Tests, the simulator and the benchmark use it as a GPU process would use the shim:

    with ShimClient.connect(socket_path, token) as shim:
        while work:
            lease = shim.acquire()            # blocks (bounded) until admitted
            ... run kernels until lease.until_ns ...
            shim.record_usage(gpu_s, burst_s)  # carried by the next lease request

`acquire` costs one shared-memory load while the lease lasts; only when it must wait does it
send a LeaseRequest frame and sleep on the region's futex word.
"""

from __future__ import annotations

import array
import contextlib
import os
import select
import socket
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from gpuloom.shimwire import (
    FRAME_HEADER,
    PROTOCOL_VERSION,
    AdmissionRegion,
    AdmissionState,
    DeskPort,
    FrameReader,
    ShimMode,
    encode_frame,
)
from gpuloom.v1 import shim_pb2


class ShimChannelError(Exception):
    """The dispatcher refused us, broke the protocol, or cannot be reached."""


class Evicted(ShimChannelError):
    """Our assignment was released or evicted: stop using the GPU."""


@dataclass(frozen=True, slots=True)
class Registration:
    assignment_id: str
    mode: ShimMode
    memory_cap_bytes: int
    sm_percent: int
    priority: int
    window_s: float


@dataclass(frozen=True, slots=True)
class LeaseView:
    lease_id: int
    until_ns: int  # CLOCK_MONOTONIC (time.monotonic_ns); 2**64-1 = open-ended

    def remaining_s(self) -> float:
        return max(0.0, (self.until_ns - time.monotonic_ns()) / 1e9)


class ShimClient:
    def __init__(
        self,
        sock: socket.socket,
        registration: Registration,
        region: AdmissionRegion,
        desk: DeskPort | None = None,
    ):
        self._sock = sock
        self.registration = registration
        self.region = region
        # The dispatcher's lease desk, when it runs one: requests go through shared memory.
        self.desk = desk
        self._reader = FrameReader()
        self._used_s = 0.0
        self._burst_s = 0.0
        self._usage_lease = 0
        # Device memory this process holds, sent with every usage report (as the C shim does).
        self.allocated_bytes = 0
        # A lease we gave back stays in the region until the dispatcher has read our release;
        # it must not be used meanwhile.
        self._released_lease = 0
        # Leases that came and expired before this client looked (reported unused).
        self.missed_leases = 0

    @classmethod
    def connect(
        cls,
        socket_path: str | Path,
        token: str,
        process_name: str = "python",
        timeout_s: float = 5.0,
        argv: Sequence[str] | None = None,
        use_desk: bool = True,
    ) -> ShimClient:
        """Register with the dispatcher. `argv` (default: this process's sys.argv) is sent so
        that a reservation without a task key gets one derived from the command line. With
        `use_desk` (as the C shim does), lease requests go through the dispatcher's lease desk
        when it offers one; otherwise as LeaseRequest frames on the socket."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(socket_path))
            register = shim_pb2.ShimMessage(
                register=shim_pb2.Register(
                    protocol_version=PROTOCOL_VERSION,
                    assignment_token=token,
                    process_name=process_name,
                    argv=list(sys.argv if argv is None else argv)[:64],
                )
            )
            sock.sendall(encode_frame(register.SerializeToString()))
            message, fds = _receive_first(sock)
        except OSError as error:
            sock.close()
            raise ShimChannelError(
                f"cannot reach the dispatcher at {socket_path}: {error}"
            ) from None
        except BaseException:
            sock.close()
            raise
        kind = message.WhichOneof("body")
        # A FIKIT registration (policies fikit and composed) also carries the engine's doorbell
        # and priority boards: this client admits no kernels, so it keeps the region and, under
        # composed, the doorbell to ask for its level's leases as a SHARE client does.
        if (
            kind != "registered"
            or not fds
            or (len(fds) > 2 and message.registered.mode != ShimMode.FIKIT)
        ):
            for fd in fds:
                os.close(fd)
            sock.close()
            if kind == "error":
                raise ShimChannelError(f"dispatcher refused registration: {message.error.message}")
            raise ShimChannelError(f"unexpected answer to register: {kind} with {len(fds)} fds")
        try:
            region = AdmissionRegion.open(fds[0])
        finally:
            os.close(fds[0])
        desk = None
        leased = message.registered.mode == ShimMode.SHARE or region.fikit_leased
        if len(fds) >= 2 and use_desk and leased:
            desk = DeskPort(region.mapping, fds[1])
        for fd in fds[2 if desk is not None else 1 :]:
            os.close(fd)
        registered = message.registered
        registration = Registration(
            assignment_id=registered.assignment_id,
            mode=ShimMode(registered.mode),
            memory_cap_bytes=registered.memory_cap_bytes,
            sm_percent=registered.sm_percent,
            priority=registered.priority,
            window_s=registered.window_ns / 1e9,
        )
        sock.settimeout(timeout_s)
        return cls(sock, registration, region, desk)

    # ---- leases ----

    def current_lease(self) -> LeaseView | None:
        """The lease in force now, from shared memory (no system call)."""
        until = self.region.admit_until_ns
        if time.monotonic_ns() < until:
            lease_id = self.region.lease_id
            if lease_id == 0 or lease_id != self._released_lease:
                return LeaseView(lease_id, until)
        return None

    def suspended(self) -> bool:
        """The dispatcher suspended this process (SuspendClient) and keeps renewing it."""
        until = self.region.suspended_until_ns
        return until != 0 and time.monotonic_ns() < until

    def acquire(self, timeout_s: float = 5.0) -> LeaseView:
        """Return a lease in force, asking for one and waiting (at most `timeout_s`) if needed.
        While the process is suspended it waits without that bound (as the C shim does), and
        asks again once resumed."""
        region = self.region
        lease = self.current_lease()
        if lease is not None:
            return lease
        if region.state is AdmissionState.EVICTED:
            raise Evicted(self._reason_from_socket() or "assignment ended")
        deadline = time.monotonic() + timeout_s
        epoch = region.epoch
        seen_lease = region.lease_id
        self._ask()
        while True:
            lease = self.current_lease()
            if lease is not None:
                return lease
            if region.state is AdmissionState.EVICTED:
                raise Evicted(self._reason_from_socket() or "assignment ended")
            if self.suspended():
                while self.suspended() and region.state is not AdmissionState.EVICTED:
                    region.wait_for_change(region.epoch, 0.02)
                    self._check_socket()
                deadline = time.monotonic() + timeout_s  # a fresh bound once resumed
                epoch, seen_lease = region.epoch, region.lease_id
                self._ask()
                continue
            missed = region.lease_id
            if missed not in (0, seen_lease):
                # A lease came and expired before we looked (a short one, or we were slow to
                # wake): report it unused and ask again.
                self._flush_usage(release=False)
                self._usage_lease, seen_lease = missed, missed
                self.missed_leases += 1
                self._ask()
            left = deadline - time.monotonic()
            if left <= 0:
                self._check_socket()
                raise TimeoutError(f"no lease within {timeout_s} s")
            region.wait_for_change(epoch, min(left, 0.05))
            new_epoch = region.epoch
            if new_epoch == epoch:
                self._check_socket()
            epoch = new_epoch

    def record_usage(self, gpu_s: float, burst_s: float = 0.0) -> None:
        """Account GPU time measured under the current lease (sent with the next request)."""
        lease_id = self.region.lease_id
        if lease_id != self._usage_lease:
            self._flush_usage(release=False)
            self._usage_lease = lease_id
        self._used_s += gpu_s
        self._burst_s = max(self._burst_s, burst_s)

    def release(self) -> None:
        """End the current lease early, reporting its usage: no more work for now."""
        lease = self.current_lease()
        if lease is None or lease.lease_id == 0:
            return  # nothing held (an open-ended admission has nothing to give back)
        if self._usage_lease != lease.lease_id:
            self._flush_usage(release=False)
            self._usage_lease = lease.lease_id
        self._released_lease = lease.lease_id
        epoch = self.region.epoch
        self._flush_usage(release=True)
        if self.desk is not None:
            # The release travels on the socket, a request through shared memory, which is
            # faster: wait until the dispatcher has taken the release (it revokes the lease),
            # so that the next request is decided with this lease's usage charged.
            deadline = min(lease.until_ns / 1e9, time.monotonic() + 1.0) + 0.001
            while self.region.epoch == epoch and (left := deadline - time.monotonic()) > 0:
                self.region.wait_for_change(epoch, left)

    def send_measurements(self, records: Iterable[shim_pb2.KernelRecord]) -> None:
        batch = shim_pb2.MeasurementBatch(records=list(records))
        self._send(shim_pb2.ShimMessage(measurements=batch))

    def close(self) -> None:
        if self._sock.fileno() >= 0:
            with contextlib.suppress(ShimChannelError):
                self._send(shim_pb2.ShimMessage(goodbye=shim_pb2.Goodbye()))
            self._sock.close()
        if self.desk is not None:
            self.desk.close()
        self.region.close()

    def __enter__(self) -> ShimClient:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- internals ----

    def _ask(self) -> None:
        """Ask for a lease, with the usage report of the lease that ended."""
        report = self._take_report(release=False) if self._usage_lease else None
        if self.desk is None:
            request = shim_pb2.LeaseRequest()
            if report is not None:
                request.report.CopyFrom(report)
            self._send(shim_pb2.ShimMessage(lease_request=request))
        elif report is None:
            self.desk.post()
        else:
            self.desk.post(
                report.lease_id,
                report.gpu_time_ns,
                report.longest_burst_ns,
                allocated_bytes=report.allocated_bytes,
            )

    def _take_report(self, release: bool) -> shim_pb2.UsageReport:
        report = shim_pb2.UsageReport(
            lease_id=self._usage_lease,
            gpu_time_ns=int(self._used_s * 1e9),
            longest_burst_ns=int(self._burst_s * 1e9),
            release=release,
            allocated_bytes=self.allocated_bytes,
        )
        self._usage_lease, self._used_s, self._burst_s = 0, 0.0, 0.0
        return report

    def _flush_usage(self, release: bool) -> None:
        if self._usage_lease:
            self._send(shim_pb2.ShimMessage(usage=self._take_report(release)))

    def _send(self, message: shim_pb2.ShimMessage) -> None:
        try:
            self._sock.sendall(encode_frame(message.SerializeToString()))
        except OSError as error:
            raise ShimChannelError(f"lost the dispatcher: {error}") from None

    def _pending_messages(self) -> tuple[list[shim_pb2.DispatcherMessage], bool]:
        """Messages the dispatcher sent since we last looked (non-blocking), and whether it has
        closed the connection."""
        messages: list[shim_pb2.DispatcherMessage] = []
        while True:
            # A poll first: the socket has a timeout for sends, which would also make a
            # non-blocking receive wait.
            readable, _, _ = select.select([self._sock], [], [], 0)
            if not readable:
                return messages, False
            try:
                data = self._sock.recv(65536)
            except OSError as error:
                raise ShimChannelError(f"lost the dispatcher: {error}") from None
            if not data:
                return messages, True
            messages.extend(
                shim_pb2.DispatcherMessage.FromString(frame) for frame in self._reader.feed(data)
            )

    def _check_socket(self) -> None:
        messages, closed = self._pending_messages()
        for message in messages:
            kind = message.WhichOneof("body")
            if kind == "evicted":
                raise Evicted(message.evicted.reason)
            if kind == "error":
                raise ShimChannelError(f"dispatcher: {message.error.message}")
        if closed:
            raise ShimChannelError("the dispatcher closed the connection")

    def _reason_from_socket(self) -> str:
        try:
            self._check_socket()
        except Evicted as evicted:
            return str(evicted)
        except ShimChannelError:
            return ""
        return ""


def _receive_first(sock: socket.socket) -> tuple[shim_pb2.DispatcherMessage, list[int]]:
    """Read the first frame and the descriptors that ride on it."""
    fds = array.array("i")
    data = b""
    while len(data) < FRAME_HEADER.size:
        # Read no further than the header: the fd rides on the first byte, and anything after
        # this frame belongs to the regular reader.
        want = FRAME_HEADER.size - len(data)
        chunk, ancillary, _flags, _ = sock.recvmsg(want, socket.CMSG_SPACE(4 * fds.itemsize))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % fds.itemsize
                fds.frombytes(payload[:usable])
        if not chunk:
            raise OSError("connection closed during registration")
        data += chunk
    (length,) = FRAME_HEADER.unpack_from(data)
    while len(data) < FRAME_HEADER.size + length:
        chunk = sock.recv(FRAME_HEADER.size + length - len(data))
        if not chunk:
            raise OSError("connection closed during registration")
        data += chunk
    payload = data[FRAME_HEADER.size : FRAME_HEADER.size + length]
    return shim_pb2.DispatcherMessage.FromString(payload), list(fds)
