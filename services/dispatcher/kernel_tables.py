"""Kernel tables for FIKIT: per task, kernel ID -> predicted duration and gap after it.

The gap predicted after a kernel is, by default ("mean"), FIKIT's own per-kernel mean gap
(Section 3.2). The arbiter sees a launch's kernel ID, not its place in the task's sequence, so
with "least" it is instead the shortest gap the profiler's chosen gap predictor expects after
that ID wherever it occurs: a kernel followed by a long gap once per request and by short ones
elsewhere then opens no window (docs/fikit.md, "Kernel tables", has what each cost on a GPU).

A FIKIT task's kernel profile lives in the profile store (written by the profiler after the
task's measurement runs). The channel thread asks `lookup` at registration and must not wait:
a table already fetched is answered at once; an unknown one is fetched on the event loop and
handed to `on_loaded` (which installs it in the arbiter) when it arrives. Until then the task
runs with an empty table: the arbiter admits its kernels conservatively (no gap filling).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Callable
from typing import Literal

import grpc
import structlog

from gpuloom.policies.profiling.gaps import InvalidPredictorError, load_predictor
from gpuloom.services.dispatcher.arbiter import KernelTiming
from gpuloom.tasks import cancel_and_wait
from gpuloom.transport import open_aio_channel
from gpuloom.v1 import profile_store_pb2, profile_store_pb2_grpc

log = structlog.get_logger("gpuloom.dispatcher.kernel_tables")

KernelTable = tuple[KernelTiming, ...]
# Predictions beyond this are garbage, not profiles (kernels last microseconds to seconds);
# the core clamps at the same 60 s (GL_FK_MAX_NS), and this keeps them within its u64 fields.
_MAX_PREDICTION_NS = 60 * 10**9


GapStatistic = Literal["mean", "least"]  # GPULOOM_DISPATCHER_FIKIT_GAP_STATISTIC


def least_gaps(profile: profile_store_pb2.KernelProfile) -> dict[int, float]:
    """Per kernel ID, the least gap the profile's chosen predictor expects after it (empty
    without a usable predictor: then the means stand)."""
    model = profile.gap_predictor.model_json
    if not model:
        return {}
    try:
        ids, gaps = load_predictor(json.loads(model)).least_gaps()
    except (InvalidPredictorError, ValueError, TypeError, KeyError) as error:
        log.warning(
            "unusable gap predictor in a kernel profile; using mean gaps",
            task=profile.meta.key,
            error=str(error),
        )
        return {}
    return {int(kernel): float(gap) for kernel, gap in zip(ids, gaps, strict=True)}


def table_from_profile(
    profile: profile_store_pb2.KernelProfile, gaps: GapStatistic = "mean"
) -> KernelTable:
    """The arbiter's view of a kernel profile: the mean duration per kernel ID, and the gap
    after it by `gaps` (module docstring)."""
    least = least_gaps(profile) if gaps == "least" else {}
    table = []
    for kernel in profile.kernels:
        duration = kernel.mean_duration_ns
        gap = least.get(kernel.kernel_id, kernel.mean_gap_after_ns)  # least <= mean
        if kernel.kernel_id == 0 or not (math.isfinite(duration) and duration >= 0):
            continue
        table.append(
            KernelTiming(
                kernel.kernel_id,
                min(int(duration), _MAX_PREDICTION_NS),
                min(int(gap), _MAX_PREDICTION_NS) if math.isfinite(gap) and gap >= 0 else None,
            )
        )
    return tuple(table)


class KernelTables:
    def __init__(
        self,
        address: str,
        gpu_model: str,
        loop: asyncio.AbstractEventLoop,
        timeout_s: float = 5.0,
        gaps: GapStatistic = "mean",
    ) -> None:
        self._address = address
        self._gaps = gaps
        self._gpu_model = gpu_model
        self._loop = loop
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # the channel thread looks up; the loop fills
        self._tables: dict[str, KernelTable] = {}
        # task key -> who waits for its table (one fetch serves every process of a task)
        self._waiting: dict[str, list[Callable[[KernelTable], None]]] = {}
        self._channel: grpc.aio.Channel | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def lookup(self, task_key: str, on_loaded: Callable[[KernelTable], None]) -> KernelTable | None:
        """The table if known; otherwise None, and `on_loaded` is called (on the loop) once
        the profile store answers with one."""
        with self._lock:
            table = self._tables.get(task_key)
            if table is not None:
                return table
        self._loop.call_soon_threadsafe(self._start_fetch, task_key, on_loaded)
        return None

    async def prefetch(self, task_key: str) -> KernelTable | None:
        """Fetch now (a reservation that names its task: the table is there before the shim)."""
        table = await self._fetch(task_key)
        if table is not None:
            with self._lock:
                self._tables[task_key] = table
        return table

    async def close(self) -> None:
        await cancel_and_wait(*self._tasks)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def _start_fetch(self, task_key: str, on_loaded: Callable[[KernelTable], None]) -> None:
        waiting = self._waiting.setdefault(task_key, [])
        waiting.append(on_loaded)
        if len(waiting) > 1:
            return  # a fetch is under way
        task = self._loop.create_task(self._fetch_then(task_key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fetch_then(self, task_key: str) -> None:
        try:
            table = await self.prefetch(task_key)
        finally:
            waiting = self._waiting.pop(task_key, [])
        if table is not None:
            for on_loaded in waiting:
                on_loaded(table)

    async def _fetch(self, task_key: str) -> KernelTable | None:
        if self._channel is None:
            self._channel = open_aio_channel(self._address)
        stub = profile_store_pb2_grpc.ProfileStoreStub(self._channel)
        request = profile_store_pb2.GetProfileRequest(key=task_key, gpu_model=self._gpu_model)
        try:
            profile = await stub.GetKernelProfile(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                log.warning(
                    "cannot fetch a kernel profile",
                    task=task_key,
                    store=self._address,
                    error=error.details(),
                )
            return None
        return table_from_profile(profile, self._gaps)
