"""Wiring of the placement service: settings -> engine, repository, dispatcher client,
profile source, core, gRPC server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from gpuloom.policies.training.gandiva import GandivaKnobs
from gpuloom.services.common.database import ensure_reachable
from gpuloom.services.common.server import RunningServer, ServiceRegistration, start_server
from gpuloom.services.placement.core import CoreConfig, PlacementCore
from gpuloom.services.placement.dispatchers import (
    DispatcherChannels,
    Dispatchers,
    GrpcDispatchers,
    GrpcMigRunner,
    MigRunner,
)
from gpuloom.services.placement.mig_batches import MigBatchConfig
from gpuloom.services.placement.profiles import GrpcProfileSource, ProfileSource
from gpuloom.services.placement.repository import PlacementRepository
from gpuloom.services.placement.servicer import SERVICE, PlacementServicer
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.services.placement.storage import create_engine, migrate
from gpuloom.services.placement.training import (
    GrpcTrainingControl,
    TrainingConfig,
    TrainingControl,
)
from gpuloom.v1 import placement_pb2_grpc as pb_grpc

DATABASE_URL_VARIABLE = "GPULOOM_PLACEMENT_DATABASE_URL"

log = structlog.get_logger("gpuloom.placement")


@dataclass
class PlacementApp:
    core: PlacementCore
    server: RunningServer
    engine: AsyncEngine
    channels: DispatcherChannels
    profiles: ProfileSource | None

    @property
    def port(self) -> int:
        return self.server.port

    @classmethod
    async def start(
        cls,
        settings: PlacementSettings,
        host: str,
        data_dir: Path,
        dispatchers: Dispatchers | None = None,
        mig_runner: MigRunner | None = None,
        training_control: TrainingControl | None = None,
    ) -> PlacementApp:
        """`dispatchers` and `mig_runner` replace the gRPC clients (the benchmark stands in its
        own dispatchers); the caller closes what it passes."""
        engine = create_engine(settings, data_dir)
        channels = DispatcherChannels()  # one connection per dispatcher, for both clients
        dispatchers = dispatchers or GrpcDispatchers(channels, settings.dispatcher_timeout_s)
        mig_runner = mig_runner or GrpcMigRunner(channels)
        profiles = (
            GrpcProfileSource(settings.profile_store_address)
            if settings.profile_store_address
            else None
        )
        core = None
        try:
            await ensure_reachable(engine, DATABASE_URL_VARIABLE)
            if settings.auto_migrate:
                await migrate(engine, settings.database_schema)
            config = CoreConfig(
                default_policy=settings.default_policy,
                function_owner=settings.function_owner,
                heartbeat_interval_s=settings.heartbeat_interval_s,
                heartbeat_timeout_s=settings.heartbeat_timeout_s,
                registration_grace_s=settings.registration_grace_s,
                max_batch=settings.max_batch,
                mig=MigBatchConfig(
                    window_s=settings.mig_batch_window_s,
                    max_tasks=settings.mig_batch_max_tasks,
                    create_seconds=settings.mig_create_seconds,
                    destroy_seconds=settings.mig_destroy_seconds,
                ),
                training=TrainingConfig(
                    policy=settings.training_policy,
                    quantum_s=settings.training_quantum_s,
                    pack_trial_s=settings.training_pack_trial_s,
                    suspend_wait_ms=settings.training_suspend_wait_ms,
                    grow_idle_s=settings.training_grow_idle_s,
                    gandiva=GandivaKnobs(
                        slice_after_s=settings.training_slice_after_s,
                        share_after_s=settings.training_share_after_s,
                        queue_ahead=settings.training_queue_ahead,
                        bet_min_ended=settings.training_bet_min_ended,
                        preempt_after_s=settings.training_preempt_after_s,
                    ),
                ),
            )
            core = PlacementCore(
                PlacementRepository(engine),
                dispatchers,
                profiles,
                config,
                mig_runner=mig_runner,
                training_control=training_control
                or GrpcTrainingControl(channels, settings.dispatcher_timeout_s),
            )
            await core.start()
            servicer = PlacementServicer(core)
            registration = ServiceRegistration(
                SERVICE, lambda server: pb_grpc.add_PlacementServicer_to_server(servicer, server)
            )
            server = await start_server(
                [registration], host, settings.port, settings.max_message_bytes
            )
        except BaseException:
            if core is not None:
                await core.stop()
            await channels.close()
            if profiles is not None:
                await profiles.close()
            await engine.dispose()
            raise
        log.info(
            "placement ready",
            port=server.port,
            database=engine.url.render_as_string(hide_password=True),
            policy=settings.default_policy,
            profile_store=settings.profile_store_address or None,
        )
        return cls(core, server, engine, channels, profiles)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.server.stop(grace_s)
        await self.core.stop()
        await self.channels.close()
        if self.profiles is not None:
            await self.profiles.close()
        await self.engine.dispose()
