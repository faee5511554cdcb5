"""MIG batches in the placement service: MIG batch tasks wait in a `BatchCollector` until a
batch is due (its oldest task waited the window, or enough tasks wait), the batch is split over
the fleet's MIG GPUs and planned with FAR on each, concatenated after that GPU's earlier batches
(`MigFleetPlanner`, gpuloom/policies/mig/fleet.py), every task's job is ASSIGNED with its
planned instance, and each GPU's share runs through its dispatcher's RunMigBatch, placement
being the run's runner: when the dispatcher hands a task its instance, the task's job shows it
(`mig.instance_uuid`, CUDA_VISIBLE_DEVICES), the submitter's own runner (`gpuloom run --mig`,
following the job) starts the command there as the submitter and reports its end
(ReportJobDone), and placement passes that end on to the dispatcher. Neither placement nor the
dispatcher starts any task's command.

It works on placement's jobs only through a `JobLedger` (ledger.py: read a job, note a pending
reason, record, finish, end as reported, under the ledger's lock) and reads the GPUs from the
`Inventory`. The decisions call its hooks: `admit` (submission), `collect` (after the decision
batch that wrote the jobs), `before_end` (cancel, ReportJobDone), `forget` (a job ended: its end
goes to its run), `restore` (start), `run` (its task), `stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import structlog

from gpuloom.domain.errors import DomainError, FailedPrecondition
from gpuloom.domain.gpus import find_model, mig_profile
from gpuloom.domain.mig_geometry import MigGeometry
from gpuloom.domain.mig_runs import NOT_REPORTED, TaskEnd, TaskRun, TaskStart
from gpuloom.domain.placement import JobSpec, JobState, MigSlot
from gpuloom.policies.mig.fleet import BatchCollector, FleetPlan, GpuPlan, MigFleetPlanner, MigGpu
from gpuloom.policies.mig.plan import MigTask
from gpuloom.services.placement import metrics
from gpuloom.services.placement.dispatchers import (
    MigRunner,
    MigRunRequest,
    MigRunStarted,
    MigTaskRequest,
)
from gpuloom.services.placement.domain import Binding, GpuRecord, Job
from gpuloom.services.placement.inventory import Inventory
from gpuloom.services.placement.ledger import JobLedger
from gpuloom.services.placement.profiles import PROFILE_TTL_S, ProfileSource
from gpuloom.tasks import cancel_and_wait

log = structlog.get_logger("gpuloom.placement.mig")

WAITING = "waiting for the next MIG batch"
NO_MIG_GPU = "no MIG-capable GPU is registered"
MIG_SIZES = (1, 2, 3, 4, 7)


@dataclass(frozen=True, slots=True)
class MigBatchConfig:
    window_s: float = 10.0
    max_tasks: int = 64
    # Instance creation/destruction seconds by size to plan with and to send to dispatchers;
    # sizes left out keep the paper's Table 1 times of the GPU's model.
    create_seconds: Mapping[int, float] = field(default_factory=dict, hash=False)
    destroy_seconds: Mapping[int, float] = field(default_factory=dict, hash=False)
    # While tasks wait for a GPU (none can take a batch, or none of their model), look again
    # this often: heartbeats, registrations and ending jobs change what can take one.
    recheck_s: float = 1.0
    # False: no task plans batches; only calls to `plan_due` do (tests with their own clock).
    timer: bool = True


@dataclass(frozen=True, slots=True)
class _MigGpuInfo:
    record: GpuRecord
    model: str  # the known model's name
    geometry: MigGeometry


class MigBatches:
    def __init__(
        self,
        ledger: JobLedger,
        inventory: Inventory,
        profile_source: ProfileSource | None,
        runner: MigRunner | None,
        config: MigBatchConfig,
    ) -> None:
        self._ledger = ledger
        self._inventory = inventory
        self._profile_source = profile_source
        self._runner = runner
        self.config = config
        self.planner = MigFleetPlanner()
        self._collector = BatchCollector(config.window_s, config.max_tasks)
        self._arrived: dict[str, float] = {}  # job id -> its place in the queue (waiting or parked)
        self._parked: dict[str, str] = {}  # job id -> why no GPU can take it now
        self._blocked = ""  # why no GPU can take any batch now ("" = some can)
        self._busy_until: dict[str, float] = {}  # GPU -> planned end of its latest batch (clock)
        self._runs: dict[str, asyncio.Task[None]] = {}  # GPU -> the run of its latest batch
        # A task handed its instance -> its run's queue of task ends (for when its job ends).
        self._handed: dict[str, asyncio.Queue[TaskEnd | None]] = {}
        self._profiles: dict[tuple[str, str], tuple[float, tuple[tuple[int, float], ...]]] = {}
        self._wake = asyncio.Event()
        self.last_plan: FleetPlan | None = None

    # ---- hooks the decisions call ----

    async def admit(self, spec: JobSpec) -> JobSpec:
        """A valid MIG batch task's spec with its per-size times from its MIG profile: every
        size it times, or only the size the task asks for (`mig_size`)."""
        usable = await self._usable_times(spec)
        if not spec.mig_size:
            return replace(spec, mig_times=usable)
        asked = tuple((size, seconds) for size, seconds in usable if size == spec.mig_size)
        if not asked:
            of_model = f" on {spec.gpu_model}" if spec.gpu_model else ""
            raise FailedPrecondition(
                f"the MIG profile of task {spec.task_key!r}{of_model} has no time for the "
                f"{spec.mig_size}-slice instance it asks for (it times sizes "
                f"{', '.join(str(size) for size, _ in usable)})"
            )
        return replace(spec, mig_times=asked)

    async def _usable_times(self, spec: JobSpec) -> tuple[tuple[int, float], ...]:
        if self._runner is None:
            raise FailedPrecondition("this placement service runs no MIG batches (no MIG runner)")
        profiles = self._profile_source
        if profiles is None:
            raise FailedPrecondition(
                "MIG batch tasks take their times from MIG profiles, and no profile store is "
                "configured (GPULOOM_PLACEMENT_PROFILE_STORE_ADDRESS)"
            )
        key = (spec.task_key, spec.gpu_model)
        now = self._ledger.now()
        cached = self._profiles.get(key)
        if cached is not None and now - cached[0] < PROFILE_TTL_S:
            return cached[1]
        times = await profiles.mig_times(spec.task_key, spec.gpu_model)
        of_model = f" on {spec.gpu_model}" if spec.gpu_model else ""
        if not times:
            raise FailedPrecondition(
                f"no MIG profile for task {spec.task_key!r}{of_model} in the profile store: "
                "a MIG batch task needs its time on each instance size (PutMigProfile)"
            )
        usable = tuple(
            sorted(
                (size, seconds)
                for size, seconds in times.items()
                if size in MIG_SIZES and math.isfinite(seconds) and seconds > 0
            )
        )
        if not usable:
            raise FailedPrecondition(
                f"the MIG profile of task {spec.task_key!r}{of_model} has no usable time "
                f"(sizes {sorted(times)})"
            )
        self._profiles[key] = (now, usable)  # only found ones: a profile put now counts at once
        return usable

    def collect(self, jobs: Sequence[Job], now: float) -> None:
        """Queue freshly written MIG jobs for the next batch (under the ledger's lock)."""
        if not jobs:
            return
        for job in jobs:
            self._collector.add(_task(job), now)
            self._arrived[job.job_id] = now
        self._refresh_reasons(now)
        self._wake.set()

    def before_end(self, job: Job, state: JobState) -> None:
        """A job is ending by request (cancel, ReportJobDone), under the ledger's lock: any MIG
        task may be cancelled; only one handed its instance has an end to report."""
        if not job.spec.is_mig_batch or state is JobState.CANCELLED:
            return
        slot = job.binding.mig if job.binding else None
        if slot is None or not slot.instance_uuid:
            gpu = job.binding.gpu_uuid if job.binding else "?"
            raise FailedPrecondition(
                f"job {job.job_id} has not been handed its MIG instance yet (its batch on GPU "
                f"{gpu} hands it out in its turn): there is no run of it to report"
            )

    def forget(self, job: Job) -> None:
        """A MIG task ended (under the ledger's lock): if it was waiting, it leaves the queue;
        if it was handed its instance, its end goes to its run (the instance moves on)."""
        self._collector.remove(job.job_id)
        self._arrived.pop(job.job_id, None)
        self._parked.pop(job.job_id, None)
        ends = self._handed.pop(job.job_id, None)
        if ends is not None:
            reported = job.state in (JobState.SUCCEEDED, JobState.FAILED)
            ends.put_nowait(TaskEnd(job.job_id, job.exit_code if reported else NOT_REPORTED))

    async def restore(self, live: Sequence[Job]) -> None:
        """At start: pending MIG tasks join the queue again (in submission order, each from
        its submission time); tasks that were in a batch when placement stopped cannot be
        followed (the run's stream is gone), so they are LOST, saying so."""
        in_batch: dict[str, list[Job]] = defaultdict(list)
        for job in live:
            if not job.spec.is_mig_batch:
                continue
            if job.state is JobState.PENDING:
                self._collector.add(_task(job), job.submitted_at)
                self._arrived[job.job_id] = job.submitted_at
            elif job.binding is not None:
                in_batch[job.binding.gpu_uuid].append(job)
        for gpu, jobs in in_batch.items():
            await self._ledger.finish(
                jobs,
                JobState.LOST,
                f"placement restarted while this task was in a MIG batch on GPU {gpu}: the "
                "run's stream is gone, so its end cannot be followed (it may have finished, or "
                "still run, on its dispatcher)",
            )
        if in_batch or self._arrived:
            log.info(
                "MIG tasks restored",
                waiting=len(self._arrived),
                lost=sum(len(j) for j in in_batch.values()),
            )
        self._refresh_reasons(self._ledger.now())

    async def run(self) -> None:
        """Plan a batch whenever one is due (the decisions run this as a task)."""
        if not self.config.timer:
            return
        while True:
            now = self._ledger.now()
            delay = self._collector.next_due_s(now)
            if self._arrived and (self._blocked or self._parked):
                recheck = self.config.recheck_s
                delay = recheck if delay is None or self._blocked else min(delay, recheck)
            if delay is None or delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
            self._wake.clear()
            try:
                await self.plan_due()
            except Exception:  # never let one bad batch stop the service
                log.exception("MIG batch planning failed; trying again")
                await asyncio.sleep(self.config.recheck_s)

    async def stop(self) -> None:
        """Stop following the runs (the dispatchers go on with them; a restart marks their
        tasks LOST)."""
        await cancel_and_wait(*self._runs.values())

    # ---- planning ----

    async def plan_due(self) -> FleetPlan | None:
        """Plan the due batch, if one is due and a GPU can take it; start its runs. Returns
        the plan (None when none was made)."""
        ledger = self._ledger
        async with ledger.lock:
            now = ledger.now()
            gpus = self._available()
            if not gpus:
                self._refresh_reasons(now)
                return None
            self._unpark(gpus)
            batch: list[MigTask] = []
            only_on: list[set[str] | None] = []
            for task in self._collector.take(now):
                job = ledger.job(task.name)
                if job is None or job.state is not JobState.PENDING:
                    self._arrived.pop(task.name, None)  # ended meanwhile (defensive)
                    continue
                allowed = _gpus_for(job, gpus)
                if not allowed:
                    self._parked[task.name] = _why_no_gpu(job)
                    continue
                batch.append(task)
                only_on.append(None if len(allowed) == len(gpus) else allowed)
            if not batch:
                self._refresh_reasons(now)
                return None
            by_id = {gpu.record.info.gpu_uuid: gpu for gpu in gpus}
            fleet = [
                MigGpu(gpu_id, gpu.geometry, self._busy_s(gpu_id, now))
                for gpu_id, gpu in by_id.items()
            ]
            plan = None
            try:
                plan = await asyncio.to_thread(self.planner.plan, batch, fleet, only_on)
                assigned = self._assigned(plan, batch, by_id, now)
                await ledger.record(assigned)
            except BaseException:
                for task in batch:  # nothing happened: they wait for the next try
                    self._collector.add(task, self._arrived[task.name])
                for gpu_id in plan.plans if plan is not None else ():
                    self.planner.forget(gpu_id)  # a plan that will not run
                raise
            for job in assigned:
                self._arrived.pop(job.job_id, None)
            for gpu_id, gpu_plan in plan.plans.items():
                self._busy_until[gpu_id] = max(
                    self._busy_until.get(gpu_id, now), now + _plan_end_s(gpu_plan)
                )
                self._start_run(by_id[gpu_id], gpu_plan, batch)
            self.last_plan = plan
            metrics.MIG_BATCHES.inc()
            self._refresh_reasons(now)
        log.info(
            "MIG batch planned",
            tasks=len(batch),
            gpus=len(plan.plans),
            makespan_s=round(plan.makespan_s, 3),
            lower_bound_s=round(plan.lower_bound_s, 3),
            concatenated=sum(p.concatenated for p in plan.plans.values()),
        )
        return plan

    def _available(self) -> list[_MigGpuInfo]:
        """The GPUs that can take a MIG batch now: registered MIG-capable, of a model whose
        MIG geometry is known, with MIG mode on, not lost, not skipped after a failure, and
        holding no MPS or whole-GPU job. Sets `_blocked` to why none can."""
        inventory = self._inventory
        gpus, capable, down, off, held = [], 0, 0, 0, 0
        for record in inventory.records():
            info = record.info
            model = find_model(info.model)
            if not info.mig_capable or model is None or not model.mig_capable:
                continue
            capable += 1
            if inventory.is_down(record):
                down += 1
            elif not info.mig_enabled:
                off += 1
            elif inventory.holds_shares(info.gpu_uuid):
                held += 1
            else:
                geometry = model.geometry().with_reconfig_times(
                    _for_sizes(self.config.create_seconds, model.geometry()),
                    _for_sizes(self.config.destroy_seconds, model.geometry()),
                )
                gpus.append(_MigGpuInfo(record, model.name, geometry))
        if gpus:
            self._blocked = ""
        elif not capable:
            self._blocked = NO_MIG_GPU
        else:
            self._blocked = (
                f"none of the {capable} MIG-capable GPUs can take a MIG batch now ({down} lost "
                f"or skipped until their next heartbeat, {off} with MIG mode off, {held} "
                "holding MPS or whole-GPU jobs)"
            )
        return gpus

    def _unpark(self, gpus: Sequence[_MigGpuInfo]) -> None:
        for job_id in list(self._parked):
            job = self._ledger.job(job_id)
            if job is None or job.state is not JobState.PENDING:
                del self._parked[job_id]
                self._arrived.pop(job_id, None)
            elif _gpus_for(job, gpus):
                del self._parked[job_id]
                self._collector.add(_task(job), self._arrived[job_id])

    def _busy_s(self, gpu_id: str, now: float) -> float:
        """Seconds until the GPU's planned MIG work ends, while a run of it is in flight."""
        run = self._runs.get(gpu_id)
        if run is None or run.done():
            return 0.0
        return max(self._busy_until.get(gpu_id, now) - now, 0.0)

    def _assigned(
        self,
        plan: FleetPlan,
        batch: Sequence[MigTask],
        gpus: Mapping[str, _MigGpuInfo],
        now: float,
    ) -> list[Job]:
        assigned = []
        for gpu_id, gpu_plan in plan.plans.items():
            gpu = gpus[gpu_id]
            model = find_model(gpu.model)
            assert model is not None
            for a in gpu_plan.new_assignments:
                task = batch[gpu_plan.batch_indices[a.task_index - gpu_plan.first_new]]
                job = self._ledger.job(task.name)
                assert job is not None  # pending under the lock since it was taken
                binding = Binding(
                    gpu_uuid=gpu_id,
                    node=gpu.record.info.node,
                    dispatcher_address=gpu.record.dispatcher_address,
                    rect=(0, 0, 0, 0),
                    share=replace(
                        job.spec.share, memory_bytes=mig_profile(model, a.size).memory_bytes
                    ),
                    token="",
                    mig=MigSlot(
                        size=a.size,
                        first_slice=a.first_slice,
                        planned_start=now + a.start_s - gpu_plan.now_s,
                        planned_end=now + a.end_s - gpu_plan.now_s,
                    ),
                )
                assigned.append(
                    job.advance(
                        now,
                        state=JobState.ASSIGNED,
                        binding=binding,
                        policy="far",
                        pending_reason="",
                        started_at=now,
                    )
                )
        return assigned

    def _refresh_reasons(self, now: float) -> None:
        """Every waiting task's pending reason, fresh (in memory only, like the decisions')."""
        due = self._collector.next_due_s(now)
        if self._blocked:
            waiting = self._blocked
        elif due is None:
            waiting = WAITING
        else:
            when = "now" if due <= 0 else f"in {due:.1f} s"
            waiting = (
                f"{WAITING} ({self._collector.waiting} of {self.config.max_tasks} tasks; "
                f"due {when})"
            )
        for job_id in self._arrived:
            self._ledger.set_pending_reason(job_id, self._parked.get(job_id, waiting))

    # ---- runs ----

    def _start_run(self, gpu: _MigGpuInfo, gpu_plan: GpuPlan, batch: Sequence[MigTask]) -> None:
        """RunMigBatch on the GPU's dispatcher with its share of the batch, once the run of
        its previous batch is over (a dispatcher runs one batch at a time)."""
        assert self._runner is not None
        sizes = gpu.geometry.sizes
        tasks = [
            MigTaskRequest(
                name=batch[index].name,
                seconds_by_size={s: t for s, t in batch[index].times.items() if s in sizes},
            )
            for index in gpu_plan.batch_indices
        ]
        geometry = gpu.geometry
        request = MigRunRequest(
            tasks=tuple(tasks),
            policy="far",
            create_seconds=_for_sizes(self.config.create_seconds, geometry),
            destroy_seconds=_for_sizes(self.config.destroy_seconds, geometry),
        )
        gpu_id = gpu.record.info.gpu_uuid
        previous = self._runs.get(gpu_id)
        run = asyncio.create_task(
            self._run(gpu_id, gpu.record.dispatcher_address, request, previous),
            name=f"mig-run-{gpu_id}",
        )
        self._runs[gpu_id] = run
        run.add_done_callback(lambda done: self._run_done(gpu_id, done))

    def _run_done(self, gpu_id: str, run: asyncio.Task[None]) -> None:
        if self._runs.get(gpu_id) is run:
            del self._runs[gpu_id]
            self._busy_until.pop(gpu_id, None)

    async def _run(
        self,
        gpu_id: str,
        address: str,
        request: MigRunRequest,
        previous: asyncio.Task[None] | None,
    ) -> None:
        assert self._runner is not None
        if previous is not None and not previous.done():
            await asyncio.wait({previous})
        names = [task.name for task in request.tasks]
        started = False
        ended: set[str] = set()
        failure = ""
        ends: asyncio.Queue[TaskEnd | None] = asyncio.Queue()

        async def reported() -> AsyncIterator[TaskEnd]:
            while (end := await ends.get()) is not None:
                yield end

        metrics.MIG_RUNS.inc()
        try:
            async for update in self._runner.run_mig_batch(address, request, reported()):
                if isinstance(update, MigRunStarted):
                    started = True
                    log.info(
                        "MIG batch started",
                        gpu=gpu_id,
                        tasks=len(names),
                        planned_makespan_s=round(update.planned_makespan_s, 3),
                    )
                elif isinstance(update, TaskStart) and update.task in names:
                    await self._task_started(gpu_id, update, ends)
                elif isinstance(update, TaskRun) and update.task in names:
                    ended.add(update.task)
                    await self._task_ended(gpu_id, update)
        except DomainError as error:
            failure = error.message
        except Exception as error:
            log.exception("MIG batch run failed", gpu=gpu_id)
            failure = repr(error)
        finally:
            ends.put_nowait(None)
            for name in names:
                if self._handed.get(name) is ends:
                    del self._handed[name]
        left = [name for name in names if name not in ended]
        if left or failure:
            metrics.MIG_RUNS_FAILED.inc()
            log.warning(
                "MIG batch run failed", gpu=gpu_id, started=started, left=len(left), error=failure
            )
            await self._run_failed(
                gpu_id, left, started, failure or "the run ended without reporting them"
            )

    async def _task_started(
        self, gpu_id: str, start: TaskStart, ends: asyncio.Queue[TaskEnd | None]
    ) -> None:
        """The dispatcher handed a task its instance: the job shows it, for its runner to start
        it there. A task whose job ended meanwhile (cancelled) ends at once; so does one nobody
        follows (no runner waits to start it), and its job fails saying so."""
        ledger = self._ledger
        async with ledger.lock:
            job = ledger.job(start.task)
            slot = job.binding.mig if job is not None and job.binding is not None else None
            if job is None or job.state is not JobState.ASSIGNED or slot is None:
                ends.put_nowait(TaskEnd(start.task, NOT_REPORTED))
                return
            if not ledger.followed(job.job_id):
                ends.put_nowait(TaskEnd(start.task, NOT_REPORTED))
                await ledger.finish(
                    [job],
                    JobState.FAILED,
                    f"its instance {start.instance_uuid} on GPU {gpu_id} was ready, and no runner "
                    "was following the job to start it there (a MIG batch task runs under its "
                    "submitter's runner: `gpuloom run --mig`, which waits for the instance)",
                )
                return
            assert job.binding is not None
            binding = replace(
                job.binding,
                mig=replace(slot, instance_uuid=start.instance_uuid),
                environment={"CUDA_VISIBLE_DEVICES": start.instance_uuid},
            )
            await ledger.record([job.advance(ledger.now(), binding=binding)])
            self._handed[job.job_id] = ends
        log.info(
            "MIG task handed its instance", job=start.task, gpu=gpu_id, instance=start.instance_uuid
        )

    async def _task_ended(self, gpu_id: str, update: TaskRun) -> None:
        job = self._ledger.job(update.task)
        if job is None or job.state is not JobState.ASSIGNED or job.binding is None:
            return  # lost with its GPU meanwhile: that stands
        slot = job.binding.mig
        planned = (
            ""
            if slot is None
            else f"; the fleet plan gave it {slot.size} slices at slice {slot.first_slice} "
            f"for {slot.planned_end - slot.planned_start:.3f} s"
        )
        message = (
            f"exit code {update.exit_code}: ran {update.start_s:.3f}-{update.end_s:.3f} s into "
            f"its batch on GPU {gpu_id} (the dispatcher planned {update.planned_start_s:.3f}-"
            f"{update.planned_end_s:.3f} s) on {update.size} slices at slice "
            f"{update.first_slice} ({update.instance_uuid}){planned}"
        )
        state = JobState.SUCCEEDED if update.exit_code == 0 else JobState.FAILED
        try:
            await self._ledger.end_reported(job.job_id, state, message, update.exit_code)
        except DomainError as error:  # ended meanwhile
            log.info("MIG task end not recorded", job=job.job_id, error=error.message)

    async def _run_failed(self, gpu_id: str, left: list[str], started: bool, why: str) -> None:
        """A run that never started gives its tasks back to the queue; one whose stream broke
        part-way cannot say how its tasks ended: they are LOST. Either way the GPU takes no
        batch until its next heartbeat."""
        ledger = self._ledger
        async with ledger.lock:
            now = ledger.now()
            jobs = [
                job
                for name in left
                if (job := ledger.job(name)) is not None
                and job.state is JobState.ASSIGNED
                and job.binding is not None
                and job.binding.gpu_uuid == gpu_id
            ]
            self._inventory.suspend(gpu_id)
            self.planner.forget(gpu_id)
            if started:
                await ledger.finish(
                    jobs,
                    JobState.LOST,
                    f"its MIG batch on GPU {gpu_id} started, then the run's stream failed "
                    f"({why}): it may have finished, or still run, there; its end cannot be "
                    "followed",
                )
                return
            back = [
                job.advance(
                    now,
                    state=JobState.PENDING,
                    binding=None,
                    policy="",
                    pending_reason=f"its MIG batch on GPU {gpu_id} could not run ({why}); "
                    "waiting for the next batch",
                )
                for job in jobs
            ]
            await ledger.record(back)
            for job in back:
                # From its submission: it has waited its window already, so the next batch
                # is due at once.
                self._collector.add(_task(job), job.submitted_at)
                self._arrived[job.job_id] = job.submitted_at
        self._wake.set()


def _task(job: Job) -> MigTask:
    return MigTask(job.job_id, dict(job.spec.mig_times))


def _gpus_for(job: Job, gpus: Sequence[_MigGpuInfo]) -> set[str]:
    """The GPUs the task may go to: of its model (if it names one), with an instance size it
    has a time for."""
    wanted = find_model(job.spec.gpu_model) if job.spec.gpu_model else None
    times = dict(job.spec.mig_times)
    return {
        gpu.record.info.gpu_uuid
        for gpu in gpus
        if (not job.spec.gpu_model or (wanted is not None and wanted.name == gpu.model))
        and any(math.isfinite(times.get(size, math.inf)) for size in gpu.geometry.sizes)
    }


def _why_no_gpu(job: Job) -> str:
    spec = job.spec
    sizes = ", ".join(str(size) for size, _ in spec.mig_times) or "none"
    of_model = f" of model {spec.gpu_model}" if spec.gpu_model else ""
    return (
        f"no MIG GPU{of_model} that can take a batch now has an instance size its MIG profile "
        f"times (sizes {sizes})"
    )


def _for_sizes(seconds: Mapping[int, float], geometry: MigGeometry) -> dict[int, float]:
    return {size: value for size, value in seconds.items() if size in geometry.sizes}


def _plan_end_s(gpu_plan: GpuPlan) -> float:
    """Seconds from planning until the GPU's plan is over, its last instance destroyed."""
    plan = gpu_plan.plan
    end = max([plan.makespan_s, *(r.end_s for r in plan.reconfigurations)])
    return end - gpu_plan.now_s
