"""Profiles placement reads from the profile store: kernel times (gap-aware placement),
throughput points (auto-scaling) and MIG times (MIG batches). A small Protocol, its gRPC
implementation, and the conversions from store profiles to the policies' inputs."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import grpc
import structlog

from gpuloom.convert.profiles import (
    kernel_profile_from_pb,
    mig_profile_from_pb,
    throughput_profile_from_pb,
)
from gpuloom.convert.status import error_from_rpc
from gpuloom.domain.errors import DomainError, NotFound
from gpuloom.domain.profiles import KernelProfile, MigProfile, ThroughputProfile
from gpuloom.policies.placement import KernelProfiles, KernelTimes, ThroughputPoint
from gpuloom.transport import open_aio_channel
from gpuloom.v1 import profile_store_pb2, profile_store_pb2_grpc

log = structlog.get_logger("gpuloom.placement")

# A profile looked up in the profile store is reused for this long (found or not).
PROFILE_TTL_S = 60.0
# A kernel profile becomes at most this many (duration, gap) pairs: enough to describe a run's
# shape, bounded so that scoring a pair of jobs stays cheap.
MAX_KERNEL_ENTRIES = 4096


class ProfileSource(Protocol):
    async def kernel_times(self, task_key: str, gpu_model: str) -> KernelTimes | None:
        """The task's kernel times on that model ("" = any model); None if unprofiled."""
        ...

    async def throughput(self, function: str, gpu_model: str) -> list[ThroughputPoint] | None:
        """The function's throughput points on that model ("" = any model)."""
        ...

    async def mig_times(self, task_key: str, gpu_model: str) -> dict[int, float] | None:
        """The task's run time on each MIG instance size (slices -> seconds) on that model
        ("" = any model); None if it has no MIG profile."""
        ...

    async def close(self) -> None: ...


class KernelTimesCache:
    """Kernel times of submitted tasks, fetched before their jobs are decided and offered to
    every placement policy as its context (policies never wait on the profile store)."""

    def __init__(self, source: ProfileSource | None, clock: Callable[[], float]) -> None:
        self._source = source
        self._clock = clock
        self._looked_up: dict[tuple[str, str], float] = {}  # (task, model) -> looked up at
        self.context = KernelProfiles()

    async def prefetch(self, task_key: str, gpu_model: str) -> None:
        """Look the task's kernel times up, once a minute at most; an unavailable store is
        logged and the job placed without them."""
        if self._source is None or not task_key:
            return
        key = (task_key, gpu_model)
        now = self._clock()
        if now - self._looked_up.get(key, -math.inf) < PROFILE_TTL_S:
            return
        self._looked_up[key] = now
        try:
            times = await self._source.kernel_times(task_key, gpu_model)
        except DomainError as error:
            log.warning("kernel profile unavailable", task=task_key, error=error.message)
            return
        if times is not None:
            self.context.set_profile(times)


def kernel_times_from_profile(profile: KernelProfile) -> KernelTimes:
    """FIKIT's per-kernel means as one run's histogram: each kernel listed as often as it
    runs per measured run, capped at MAX_KERNEL_ENTRIES entries in proportion."""
    runs = max(1, profile.measured_runs)
    per_run = [max(1, round(k.sample_count / runs)) for k in profile.kernels]
    total = sum(per_run)
    scale = min(1.0, MAX_KERNEL_ENTRIES / total) if total else 1.0
    durations: list[float] = []
    gaps: list[float] = []
    for kernel, count in zip(profile.kernels, per_run, strict=True):
        n = max(1, round(count * scale))
        durations.extend([kernel.mean_duration_ns] * n)
        gaps.extend([kernel.mean_gap_after_ns] * n)
    return KernelTimes(profile.key, tuple(durations), tuple(gaps))


def throughput_points(profile: ThroughputProfile) -> list[ThroughputPoint]:
    return [
        ThroughputPoint(p.sm_percent, p.quota_percent, p.requests_per_s) for p in profile.points
    ]


def mig_times_from_profile(profile: MigProfile) -> dict[int, float]:
    return {t.slices: t.exec_time_s for t in profile.times}


class GrpcProfileSource:
    def __init__(self, address: str, timeout_s: float = 5.0) -> None:
        self._channel = open_aio_channel(address)
        self._stub = profile_store_pb2_grpc.ProfileStoreStub(self._channel)
        self._timeout_s = timeout_s

    async def kernel_times(self, task_key: str, gpu_model: str) -> KernelTimes | None:
        found = await self._get(
            self._stub.GetKernelProfile, task_key, gpu_model, profile_store_pb2.PROFILE_KIND_KERNEL
        )
        return None if found is None else kernel_times_from_profile(kernel_profile_from_pb(found))

    async def throughput(self, function: str, gpu_model: str) -> list[ThroughputPoint] | None:
        found = await self._get(
            self._stub.GetThroughputProfile,
            function,
            gpu_model,
            profile_store_pb2.PROFILE_KIND_THROUGHPUT,
        )
        return None if found is None else throughput_points(throughput_profile_from_pb(found))

    async def mig_times(self, task_key: str, gpu_model: str) -> dict[int, float] | None:
        found = await self._get(
            self._stub.GetMigProfile, task_key, gpu_model, profile_store_pb2.PROFILE_KIND_MIG
        )
        return None if found is None else mig_times_from_profile(mig_profile_from_pb(found))

    async def _get(self, method, key: str, gpu_model: str, kind: int):  # type: ignore[no-untyped-def]
        """The profile of (key, gpu_model); with no model, of the first model listed."""
        try:
            model = gpu_model
            if not model:
                listing = await self._stub.ListProfiles(
                    profile_store_pb2.ListProfilesRequest(key=key, kind=kind, page_size=1),
                    timeout=self._timeout_s,
                )
                if not listing.profiles:
                    return None
                model = listing.profiles[0].meta.gpu_model
            request = profile_store_pb2.GetProfileRequest(key=key, gpu_model=model)
            return await method(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            domain = error_from_rpc(error)
            if isinstance(domain, NotFound):
                return None
            raise domain from None

    async def close(self) -> None:
        await self._channel.close()
