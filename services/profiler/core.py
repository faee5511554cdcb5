"""The profiler's domain core: sessions, batch ingestion, and the profile at the T-th run.

Sessions live in memory (a restarted profiler forgets open sessions; their tasks are simply
measured again). Batches are validated whole before anything is applied, so a refused or
broken batch leaves the session as it was.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Protocol

import numpy as np
import structlog

from gpuloom.domain.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from gpuloom.domain.profiler import SessionState
from gpuloom.domain.profiles import (
    JobProfile,
    KernelProfile,
    ThroughputPoint,
    ThroughputProfile,
)
from gpuloom.domain.validation import (
    MAX_GPU_MODEL_CHARS,
    MAX_KEY_CHARS,
    check_name,
    check_throughput_point,
)
from gpuloom.policies.profiling.cycles import Cycle, NoCycle, detect_cycle
from gpuloom.services.profiler.domain import (
    DEFAULT_RUNS,
    MAX_RUNS,
    MIN_RUNS,
    KernelName,
    MeasurementBatch,
    Session,
)
from gpuloom.services.profiler.profile import build_kernel_profile

log = structlog.get_logger("gpuloom.profiler")


class ProfileStorePort(Protocol):
    """What the profiler needs of the profile store (gRPC in the service, a fake in tests)."""

    async def put_kernel_profile(self, profile: KernelProfile) -> object: ...
    async def get_job_profile(self, key: str, gpu_model: str) -> JobProfile | None: ...
    async def put_job_profile(self, profile: JobProfile) -> object: ...
    async def get_throughput_profile(
        self, key: str, gpu_model: str
    ) -> ThroughputProfile | None: ...
    async def put_throughput_profile(
        self, profile: ThroughputProfile, expected_version: int | None
    ) -> ThroughputProfile: ...


MAX_RECORDS_PER_SESSION = 50_000_000
MAX_RECORDS_PER_BATCH = 1_000_000
MAX_MEMORY_SAMPLES = 1_000_000


class _Buffers:
    """A session's records so far, as the column chunks they arrived in."""

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.names: dict[int, KernelName] = {}

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if not self.chunks:
            empty = np.empty(0, dtype=np.uint64)
            return empty, empty, empty, np.empty(0, dtype=np.uint32)
        return tuple(np.concatenate(column) for column in zip(*self.chunks, strict=True))  # type: ignore[return-value]


