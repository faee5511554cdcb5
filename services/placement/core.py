"""The placement service's core: the GPU inventory, durable jobs, and decisions.

Decisions are made by one task, in batches: submissions queued since the last batch (and the
pending jobs, when capacity was freed) are decided against the in-memory `Fleet` and written
in one transaction; only then are their reservations bound on the dispatchers
(reserve-then-bind). A bind that fails gives the capacity back and leaves the job pending with
the reason; the GPU takes no new job until its next heartbeat. The database is the truth: a
restarted service reloads the GPUs and every live job, rebuilds the fleet from the stored
rectangles, and binds again what was reserved but not yet bound (Reserve is idempotent by the
job id and its stored token).

MIG batch tasks take another road (mig_batches.py): written PENDING by the same decision
batches, then collected into MIG batches, planned over the MIG GPUs and run by the dispatchers.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import itertools
import math
import secrets
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

import structlog

from gpuloom.domain.errors import (
    AlreadyExists,
    DomainError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from gpuloom.domain.placement import MAX_KEY, GpuInfo, JobKind, JobSpec, JobState
from gpuloom.domain.shares import SpatioTemporalShare, TimeQuota
from gpuloom.policies.placement import (
    GRID_AREA,
    POLICIES,
    Allocation,
    Fleet,
    GapAwarePolicy,
    GpuState,
    InvalidRequestError,
    JobRequest,
    PlacementPolicy,
    Rect,
    Replica,
    ThroughputPoint,
    Unplaceable,
    get_policy,
    plan_scaling,
)
from gpuloom.services.placement import metrics
from gpuloom.services.placement.dispatchers import BindRequest, Dispatchers, MigRunner
from gpuloom.services.placement.domain import (
    JOB_ID_PREFIX,
    Binding,
    GpuRecord,
    Job,
    validate_address,
    validate_request_id,
)
from gpuloom.services.placement.mig_batches import WAITING, MigBatchConfig, MigBatches
from gpuloom.services.placement.profiles import ProfileSource
from gpuloom.services.placement.repository import JobFilter, PlacementRepository

log = structlog.get_logger("gpuloom.placement")

# A profile looked up in the profile store is reused for this long (found or not).
PROFILE_TTL_S = 60.0
MAX_PAGE_JOBS = 1000
# Bindings wait at most this long to be written with a decision batch.
RECORD_DELAY_S = 0.05
MAX_PAGE_GPUS = 10_000


@dataclass(frozen=True, slots=True)
class CoreConfig:
    default_policy: str = "mra"
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    max_batch: int = 256
    mig: MigBatchConfig = field(default_factory=MigBatchConfig)


class LiveJobs(dict[str, Job]):
    """The jobs still pending or holding capacity, by id, with the pending ones (MIG batch
    tasks aside: they wait for their batch) indexed, so that retrying them scans only them."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[str, None] = {}

    def __setitem__(self, job_id: str, job: Job) -> None:
        super().__setitem__(job_id, job)
        if job.state is JobState.PENDING and not job.spec.is_mig_batch:
            self.pending[job_id] = None
        else:
            self.pending.pop(job_id, None)

    def pop(self, job_id: str, default: Job | None = None) -> Job | None:  # type: ignore[override]
        self.pending.pop(job_id, None)
        return super().pop(job_id, default)


@dataclass(slots=True)
class _Submission:
    request_id: str
    spec: JobSpec
    function: str
    done: asyncio.Future[Job]
    arrived: float = field(default_factory=time.perf_counter)


@dataclass(slots=True)
class _Ending:
    """A request to end a job (cancel, a runner's report, a MIG task's end)."""

    job_id: str
    state: JobState
    message: str
    exit_code: int
    from_mig_run: bool
    require_assigned: bool
    done: asyncio.Future[Job]


@dataclass(frozen=True, slots=True)
class GpuView:
    """A GPU for ListGpus: the record plus what the fleet holds on it."""

    record: GpuRecord
    schedulable: bool
    memory_reserved_bytes: int
    area_reserved_percent: float
    jobs: int


