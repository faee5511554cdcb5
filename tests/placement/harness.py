"""A placement core on a SQLite file with in-memory dispatchers and a clock the test moves;
it can be stopped and started again on the same file (a restart)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Self

from gpuloom.domain.gpus import GpuInfo
from gpuloom.services.placement.core import CoreConfig, PlacementCore
from gpuloom.services.placement.mig_batches import MigBatchConfig
from gpuloom.services.placement.profiles import ProfileSource
from gpuloom.services.placement.repository import PlacementRepository
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.services.placement.storage import create_engine, migrate
from gpuloom.services.placement.training import TrainingConfig, TrainingControl
from tests.placement.fakes import FakeDispatchers, FakeMigRunner


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class CoreHarness:
    def __init__(
        self,
        folder: Path,
        profiles: ProfileSource | None = None,
        runner: FakeMigRunner | None = None,
        mig: MigBatchConfig | None = None,
        training: TrainingConfig | None = None,
        training_control: TrainingControl | None = None,
        registration_grace_s: float = 0.0,
    ) -> None:
        self.settings = PlacementSettings(database_url=f"sqlite:///{folder / 'p.db'}")
        self.dispatchers = FakeDispatchers()
        self.profiles = profiles
        self.runner = runner
        self.mig = mig or MigBatchConfig(timer=False)
        self.training = training or TrainingConfig()
        self.training_control = training_control
        self.registration_grace_s = registration_grace_s
        self.clock = Clock()
        self.core: PlacementCore | None = None
        self.engine = None

    async def start(self) -> PlacementCore:
        self.engine = create_engine(self.settings)
        await migrate(self.engine)
        config = CoreConfig(
            heartbeat_interval_s=1,
            heartbeat_timeout_s=5,
            registration_grace_s=self.registration_grace_s,
            mig=self.mig,
            training=self.training,
        )
        self.core = PlacementCore(
            PlacementRepository(self.engine),
            self.dispatchers,
            self.profiles,
            config,
            self.clock,
            mig_runner=self.runner,
            training_control=self.training_control,
        )
        await self.core.start()
        return self.core

    async def with_gpus(
        self, make_gpu: Callable[[int], GpuInfo], indexes: Iterable[int]
    ) -> PlacementCore:
        """The started core with `make_gpu(i)` registered for each of `indexes`, behind the
        dispatcher at 10.0.0.i:50060."""
        assert self.core is not None
        for i in indexes:
            await self.core.register_gpu(make_gpu(i), f"10.0.0.{i}:50060")
        return self.core

    async def stop(self) -> None:
        assert self.core is not None and self.engine is not None
        await self.core.stop()
        await self.engine.dispose()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()