class ProfilerCore:
    def __init__(self, store: ProfileStorePort, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._buffers: dict[str, _Buffers] = {}
        self._lock = asyncio.Lock()

    # ---- sessions ----

    def open_session(self, task_key: str, gpu_model: str, runs: int) -> Session:
        check_name("task_key", task_key, MAX_KEY_CHARS)
        check_name("gpu_model", gpu_model, MAX_GPU_MODEL_CHARS)
        runs = runs or DEFAULT_RUNS
        if not MIN_RUNS <= runs <= MAX_RUNS:
            raise InvalidArgument("runs", f"must be within {MIN_RUNS}..{MAX_RUNS}, got {runs}")
        for session in self._sessions.values():
            same = (session.task_key, session.gpu_model) == (task_key, gpu_model)
            if same and session.state is SessionState.OPEN:
                raise AlreadyExists(
                    f"session {session.session_id} is already measuring {task_key!r} on {gpu_model}"
                )
        session = Session(uuid.uuid4().hex, task_key, gpu_model, runs, self._clock())
        self._sessions[session.session_id] = session
        self._buffers[session.session_id] = _Buffers()
        log.info("session opened", session=session.session_id, task=task_key, gpu=gpu_model)
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"no session {session_id!r}")
        return session

    def list(
        self, state: SessionState | None = None, task_key: str = "", gpu_model: str = ""
    ) -> list[Session]:
        return [
            s
            for s in sorted(self._sessions.values(), key=lambda s: s.opened_at_unix_s)
            if (state is None or s.state is state)
            and (not task_key or s.task_key == task_key)
            and (not gpu_model or s.gpu_model == gpu_model)
        ]

    def cancel(self, session_id: str) -> Session:
        session = self.get(session_id)
        if session.state is not SessionState.OPEN:
            raise FailedPrecondition(f"session {session_id} is {session.state.value}, not open")
        self._close(session, SessionState.CANCELLED)
        return session

    # ---- ingestion ----

    async def ingest(self, batch: MeasurementBatch) -> Session:
        """Apply one batch (whole or not at all); completes the session at its T-th run."""
        async with self._lock:
            session = self._sessions.get(batch.session_id)
            if session is None:
                raise InvalidArgument("session_id", f"no session {batch.session_id!r}")
            if session.state is not SessionState.OPEN:
                raise FailedPrecondition(
                    f"session {session.session_id} is {session.state.value}, not open"
                )
            buffers = self._buffers[session.session_id]
            _validate(batch, session, buffers)
            if len(batch.kernel_ids):
                buffers.chunks.append(
                    (batch.kernel_ids, batch.start_ns, batch.end_ns, batch.run_index)
                )
            for kernel in batch.kernels:
                buffers.names[kernel.kernel_id] = kernel
            session.records += len(batch.kernel_ids)
            session.runs_completed.update(batch.completed_runs)
            if len(session.runs_completed) == session.runs:
                await self._finish(session, buffers)
            return session

    async def _finish(self, session: Session, buffers: _Buffers) -> None:
        columns = buffers.columns()
        try:
            profile, predictor = await asyncio.to_thread(
                build_kernel_profile, session, columns, buffers.names
            )
            await self._store.put_kernel_profile(profile)
        except Exception as error:  # the session says why; the store was not written
            log.exception("profile failed", session=session.session_id)
            session.error = str(error) or type(error).__name__
            self._close(session, SessionState.FAILED)
            return
        session.predictor = predictor
        session.kernels = len(profile.kernels)
        self._close(session, SessionState.COMPLETE)
        log.info(
            "profile stored",
            session=session.session_id,
            task=session.task_key,
            gpu=session.gpu_model,
            kernels=session.kernels,
            predictor=predictor.chosen,
        )

    # ---- training introspection ----

    async def analyze_memory(
        self,
        job_key: str,
        gpu_model: str,
        times_s: np.ndarray,
        memory_bytes: np.ndarray,
        store: bool,
    ) -> tuple[Cycle | NoCycle, bool]:
        """The mini-batch cycle of a memory series (Gandiva); with `store`, a cycle found is
        written into the job's profile (other fields kept). Returns (analysis, stored)."""
        check_name("job_key", job_key, MAX_KEY_CHARS)
        check_name("gpu_model", gpu_model, MAX_GPU_MODEL_CHARS)
        if len(times_s) != len(memory_bytes):
            raise InvalidArgument("memory_bytes", "needs one sample per entry of times_s")
        if len(times_s) > MAX_MEMORY_SAMPLES:
            raise InvalidArgument("times_s", f"at most {MAX_MEMORY_SAMPLES} samples")
        if len(times_s) and (np.min(memory_bytes) < 0):
            raise InvalidArgument("memory_bytes", "must not be negative")
        try:
            analysis = await asyncio.to_thread(detect_cycle, times_s, memory_bytes)
        except ValueError as error:
            raise InvalidArgument("times_s", str(error)) from None
        if not store or not isinstance(analysis, Cycle):
            return analysis, False
        existing = await self._store.get_job_profile(job_key, gpu_model)
        cycle_fields = {
            "minibatch_time_s": analysis.period_s,
            "minibatch_cv": analysis.cv,
            "low_memory_points_s": tuple(
                float(t) - float(times_s.min()) for t in analysis.low_points_s
            ),
            "low_memory_bytes": int(analysis.low_memory_bytes),
            "peak_memory_bytes": int(max(memory_bytes.max(), existing.peak_memory_bytes))
            if existing is not None
            else int(memory_bytes.max()),
        }
        if existing is None:
            profile = JobProfile(
                key=job_key,
                gpu_model=gpu_model,
                gpu_utilization_percent=0.0,
                solo_throughput=1.0 / analysis.period_s,
                **cycle_fields,
            )
        else:
            profile = replace(existing, version=0, updated_at=None, **cycle_fields)
        await self._store.put_job_profile(profile)
        return analysis, True

    # ---- throughput sweeps ----

    async def record_throughput_point(
        self, function: str, gpu_model: str, point: ThroughputPoint
    ) -> ThroughputProfile:
        """Merge one sweep point into the function's throughput profile; a concurrent writer
        makes this read again and retry (the store's version check), so no point is lost."""
        check_name("function", function, MAX_KEY_CHARS)
        check_name("gpu_model", gpu_model, MAX_GPU_MODEL_CHARS)
        check_throughput_point("point", point)
        for _attempt in range(5):
            existing = await self._store.get_throughput_profile(function, gpu_model)
            others = () if existing is None else tuple(
                p for p in existing.points
                if (p.sm_percent, p.quota_percent) != (point.sm_percent, point.quota_percent)
            )  # fmt: skip
            points = tuple(sorted((*others, point), key=lambda p: (p.sm_percent, p.quota_percent)))
            profile = ThroughputProfile(function, gpu_model, points)
            try:
                return await self._store.put_throughput_profile(
                    profile, 0 if existing is None else existing.version
                )
            except Aborted:
                continue
        raise Aborted(f"throughput profile of {function!r} keeps changing; try again")

    def _close(self, session: Session, state: SessionState) -> None:
        session.state = state
        session.closed_at_unix_s = self._clock()
        self._buffers.pop(session.session_id, None)


