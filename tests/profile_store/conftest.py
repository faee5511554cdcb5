"""A running profile store (real gRPC server on an ephemeral port, PostgreSQL and Redis)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.services.profile_store.settings import ProfileStoreSettings
from gpuloom.v1 import profile_store_pb2_grpc as pb_grpc
from tests.conftest import POSTGRES_URL, postgres_schema


@pytest.fixture
async def store_app(
    redis_url: str, cache_prefix: str, tmp_path: Path
) -> AsyncIterator[ProfileStoreApp]:
    async with postgres_schema() as (_engine, schema):
        settings = ProfileStoreSettings(
            port=0,
            database_url=POSTGRES_URL,
            database_schema=schema,
            redis_url=redis_url,
            cache_prefix=cache_prefix,
            max_message_bytes=256 * 1024,
        )
        app = await ProfileStoreApp.start(settings, "127.0.0.1", tmp_path)
        yield app
        await app.cache.flush()  # type: ignore[attr-defined]
        await app.stop(grace_s=0)


@pytest.fixture
async def stub(store_app: ProfileStoreApp) -> AsyncIterator[pb_grpc.ProfileStoreStub]:
    async with grpc.aio.insecure_channel(
        f"127.0.0.1:{store_app.port}",
        options=[("grpc.max_send_message_length", 64 * 1024 * 1024)],
    ) as channel:
        yield pb_grpc.ProfileStoreStub(channel)
