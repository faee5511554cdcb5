"""A small typed client for gpuloom.v1.ProfileStore.

Returns the domain's profile dataclasses (gpuloom.domain.profiles) and raises domain errors
(NotFound, InvalidArgument, Aborted, ...), so callers never touch protobuf or status codes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import UTC

from gpuloom.clients.blocking import BlockingClient
from gpuloom.convert import profiles as convert
from gpuloom.domain import profiles as d
from gpuloom.v1 import profile_store_pb2 as pb
from gpuloom.v1 import profile_store_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "localhost:50052"


def default_address() -> str:
    return os.environ.get("GPULOOM_PROFILE_STORE_ADDRESS", DEFAULT_ADDRESS)


class ProfileStoreClient(BlockingClient):
    def __init__(self, address: str | None = None, timeout_s: float = 10.0) -> None:
        super().__init__(address or default_address(), pb_grpc.ProfileStoreStub, timeout_s)

    def put(self, profile: d.Profile, expected_version: int | None = None) -> d.Profile:
        """Store a profile of any kind; returns it with the version the store gave it."""
        method, request_type = _PUTS[profile.KIND]
        request = request_type(profile=convert.TO_PB[type(profile)](profile))
        if expected_version is not None:
            request.expected_version = expected_version
        return convert.stamped_from_pb(profile.KIND, self._call(method, request))

    def get(self, kind: d.ProfileKind, key: str, gpu_model: str) -> d.Profile:
        request = pb.GetProfileRequest(key=key, gpu_model=gpu_model)
        return convert.stamped_from_pb(kind, self._call(_GETS[kind], request))

    def get_kernel_profile(self, task_key: str, gpu_model: str) -> d.KernelProfile:
        profile = self.get(d.ProfileKind.KERNEL, task_key, gpu_model)
        assert isinstance(profile, d.KernelProfile)
        return profile

    def list(
        self,
        kind: d.ProfileKind | None = None,
        key: str = "",
        gpu_model: str = "",
        page_size: int = 100,
    ) -> Iterator[d.ProfileSummary]:
        """Every matching profile summary, fetching pages as the iteration goes."""
        token = ""
        while True:
            response = self._call(
                "ListProfiles",
                pb.ListProfilesRequest(
                    kind=convert.KIND_TO_PB[kind] if kind else pb.PROFILE_KIND_UNSPECIFIED,
                    key=key,
                    gpu_model=gpu_model,
                    page_size=page_size,
                    page_token=token,
                ),
            )
            assert isinstance(response, pb.ListProfilesResponse)
            for summary in response.profiles:
                meta = summary.meta
                yield d.ProfileSummary(
                    d.ProfileId(convert.KIND_FROM_PB[meta.kind], meta.key, meta.gpu_model),
                    meta.version,
                    meta.updated_at.ToDatetime(tzinfo=UTC),
                    summary.entries,
                )
            token = response.next_page_token
            if not token:
                return

    def delete(
        self, kind: d.ProfileKind, key: str, gpu_model: str, expected_version: int | None = None
    ) -> int:
        request = pb.DeleteProfileRequest(
            kind=convert.KIND_TO_PB[kind], key=key, gpu_model=gpu_model
        )
        if expected_version is not None:
            request.expected_version = expected_version
        response = self._call("DeleteProfile", request)
        assert isinstance(response, pb.DeleteProfileResponse)
        return response.deleted_version


_PUTS = {
    d.ProfileKind.KERNEL: ("PutKernelProfile", pb.PutKernelProfileRequest),
    d.ProfileKind.THROUGHPUT: ("PutThroughputProfile", pb.PutThroughputProfileRequest),
    d.ProfileKind.MIG: ("PutMigProfile", pb.PutMigProfileRequest),
    d.ProfileKind.JOB: ("PutJobProfile", pb.PutJobProfileRequest),
}
_GETS = {
    d.ProfileKind.KERNEL: "GetKernelProfile",
    d.ProfileKind.THROUGHPUT: "GetThroughputProfile",
    d.ProfileKind.MIG: "GetMigProfile",
    d.ProfileKind.JOB: "GetJobProfile",
}
