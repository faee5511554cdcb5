"""Throughput sweeps (FaST-Profiler): run a load generator once per (SM percent, time quota)
grid point under that configuration, through a real dispatcher (and the shim when the command
uses CUDA), and record each point with the profiler.

The load generator is any command. It runs with its assignment's environment (dispatcher
socket, one-time token), `LD_PRELOAD` set to the shim when one is given,
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` = the SM percent (for an MPS server), and
`GPULOOM_SWEEP_SM_PERCENT` / `GPULOOM_SWEEP_QUOTA_PERCENT`. It reports on stdout with JSON
lines; the last line that has `requests_per_s` is the point's measurement:

    {"requests_per_s": 412.5, "p50_latency_ms": 2.1, "p99_latency_ms": 9.8}

Points already in the function's stored throughput profile are skipped, so an interrupted
sweep resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from gpuloom.convert.shares import reservation_share_fields
from gpuloom.convert.status import error_from_rpc
from gpuloom.domain.errors import InvalidArgument, NotFound
from gpuloom.domain.shares import share_of
from gpuloom.transport import open_channel
from gpuloom.v1 import (
    dispatcher_pb2,
    dispatcher_pb2_grpc,
    profile_store_pb2,
    profile_store_pb2_grpc,
    profiler_pb2,
    profiler_pb2_grpc,
)

# FaST-GShare's grid (Section 5.2).
DEFAULT_QUOTAS = (20.0, 40.0, 60.0, 80.0, 100.0)
DEFAULT_SM = (6, 12, 24, 50, 60, 80, 100)


class SweepError(Exception):
    """A point could not be measured; the points before it are stored."""


@dataclass(frozen=True, slots=True)
class Measurement:
    requests_per_s: float
    p50_latency_ms: float
    p99_latency_ms: float


def validate_grid(sm_percents: Sequence[int], quotas: Sequence[float]) -> None:
    if not sm_percents or not quotas:
        raise InvalidArgument("grid", "needs at least one SM percent and one quota")
    for sm in sm_percents:
        if not 1 <= sm <= 100:
            raise InvalidArgument("sm", f"SM percents must be within 1..100, got {sm}")
    for quota in quotas:
        if not (math.isfinite(quota) and 0 < quota <= 100):
            raise InvalidArgument("quotas", f"quotas must be in (0, 100] percent, got {quota}")


def parse_report(stdout: str) -> Measurement:
    """The last JSON line with requests_per_s (see the module docstring)."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if "requests_per_s" not in data:
            continue
        try:
            measured = Measurement(
                float(data["requests_per_s"]),
                float(data.get("p50_latency_ms", 0.0)),
                float(data.get("p99_latency_ms", 0.0)),
            )
        except (TypeError, ValueError):
            raise SweepError(f"bad report line: {line[:200]}") from None
        values = (measured.requests_per_s, measured.p50_latency_ms, measured.p99_latency_ms)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise SweepError(f"report values must be finite and >= 0: {line[:200]}")
        return measured
    raise SweepError('the command printed no JSON line with "requests_per_s"')


class Sweep:
    def __init__(
        self,
        function: str,
        command: Sequence[str],
        dispatcher: str,
        profiler: str,
        profile_store: str,
        shim_path: str | None,
        memory_bytes: int,
        point_timeout_s: float,
        progress: Callable[[str], None],
    ) -> None:
        self._function = function
        self._command = list(command)
        self._dispatcher = dispatcher_pb2_grpc.DispatcherStub(open_channel(dispatcher))
        self._profiler = profiler_pb2_grpc.ProfilerStub(open_channel(profiler))
        self._store = profile_store_pb2_grpc.ProfileStoreStub(open_channel(profile_store))
        self._shim_path = shim_path
        self._memory_bytes = memory_bytes
        self._timeout_s = point_timeout_s
        self._progress = progress

    def run(self, sm_percents: Sequence[int], quotas: Sequence[float]) -> int:
        """Measure every grid point not yet stored; returns how many were measured."""
        validate_grid(sm_percents, quotas)
        gpu_model = self._call(
            self._dispatcher.GetGpuStatus, dispatcher_pb2.GetGpuStatusRequest()
        ).gpu.model
        done = self._stored_points(gpu_model)
        grid = [(sm, q) for sm in sm_percents for q in quotas]
        todo = [point for point in grid if point not in done]
        if len(todo) < len(grid):
            self._progress(f"skipping {len(grid) - len(todo)} points already measured")
        for number, (sm, quota) in enumerate(todo, start=1):
            measured = self._measure(sm, quota)
            point = profile_store_pb2.ThroughputPoint(
                sm_percent=sm,
                quota_percent=quota,
                requests_per_s=measured.requests_per_s,
                p50_latency_ms=measured.p50_latency_ms,
                p99_latency_ms=max(measured.p99_latency_ms, measured.p50_latency_ms),
            )
            self._call(
                self._profiler.RecordThroughputPoint,
                profiler_pb2.RecordThroughputPointRequest(
                    function=self._function, gpu_model=gpu_model, point=point
                ),
            )
            self._progress(
                f"[{number}/{len(todo)}] SM {sm}% quota {quota:g}%: "
                f"{measured.requests_per_s:.1f} req/s, p50 {measured.p50_latency_ms:.2f} ms, "
                f"p99 {measured.p99_latency_ms:.2f} ms"
            )
        return len(todo)

    def _stored_points(self, gpu_model: str) -> set[tuple[int, float]]:
        request = profile_store_pb2.GetProfileRequest(key=self._function, gpu_model=gpu_model)
        try:
            stored = self._call(self._store.GetThroughputProfile, request)
        except NotFound:
            return set()
        return {(p.sm_percent, p.quota_percent) for p in stored.points}

    def _measure(self, sm: int, quota: float) -> Measurement:
        request = dispatcher_pb2.ReserveRequest(
            assignment_id=f"sweep-{uuid.uuid4().hex[:12]}",
            client_name=f"sweep {self._function}",
            **reservation_share_fields(share_of(sm, quota, memory_bytes=self._memory_bytes)),
            task_key=self._function,
        )
        assignment = self._call(self._dispatcher.Reserve, request)
        try:
            # A dispatcher that runs MPS answers with the MPS client environment itself; the
            # SM percent is set here too for one that does not (an MPS server started by hand).
            environment = {
                **os.environ,
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(sm),
                **assignment.environment,
                "GPULOOM_SWEEP_SM_PERCENT": str(sm),
                "GPULOOM_SWEEP_QUOTA_PERCENT": f"{quota:g}",
            }
            if self._shim_path:
                environment["LD_PRELOAD"] = self._shim_path
            try:
                result = subprocess.run(
                    self._command,
                    env=environment,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=self._timeout_s,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                raise SweepError(
                    f"SM {sm}% quota {quota:g}%: the command ran past {self._timeout_s:g} s"
                ) from None
            except OSError as error:
                raise SweepError(f"cannot run {self._command[0]!r}: {error}") from None
            if result.returncode != 0:
                tail = result.stderr.strip().splitlines()[-3:]
                raise SweepError(
                    f"SM {sm}% quota {quota:g}%: the command exited with {result.returncode}: "
                    + " | ".join(tail)
                )
            return parse_report(result.stdout)
        finally:
            self._call(
                self._dispatcher.Release,
                dispatcher_pb2.ReleaseRequest(assignment_id=assignment.assignment_id),
            )

    @staticmethod
    def _call(method, request):  # type: ignore[no-untyped-def]
        try:
            return method(request, timeout=30)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None
