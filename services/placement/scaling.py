"""FaST-GShare's auto-scaling of inference functions (Algorithm 1) in the placement service:
the function's throughput profile and its live replicas decide which replicas to add or remove;
replicas are submitted and cancelled like any job, through `FunctionJobs`."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Protocol

import structlog

from gpuloom.domain.errors import FailedPrecondition, InvalidArgument
from gpuloom.domain.placement import MAX_KEY, JobKind, JobSpec
from gpuloom.domain.shares import TimeQuota
from gpuloom.policies.placement import (
    POLICIES,
    InvalidRequestError,
    Replica,
    ThroughputPoint,
    plan_scaling,
)
from gpuloom.services.placement.domain import Job
from gpuloom.services.placement.profiles import ProfileSource

log = structlog.get_logger("gpuloom.placement")


@dataclass(frozen=True, slots=True)
class ScalingResult:
    added: tuple[Job, ...]
    removed: tuple[Job, ...]
    capacity_rps: float
    most_efficient: ThroughputPoint | None


class FunctionJobs(Protocol):
    """What auto-scaling does with jobs: see a function's replicas, add and remove some."""

    def replicas(self, function: str) -> list[Job]: ...

    async def submit(
        self, request_id: str, spec: JobSpec, function: str = "", owner: str = ""
    ) -> Job: ...

    async def cancel(self, job_id: str, reason: str = "") -> Job: ...


class AutoScaler:
    def __init__(self, jobs: FunctionJobs, profiles: ProfileSource | None, owner: str = "") -> None:
        """`owner`: the submitter the replicas belong to (on Kubernetes, gpuloom's components,
        which start them as Pods and hand each its assignment token)."""
        self._jobs = jobs
        self._profiles = profiles
        self._owner = owner
        self._function_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def set_function_load(
        self, function: str, requests_per_s: float, template: JobSpec
    ) -> ScalingResult:
        """FaST-GShare Algorithm 1 for one inference function: add replicas of the most
        efficient configuration (plus one minimal one for the rest), or remove the least
        efficient ones; each new replica is placed like any job."""
        if not 1 <= len(function) <= MAX_KEY or not function.isprintable():
            raise InvalidArgument("function", f"must be 1..{MAX_KEY} printable characters")
        if not (math.isfinite(requests_per_s) and requests_per_s >= 0):
            raise InvalidArgument(
                "requests_per_s", f"must be finite and >= 0, got {requests_per_s}"
            )
        _replica_spec(template, 1, 1.0).validate_as("template", POLICIES)
        if self._profiles is None:
            raise FailedPrecondition(
                "auto-scaling needs throughput profiles, and no profile store is configured "
                "(GPULOOM_PLACEMENT_PROFILE_STORE_ADDRESS)"
            )
        points = await self._profiles.throughput(function, template.gpu_model)
        if not points:
            raise FailedPrecondition(f"no throughput profile for function {function!r}")
        async with self._function_locks[function]:
            replicas = [
                Replica(j.job_id, j.spec.share.sm_percent, j.spec.share.quota.request_percent)
                for j in self._jobs.replicas(function)
            ]
            try:
                plan = plan_scaling(points, replicas, requests_per_s)
            except InvalidRequestError as error:
                raise FailedPrecondition(f"function {function!r}: {error}") from None
            added = []
            for point in plan.add:
                spec = replace(
                    _replica_spec(template, point.sm_percent, point.quota_percent),
                    task_key=function,
                )
                added.append(
                    await self._jobs.submit(
                        f"scale-{uuid.uuid4().hex}", spec, function, self._owner
                    )
                )
            removed = [
                await self._jobs.cancel(job_id, f"scaled down to {requests_per_s:g} requests/s")
                for job_id in plan.remove
            ]
        best = max(points, key=lambda p: p.rpr)
        log.info(
            "function scaled",
            function=function,
            target_rps=requests_per_s,
            added=len(added),
            removed=len(removed),
            capacity_rps=plan.capacity_rps,
        )
        return ScalingResult(tuple(added), tuple(removed), plan.capacity_rps, best)


def _replica_spec(template: JobSpec, sm_percent: int, quota_percent: float) -> JobSpec:
    """A function replica: the template's name, memory, priority, policy and model, at one
    profiled configuration (guaranteed its quota, and no more)."""
    return replace(
        template,
        kind=JobKind.INFERENCE,
        share=replace(
            template.share, sm_percent=sm_percent, quota=TimeQuota(quota_percent, quota_percent)
        ),
        mps=True,
        whole_gpus=0,
        mig_slices=0,
        command=(),
    )