@dataclass(frozen=True, slots=True)
class ScalingResult:
    added: tuple[Job, ...]
    removed: tuple[Job, ...]
    capacity_rps: float
    most_efficient: ThroughputPoint | None


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
    ) -> None:
        """`mig_runner` runs MIG batches on the dispatchers; None: MIG batch tasks are
        refused."""
        self._repo = repository
        self._dispatchers = dispatchers
        self._profiles = profiles
        self.config = config
        self._clock = clock
        self._fleet = Fleet()
        self._gpus: dict[str, GpuRecord] = {}
        self._gpu_keys: list[tuple[str, str]] | None = None  # (node, uuid), sorted: ListGpus
        self._max_memory: dict[str, int] = {}  # model -> largest GPU memory ("" = any model)
        self._live = LiveJobs()
        self._policies: dict[str, PlacementPolicy] = {name: get_policy(name) for name in POLICIES}
        self._kernel_cache: dict[tuple[str, str], float] = {}  # (task, model) -> looked up at
        self._watchers: dict[str, set[asyncio.Queue[Job]]] = defaultdict(set)
        self._lock = asyncio.Lock()  # one writer of fleet + database at a time
        self._queue: list[_Submission] = []
        self._ends: list[_Ending] = []
        self._unsaved: dict[str, Job] = {}  # bindings not yet written (see _bind)
        self._wake = asyncio.Event()
        self._retry_pending = False
        self._function_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = False
        # GPUs whose dispatcher failed a bind or a MIG run: no new work until its next heartbeat.
        self.suspended: set[str] = set()
        self.mig = MigBatches(self, mig_runner, config.mig)

    # ---- life cycle ----

    async def start(self) -> None:
        """Reload the inventory and every live job, then start deciding and watching heartbeats."""
        now = self._clock()
        records = await self._repo.gpus()
        live = await self._repo.live_jobs()
        holding: dict[str, list[Allocation]] = defaultdict(list)
        for job in live:
            if job.state.holds_capacity and job.binding is not None and job.binding.mig is None:
                holding[job.binding.gpu_uuid].append(_allocation(job))
        for record in records:
            record.last_heartbeat = now  # a full timeout of grace after a restart
            self._gpus[record.info.gpu_uuid] = record
            self._fleet.add_gpu(_gpu_state(record, holding.pop(record.info.gpu_uuid, [])))
            self._note_memory(record.info)
        for job in live:
            self._live[job.job_id] = job
        orphans = [j for j in live if j.binding is not None and j.binding.gpu_uuid in holding]
        if orphans:  # a GPU row vanished under its jobs: say so rather than forget them
            await self._finish_many(orphans, JobState.LOST, "its GPU is no longer registered")
        await self.mig.restore(list(self._live.values()))
        self._retry_pending = True
        rebind = [j for j in self._live.values() if j.state is JobState.BINDING]
        log.info(
            "placement state loaded",
            gpus=len(records),
            live_jobs=len(self._live),
            rebinding=len(rebind),
        )
        self._tasks = [
            asyncio.create_task(self._decide_loop(), name="placement-decide"),
            asyncio.create_task(self._heartbeat_monitor(), name="placement-heartbeats"),
            asyncio.create_task(self.mig.run(), name="placement-mig-batches"),
        ]
        if rebind:
            self._spawn(self._bind(rebind, []))
        self._wake.set()

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.mig.stop()
        if self._background:
            await asyncio.wait(self._background, timeout=5)
        if self._unsaved:
            try:
                await self._repo.update_jobs(list(self._unsaved.values()))
                self._unsaved.clear()
            except Exception:
                log.exception("bindings not recorded at shutdown; the restart binds them again")
        for waiter in (*self._queue, *self._ends):
            if not waiter.done.done():
                waiter.done.set_exception(Unavailable("placement is shutting down"))
        self._queue.clear()
        self._ends.clear()

    def _spawn(self, coroutine: object) -> None:
        task = asyncio.ensure_future(coroutine)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- submitters ----

    async def submit(self, request_id: str, spec: JobSpec, function: str = "") -> Job:
        """Queue a job for the next decision batch; answers once it is bound or pending."""
        validate_request_id(request_id)
        spec.validate(POLICIES)
        self._check_memory(spec)
        if self._stopping:
            raise Unavailable("placement is shutting down")
        if spec.is_mig_batch:
            spec = await self.mig.admit(spec)
        else:
            await self._load_kernel_profile(spec)
        done: asyncio.Future[Job] = asyncio.get_running_loop().create_future()
        self._queue.append(_Submission(request_id, spec, function, done))
        self._wake.set()
        return await done

    async def get(self, job_id: str) -> Job:
        job = self._live.get(job_id) or await self._repo.get_job(job_id)
        if job is None:
            raise NotFound(f"no job {job_id!r}")
        return job

    async def list(
        self, where: JobFilter, page_size: int, page_token: str
    ) -> tuple[list[Job], str]:
        if page_size > MAX_PAGE_JOBS:
            raise InvalidArgument("page_size", f"must be at most {MAX_PAGE_JOBS}, got {page_size}")
        after = _decode_seq(page_token)
        jobs, last = await self._repo.list_jobs(where, page_size or 100, after)
        jobs = [self._live.get(job.job_id, job) for job in jobs]
        return jobs, "" if last is None else _encode_token(str(last))

    async def cancel(self, job_id: str, reason: str = "") -> Job:
        return await self._end(job_id, JobState.CANCELLED, reason or "cancelled", 0)

    async def report_done(self, job_id: str, succeeded: bool, exit_code: int, message: str) -> Job:
        state = JobState.SUCCEEDED if succeeded else JobState.FAILED
        return await self._end(job_id, state, message, exit_code, require_assigned=True)

    async def watch(self, job_id: str) -> AsyncIterator[Job]:
        """The job now, then each new revision, until it finishes."""
        queue: asyncio.Queue[Job] = asyncio.Queue()
        self._watchers[job_id].add(queue)  # before reading, so no change slips through
        try:
            job = await self.get(job_id)
            yield job
            revision = job.revision
            while not job.state.finished:
                job = await queue.get()
                if job.revision > revision:
                    revision = job.revision
                    yield job
        finally:
            watchers = self._watchers.get(job_id)
            if watchers is not None:
                watchers.discard(queue)
                if not watchers:
                    del self._watchers[job_id]

    async def set_function_load(
        self, function: str, requests_per_s: float, template: JobSpec
    ) -> ScalingResult:
        """FaST-GShare Algorithm 1 for one inference function: add replicas of the most
        efficient configuration (plus one minimal one for the rest), or remove the least
        efficient ones; each new replica is placed like any job."""
        if not 1 <= len(function) <= MAX_KEY or not function.isprintable():
            raise InvalidArgument("function", f"must be 1..{MAX_KEY} printable characters")
        if not (math.isfinite(requests_per_s) and requests_per_s >= 0):
            raise InvalidArgument(
                "requests_per_s", f"must be finite and >= 0, got {requests_per_s}"
            )
        _replica_spec(template, 1, 1.0).validate_as("template", POLICIES)
        if self._profiles is None:
            raise FailedPrecondition(
                "auto-scaling needs throughput profiles, and no profile store is configured "
                "(GPULOOM_PLACEMENT_PROFILE_STORE_ADDRESS)"
            )
        points = await self._profiles.throughput(function, template.gpu_model)
        if not points:
            raise FailedPrecondition(f"no throughput profile for function {function!r}")
        async with self._function_locks[function]:
            replicas = [
                Replica(j.job_id, j.spec.sm_percent, j.spec.quota.request_percent)
                for j in self._live.values()
                if j.function == function
            ]
            try:
                plan = plan_scaling(points, replicas, requests_per_s)
            except InvalidRequestError as error:
                raise FailedPrecondition(f"function {function!r}: {error}") from None
            added = []
            for point in plan.add:
                spec = replace(
                    _replica_spec(template, point.sm_percent, point.quota_percent),
                    task_key=function,
                )
                added.append(await self.submit(f"scale-{uuid.uuid4().hex}", spec, function))
            removed = [
                await self.cancel(job_id, f"scaled down to {requests_per_s:g} requests/s")
                for job_id in plan.remove
            ]
        best = max(points, key=lambda p: p.rpr)
        log.info(
            "function scaled",
            function=function,
            target_rps=requests_per_s,
            added=len(added),
            removed=len(removed),
            capacity_rps=plan.capacity_rps,
        )
        return ScalingResult(tuple(added), tuple(removed), plan.capacity_rps, best)

    # ---- dispatchers ----

    async def register_gpu(self, info: GpuInfo, dispatcher_address: str) -> float:
        """Add or refresh a GPU; returns the heartbeat interval the dispatcher must keep."""
        info.validate()
        validate_address("dispatcher_address", dispatcher_address)
        async with self._lock:
            now = self._clock()
            old = self._gpus.get(info.gpu_uuid)
            record = GpuRecord(
                info=info,
                dispatcher_address=dispatcher_address,
                registered_at=now if old is None else old.registered_at,
                last_heartbeat=now,
            )
            reshaped = old is not None and (
                (old.info.node, old.info.model, old.info.memory_bytes)
                != (info.node, info.model, info.memory_bytes)
            )
            if old is None:
                self._fleet.add_gpu(_gpu_state(record, []))
            elif reshaped:
                self._replace_gpu(old, record)
            try:
                await self._repo.save_gpu(record)
            except BaseException:  # not recorded: the fleet goes back to what it was
                if old is None:
                    self._fleet.remove_gpu(info.gpu_uuid)
                elif reshaped:
                    self._replace_gpu(record, old)
                raise
            self._gpus[info.gpu_uuid] = record
            if old is None or old.info.node != info.node:
                self._gpu_keys = None
            self._fleet.set_schedulable(info.gpu_uuid, _takes_shares(record))
            self.suspended.discard(info.gpu_uuid)
            self._note_memory(info)
            self._retry_pending = True
        self._wake.set()
        log.info(
            "GPU registered",
            gpu=info.gpu_uuid,
            node=info.node,
            model=info.model,
            dispatcher=dispatcher_address,
            again=old is not None,
        )
        return self.config.heartbeat_interval_s

    def _replace_gpu(self, old: GpuRecord, new: GpuRecord) -> None:
        """The same GPU registered with another node, model or memory: its jobs stay on it
        if they still fit, otherwise the registration is refused and nothing changes."""
        held = self._fleet.remove_gpu(old.info.gpu_uuid)
        try:
            self._fleet.add_gpu(_gpu_state(new, list(held)))
        except ValueError as error:
            self._fleet.add_gpu(_gpu_state(old, list(held)))
            raise FailedPrecondition(
                f"GPU {new.info.gpu_uuid} holds jobs that would not fit it as registered now "
                f"({error}); end them first"
            ) from None

    async def heartbeat(
        self,
        gpu_uuid: str,
        utilization_percent: float,
        memory_used_bytes: int,
        assignment_ids: Sequence[str],
    ) -> list[str]:
        """Refresh a GPU; returns the assignments its dispatcher holds that no live job owns."""
        record = self._gpus.get(gpu_uuid)
        if record is None:
            raise NotFound(f"GPU {gpu_uuid!r} is not registered: register it first")
        # NaN: the driver cannot tell (NVML with MIG on); anything else must be a percentage.
        if not math.isnan(utilization_percent) and not 0 <= utilization_percent <= 100:
            raise InvalidArgument(
                "utilization_percent", f"must be within 0..100, got {utilization_percent}"
            )
        record.last_heartbeat = self._clock()
        record.utilization_percent = utilization_percent
        record.memory_used_bytes = memory_used_bytes
        if record.lost or gpu_uuid in self.suspended:
            async with self._lock:
                if record.lost:
                    await self._repo.set_gpu_lost(gpu_uuid, False)
                    record.lost = False
                    log.info("GPU is back", gpu=gpu_uuid, node=record.info.node)
                self.suspended.discard(gpu_uuid)
                self._fleet.set_schedulable(gpu_uuid, _takes_shares(record))
                self._retry_pending = True
            self._wake.set()
        stale = []
        for assignment_id in assignment_ids:
            if not assignment_id.startswith(JOB_ID_PREFIX):
                continue  # reserved on the dispatcher by someone else: not ours to judge
            job = self._live.get(assignment_id)
            if job is None or job.binding is None or job.binding.gpu_uuid != gpu_uuid:
                stale.append(assignment_id)
        return stale

    def gpus(self, node: str, page_size: int, page_token: str) -> tuple[list[GpuView], str]:
        if page_size > MAX_PAGE_GPUS:
            raise InvalidArgument("page_size", f"must be at most {MAX_PAGE_GPUS}, got {page_size}")
        limit = page_size or 1000
        if self._gpu_keys is None:
            self._gpu_keys = sorted((r.info.node, r.info.gpu_uuid) for r in self._gpus.values())
        keys = self._gpu_keys
        start = 0
        if page_token:
            after = tuple(_decode_text(page_token).split("\x1f"))
            if len(after) != 2:
                raise InvalidArgument("page_token", "is not a token this service handed out")
            start = bisect.bisect_right(keys, after)
        page: list[tuple[str, str]] = []
        more = False
        for key in itertools.islice(keys, start, None):
            if node and key[0] != node:
                continue
            if len(page) == limit:
                more = True
                break
            page.append(key)
        views = []
        for _, gpu_uuid in page:
            slot = self._fleet.slot(gpu_uuid)
            views.append(
                GpuView(
                    record=self._gpus[gpu_uuid],
                    schedulable=slot.schedulable,
                    memory_reserved_bytes=slot.memory_used,
                    area_reserved_percent=100.0 * slot.area_used / GRID_AREA,
                    jobs=len(slot.allocations),
                )
            )
        token = _encode_token("\x1f".join(page[-1])) if more else ""
        return views, token

    # ---- deciding ----

    async def _decide_loop(self) -> None:
        while True:
            if not (self._queue or self._ends or self._retry_pending):
                # Bindings are written with the next batch, or after a short quiet spell.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._wake.wait(), RECORD_DELAY_S if self._unsaved else None
                    )
                self._wake.clear()
            if not (self._queue or self._ends or self._retry_pending or self._unsaved):
                continue
            batch = self._queue[: self.config.max_batch]
            del self._queue[: len(batch)]
            ends = self._ends[: self.config.max_batch]
            del self._ends[: len(ends)]
            try:
                await self._decide(batch, ends)
            except Exception as error:  # never let one bad batch stop the service
                log.exception("decision batch failed", jobs=len(batch), ends=len(ends))
                for waiter in (*batch, *ends):
                    if not waiter.done.done():
                        waiter.done.set_exception(
                            Unavailable(f"placement could not decide: {error}")
                        )

    async def _decide(self, batch: list[_Submission], ends: list[_Ending]) -> None:
        async with self._lock:
            now = self._clock()
            endings = await self._take_ends(list(ends), now)
            ending = {before.job_id for _, before, _ in endings}
            retried = self._place_pending(now, ending) if self._retry_pending else []
            self._retry_pending = False
            fresh: dict[str, Job] = {}  # request id -> the job this batch makes of it
            waiting: list[tuple[_Submission, Job]] = []
            for submission in batch:
                job = fresh.get(submission.request_id)
                if job is None:
                    job = Job(
                        job_id=f"{JOB_ID_PREFIX}{uuid.uuid4().hex}",
                        request_id=submission.request_id,
                        spec=submission.spec,
                        state=JobState.PENDING,
                        submitted_at=now,
                        updated_at=now,
                        function=submission.function,
                    )
                    job = fresh[submission.request_id] = self._place(job, now)
                waiting.append((submission, job))
            changed = [job for job, _ in retried]
            unsaved = list(self._unsaved.values())
            self._unsaved.clear()
            ended = [after for _, _, after in endings]
            try:
                taken = await self._repo.write(list(fresh.values()), [*changed, *unsaved, *ended])
            except BaseException:  # a failed write, or the service stopping in the middle
                for job in (*fresh.values(), *changed):
                    if job.state is JobState.BINDING:
                        self._fleet.release(job.job_id)
                for job, before in retried:
                    self._live[job.job_id] = before
                for job in unsaved:
                    self._unsaved.setdefault(job.job_id, job)
                for end, _, _ in endings:
                    end.done.set_exception(Unavailable("the job's end could not be recorded"))
                raise
            for end, before, after in endings:
                self._retire(before, after)
                end.done.set_result(after)
            for request_id in taken:  # submitted before: that job stands, this one never was
                job = fresh.pop(request_id)
                if job.state is JobState.BINDING:
                    self._fleet.release(job.job_id)
            prior = await self._repo.jobs_by_request_id(list(taken)) if taken else {}
            for job in (*fresh.values(), *changed):
                self._live[job.job_id] = job
                self._publish(job)
            self.mig.collect([j for j in fresh.values() if j.spec.is_mig_batch], now)
            decided_at = time.perf_counter()
            for submission in batch:
                metrics.DECISION_LATENCY.observe(decided_at - submission.arrived)
        answers: list[tuple[_Submission, str]] = []
        for submission, job in waiting:
            job = prior.get(submission.request_id, job)
            if job.spec != submission.spec or job.function != submission.function:
                submission.done.set_exception(
                    AlreadyExists(
                        f"request_id {submission.request_id!r} was used for a different job "
                        f"({job.job_id})"
                    )
                )
            else:
                answers.append((submission, job.job_id))
        binding = [job for job in (*fresh.values(), *changed) if job.state is JobState.BINDING]
        if binding:
            self._spawn(self._bind(binding, answers))
        else:
            await self._answer(answers)

    def _place(self, job: Job, now: float) -> Job:
        """Ask the job's policy for a place. A placed job is BINDING (its capacity is now
        taken in the fleet); an unplaceable one stays PENDING with the reason. A MIG batch task
        stays PENDING: the MIG batches take it from there."""
        if job.spec.is_mig_batch:
            return replace(job, pending_reason=WAITING)
        if not len(self._fleet):
            return replace(job, pending_reason="no GPU is registered yet")
        spec = job.spec
        request = JobRequest(
            job_id=job.job_id,
            sm_percent=spec.sm_percent,
            quota_request_percent=spec.quota.request_percent,
            memory_bytes=spec.memory_bytes,
            quota_limit_percent=spec.quota.limit_percent,
            priority=spec.priority,
            gpu_model=spec.gpu_model,
            task_key=spec.task_key,
        )
        decision = self._fleet.place(
            request, self._policies[spec.policy or self.config.default_policy]
        )
        if isinstance(decision, Unplaceable):
            return replace(job, pending_reason=decision.reason)
        gpu = self._gpus[decision.gpu_id]
        rect = decision.rect
        binding = Binding(
            gpu_uuid=decision.gpu_id,
            node=decision.node,
            dispatcher_address=gpu.dispatcher_address,
            rect=(rect.x, rect.y, rect.w, rect.h),
            memory_cap_bytes=spec.memory_bytes,
            token=secrets.token_urlsafe(32),
        )
        return job.advance(
            now, state=JobState.BINDING, binding=binding, policy=decision.policy, pending_reason=""
        )

    def _place_pending(self, now: float, ending: set[str]) -> list[tuple[Job, Job]]:
        """Try every pending job again, highest priority and oldest first; returns
        (placed job, job before) for those that found a place."""
        placed = []
        pending = sorted(
            (self._live[job_id] for job_id in self._live.pending if job_id not in ending),
            key=lambda j: (j.spec.priority, j.submitted_at),
        )
        for job in pending:
            decided = self._place(job, now)
            if decided.state is JobState.BINDING:
                placed.append((decided, job))
            elif decided.pending_reason != job.pending_reason:
                self._live[job.job_id] = decided  # a fresher reason, kept in memory only
        return placed

    async def _bind(self, jobs: list[Job], waiting: list[tuple[_Submission, str]]) -> None:
        """Reserve each job on its dispatcher, then record ASSIGNED, or give the capacity
        back and leave the job PENDING with the reason."""
        results = await asyncio.gather(
            *(self._reserve(job) for job in jobs), return_exceptions=True
        )
        async with self._lock:
            now = self._clock()
            changed = []
            for job, result in zip(jobs, results, strict=True):
                assert job.binding is not None
                current = self._live.get(job.job_id)
                if current is None or current.revision != job.revision:
                    # Cancelled or lost while binding: make sure the dispatcher lets go too.
                    if not isinstance(result, BaseException):
                        self._release_on_dispatcher(job.binding, job.job_id)
                    continue
                if isinstance(result, BaseException):
                    message = result.message if isinstance(result, DomainError) else repr(result)
                    self._fleet.release(job.job_id)
                    self._suspend(job.binding.gpu_uuid)
                    self._release_on_dispatcher(job.binding, job.job_id)
                    metrics.BIND_FAILURES.inc()
                    log.warning(
                        "binding failed", job=job.job_id, gpu=job.binding.gpu_uuid, error=message
                    )
                    changed.append(
                        current.advance(
                            now,
                            state=JobState.PENDING,
                            binding=None,
                            policy="",
                            pending_reason=f"binding on GPU {job.binding.gpu_uuid} failed "
                            f"({message}); will try again",
                        )
                    )
                else:
                    changed.append(
                        current.advance(
                            now,
                            state=JobState.ASSIGNED,
                            binding=replace(job.binding, environment=result),
                        )
                    )
            # Recorded behind, with the next decision batch: the BINDING row already holds the
            # decision, and a restart binds it again (idempotently) if this write never lands.
            for job in changed:
                self._live[job.job_id] = job
                self._unsaved[job.job_id] = job
                self._publish(job)
            if any(job.state is JobState.PENDING for job in changed):
                self._retry_pending = True
                self._wake.set()
        await self._answer(waiting)

    async def _reserve(self, job: Job) -> dict[str, str]:
        binding = job.binding
        assert binding is not None
        spec = job.spec
        return await self._dispatchers.reserve(
            binding.dispatcher_address,
            BindRequest(
                assignment_id=job.job_id,
                client_name=spec.name,
                priority=spec.priority,
                memory_cap_bytes=binding.memory_cap_bytes,
                sm_percent=spec.sm_percent,
                quota_request_percent=spec.quota.request_percent,
                quota_limit_percent=spec.quota.limit_percent,
                token=binding.token,
                task_key=spec.task_key,
            ),
        )

    async def _answer(self, waiting: list[tuple[_Submission, str]]) -> None:
        for submission, job_id in waiting:
            if submission.done.done():
                continue
            job = self._live.get(job_id)
            if job is None:
                try:
                    job = await self.get(job_id)
                except DomainError as error:
                    submission.done.set_exception(error)
                    continue
            submission.done.set_result(job)

    def _suspend(self, gpu_uuid: str) -> None:
        """No new job on this GPU until its dispatcher shows it is alive again."""
        if gpu_uuid in self._fleet:
            self._fleet.set_schedulable(gpu_uuid, False)
            self.suspended.add(gpu_uuid)

    def _release_on_dispatcher(self, binding: Binding, job_id: str) -> None:
        async def release() -> None:
            try:
                await self._dispatchers.release(binding.dispatcher_address, job_id)
            except DomainError as error:
                # The dispatcher's next heartbeat lists the id, and is told to release it.
                log.info("release on dispatcher deferred", job=job_id, error=error.message)

        self._spawn(release())

    # ---- ending jobs ----

    async def _end(
        self,
        job_id: str,
        state: JobState,
        message: str,
        exit_code: int,
        *,
        from_mig_run: bool = False,
        require_assigned: bool = False,
    ) -> Job:
        """End a job with the next decision batch (its write shares that transaction)."""
        if self._stopping:
            raise Unavailable("placement is shutting down")
        done: asyncio.Future[Job] = asyncio.get_running_loop().create_future()
        self._ends.append(
            _Ending(job_id, state, message, exit_code, from_mig_run, require_assigned, done)
        )
        self._wake.set()
        ended = await done
        log.info("job ended", job=job_id, state=state.value, message=message)
        return ended

    async def _take_ends(self, ends: list[_Ending], now: float) -> list[tuple[_Ending, Job, Job]]:
        """Check the queued ends against the jobs now; refused ones get their error."""
        taken: list[tuple[_Ending, Job, Job]] = []
        seen: set[str] = set()
        for end in ends:
            job = self._live.get(end.job_id)
            try:
                if job is None or end.job_id in seen:
                    stored = await self._repo.get_job(end.job_id)
                    if stored is None and job is None:
                        raise NotFound(f"no job {end.job_id!r}")
                    state = stored.state.value if stored else end.state.value
                    raise FailedPrecondition(f"job {end.job_id} already finished ({state})")
                if end.require_assigned and job.state is not JobState.ASSIGNED:
                    raise FailedPrecondition(
                        f"job {end.job_id} is {job.state.value}: only an assigned job can finish"
                    )
                if not end.from_mig_run:
                    self.mig.before_end(job, end.state)
            except DomainError as error:
                end.done.set_exception(error)
                continue
            seen.add(end.job_id)
            ended = job.advance(now, state=end.state, message=end.message, exit_code=end.exit_code)
            self._unsaved.pop(end.job_id, None)
            taken.append((end, job, ended))
        return taken

    async def _finish_many(self, jobs: Sequence[Job], state: JobState, message: str) -> None:
        now = self._clock()
        ended = [j.advance(now, state=state, message=message) for j in jobs]
        for job in jobs:
            self._unsaved.pop(job.job_id, None)
        await self._repo.update_jobs(ended)
        for before, after in zip(jobs, ended, strict=True):
            self._retire(before, after)

    def _retire(self, before: Job, after: Job) -> None:
        """Forget a finished job: its capacity goes back, here and on the dispatcher."""
        self._live.pop(before.job_id, None)
        if before.spec.is_mig_batch:
            self.mig.forget(before.job_id)
        # A MIG task holds no rectangle and no reservation: its run is the dispatcher's.
        if (
            before.state.holds_capacity
            and before.binding is not None
            and before.binding.mig is None
        ):
            self._fleet.release(before.job_id)
            self._release_on_dispatcher(before.binding, before.job_id)
            self._retry_pending = True
        self._publish(after)

    # ---- heartbeats ----

    async def _heartbeat_monitor(self) -> None:
        period = min(self.config.heartbeat_interval_s, self.config.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                await self.check_heartbeats()
            except Exception:
                log.exception("heartbeat check failed")

    async def check_heartbeats(self) -> list[str]:
        """Mark GPUs silent for longer than the timeout as lost, and their jobs LOST."""
        now = self._clock()
        silent = [
            r
            for r in self._gpus.values()
            if not r.lost and now - r.last_heartbeat > self.config.heartbeat_timeout_s
        ]
        for record in silent:
            await self._lose(record, now)
        if silent:
            self._wake.set()
        return [r.info.gpu_uuid for r in silent]

    async def _lose(self, record: GpuRecord, now: float) -> None:
        gpu_uuid = record.info.gpu_uuid
        async with self._lock:
            if record.lost or now - record.last_heartbeat <= self.config.heartbeat_timeout_s:
                return
            await self._repo.set_gpu_lost(gpu_uuid, True)
            record.lost = True
            self._fleet.set_schedulable(gpu_uuid, False)
            held = [
                j
                for j in self._live.values()
                if j.state.holds_capacity
                and j.binding is not None
                and j.binding.gpu_uuid == gpu_uuid
            ]
            age = now - record.last_heartbeat
            message = (
                f"GPU {gpu_uuid} on node {record.info.node} stopped sending heartbeats "
                f"(last one {age:.1f} s ago)"
            )
            await self._finish_many(held, JobState.LOST, message)
            metrics.JOBS_LOST.inc(len(held))
        log.warning("GPU lost", gpu=gpu_uuid, node=record.info.node, jobs_lost=len(held))

    # ---- helpers ----

    def _publish(self, job: Job) -> None:
        for queue in self._watchers.get(job.job_id, ()):
            queue.put_nowait(job)

    def _note_memory(self, info: GpuInfo) -> None:
        for model in ("", info.model):
            self._max_memory[model] = max(self._max_memory.get(model, 0), info.memory_bytes)

    def _check_memory(self, spec: JobSpec) -> None:
        """A job asking for more memory than any registered GPU (of its model) can never run."""
        largest = self._max_memory.get(spec.gpu_model)
        if largest is not None and spec.memory_bytes > largest:
            of_model = f" {spec.gpu_model}" if spec.gpu_model else ""
            raise InvalidArgument(
                "spec.resources.memory_bytes",
                f"{spec.memory_bytes} bytes is more than any{of_model} GPU in the fleet has "
                f"(largest: {largest} bytes)",
            )

    async def _load_kernel_profile(self, spec: JobSpec) -> None:
        """Give the gap-aware policy this task's kernel times, once a minute at most."""
        if self._profiles is None or not spec.task_key:
            return
        key = (spec.task_key, spec.gpu_model)
        now = self._clock()
        if now - self._kernel_cache.get(key, -math.inf) < PROFILE_TTL_S:
            return
        self._kernel_cache[key] = now
        try:
            times = await self._profiles.kernel_times(spec.task_key, spec.gpu_model)
        except DomainError as error:
            log.warning("kernel profile unavailable", task=spec.task_key, error=error.message)
            return
        policy = self._policies["gap-aware"]
        if times is not None and isinstance(policy, GapAwarePolicy):
            policy.set_profile(times)


def _replica_spec(template: JobSpec, sm_percent: int, quota_percent: float) -> JobSpec:
    """A function replica: the template's name, memory, priority, policy and model, at one
    profiled configuration (guaranteed its quota, and no more)."""
    return replace(
        template,
        kind=JobKind.INFERENCE,
        share=SpatioTemporalShare(sm_percent, TimeQuota(quota_percent, quota_percent)),
        whole_gpus=0,
        mig_slices=0,
        command=(),
    )


def _allocation(job: Job) -> Allocation:
    assert job.binding is not None
    spec = job.spec
    return Allocation(
        allocation_id=job.job_id,
        sm_percent=spec.sm_percent,
        quota_percent=spec.quota.request_percent,
        memory_bytes=spec.memory_bytes,
        priority=spec.priority,
        task_key=spec.task_key,
        rect=Rect(*job.binding.rect),
    )


def _takes_shares(record: GpuRecord) -> bool:
    """MPS shares and whole-GPU jobs go to live GPUs not in MIG mode (those run MIG batches)."""
    return not record.lost and not record.info.mig_enabled


def _gpu_state(record: GpuRecord, allocations: Sequence[Allocation]) -> GpuState:
    info = record.info
    return GpuState(
        gpu_id=info.gpu_uuid,
        node=info.node,
        model=info.model,
        memory_bytes=info.memory_bytes,
        sm_count=info.sm_count,
        schedulable=_takes_shares(record),
        allocations=tuple(allocations),
    )


def _encode_token(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


def _decode_text(token: str) -> str:
    if not token:
        return ""
    try:
        return base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
    except (ValueError, UnicodeError):
        raise InvalidArgument("page_token", "is not a token this service handed out") from None


def _decode_seq(token: str) -> int:
    text = _decode_text(token)
    if not text:
        return 0
    if not text.isdigit():
        raise InvalidArgument("page_token", "is not a token this service handed out")
    return int(text)
