"""Wiring of the profiler: settings -> profile store channel, core, gRPC server."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import structlog

from gpuloom.services.common.grpc_errors import error_from_rpc
from gpuloom.services.common.server import RunningServer, ServiceRegistration, start_server
from gpuloom.services.profile_store.convert import kernel_profile_to_pb
from gpuloom.services.profile_store.domain import KernelProfile
from gpuloom.services.profiler.core import ProfilerCore
from gpuloom.services.profiler.servicer import SERVICE, ProfilerServicer
from gpuloom.services.profiler.settings import ProfilerSettings
from gpuloom.v1 import profile_store_pb2, profile_store_pb2_grpc
from gpuloom.v1 import profiler_pb2_grpc as pb_grpc

log = structlog.get_logger("gpuloom.profiler")


class ProfileStoreSink:
    """Writes finished kernel profiles to the profile store over gRPC."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = profile_store_pb2_grpc.ProfileStoreStub(self._channel)

    async def __call__(self, profile: KernelProfile) -> object:
        request = profile_store_pb2.PutKernelProfileRequest(profile=kernel_profile_to_pb(profile))
        try:
            return await self._stub.PutKernelProfile(request, timeout=30)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error) from None

    async def close(self) -> None:
        await self._channel.close()


@dataclass
class ProfilerApp:
    core: ProfilerCore
    server: RunningServer
    sink: ProfileStoreSink

    @property
    def port(self) -> int:
        return self.server.port

    @classmethod
    async def start(cls, settings: ProfilerSettings, host: str) -> ProfilerApp:
        sink = ProfileStoreSink(settings.profile_store_address)
        core = ProfilerCore(sink)
        servicer = ProfilerServicer(core)
        registration = ServiceRegistration(
            SERVICE, lambda server: pb_grpc.add_ProfilerServicer_to_server(servicer, server)
        )
        try:
            server = await start_server(
                [registration], host, settings.port, settings.max_message_bytes
            )
        except BaseException:
            await sink.close()
            raise
        log.info("profiler ready", port=server.port, store=settings.profile_store_address)
        return cls(core, server, sink)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.server.stop(grace_s)
        await self.sink.close()
