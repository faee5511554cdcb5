"""Settings of the placement service (environment variables GPULOOM_PLACEMENT_*)."""

from __future__ import annotations

import math

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuloom.policies.placement import DEFAULT_POLICY, POLICIES
from gpuloom.policies.training.gandiva import (
    BET_MIN_ENDED,
    GROW_IDLE_S,
    PREEMPT_AFTER_S,
    QUEUE_AHEAD,
    SHARE_AFTER_S,
    SLICE_AFTER_S,
)
from gpuloom.policies.training.model import SERVICE_HISTORY_WINDOW
from gpuloom.services.common.database import SCHEMA_PATTERN, async_database_url
from gpuloom.services.common.server import DEFAULT_MAX_MESSAGE_BYTES
from gpuloom.services.placement.training import validate_training_policy


class PlacementSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPULOOM_PLACEMENT_", extra="ignore")

    port: int = Field(default=50051, ge=0, le=65535)
    # Empty: the embedded default, SQLite in GPULOOM_DATA_DIR/placement.db.
    database_url: str = ""
    # PostgreSQL only: keep the tables in this schema (created if missing).
    database_schema: str = Field(default="", pattern=SCHEMA_PATTERN)
    auto_migrate: bool = True
    # Where kernel and throughput profiles come from (gap-aware placement, auto-scaling);
    # empty: no profile store (gap-aware falls back to mra, SetFunctionLoad is refused).
    profile_store_address: str = ""
    default_policy: str = DEFAULT_POLICY
    # The submitter the replicas auto-scaling adds belong to (the name of a token): it sees
    # and ends them and is told their assignment tokens. deploy/k8s sets `kubernetes`, whose
    # components start the replicas as Pods; empty: no submitter's (admins see them).
    function_owner: str = Field(default="", pattern=r"^[A-Za-z0-9._@-]{0,128}$")
    # Dispatchers send a heartbeat this often; a GPU silent for heartbeat_timeout_s is lost.
    heartbeat_interval_s: float = Field(default=2.0, gt=0, le=300)
    heartbeat_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    # After a restart, the GPUs placement knew may stay silent this long before they (and their
    # jobs) are lost: their dispatchers may be restarting too, and register only once placement
    # and the profiler are up again (compose starts them in that order).
    registration_grace_s: float = Field(default=120.0, ge=0, le=86_400)
    # How long a dispatcher may take to answer Reserve/Release.
    dispatcher_timeout_s: float = Field(default=5.0, gt=0, le=120)
    # Submissions decided and written in one transaction at most.
    max_batch: int = Field(default=256, ge=1, le=10_000)
    max_message_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=64 * 1024, le=1 << 30)
    # MIG batch tasks are collected into a batch until the oldest has waited this long, or
    # until this many wait (RunMigBatch takes at most 1000 tasks).
    mig_batch_window_s: float = Field(default=10.0, gt=0, le=86_400)
    mig_batch_max_tasks: int = Field(default=64, ge=1, le=1000)
    # Instance creation / destruction seconds by size (JSON, e.g. {"1": 0.2, "7": 0.4}) that
    # MIG batches are planned with and that dispatchers are told to plan with; sizes left out
    # keep the paper's Table 1 times of the GPU's model.
    mig_create_seconds: dict[int, float] = Field(default_factory=dict)
    mig_destroy_seconds: dict[int, float] = Field(default_factory=dict)
    # Gandiva's live mechanisms for training jobs (docs/training.md): "off" (their state is
    # shown, nothing is suspended, packed or migrated), "gandiva" or "gandiva:HEIGHT",
    # "gandiva-gs" (with grow-shrink of elastic jobs), "fifo".
    training_policy: str = "off"
    training_quantum_s: float = Field(default=60.0, ge=1, le=86_400)
    training_pack_trial_s: float = Field(default=120.0, ge=1, le=86_400)
    training_suspend_wait_ms: float = Field(default=2000.0, ge=0, le=600_000)
    # gandiva-gs: how long a GPU stays free before an elastic job may grow onto it.
    training_grow_idle_s: float = Field(default=GROW_IDLE_S, ge=0, le=604_800)
    # gandiva: a pending training job is time-sliced into a full GPU only once it has waited
    # this long, with jobs that have each run this long, behind this many of its shape, once
    # this many of its GPU count were seen to end.
    training_slice_after_s: float = Field(default=SLICE_AFTER_S, ge=0, le=604_800)
    training_share_after_s: float = Field(default=SHARE_AFTER_S, ge=0, le=604_800)
    training_queue_ahead: int = Field(default=QUEUE_AHEAD, ge=0, le=10_000)
    training_bet_min_ended: int = Field(default=BET_MIN_ENDED, ge=0, le=SERVICE_HISTORY_WINDOW)
    # gandiva: the head of the queue preempts a later job running alone on the GPUs it needs
    # once it has waited this long (through suspension; docs/training.md).
    training_preempt_after_s: float = Field(default=PREEMPT_AFTER_S, ge=0, le=604_800)

    @field_validator("database_url")
    @classmethod
    def _async_driver(cls, url: str) -> str:
        return async_database_url(url)

    @field_validator("default_policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        if name not in POLICIES:
            raise ValueError(f"unknown placement policy; known: {', '.join(sorted(POLICIES))}")
        return name

    @field_validator("training_policy")
    @classmethod
    def _known_training_policy(cls, name: str) -> str:
        return validate_training_policy(name.strip())

    @field_validator("mig_create_seconds", "mig_destroy_seconds")
    @classmethod
    def _reconfig_seconds(cls, seconds: dict[int, float]) -> dict[int, float]:
        for size, value in seconds.items():
            if size not in (1, 2, 3, 4, 7):
                raise ValueError(f"{size} is no MIG instance size (1, 2, 3, 4 or 7)")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"size {size}: must be a finite number of seconds >= 0")
        return seconds

    @model_validator(mode="after")
    def _timeout_after_interval(self) -> PlacementSettings:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")
        return self
