"""gpuloom.v1.Profiler servicer: protobuf in, domain core, protobuf out."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import numpy as np

from gpuloom.convert.profiler import STATE_FROM_PB
from gpuloom.convert.profiles import throughput_profile_to_pb
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.profiler import SessionState
from gpuloom.domain.profiles import ThroughputPoint
from gpuloom.policies.profiling.cycles import Cycle
from gpuloom.services.common.grpc_errors import rpc
from gpuloom.services.profiler import convert
from gpuloom.services.profiler.core import ProfilerCore
from gpuloom.v1 import profile_store_pb2
from gpuloom.v1 import profiler_pb2 as pb
from gpuloom.v1 import profiler_pb2_grpc as pb_grpc

SERVICE = "gpuloom.v1.Profiler"
Context = grpc.aio.ServicerContext


class ProfilerServicer(pb_grpc.ProfilerServicer):
    def __init__(self, core: ProfilerCore) -> None:
        self._core = core

    @rpc(SERVICE)
    async def OpenSession(self, request: pb.OpenSessionRequest, context: Context) -> pb.Session:
        session = self._core.open_session(request.task_key, request.gpu_model, request.runs)
        return convert.session_to_pb(session)

    @rpc(SERVICE)
    async def GetSession(self, request: pb.GetSessionRequest, context: Context) -> pb.Session:
        return convert.session_to_pb(self._core.get(request.session_id))

    @rpc(SERVICE)
    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: Context
    ) -> pb.ListSessionsResponse:
        state = None
        if request.state:
            state = STATE_FROM_PB.get(request.state)
            if state is None:
                raise InvalidArgument("state", f"unknown session state {request.state}")
        sessions = self._core.list(state, request.task_key, request.gpu_model)
        return pb.ListSessionsResponse(sessions=[convert.session_to_pb(s) for s in sessions])

    @rpc(SERVICE)
    async def CancelSession(self, request: pb.CancelSessionRequest, context: Context) -> pb.Session:
        return convert.session_to_pb(self._core.cancel(request.session_id))

    @rpc(SERVICE)
    async def UploadMeasurements(
        self, request_iterator: AsyncIterator[pb.MeasurementUpload], context: Context
    ) -> pb.UploadSummary:
        summary = pb.UploadSummary()
        async for upload in request_iterator:
            batch = convert.batch_from_pb(upload)
            session = await self._core.ingest(batch)
            summary.messages += 1
            summary.records += len(batch.kernel_ids)
            finished = session.state is not SessionState.OPEN
            if finished and session.session_id not in summary.completed_sessions:
                summary.completed_sessions.append(session.session_id)
        return summary

    @rpc(SERVICE)
    async def AnalyzeMemory(
        self, request: pb.AnalyzeMemoryRequest, context: Context
    ) -> pb.MemoryAnalysis:
        analysis, stored = await self._core.analyze_memory(
            request.job_key,
            request.gpu_model,
            np.array(request.times_s, dtype=np.float64),
            np.array(request.memory_bytes, dtype=np.float64),
            request.store,
        )
        if not isinstance(analysis, Cycle):
            return pb.MemoryAnalysis(cycle_found=False, reason=analysis.reason)
        return pb.MemoryAnalysis(
            cycle_found=True,
            minibatch_time_s=analysis.period_s,
            cv=analysis.cv,
            stable=analysis.stable,
            low_points_s=analysis.low_points_s,
            low_memory_bytes=analysis.low_memory_bytes,
            high_memory_bytes=analysis.high_memory_bytes,
            stored=stored,
        )

    @rpc(SERVICE)
    async def RecordThroughputPoint(
        self, request: pb.RecordThroughputPointRequest, context: Context
    ) -> profile_store_pb2.ThroughputProfile:
        point = request.point
        profile = await self._core.record_throughput_point(
            request.function,
            request.gpu_model,
            ThroughputPoint(
                point.sm_percent,
                point.quota_percent,
                point.requests_per_s,
                point.p50_latency_ms,
                point.p99_latency_ms,
            ),
        )
        return throughput_profile_to_pb(profile)
