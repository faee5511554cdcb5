"""gpuloom.v1.Dispatcher servicer: protobuf in, domain core, protobuf out. Nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import grpc

from gpuloom.convert.dispatcher import gpu_description_to_pb
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.training import MAX_SUSPEND_REASON_CHARS
from gpuloom.services.common.grpc_errors import rpc, stream_rpc
from gpuloom.services.dispatcher import convert
from gpuloom.services.dispatcher.core import DispatcherCore
from gpuloom.services.dispatcher.domain import MoveTarget, check_assignment_id
from gpuloom.services.dispatcher.model_store import ModelStore
from gpuloom.v1 import dispatcher_pb2 as pb
from gpuloom.v1 import dispatcher_pb2_grpc as pb_grpc

SERVICE = "gpuloom.v1.Dispatcher"
Context = grpc.aio.ServicerContext
# Eviction and suspension reasons: a suspension's goes to placement in every heartbeat,
# which refuses a longer one.
MAX_REASON_CHARS = MAX_SUSPEND_REASON_CHARS


def _check_reason(reason: str) -> str:
    if len(reason) > MAX_REASON_CHARS:
        raise InvalidArgument("reason", f"must be at most {MAX_REASON_CHARS} characters")
    return reason


class DispatcherServicer(pb_grpc.DispatcherServicer):
    def __init__(self, core: DispatcherCore, models: ModelStore) -> None:
        self._core = core
        self._models = models

    @rpc(SERVICE)
    async def Reserve(self, request: pb.ReserveRequest, context: Context) -> pb.Assignment:
        core = self._core
        reservation = await core.reserve(convert.reserve_spec_from_pb(request))
        return convert.assignment_to_pb(
            reservation, core.gpu, core.node, core.socket_path, core.environment(reservation)
        )

    @rpc(SERVICE)
    async def Release(self, request: pb.ReleaseRequest, context: Context) -> pb.ReleaseResponse:
        released = await self._core.release(check_assignment_id(request.assignment_id))
        return pb.ReleaseResponse(released=released)

    @rpc(SERVICE)
    async def GetGpuStatus(self, request: pb.GetGpuStatusRequest, context: Context) -> pb.GpuStatus:
        core = self._core
        view, usage = await core.status()
        return convert.gpu_status_to_pb(
            view, usage, core.gpu, core.node, core.backend.name, core.socket_path
        )

    @rpc(SERVICE)
    async def ListClients(
        self, request: pb.ListClientsRequest, context: Context
    ) -> pb.ListClientsResponse:
        core = self._core
        view, _ = await core.status()
        return pb.ListClientsResponse(
            clients=[
                convert.client_status_to_pb(c, core.gpu, core.node, core.socket_path)
                for c in view.clients
            ]
        )

    @rpc(SERVICE)
    async def EvictClient(
        self, request: pb.EvictClientRequest, context: Context
    ) -> pb.EvictClientResponse:
        reason = _check_reason(request.reason)
        await self._core.evict(check_assignment_id(request.assignment_id), reason)
        return pb.EvictClientResponse()

    @rpc(SERVICE)
    async def SuspendClient(
        self, request: pb.SuspendClientRequest, context: Context
    ) -> pb.ClientStatus:
        reason = _check_reason(request.reason)
        core = self._core
        status = await core.suspend(
            check_assignment_id(request.assignment_id), request.max_wait_ms / 1e3, reason
        )
        return convert.client_status_to_pb(status, core.gpu, core.node, core.socket_path)

    @rpc(SERVICE)
    async def MoveClient(self, request: pb.MoveClientRequest, context: Context) -> pb.ClientStatus:
        core = self._core
        target = MoveTarget(
            request.target_gpu_uuid, request.target_socket_path, request.target_token
        )
        status = await core.move_out(check_assignment_id(request.assignment_id), target)
        return convert.client_status_to_pb(status, core.gpu, core.node, core.socket_path)

    @rpc(SERVICE)
    async def UnlockMovedClient(
        self, request: pb.UnlockMovedClientRequest, context: Context
    ) -> pb.ClientStatus:
        core = self._core
        status = await core.unlock_moved(check_assignment_id(request.assignment_id))
        return convert.client_status_to_pb(status, core.gpu, core.node, core.socket_path)

    @rpc(SERVICE)
    async def ResumeClient(
        self, request: pb.ResumeClientRequest, context: Context
    ) -> pb.ClientStatus:
        core = self._core
        status = await core.resume(check_assignment_id(request.assignment_id))
        return convert.client_status_to_pb(status, core.gpu, core.node, core.socket_path)

    @stream_rpc(SERVICE)
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: Context
    ) -> AsyncIterator[pb.DispatcherEvent]:
        async for event in self._core.events(request.include_leases):
            yield convert.event_to_pb(event)

    @rpc(SERVICE)
    async def SetMigMode(
        self, request: pb.SetMigModeRequest, context: Context
    ) -> pb.GpuDescription:
        core = self._core
        gpu = await core.set_mig_mode(request.enabled)
        return gpu_description_to_pb(replace(gpu, node=core.node), core.backend.name)

    @stream_rpc(SERVICE)
    async def RunMigBatch(
        self, requests: AsyncIterator[pb.MigRunInput], context: Context
    ) -> AsyncIterator[pb.MigRunUpdate]:
        first = await anext(aiter(requests), None)
        if first is None or first.WhichOneof("input") != "batch":
            raise InvalidArgument(
                "batch", "the first message is the batch (then a task_end for each task started)"
            )
        batch = first.batch
        updates = self._core.run_mig_batch(
            convert.mig_batch_from_pb(batch),
            batch.policy,
            dict(batch.create_seconds),
            dict(batch.destroy_seconds),
            convert.task_ends_from_pb(requests),
        )
        async for update in updates:
            yield convert.mig_update_to_pb(update)

    # -- the model store --

    @rpc(SERVICE)
    async def LoadModel(
        self, request: pb.LoadModelRequest, context: Context
    ) -> pb.LoadModelResponse:
        view, loaded = await self._models.load(request.name, request.path)
        return pb.LoadModelResponse(model=convert.model_info_to_pb(view), loaded=loaded)

    @rpc(SERVICE)
    async def AttachModel(self, request: pb.AttachModelRequest, context: Context) -> pb.ModelHandle:
        view = await self._models.attach(
            request.name, request.replica, request.gpu_uuid, request.model_id
        )
        return convert.model_handle_to_pb(view, self._core.gpu, self._core.node)

    @rpc(SERVICE)
    async def DetachModel(
        self, request: pb.DetachModelRequest, context: Context
    ) -> pb.DetachModelResponse:
        detached = await self._models.detach(request.name, request.replica, request.model_id)
        return pb.DetachModelResponse(detached=detached)

    @rpc(SERVICE)
    async def ListModels(
        self, request: pb.ListModelsRequest, context: Context
    ) -> pb.ListModelsResponse:
        core = self._core
        return pb.ListModelsResponse(
            models=[convert.model_info_to_pb(view) for view in self._models.list()],
            gpu=convert.gpu_ref(core.gpu, core.node),
            store_bytes=core.book.store_bytes(),
        )

    @rpc(SERVICE)
    async def UnloadModel(
        self, request: pb.UnloadModelRequest, context: Context
    ) -> pb.UnloadModelResponse:
        view = await self._models.unload(request.name, request.force)
        return pb.UnloadModelResponse(model=convert.model_info_to_pb(view))
