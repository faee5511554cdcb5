"""gpuloom.v1.ProfileStore servicer: protobuf in, domain core, protobuf out. Nothing else."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from gpuloom.convert import profiles as convert
from gpuloom.domain.profiles import ProfileFilter, ProfileId, ProfileKind
from gpuloom.services.common.grpc_errors import rpc
from gpuloom.services.profile_store.core import ProfileStore
from gpuloom.v1 import profile_store_pb2 as pb
from gpuloom.v1 import profile_store_pb2_grpc as pb_grpc

SERVICE = "gpuloom.v1.ProfileStore"
Context = grpc.aio.ServicerContext


class ProfileStoreServicer(pb_grpc.ProfileStoreServicer):
    def __init__(self, store: ProfileStore) -> None:
        self._store = store

    async def _put(self, request: Any, from_pb: Callable[[Any], Any], to_pb: Callable) -> Any:
        stored = await self._store.put(from_pb(request.profile), _optional_version(request))
        return to_pb(stored)

    async def _get(self, kind: ProfileKind, request: pb.GetProfileRequest) -> Any:
        # The store hands back the serialized reply (usually straight from the cache); parsing it
        # in C is far cheaper than building it field by field from domain objects.
        data = await self._store.get_encoded(ProfileId(kind, request.key, request.gpu_model))
        return convert.FROM_PB[kind][0].FromString(data)

    @rpc(SERVICE)
    async def PutKernelProfile(
        self, request: pb.PutKernelProfileRequest, context: Context
    ) -> pb.KernelProfile:
        return await self._put(
            request, convert.kernel_profile_from_pb, convert.kernel_profile_to_pb
        )

    @rpc(SERVICE)
    async def GetKernelProfile(
        self, request: pb.GetProfileRequest, context: Context
    ) -> pb.KernelProfile:
        return await self._get(ProfileKind.KERNEL, request)

    @rpc(SERVICE)
    async def PutThroughputProfile(
        self, request: pb.PutThroughputProfileRequest, context: Context
    ) -> pb.ThroughputProfile:
        return await self._put(
            request, convert.throughput_profile_from_pb, convert.throughput_profile_to_pb
        )

    @rpc(SERVICE)
    async def GetThroughputProfile(
        self, request: pb.GetProfileRequest, context: Context
    ) -> pb.ThroughputProfile:
        return await self._get(ProfileKind.THROUGHPUT, request)

    @rpc(SERVICE)
    async def PutMigProfile(
        self, request: pb.PutMigProfileRequest, context: Context
    ) -> pb.MigProfileRecord:
        return await self._put(request, convert.mig_profile_from_pb, convert.mig_profile_to_pb)

    @rpc(SERVICE)
    async def GetMigProfile(
        self, request: pb.GetProfileRequest, context: Context
    ) -> pb.MigProfileRecord:
        return await self._get(ProfileKind.MIG, request)

    @rpc(SERVICE)
    async def PutJobProfile(
        self, request: pb.PutJobProfileRequest, context: Context
    ) -> pb.JobProfile:
        return await self._put(request, convert.job_profile_from_pb, convert.job_profile_to_pb)

    @rpc(SERVICE)
    async def GetJobProfile(self, request: pb.GetProfileRequest, context: Context) -> pb.JobProfile:
        return await self._get(ProfileKind.JOB, request)

    @rpc(SERVICE)
    async def ListProfiles(
        self, request: pb.ListProfilesRequest, context: Context
    ) -> pb.ListProfilesResponse:
        where = ProfileFilter(
            key=request.key,
            kind=convert.kind_from_pb(request.kind, "kind", allow_unspecified=True),
            gpu_model=request.gpu_model,
        )
        page = await self._store.list(where, request.page_size, request.page_token)
        return pb.ListProfilesResponse(
            profiles=[convert.summary_to_pb(s) for s in page.summaries],
            next_page_token=page.next_page_token,
        )

    @rpc(SERVICE)
    async def DeleteProfile(
        self, request: pb.DeleteProfileRequest, context: Context
    ) -> pb.DeleteProfileResponse:
        kind = convert.kind_from_pb(request.kind, "kind")
        assert kind is not None
        pid = ProfileId(kind, request.key, request.gpu_model)
        version = await self._store.delete(pid, _optional_version(request))
        return pb.DeleteProfileResponse(deleted_version=version)


def _optional_version(request: object) -> int | None:
    return request.expected_version if request.HasField("expected_version") else None  # type: ignore[attr-defined]
