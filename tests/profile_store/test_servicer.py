"""The gRPC service end to end: real server on an ephemeral port, real PostgreSQL and Redis."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gpuloom.convert import profiles as convert
from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.services.profile_store.settings import ProfileStoreSettings
from gpuloom.v1 import common_pb2
from gpuloom.v1 import profile_store_pb2 as pb
from gpuloom.v1 import profile_store_pb2_grpc as pb_grpc
from tests.conftest import POSTGRES_URL, postgres_schema
from tests.profile_store import samples


def kernel_request(**kernel_changes: object) -> pb.PutKernelProfileRequest:
    profile = convert.kernel_profile_to_pb(samples.kernel_profile(key="bad-input-task"))
    for name, value in kernel_changes.items():
        if isinstance(value, common_pb2.Dim3):
            getattr(profile.kernels[0], name).CopyFrom(value)
        else:
            setattr(profile.kernels[0], name, value)
    return pb.PutKernelProfileRequest(profile=profile)


def with_meta(request: pb.PutKernelProfileRequest, **meta: object) -> pb.PutKernelProfileRequest:
    for name, value in meta.items():
        setattr(request.profile.meta, name, value)
    return request


def duplicate_ids() -> pb.PutKernelProfileRequest:
    request = kernel_request()
    request.profile.kernels[1].kernel_id = request.profile.kernels[0].kernel_id
    return request


def throughput_request(sm: int, quota: float) -> pb.PutThroughputProfileRequest:
    profile = convert.throughput_profile_to_pb(samples.throughput_profile(key="bad-fn"))
    profile.points[0].sm_percent = sm
    profile.points[0].quota_percent = quota
    return pb.PutThroughputProfileRequest(profile=profile)


BAD_REQUESTS = [
    ("PutKernelProfile", with_meta(kernel_request(), key=""), "profile.meta.key"),
    ("PutKernelProfile", with_meta(kernel_request(), key="x" * 300), "profile.meta.key"),
    ("PutKernelProfile", with_meta(kernel_request(), gpu_model=""), "profile.meta.gpu_model"),
    ("PutKernelProfile", kernel_request(mean_duration_ns=-5.0), "mean_duration_ns"),
    ("PutKernelProfile", kernel_request(p95_duration_ns=math.nan), "p95_duration_ns"),
    ("PutKernelProfile", duplicate_ids(), "profile.kernels[1]"),
    ("PutKernelProfile", kernel_request(grid=common_pb2.Dim3(x=0)), "grid.x"),
    ("PutKernelProfile", kernel_request(bound=9), "profile.kernels[0].bound"),
    (
        "PutKernelProfile",
        with_meta(kernel_request(sm_usage=109), gpu_model="A100-80GB"),
        "profile.kernels[0].sm_usage",
    ),
    ("PutKernelProfile", with_meta(kernel_request(), kind=pb.PROFILE_KIND_MIG), "meta.kind"),
    ("PutKernelProfile", with_meta(kernel_request(), kind=77), "meta.kind"),
    ("PutThroughputProfile", throughput_request(0, 40), "sm_percent"),
    ("PutThroughputProfile", throughput_request(101, 40), "sm_percent"),
    ("PutThroughputProfile", throughput_request(50, 120), "quota_percent"),
    ("ListProfiles", pb.ListProfilesRequest(kind=42), "kind"),
    ("ListProfiles", pb.ListProfilesRequest(page_size=5000), "page_size"),
    ("ListProfiles", pb.ListProfilesRequest(page_token="not-a-token"), "page_token"),
    ("DeleteProfile", pb.DeleteProfileRequest(key="a", gpu_model="A100"), "kind"),
    ("GetMigProfile", pb.GetProfileRequest(key="", gpu_model="A100"), "key"),
]


async def _snapshot(stub: pb_grpc.ProfileStoreStub) -> list[tuple]:
    listed = await stub.ListProfiles(pb.ListProfilesRequest())
    return sorted(
        (p.meta.kind, p.meta.key, p.meta.gpu_model, p.meta.version, p.entries)
        for p in listed.profiles
    )


async def test_every_kind_round_trips_with_versions(stub: pb_grpc.ProfileStoreStub) -> None:
    cases = [
        ("PutKernelProfile", "GetKernelProfile", pb.PutKernelProfileRequest,
         convert.kernel_profile_to_pb(samples.kernel_profile())),
        ("PutThroughputProfile", "GetThroughputProfile", pb.PutThroughputProfileRequest,
         convert.throughput_profile_to_pb(samples.throughput_profile())),
        ("PutMigProfile", "GetMigProfile", pb.PutMigProfileRequest,
         convert.mig_profile_to_pb(samples.mig_profile())),
        ("PutJobProfile", "GetJobProfile", pb.PutJobProfileRequest,
         convert.job_profile_to_pb(samples.job_profile())),
    ]  # fmt: skip
    for put, get, request_type, profile in cases:
        stored = await getattr(stub, put)(request_type(profile=profile))
        assert stored.meta.version == 1
        fetched = await getattr(stub, get)(
            pb.GetProfileRequest(key=profile.meta.key, gpu_model=profile.meta.gpu_model)
        )
        assert fetched == stored
        # Content survives exactly; only the store-assigned meta fields differ from the input.
        fetched.meta.ClearField("version")
        fetched.meta.ClearField("updated_at")
        assert fetched == profile
    assert len(await _snapshot(stub)) == 4


async def test_write_invalidates_the_cache(stub: pb_grpc.ProfileStoreStub) -> None:
    get = pb.GetProfileRequest(key="resnet50-train", gpu_model="A100")
    await stub.PutKernelProfile(
        pb.PutKernelProfileRequest(
            profile=convert.kernel_profile_to_pb(samples.kernel_profile(n=3))
        )
    )
    assert len((await stub.GetKernelProfile(get)).kernels) == 3  # now cached
    await stub.PutKernelProfile(
        pb.PutKernelProfileRequest(
            profile=convert.kernel_profile_to_pb(samples.kernel_profile(n=1))
        )
    )
    fresh = await stub.GetKernelProfile(get)
    assert (fresh.meta.version, len(fresh.kernels)) == (2, 1)
    await stub.DeleteProfile(
        pb.DeleteProfileRequest(kind=pb.PROFILE_KIND_KERNEL, key=get.key, gpu_model=get.gpu_model)
    )
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await stub.GetKernelProfile(get)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


async def test_bad_input_is_refused_naming_the_field_and_changes_nothing(
    stub: pb_grpc.ProfileStoreStub, store_app: ProfileStoreApp
) -> None:
    await stub.PutMigProfile(
        pb.PutMigProfileRequest(profile=convert.mig_profile_to_pb(samples.mig_profile()))
    )
    before = await _snapshot(stub)
    for method, request, field in BAD_REQUESTS:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await getattr(stub, method)(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, field)
        assert field in refused.value.details(), (field, refused.value.details())
    assert await _snapshot(stub) == before
    await _assert_healthy(store_app)


async def test_absent_stale_and_oversized_requests(
    stub: pb_grpc.ProfileStoreStub, store_app: ProfileStoreApp
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as absent:
        await stub.GetJobProfile(pb.GetProfileRequest(key="nobody", gpu_model="A100"))
    assert absent.value.code() == grpc.StatusCode.NOT_FOUND

    profile = convert.mig_profile_to_pb(samples.mig_profile())
    await stub.PutMigProfile(pb.PutMigProfileRequest(profile=profile, expected_version=0))
    with pytest.raises(grpc.aio.AioRpcError) as stale:
        await stub.PutMigProfile(pb.PutMigProfileRequest(profile=profile, expected_version=0))
    assert stale.value.code() == grpc.StatusCode.ABORTED
    assert "stale version" in stale.value.details()

    # The test server accepts messages up to 256 KiB; this one is about 1 MiB.
    huge = convert.kernel_profile_to_pb(samples.kernel_profile(key="huge", n=6000))
    with pytest.raises(grpc.aio.AioRpcError) as oversized:
        await stub.PutKernelProfile(pb.PutKernelProfileRequest(profile=huge))
    assert oversized.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    snapshot = await _snapshot(stub)
    assert [(s[1], s[3]) for s in snapshot] == [("rodinia-lud", 1)]
    await _assert_healthy(store_app)


async def test_store_keeps_serving_while_redis_is_down(
    redis_proxy, cache_prefix: str, tmp_path
) -> None:
    async with postgres_schema() as (_engine, schema):
        settings = ProfileStoreSettings(
            port=0,
            database_url=POSTGRES_URL,
            database_schema=schema,
            redis_url=redis_proxy.url,
            cache_prefix=cache_prefix,
            cache_timeout_s=0.3,
            cache_retry_s=0.2,
        )
        app = await ProfileStoreApp.start(settings, "127.0.0.1", tmp_path)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
                stub = pb_grpc.ProfileStoreStub(channel)
                request = pb.PutJobProfileRequest(
                    profile=convert.job_profile_to_pb(samples.job_profile())
                )
                get = pb.GetProfileRequest(key="bert-finetune", gpu_model="V100")
                await stub.PutJobProfile(request)
                assert (await stub.GetJobProfile(get)).meta.version == 1

                await redis_proxy.stop()
                await stub.PutJobProfile(request)  # the cache misses this invalidation
                assert (await stub.GetJobProfile(get)).meta.version == 2
                await redis_proxy.start()

                await asyncio.sleep(0.3)  # past the retry pause
                for _ in range(3):
                    assert (await stub.GetJobProfile(get)).meta.version == 2
        finally:
            await app.cache.flush()  # type: ignore[attr-defined]
            await app.stop(grace_s=0)


async def test_reflection_and_health_are_served(store_app: ProfileStoreApp) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{store_app.port}") as channel:
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name async for r in responses for s in r.list_services_response.service}
    assert {"gpuloom.v1.ProfileStore", "grpc.health.v1.Health"} <= names
    await _assert_healthy(store_app)


async def _assert_healthy(app: ProfileStoreApp) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "gpuloom.v1.ProfileStore"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
