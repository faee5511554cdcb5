"""The dispatcher's side of measurement sessions (FIKIT, Section 3.2).

While the profiler has a session open for a task on this GPU's model, each process of that
task that registers is one measured run: it is told to measure (MEASURE mode), its kernel
records are forwarded to the profiler with its run index, and its run is complete when it
disconnects. Once the session has its T runs (or closes), the task's next processes share.

Open sessions are polled from the profiler (ListSessions) every `poll_s`; records travel on
one long-lived UploadMeasurements stream, re-opened after a failure (a broken stream loses at
most the batches in flight; measurement data, unlike reservations, may be lost).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import structlog

from gpuloom.services.dispatcher.domain import DispatcherEvent, EventKind, Reservation
from gpuloom.shimwire import ShimMode
from gpuloom.tasks import cancel_and_wait
from gpuloom.transport import open_aio_channel
from gpuloom.v1 import common_pb2, profiler_pb2, profiler_pb2_grpc, shim_pb2

log = structlog.get_logger("gpuloom.dispatcher.profiling")

MAX_QUEUED_UPLOADS = 1000
# Queued batches of one session travel merged, up to this many records a message: the shim
# sends small batches, and one message each is more than the profiler keeps up with.
MAX_MERGED_RECORDS = 65536


@dataclass(frozen=True, slots=True)
class _Run:
    session_id: str
    run: int


class ProfilerLink:
    def __init__(self, address: str, gpu_model: str, poll_s: float = 1.0) -> None:
        self._address = address
        self._gpu_model = gpu_model
        self._poll_s = poll_s
        self._lock = threading.Lock()  # the channel thread and the loop both use the maps
        self._open: dict[str, profiler_pb2.Session] = {}  # task key -> open session
        self._claimed: dict[str, int] = {}  # session id -> run indexes handed out
        self._runs: dict[str, _Run] = {}  # assignment id -> its run
        self._queue: asyncio.Queue[profiler_pb2.MeasurementUpload] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._channel: grpc.aio.Channel | None = None
        self.dropped_uploads = 0

    # ---- life cycle (asyncio) ----

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._channel = open_aio_channel(
            self._address, options=[("grpc.max_send_message_length", 64 << 20)]
        )
        stub = profiler_pb2_grpc.ProfilerStub(self._channel)
        self._tasks = [
            asyncio.create_task(self._poll_sessions(stub)),
            asyncio.create_task(self._upload(stub)),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        if self._channel is not None:
            await self._channel.close()

    # ---- called on the shim channel thread ----

    def choose_mode(self, reservation: Reservation, task_key: str) -> ShimMode:
        """MEASURE for a SHARE process of a task with an open session and runs left (this
        process takes the next run), else the reservation's own mode. `task_key` is the
        reservation's, or the one derived from the process's command line."""
        if reservation.mode is not ShimMode.SHARE or not task_key:
            return reservation.mode
        with self._lock:
            existing = self._runs.get(reservation.assignment_id)
            if existing is not None:  # the same process reconnected: same run
                return ShimMode.MEASURE
            session = self._open.get(task_key)
            if session is None:
                return reservation.mode
            claimed = self._claimed.get(session.session_id, 0)
            if claimed >= session.runs:
                return reservation.mode
            self._claimed[session.session_id] = claimed + 1
            self._runs[reservation.assignment_id] = _Run(session.session_id, claimed)
        log.info(
            "process measures",
            assignment=reservation.assignment_id,
            task=task_key,
            session=session.session_id,
            run=claimed,
        )
        return ShimMode.MEASURE

    def records(self, assignment_id: str, records: Sequence[shim_pb2.KernelRecord]) -> None:
        with self._lock:
            run = self._runs.get(assignment_id)
        if run is None or self._loop is None:
            return  # not a measured run (a MEASURE reservation without a session)
        upload = _columns(run, records)
        self._loop.call_soon_threadsafe(self._enqueue, upload)

    # ---- called on the loop ----

    def on_event(self, event: DispatcherEvent) -> None:
        """A measured process that disconnects has finished its run."""
        if event.kind is not EventKind.DISCONNECTED:
            return
        with self._lock:
            run = self._runs.pop(event.assignment_id, None)
        if run is not None:
            self._enqueue(
                profiler_pb2.MeasurementUpload(session_id=run.session_id, completed_runs=[run.run])
            )

    def _enqueue(self, upload: profiler_pb2.MeasurementUpload) -> None:
        assert self._queue is not None
        # A run's end is never dropped (a session missing one would stay open for ever); its
        # records may be, when the profiler falls behind.
        if self._queue.qsize() >= MAX_QUEUED_UPLOADS and not upload.completed_runs:
            self.dropped_uploads += 1
            if self.dropped_uploads == 1:
                log.warning("profiler not keeping up: dropping measurement batches")
            return
        self._queue.put_nowait(upload)

    async def _poll_sessions(self, stub: profiler_pb2_grpc.ProfilerStub) -> None:
        request = profiler_pb2.ListSessionsRequest(
            state=profiler_pb2.SESSION_STATE_OPEN, gpu_model=self._gpu_model
        )
        reachable = True
        while True:
            try:
                listed = await stub.ListSessions(request, timeout=5)
                open_now = {s.task_key: s for s in listed.sessions}
                with self._lock:
                    self._open = open_now
                    live = {s.session_id for s in open_now.values()}
                    self._claimed = {k: v for k, v in self._claimed.items() if k in live}
                if not reachable:
                    log.info("profiler reachable again", address=self._address)
                reachable = True
            except grpc.aio.AioRpcError as error:
                if reachable:  # once per outage: a wrong address must not pass unnoticed
                    log.warning(
                        "profiler unreachable: tasks share instead of being measured",
                        address=self._address,
                        code=error.code().name,
                    )
                reachable = False
            await asyncio.sleep(self._poll_s)

    async def _upload(self, stub: profiler_pb2_grpc.ProfilerStub) -> None:
        assert self._queue is not None
        queue = self._queue

        async def stream() -> AsyncIterator[profiler_pb2.MeasurementUpload]:
            held: profiler_pb2.MeasurementUpload | None = None
            while True:
                upload = held if held is not None else await queue.get()
                held = None
                while not queue.empty() and _record_count(upload) < MAX_MERGED_RECORDS:
                    following = queue.get_nowait()
                    if following.session_id != upload.session_id:
                        held = following
                        break
                    upload = _merged(upload, following)
                yield upload

        while True:
            try:
                await stub.UploadMeasurements(stream())
            except grpc.aio.AioRpcError as error:
                # The profiler refused a batch (a session closed meanwhile) or went away: the
                # message in flight is lost, the rest continue on a new stream.
                log.warning("measurement upload failed", code=error.code().name,
                            error=error.details())  # fmt: skip
                await asyncio.sleep(0.2)


def _record_count(upload: profiler_pb2.MeasurementUpload) -> int:
    return len(upload.kernel_ids) // 8


def _merged(
    first: profiler_pb2.MeasurementUpload, then: profiler_pb2.MeasurementUpload
) -> profiler_pb2.MeasurementUpload:
    """Two uploads of one session as one: the columns concatenated (little-endian arrays), the
    kernel names and completed runs together. The profiler takes a message's records before
    its completed runs, so a run's records and its end may share a message."""
    named = {kernel.kernel_id for kernel in first.kernels}
    return profiler_pb2.MeasurementUpload(
        session_id=first.session_id,
        kernels=[*first.kernels, *(k for k in then.kernels if k.kernel_id not in named)],
        kernel_ids=first.kernel_ids + then.kernel_ids,
        start_ns=first.start_ns + then.start_ns,
        end_ns=first.end_ns + then.end_ns,
        run_index=first.run_index + then.run_index,
        completed_runs=[*first.completed_runs, *then.completed_runs],
    )


def _columns(run: _Run, records: Sequence[shim_pb2.KernelRecord]) -> profiler_pb2.MeasurementUpload:
    count = len(records)
    ids = np.fromiter((r.kernel_id for r in records), dtype="<u8", count=count)
    starts = np.fromiter((r.start_ns for r in records), dtype="<u8", count=count)
    ends = np.fromiter((r.end_ns for r in records), dtype="<u8", count=count)
    kernels: dict[int, profiler_pb2.KernelInfo] = {}
    for record in records:
        if record.kernel_id not in kernels:
            kernels[record.kernel_id] = profiler_pb2.KernelInfo(
                kernel_id=record.kernel_id,
                name=record.name,
                grid=common_pb2.Dim3(x=record.grid.x, y=record.grid.y, z=record.grid.z),
                block=common_pb2.Dim3(x=record.block.x, y=record.block.y, z=record.block.z),
            )
    return profiler_pb2.MeasurementUpload(
        session_id=run.session_id,
        kernels=list(kernels.values()),
        kernel_ids=ids.tobytes(),
        start_ns=starts.tobytes(),
        end_ns=ends.tobytes(),
        run_index=np.full(count, run.run, dtype="<u4").tobytes(),
    )
