"""Wiring of the profiler: settings -> profile store channel, core, gRPC server."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import structlog

from gpuloom.convert.profiles import (
    job_profile_from_pb,
    job_profile_to_pb,
    kernel_profile_to_pb,
    stamped_from_pb,
    throughput_profile_to_pb,
)
from gpuloom.convert.status import error_from_rpc
from gpuloom.domain.errors import NotFound
from gpuloom.domain.profiles import (
    JobProfile,
    KernelProfile,
    ProfileKind,
    ThroughputProfile,
)
from gpuloom.services.common.server import RunningServer, ServiceRegistration, start_server
from gpuloom.services.profiler.core import ProfilerCore
from gpuloom.services.profiler.servicer import SERVICE, ProfilerServicer
from gpuloom.services.profiler.settings import ProfilerSettings
from gpuloom.transport import open_aio_channel
from gpuloom.v1 import profile_store_pb2, profile_store_pb2_grpc
from gpuloom.v1 import profiler_pb2_grpc as pb_grpc

log = structlog.get_logger("gpuloom.profiler")


class ProfileStoreClient:
    """The profile store over gRPC, as the profiler core needs it."""

    def __init__(self, address: str) -> None:
        self._channel = open_aio_channel(address)
        self._stub = profile_store_pb2_grpc.ProfileStoreStub(self._channel)

    async def put_kernel_profile(self, profile: KernelProfile) -> object:
        request = profile_store_pb2.PutKernelProfileRequest(profile=kernel_profile_to_pb(profile))
        return await self._call(self._stub.PutKernelProfile, request)

    async def get_job_profile(self, key: str, gpu_model: str) -> JobProfile | None:
        request = profile_store_pb2.GetProfileRequest(key=key, gpu_model=gpu_model)
        try:
            return job_profile_from_pb(await self._call(self._stub.GetJobProfile, request))
        except NotFound:
            return None

    async def put_job_profile(self, profile: JobProfile) -> object:
        request = profile_store_pb2.PutJobProfileRequest(profile=job_profile_to_pb(profile))
        return await self._call(self._stub.PutJobProfile, request)

    async def get_throughput_profile(self, key: str, gpu_model: str) -> ThroughputProfile | None:
        request = profile_store_pb2.GetProfileRequest(key=key, gpu_model=gpu_model)
        try:
            found = await self._call(self._stub.GetThroughputProfile, request)
        except NotFound:
            return None
        return stamped_from_pb(ProfileKind.THROUGHPUT, found)  # type: ignore[return-value]

    async def put_throughput_profile(
        self, profile: ThroughputProfile, expected_version: int | None
    ) -> ThroughputProfile:
        request = profile_store_pb2.PutThroughputProfileRequest(
            profile=throughput_profile_to_pb(profile)
        )
        if expected_version is not None:
            request.expected_version = expected_version
        stored = await self._call(self._stub.PutThroughputProfile, request)
        return stamped_from_pb(ProfileKind.THROUGHPUT, stored)  # type: ignore[return-value]

    async def _call(self, method, request):  # type: ignore[no-untyped-def]
        try:
            return await method(request, timeout=30)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from None

    async def close(self) -> None:
        await self._channel.close()


@dataclass
class ProfilerApp:
    core: ProfilerCore
    server: RunningServer
    store: ProfileStoreClient

    @property
    def port(self) -> int:
        return self.server.port

    @classmethod
    async def start(cls, settings: ProfilerSettings, host: str) -> ProfilerApp:
        store = ProfileStoreClient(settings.profile_store_address)
        core = ProfilerCore(store)
        servicer = ProfilerServicer(core)
        registration = ServiceRegistration(
            SERVICE, lambda server: pb_grpc.add_ProfilerServicer_to_server(servicer, server)
        )
        try:
            server = await start_server(
                [registration], host, settings.port, settings.max_message_bytes
            )
        except BaseException:
            await store.close()
            raise
        log.info("profiler ready", port=server.port, store=settings.profile_store_address)
        return cls(core, server, store)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.server.stop(grace_s)
        await self.store.close()
