"""Settings of the profile store (environment variables GPULOOM_PROFILE_STORE_*)."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuloom.services.common.database import SCHEMA_PATTERN, async_database_url
from gpuloom.services.common.server import DEFAULT_MAX_MESSAGE_BYTES


class ProfileStoreSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPULOOM_PROFILE_STORE_", extra="ignore")

    port: int = Field(default=50052, ge=0, le=65535)
    # Empty: the embedded default, SQLite in GPULOOM_DATA_DIR/profiles.db.
    database_url: str = ""
    # PostgreSQL only: keep the tables in this schema (created if missing).
    database_schema: str = Field(default="", pattern=SCHEMA_PATTERN)
    # Empty: the embedded default, an in-process cache.
    redis_url: str = ""
    # Every cache key starts with this, so several stores (or tests) can share one Redis.
    cache_prefix: str = Field(default="gpuloom:profile-store:v1:", min_length=1, max_length=128)
    cache_ttl_s: int = Field(default=3600, ge=1, le=7 * 24 * 3600)
    # Per-command Redis timeout; a slow or dead Redis costs a request at most this much.
    cache_timeout_s: float = Field(default=0.25, gt=0, le=10)
    # After a Redis failure, requests skip the cache for this long before trying it again.
    cache_retry_s: float = Field(default=1.0, gt=0, le=300)
    in_process_cache_entries: int = Field(default=10_000, ge=1)
    max_message_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=64 * 1024, le=1 << 30)
    auto_migrate: bool = True

    @field_validator("database_url")
    @classmethod
    def _async_driver(cls, url: str) -> str:
        return async_database_url(url)

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str) -> str:
        if url and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return url