def _validate(batch: MeasurementBatch, session: Session, buffers: _Buffers) -> None:
    n = len(batch.kernel_ids)
    if not (len(batch.start_ns) == len(batch.end_ns) == len(batch.run_index) == n):
        raise InvalidArgument(
            "kernel_ids", "kernel_ids, start_ns, end_ns and run_index must have equal lengths"
        )
    if n > MAX_RECORDS_PER_BATCH:
        raise InvalidArgument("kernel_ids", f"at most {MAX_RECORDS_PER_BATCH} records a batch")
    if session.records + n > MAX_RECORDS_PER_SESSION:
        raise FailedPrecondition(f"session would exceed {MAX_RECORDS_PER_SESSION} records")
    if n:
        backwards = np.flatnonzero(batch.end_ns < batch.start_ns)
        if backwards.size:
            raise InvalidArgument(
                f"end_ns[{backwards[0]}]", "a record must not end before it starts"
            )
        outside = np.flatnonzero(batch.run_index >= session.runs)
        if outside.size:
            raise InvalidArgument(
                f"run_index[{outside[0]}]",
                f"run {batch.run_index[outside[0]]} is outside 0..{session.runs - 1}",
            )
        done = session.runs_completed
        if done:
            late = np.isin(batch.run_index, np.fromiter(done, dtype=np.uint32))
            if late.any():
                first = int(np.flatnonzero(late)[0])
                raise InvalidArgument(
                    f"run_index[{first}]", f"run {batch.run_index[first]} is already complete"
                )
    for index, run in enumerate(batch.completed_runs):
        if not 0 <= run < session.runs:
            raise InvalidArgument(
                f"completed_runs[{index}]", f"run {run} is outside 0..{session.runs - 1}"
            )
    for index, kernel in enumerate(batch.kernels):
        check_name(f"kernels[{index}].name", kernel.name, 8192)
    unnamed = _unnamed(batch, buffers.names)
    if unnamed is not None:
        raise InvalidArgument(
            "kernels", f"kernel ID {unnamed} has records but no name (send its KernelInfo)"
        )


def _unnamed(batch: MeasurementBatch, known: dict[int, KernelName]) -> int | None:
    if not len(batch.kernel_ids):
        return None
    named: Iterable[int] = (*known, *(k.kernel_id for k in batch.kernels))
    ids = np.unique(batch.kernel_ids)
    missing = np.setdiff1d(ids, np.fromiter(named, dtype=np.uint64), assume_unique=False)
    return int(missing[0]) if missing.size else None
