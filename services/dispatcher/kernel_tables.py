"""Kernel tables for FIKIT: per task, kernel ID -> predicted duration and gap after it.

The gap predicted after a kernel is FIKIT's own per-kernel mean gap (Section 3.2).

A FIKIT task's kernel profile lives in the profile store (written by the profiler after the
task's measurement runs). The channel thread asks `lookup` at registration and must not wait:
a table already fetched is answered at once; an unknown one is fetched on the event loop and
handed to `on_loaded` (which installs it in the arbiter) when it arrives. Until then the task
runs with an empty table: the arbiter admits its kernels conservatively (no gap filling).
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable

import grpc
import structlog

from gpuloom.services.dispatcher.admission_engine import KernelTiming
from gpuloom.tasks import cancel_and_wait
from gpuloom.transport import open_aio_channel
from gpuloom.v1 import profile_store_pb2, profile_store_pb2_grpc

log = structlog.get_logger("gpuloom.dispatcher.kernel_tables")

KernelTable = tuple[KernelTiming, ...]
# Predictions beyond this are garbage, not profiles (kernels last microseconds to seconds);
# the core clamps at the same 60 s (GL_FK_MAX_NS), and this keeps them within its u64 fields.
_MAX_PREDICTION_NS = 60 * 10**9


# The profile store's KernelBound -> the engine's class names (an unknown value: unknown).
_BOUNDS = {
    profile_store_pb2.KERNEL_BOUND_COMPUTE: "compute",
    profile_store_pb2.KERNEL_BOUND_MEMORY: "memory",
}


def table_from_profile(profile: profile_store_pb2.KernelProfile) -> KernelTable:
    """The arbiter's view of a kernel profile: per kernel ID the mean duration, the mean gap
    after it, the SMs its launch shape occupies and its bound class (the last two for the
    spatial rule, where the GPU runs MPS; 0 and unknown where the profiler could not tell),
    and its sample count (the harvest gauge weighs kernels by it)."""
    table = []
    for kernel in profile.kernels:
        duration = kernel.mean_duration_ns
        gap = kernel.mean_gap_after_ns
        if kernel.kernel_id == 0 or not (math.isfinite(duration) and duration >= 0):
            continue
        table.append(
            KernelTiming(
                kernel.kernel_id,
                min(int(duration), _MAX_PREDICTION_NS),
                min(int(gap), _MAX_PREDICTION_NS) if math.isfinite(gap) and gap >= 0 else None,
                kernel.sm_usage,
                _BOUNDS.get(kernel.bound, "unknown"),
                kernel.sample_count,
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
    ) -> None:
        self._address = address
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
        return table_from_profile(profile)
