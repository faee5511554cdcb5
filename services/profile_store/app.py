"""Wiring of the profile store: settings -> engine, cache, core, gRPC server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from gpuloom.convert.profiles import ProtobufCodec
from gpuloom.services.common.database import ensure_reachable
from gpuloom.services.common.server import RunningServer, ServiceRegistration, start_server
from gpuloom.services.profile_store.cache import InProcessCache, ProfileCache, RedisCache
from gpuloom.services.profile_store.core import ProfileStore
from gpuloom.services.profile_store.repository import ProfileRepository
from gpuloom.services.profile_store.servicer import SERVICE, ProfileStoreServicer
from gpuloom.services.profile_store.settings import ProfileStoreSettings
from gpuloom.services.profile_store.storage import create_engine, migrate
from gpuloom.v1 import profile_store_pb2_grpc as pb_grpc

DATABASE_URL_VARIABLE = "GPULOOM_PROFILE_STORE_DATABASE_URL"

log = structlog.get_logger("gpuloom.profile_store")


def build_cache(settings: ProfileStoreSettings) -> ProfileCache:
    if settings.redis_url:
        return RedisCache(
            settings.redis_url,
            ttl_s=settings.cache_ttl_s,
            timeout_s=settings.cache_timeout_s,
            retry_s=settings.cache_retry_s,
            prefix=settings.cache_prefix,
        )
    return InProcessCache(settings.in_process_cache_entries, settings.cache_ttl_s)


@dataclass
class ProfileStoreApp:
    store: ProfileStore
    server: RunningServer
    engine: AsyncEngine
    cache: ProfileCache

    @property
    def port(self) -> int:
        return self.server.port

    @classmethod
    async def start(
        cls, settings: ProfileStoreSettings, host: str, data_dir: Path
    ) -> ProfileStoreApp:
        engine = create_engine(settings, data_dir)
        cache = build_cache(settings)
        try:
            await ensure_reachable(engine, DATABASE_URL_VARIABLE)
            if settings.auto_migrate:
                await migrate(engine, settings.database_schema)
            store = ProfileStore(ProfileRepository(engine), cache, ProtobufCodec())
            servicer = ProfileStoreServicer(store)
            registration = ServiceRegistration(
                SERVICE, lambda server: pb_grpc.add_ProfileStoreServicer_to_server(servicer, server)
            )
            server = await start_server(
                [registration], host, settings.port, settings.max_message_bytes
            )
        except BaseException:
            await cache.close()
            await engine.dispose()
            raise
        log.info(
            "profile store ready",
            database=engine.url.render_as_string(hide_password=True),
            cache="redis" if isinstance(cache, RedisCache) else "in-process",
        )
        return cls(store, server, engine, cache)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.server.stop(grace_s)
        await self.cache.close()
        await self.engine.dispose()
