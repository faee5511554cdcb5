"""The placement service's core: the composition of its three parts, and what crosses them.

- `Inventory` (inventory.py): the registered GPUs and the `Fleet` of their free space,
  registration, heartbeats, ListGpus;
- `Decisions` (decisions.py): durable jobs, decided in batches, bound on the dispatchers, ended,
  watched; with its MIG batches (mig_batches.py), which see the jobs through a `JobLedger`;
- `AutoScaler` (scaling.py): FaST-GShare's auto-scaling of inference functions.

The core starts and stops them, and carries what links them: a GPU registered or back gives the
pending jobs another try; a GPU silent past the heartbeat timeout is lost, with its jobs. The
database is the truth: a restarted service reloads the GPUs and every live job, rebuilds the
fleet from the stored rectangles, and binds again what was reserved but not yet bound (Reserve
is idempotent by the job id and its stored token).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import structlog

from gpuloom.domain.gpus import GpuInfo
from gpuloom.domain.placement import JobSpec, JobState
from gpuloom.domain.training import TrainingReport
from gpuloom.policies.placement import DEFAULT_POLICY, Allocation
from gpuloom.services.placement import metrics
from gpuloom.services.placement.decisions import Decisions
from gpuloom.services.placement.dispatchers import Dispatchers, MigRunner
from gpuloom.services.placement.domain import GpuRecord, Job
from gpuloom.services.placement.inventory import (
    GpuView,
    Inventory,
    StoreModels,
    allocations,
    check_store,
)
from gpuloom.services.placement.mig_batches import MigBatchConfig, MigBatches
from gpuloom.services.placement.profiles import ProfileSource
from gpuloom.services.placement.repository import JobFilter, PlacementRepository
from gpuloom.services.placement.scaling import AutoScaler, ScalingResult
from gpuloom.services.placement.training import TrainingConfig, TrainingControl, TrainingDriver
from gpuloom.services.placement.training_cluster import TrainingCluster
from gpuloom.tasks import cancel_and_wait

log = structlog.get_logger("gpuloom.placement")
# The states of the jobs the service keeps in memory (the gauges of jobs by state).
LIVE_STATES = (JobState.PENDING, JobState.BINDING, JobState.ASSIGNED)


@dataclass(frozen=True, slots=True)
class CoreConfig:
    default_policy: str = DEFAULT_POLICY
    # The submitter auto-scaling's replicas belong to ("": none).
    function_owner: str = ""
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    # After a restart, how long the GPUs loaded from the database may stay silent (at least a
    # heartbeat timeout): their dispatchers may be restarting too.
    registration_grace_s: float = 0.0
    max_batch: int = 256
    mig: MigBatchConfig = field(default_factory=MigBatchConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)


class PlacementCore:
    def __init__(
        self,
        repository: PlacementRepository,
        dispatchers: Dispatchers,
        profiles: ProfileSource | None,
        config: CoreConfig = CoreConfig(),
        clock: Callable[[], float] = time.time,
        *,
        mig_runner: MigRunner | None = None,
        training_control: TrainingControl | None = None,
    ) -> None:
        """`mig_runner` runs MIG batches on the dispatchers; None: MIG batch tasks are
        refused. `training_control` suspends and resumes training jobs on the dispatchers;
        None: the training policy only shows their state."""
        self.repository = repository
        self.config = config
        self._clock = clock
        self.inventory = Inventory(repository)
        self.jobs = Decisions(
            repository,
            dispatchers,
            self.inventory,
            profiles,
            default_policy=config.default_policy,
            max_batch=config.max_batch,
            mig=config.mig,
            mig_runner=mig_runner,
            clock=clock,
        )
        self.scaler = AutoScaler(self.jobs, profiles, config.function_owner)
        self.training = TrainingDriver(
            TrainingCluster(self.jobs, self.inventory),
            dispatchers,
            training_control,
            config.training,
            clock,
        )
        self._heartbeats: asyncio.Task[None] | None = None

    @property
    def mig(self) -> MigBatches:
        return self.jobs.mig

    # ---- life cycle ----

    async def start(self) -> None:
        """Reload the inventory and every live job, then start deciding and watching heartbeats."""
        now = self._clock()
        records = await self.repository.gpus()
        live = await self.repository.live_jobs()
        holding: dict[str, list[Allocation]] = defaultdict(list)
        for job in live:
            if job.state.holds_capacity and job.binding is not None and job.binding.mig is None:
                for gpu_uuid, held in allocations(job):
                    holding[gpu_uuid].append(held)
        self.inventory.load(records, holding, now, self.config.registration_grace_s)
        unregistered = {gpu for gpu in holding if gpu not in self.inventory}
        rebinding = await self.jobs.start(live, unregistered)
        log.info(
            "placement state loaded",
            gpus=len(records),
            live_jobs=len(self.jobs.live),
            rebinding=rebinding,
        )
        self.update_gauges()
        self._heartbeats = asyncio.create_task(
            self._heartbeat_monitor(), name="placement-heartbeats"
        )
        self.training.start()

    async def stop(self) -> None:
        if self._heartbeats is not None:
            await cancel_and_wait(self._heartbeats)
        await self.training.stop()
        await self.jobs.stop()

    # ---- submitters ----

    # `owner` names the submitter; where it is optional, None means any submitter's job (an
    # admin, or placement without tokens) and a name restricts to that submitter's jobs.

    async def submit(
        self, request_id: str, spec: JobSpec, function: str = "", owner: str = ""
    ) -> Job:
        return await self.jobs.submit(request_id, spec, function, owner)

    async def get(self, job_id: str, owner: str | None = None) -> Job:
        return await self.jobs.get(job_id, owner)

    async def list(
        self, where: JobFilter, page_size: int, page_token: str
    ) -> tuple[list[Job], str]:
        return await self.jobs.list(where, page_size, page_token)

    async def cancel(self, job_id: str, reason: str = "", owner: str | None = None) -> Job:
        return await self.jobs.cancel(job_id, reason, owner)

    async def report_done(
        self, job_id: str, succeeded: bool, exit_code: int, message: str, owner: str | None = None
    ) -> Job:
        return await self.jobs.report_done(job_id, succeeded, exit_code, message, owner)

    def watch(self, job_id: str, owner: str | None = None) -> AsyncIterator[Job]:
        return self.jobs.watch(job_id, owner)

    async def set_function_load(
        self, function: str, requests_per_s: float, template: JobSpec
    ) -> ScalingResult:
        return await self.scaler.set_function_load(function, requests_per_s, template)

    # ---- dispatchers ----

    async def register_gpu(
        self,
        info: GpuInfo,
        dispatcher_address: str,
        direct: Sequence[Allocation] = (),
        models: StoreModels = (),
    ) -> float:
        """Add or refresh a GPU with the shares reserved on its dispatcher directly and the
        models its store holds; returns the heartbeat interval the dispatcher must keep."""
        info.validate()  # before the store's size is checked against its memory
        check_store(models, info.memory_bytes)
        async with self.jobs.lock:
            again = await self.inventory.register(info, dispatcher_address, self._clock())
            self.inventory.set_direct(info.gpu_uuid, direct)
            self.inventory.set_models(info.gpu_uuid, models)
            self.jobs.capacity_changed(info.gpu_uuid)
        self.jobs.wake()
        log.info(
            "GPU registered",
            gpu=info.gpu_uuid,
            node=info.node,
            model=info.model,
            dispatcher=dispatcher_address,
            again=again,
        )
        return self.config.heartbeat_interval_s

    async def heartbeat(
        self,
        gpu_uuid: str,
        utilization_percent: float,
        memory_used_bytes: int,
        assignment_ids: Sequence[str],
        direct: Sequence[Allocation] = (),
        models: StoreModels = (),
        training: Sequence[TrainingReport] = (),
        evicted: Sequence[tuple[str, str]] = (),
        suspend_releases_memory: bool = False,
    ) -> list[str]:
        """Refresh a GPU, the shares reserved on its dispatcher directly, the models its store
        holds and its training processes' cycles; end the jobs its dispatcher evicted
        (`evicted`: assignment id, reason); returns the assignments its dispatcher holds that
        no live job owns."""
        if gpu_uuid in self.inventory:  # an unknown GPU is refused by refresh
            check_store(models, self.inventory.record(gpu_uuid).info.memory_bytes)
        record = self.inventory.refresh(
            gpu_uuid, utilization_percent, memory_used_bytes, self._clock()
        )
        self.training.note_suspend_memory(gpu_uuid, suspend_releases_memory)
        if training:
            self.training.ingest(gpu_uuid, training)
        if evicted:
            await self.jobs.evicted(gpu_uuid, evicted)
        down = self.inventory.is_down(record)
        if (
            down
            or self.inventory.direct_changed(gpu_uuid, direct)
            or self.inventory.models_changed(gpu_uuid, models)
        ):
            async with self.jobs.lock:
                if down:
                    await self.inventory.revive(record)
                self.inventory.set_direct(gpu_uuid, direct)
                self.inventory.set_models(gpu_uuid, models)
                self.jobs.capacity_changed(gpu_uuid)
            self.jobs.wake()
        return self.jobs.stale(gpu_uuid, assignment_ids)

    async def report_checkpoint(
        self,
        job_id: str,
        migration_id: str,
        succeeded: bool,
        message: str,
        owner: str | None = None,
    ) -> Job:
        """A runner's answer to a migration (services/placement/training.py)."""
        if owner is not None:
            await self.jobs.get(job_id, owner)
        return await self.training.report_checkpoint(job_id, migration_id, succeeded, message)

    def gpus(self, node: str, page_size: int, page_token: str) -> tuple[list[GpuView], str]:
        return self.inventory.page(node, page_size, page_token)

    # ---- heartbeats ----

    async def _heartbeat_monitor(self) -> None:
        period = min(self.config.heartbeat_interval_s, self.config.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                await self.check_heartbeats()
            except Exception:
                log.exception("heartbeat check failed")
            self.update_gauges()

    def update_gauges(self) -> None:
        """Set the gauges of live jobs by state and of what is reserved on each GPU."""
        states = Counter(job.state for job in self.jobs.live.values())
        for state in LIVE_STATES:
            metrics.JOBS.labels(state.value).set(states[state])
        for view in self.inventory.views():
            info = view.record.info
            labels = (info.node, info.gpu_uuid)
            metrics.GPU_AREA_RESERVED.labels(*labels).set(view.area_reserved_percent / 100)
            metrics.GPU_MEMORY_RESERVED.labels(*labels).set(view.memory_reserved_bytes)

    async def check_heartbeats(self) -> list[str]:
        """Mark GPUs silent for longer than the timeout as lost, and their jobs LOST."""
        now = self._clock()
        silent = self.inventory.silent(now, self.config.heartbeat_timeout_s)
        for record in silent:
            await self._lose(record, now)
        if silent:
            self.jobs.wake()
        return [r.info.gpu_uuid for r in silent]

    async def _lose(self, record: GpuRecord, now: float) -> None:
        gpu_uuid = record.info.gpu_uuid
        async with self.jobs.lock:
            if not self.inventory.is_silent(record, now, self.config.heartbeat_timeout_s):
                return
            if self.inventory.awaited(gpu_uuid):
                message = (
                    f"GPU {gpu_uuid} on node {record.info.node} did not register again within "
                    f"{self.config.registration_grace_s:g} s of placement's restart"
                )
            else:
                age = now - record.last_heartbeat
                message = (
                    f"GPU {gpu_uuid} on node {record.info.node} stopped sending heartbeats "
                    f"(last one {age:.1f} s ago)"
                )
            await self.inventory.mark_lost(record)
            held = self.jobs.holding(gpu_uuid)
            await self.jobs.finish(held, JobState.LOST, message)
            metrics.JOBS_LOST.inc(len(held))
        log.warning("GPU lost", gpu=gpu_uuid, node=record.info.node, jobs_lost=len(held))
