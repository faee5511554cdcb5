"""Settings of the profiler (environment variables GPULOOM_PROFILER_*)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ProfilerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPULOOM_PROFILER_", extra="ignore")

    port: int = Field(default=50053, ge=0, le=65535)
    # Where finished kernel profiles go.
    profile_store_address: str = Field(default="localhost:50052", min_length=1)
    # Uploads carry column batches of up to a million records.
    max_message_bytes: int = Field(default=64 << 20, ge=1 << 20, le=1 << 30)
