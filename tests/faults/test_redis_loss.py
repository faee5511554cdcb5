"""A profile written while the profile store cannot reach Redis, then Redis back: no read may
serve the entry Redis held from before. The store is pointed at a closed port, then (restarted,
as an operator fixing its address would) at the real Redis; the shared Redis is never stopped.
(Redis going away under a running store is tests/profile_store/test_servicer.py's.)"""

from __future__ import annotations

from pathlib import Path

import grpc
import redis.asyncio as aioredis

from gpuloom.convert import profiles as convert
from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.services.profile_store.settings import ProfileStoreSettings
from gpuloom.v1 import profile_store_pb2 as pb
from gpuloom.v1 import profile_store_pb2_grpc as pb_grpc
from tests.conftest import POSTGRES_URL, free_port, postgres_schema
from tests.profile_store import samples

GET = pb.GetProfileRequest(key="bert-finetune", gpu_model="V100")


async def _version_served(settings: ProfileStoreSettings, tmp_path: Path, put: bool) -> int:
    """Start a store, optionally write the profile once more, read it; the version read."""
    app = await ProfileStoreApp.start(settings, "127.0.0.1", tmp_path)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = pb_grpc.ProfileStoreStub(channel)
            if put:
                profile = convert.job_profile_to_pb(samples.job_profile())
                await stub.PutJobProfile(pb.PutJobProfileRequest(profile=profile))
            return (await stub.GetJobProfile(GET)).meta.version
    finally:
        await app.stop(0)


async def test_a_write_redis_missed_is_not_shadowed_when_redis_is_back(
    redis_url: str, cache_prefix: str, tmp_path: Path
) -> None:
    async with postgres_schema() as (_engine, schema):
        common = {
            "port": 0,
            "database_url": POSTGRES_URL,
            "database_schema": schema,
            "cache_prefix": cache_prefix,
            "cache_timeout_s": 0.3,
        }
        with_redis = ProfileStoreSettings(redis_url=redis_url, **common)
        closed = ProfileStoreSettings(redis_url=f"redis://127.0.0.1:{free_port()}/0", **common)
        redis = aioredis.Redis.from_url(redis_url)
        try:
            # Version 1, read through Redis: Redis now holds it.
            assert await _version_served(with_redis, tmp_path, put=True) == 1
            assert [k async for k in redis.scan_iter(match=f"{cache_prefix}*")]

            # Redis unreachable: version 2 goes to the database only, and is served from it.
            assert await _version_served(closed, tmp_path, put=True) == 2

            # Redis back: version 2, never the version 1 Redis still holds.
            assert await _version_served(with_redis, tmp_path, put=False) == 2
            assert await _version_served(with_redis, tmp_path, put=False) == 2
        finally:
            async for key in redis.scan_iter(match=f"{cache_prefix}*"):
                await redis.unlink(key)
            await redis.aclose()
