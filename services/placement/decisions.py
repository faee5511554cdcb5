"""Placement's jobs and its decisions: submissions and ends are queued, decided in batches by
one task, written in one transaction, and only then bound on the dispatchers (reserve-then-bind).
A bind that fails gives the capacity back and leaves the job pending with the reason; the GPU
takes no new job until its next heartbeat.

Which job goes where, and which waits, is the pure `Scheduler`'s
(gpuloom/policies/placement/scheduler.py) on the inventory's `Fleet`: this module turns jobs
into its asks and its answers into job revisions, and keeps what is not pure around it (the
database, the dispatchers, the watchers, the submitters waiting for their answer).

`Decisions` is also the `JobLedger` its MIG batches work through (mig_batches.py): MIG batch
tasks are written PENDING by the same decision batches, then collected into MIG batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import structlog

from gpuloom.domain.errors import (
    AlreadyExists,
    DomainError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from gpuloom.domain.placement import JobSpec, JobState
from gpuloom.domain.training import TrainingState
from gpuloom.policies.placement import POLICIES, JobRequest, get_policy
from gpuloom.policies.placement.registry import FLEET_MODEL_POLICIES
from gpuloom.policies.placement.scheduler import Ask, Placed, Round, Scheduler
from gpuloom.services.placement import metrics
from gpuloom.services.placement.dispatchers import Dispatchers, MigRunner, bind_request
from gpuloom.services.placement.domain import (
    JOB_ID_PREFIX,
    Binding,
    ExtraGpu,
    Job,
    validate_request_id,
)
from gpuloom.services.placement.inventory import Inventory
from gpuloom.services.placement.mig_batches import WAITING, MigBatchConfig, MigBatches
from gpuloom.services.placement.paging import decode_seq, encode_token
from gpuloom.services.placement.profiles import KernelTimesCache, ProfileSource
from gpuloom.services.placement.repository import JobFilter, PlacementRepository
from gpuloom.tasks import cancel_and_wait

log = structlog.get_logger("gpuloom.placement")

MAX_PAGE_JOBS = 1000
# Bindings wait at most this long to be written with a decision batch.
RECORD_DELAY_S = 0.05


@dataclass(slots=True)
class _Submission:
    request_id: str
    spec: JobSpec
    function: str
    owner: str
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


class _BindFailed(Exception):
    """A Reserve of one of a job's GPUs failed (the others it made are released)."""

    def __init__(self, gpu_uuid: str, message: str) -> None:
        super().__init__(message)
        self.gpu_uuid = gpu_uuid
        self.message = message


# What the process of a job on several GPUs is told about all of them (docs/jobs.md).
GPU_UUIDS_VARIABLE = "GPULOOM_GPU_UUIDS"
DISPATCHER_ADDRESSES_VARIABLE = "GPULOOM_DISPATCHER_ADDRESSES"


class Decisions:
    def __init__(
        self,
        repository: PlacementRepository,
        dispatchers: Dispatchers,
        inventory: Inventory,
        profiles: ProfileSource | None,
        *,
        default_policy: str,
        max_batch: int,
        mig: MigBatchConfig,
        mig_runner: MigRunner | None,
        clock: Callable[[], float],
    ) -> None:
        """`mig_runner` runs MIG batches on the dispatchers; None: MIG batch tasks are
        refused."""
        self._repo = repository
        self._dispatchers = dispatchers
        self._inventory = inventory
        self._max_batch = max_batch
        self._clock = clock
        self._live: dict[str, Job] = {}
        self._kernel_times = KernelTimesCache(profiles, clock)
        self.scheduler = Scheduler(
            {name: get_policy(name) for name in POLICIES},
            default_policy,
            fleet=inventory.fleet,
            context=self._kernel_times.context,
        )
        self._watchers: dict[str, set[asyncio.Queue[Job]]] = defaultdict(set)
        self._lock = asyncio.Lock()  # one writer of fleet + database at a time
        self._queue: list[_Submission] = []
        self._ends: list[_Ending] = []
        self._unsaved: dict[str, Job] = {}  # bindings not yet written (see _bind)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.mig = MigBatches(self, inventory, profiles, mig_runner, mig)
        # Training jobs migrating or growing: job id -> the GPUs whose dispatchers hold their
        # next reservation too (services/placement/training.py); not stale there.
        self.moving: dict[str, tuple[str, ...]] = {}

    # ---- life cycle ----

    async def start(self, live: Sequence[Job], unregistered: Collection[str]) -> int:
        """Take the stored live jobs (those on `unregistered` GPUs are LOST), then start
        deciding; returns how many are bound again."""
        for job in live:
            self._live[job.job_id] = job
        orphans = [
            j
            for j in live
            if j.binding is not None and any(g in unregistered for g in j.binding.gpu_uuids)
        ]
        if orphans:  # a GPU row vanished under its jobs: say so rather than forget them
            await self.finish(orphans, JobState.LOST, "its GPU is no longer registered")
        await self.mig.restore(list(self._live.values()))
        for job in self._live.values():
            if job.state is JobState.PENDING and not job.spec.is_mig_batch:
                self.scheduler.restore(ask_of(job), job.pending_reason)
        rebind = [j for j in self._live.values() if j.state is JobState.BINDING]
        self._tasks = [
            asyncio.create_task(self._decide_loop(), name="placement-decide"),
            asyncio.create_task(self.mig.run(), name="placement-mig-batches"),
        ]
        if rebind:
            self._spawn(self._bind(rebind, []))
        self._wake.set()
        return len(rebind)

    async def stop(self) -> None:
        self._stopping = True
        await cancel_and_wait(*self._tasks)
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

    # ---- what the core tells ----

    @property
    def live(self) -> Mapping[str, Job]:
        """The jobs still pending or holding capacity, by id (read-only)."""
        return MappingProxyType(self._live)

    def capacity_changed(self, gpu_uuid: str | None = None) -> None:
        """A GPU came, came back or changed (under the lock): try the pending jobs it may
        take now."""
        self.scheduler.capacity_changed(gpu_uuid)

    def wake(self) -> None:
        self._wake.set()

    def holding(self, gpu_uuid: str) -> list[Job]:
        """The live jobs holding capacity on the GPU."""
        return [
            j
            for j in self._live.values()
            if j.state.holds_capacity and j.binding is not None and j.binding.on(gpu_uuid)
        ]

    async def evicted(self, gpu_uuid: str, evictions: Sequence[tuple[str, str]]) -> None:
        """The dispatcher of `gpu_uuid` evicted these assignments (id, reason): their live jobs
        on it end EVICTED (their runners see it and stop their commands); others are ignored
        (reserved there by someone else, or ended already)."""
        async with self._lock:
            by_reason: dict[str, list[Job]] = defaultdict(list)
            for assignment_id, reason in evictions:
                job = self._live.get(assignment_id)
                if job is None or job.binding is None or not job.binding.on(gpu_uuid):
                    continue
                if job.state.holds_capacity:
                    by_reason[reason or "evicted"].append(job)
            for reason, jobs in by_reason.items():
                await self.finish(
                    jobs, JobState.EVICTED, f"evicted by the dispatcher of GPU {gpu_uuid}: {reason}"
                )
                log.info("jobs evicted", gpu=gpu_uuid, jobs=[j.job_id for j in jobs], reason=reason)

    def stale(self, gpu_uuid: str, assignment_ids: Sequence[str]) -> list[str]:
        """The assignments a GPU's dispatcher holds that no live job on it owns."""
        stale = []
        for assignment_id in assignment_ids:
            if not assignment_id.startswith(JOB_ID_PREFIX):
                continue  # reserved on the dispatcher by someone else: not ours to judge
            job = self._live.get(assignment_id)
            if gpu_uuid in self.moving.get(assignment_id, ()):
                continue
            if job is None or job.binding is None or not job.binding.on(gpu_uuid):
                stale.append(assignment_id)
        return stale

    def replicas(self, function: str) -> list[Job]:
        """The live jobs serving an inference function."""
        return [j for j in self._live.values() if j.function == function]

    # ---- submitters ----

    async def submit(
        self, request_id: str, spec: JobSpec, function: str = "", owner: str = ""
    ) -> Job:
        """Queue a job for the next decision batch; answers once it is bound or pending.
        `owner` names the submitter (services/common/auth.py)."""
        validate_request_id(request_id)
        spec.validate(POLICIES)
        if spec.is_mig_batch and spec.policy in FLEET_MODEL_POLICIES:
            raise InvalidArgument(
                "spec.policy",
                f"{spec.policy} places MPS shares and whole GPUs, not MIG batch tasks "
                "(their batches are planned by the MIG batch planner)",
            )
        if spec.is_mig_batch:
            self._inventory.check_memory(spec)
        else:
            self._inventory.check_spec(spec)
        if self._stopping:
            raise Unavailable("placement is shutting down")
        if spec.is_mig_batch:
            spec = await self.mig.admit(spec)
        else:
            await self._kernel_times.prefetch(spec.task_key, spec.gpu_model)
        done: asyncio.Future[Job] = asyncio.get_running_loop().create_future()
        self._queue.append(_Submission(request_id, spec, function, owner, done))
        self._wake.set()
        return await done

    async def get(self, job_id: str, owner: str | None = None) -> Job:
        """The job; with `owner`, only if that submitter submitted it (PermissionDenied)."""
        job = self._live.get(job_id) or await self._repo.get_job(job_id)
        if job is None:
            raise NotFound(f"no job {job_id!r}")
        if owner is not None and job.owner != owner:
            raise PermissionDenied(f"job {job_id} belongs to another submitter, not {owner!r}")
        return job

    async def list(
        self, where: JobFilter, page_size: int, page_token: str
    ) -> tuple[list[Job], str]:
        if page_size > MAX_PAGE_JOBS:
            raise InvalidArgument("page_size", f"must be at most {MAX_PAGE_JOBS}, got {page_size}")
        after = decode_seq(page_token)
        stored = where
        if JobState.ASSIGNED in where.states and JobState.BINDING not in where.states:
            # ASSIGNED is written behind the answer: a job bound a moment ago is still BINDING
            # in the database. Read those too and filter on the live state below.
            stored = replace(where, states=(*where.states, JobState.BINDING))
        jobs, last = await self._repo.list_jobs(stored, page_size or 100, after)
        jobs = [self._live.get(job.job_id, job) for job in jobs]
        if where.states:  # the live state decides, not the stored one
            jobs = [job for job in jobs if job.state in where.states]
        return jobs, "" if last is None else encode_token(str(last))

    async def cancel(self, job_id: str, reason: str = "", owner: str | None = None) -> Job:
        if owner is not None:
            await self.get(job_id, owner)
        return await self._end(job_id, JobState.CANCELLED, reason or "cancelled", 0)

    async def report_done(
        self, job_id: str, succeeded: bool, exit_code: int, message: str, owner: str | None = None
    ) -> Job:
        if owner is not None:
            await self.get(job_id, owner)
        state = JobState.SUCCEEDED if succeeded else JobState.FAILED
        return await self._end(job_id, state, message, exit_code, require_assigned=True)

    async def watch(self, job_id: str, owner: str | None = None) -> AsyncIterator[Job]:
        """The job now, then each new revision, until it finishes."""
        queue: asyncio.Queue[Job] = asyncio.Queue()
        self._watchers[job_id].add(queue)  # before reading, so no change slips through
        try:
            job = await self.get(job_id, owner)
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

    # ---- the job ledger (for MIG batches) ----

    @property
    def lock(self) -> asyncio.Lock:
        return self._lock

    def now(self) -> float:
        return self._clock()

    def job(self, job_id: str) -> Job | None:
        return self._live.get(job_id)

    def followed(self, job_id: str) -> bool:
        return bool(self._watchers.get(job_id))

    def set_pending_reason(self, job_id: str, reason: str) -> None:
        job = self._live.get(job_id)
        if job is not None and job.state is JobState.PENDING and job.pending_reason != reason:
            self._live[job_id] = replace(job, pending_reason=reason)

    def set_training(self, job_id: str, training: TrainingState, *, publish: bool) -> None:
        """Put an assigned job's training state on it: in place, or (`publish`, under the
        lock) as a new revision that watchers see, written with the next batch."""
        job = self._live.get(job_id)
        if job is None or job.state is not JobState.ASSIGNED:
            return
        if publish:
            self.update_live(job.advance(self._clock(), training=training))
        else:
            self._live[job_id] = replace(job, training=training)

    def update_live(self, job: Job) -> None:
        """A new revision of an assigned job (under the lock): live now, seen by its watchers,
        written with the next decision batch (or after a short quiet spell)."""
        self._live[job.job_id] = job
        self._unsaved[job.job_id] = job
        self._publish(job)
        self._wake.set()

    def bind_placed(self, job: Job) -> None:
        """A job the training driver placed (under the lock; BINDING, its capacity taken in
        the fleet, no longer waiting in the scheduler): live now, written with the next batch,
        and bound on its dispatcher as the scheduler's placements are (a failed binding gives
        the capacity back and leaves it PENDING)."""
        self.update_live(job)
        self._spawn(self._bind([job], []))

    async def record(self, jobs: Sequence[Job]) -> None:
        await self._repo.update_jobs(list(jobs))
        for job in jobs:
            self._live[job.job_id] = job
            self._publish(job)

    async def finish(self, jobs: Sequence[Job], state: JobState, message: str) -> None:
        now = self._clock()
        ended = [j.advance(now, state=state, message=message) for j in jobs]
        for job in jobs:
            self._unsaved.pop(job.job_id, None)
        await self._repo.update_jobs(ended)
        for before, after in zip(jobs, ended, strict=True):
            self._retire(before, after)

    async def end_reported(self, job_id: str, state: JobState, message: str, exit_code: int) -> Job:
        return await self._end(job_id, state, message, exit_code, from_mig_run=True)

    # ---- deciding ----

    async def _decide_loop(self) -> None:
        while True:
            if not (self._queue or self._ends or self.scheduler.wants_decide):
                # Bindings are written with the next batch, or after a short quiet spell.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._wake.wait(), RECORD_DELAY_S if self._unsaved else None
                    )
                self._wake.clear()
            if not (self._queue or self._ends or self.scheduler.wants_decide or self._unsaved):
                continue
            batch = self._queue[: self._max_batch]
            del self._queue[: len(batch)]
            ends = self._ends[: self._max_batch]
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
            retried = self._retry(now, ending)
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
                        owner=submission.owner,
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
                for job in fresh.values():
                    self.scheduler.take_back(job.job_id)
                for job, before in retried:
                    self.scheduler.take_back(job.job_id, ask_of(before), before.pending_reason)
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
                self.scheduler.end(fresh.pop(request_id).job_id)
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
            if job.owner != submission.owner:
                submission.done.set_exception(
                    PermissionDenied(
                        f"request_id {submission.request_id!r} names another submitter's job"
                    )
                )
            elif job.spec != submission.spec or job.function != submission.function:
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
        """A new job to the scheduler. A placed job is BINDING (its capacity is now taken in
        the fleet); an unplaceable one stays PENDING with the reason. A MIG batch task stays
        PENDING: the MIG batches take it from there."""
        if job.spec.is_mig_batch:
            return replace(job, pending_reason=WAITING)
        decision = self.scheduler.submit(ask_of(job))
        if isinstance(decision, Placed):
            return self._binding(job, decision, now)
        return replace(job, pending_reason=decision.reason)

    def _binding(self, job: Job, placed: Placed, now: float) -> Job:
        """The BINDING revision of a job the scheduler placed."""
        placement = placed.placement
        gpu = self._inventory.record(placement.gpu_id)
        rect = placement.rect
        # The share the fleet holds: its memory less than asked for a replica placed beside its
        # model (the weights are the model store's), the cap the dispatcher enforces.
        held = self._inventory.fleet.allocation(job.job_id)
        binding = Binding(
            gpu_uuid=placement.gpu_id,
            node=placement.node,
            dispatcher_address=gpu.dispatcher_address,
            rect=(rect.x, rect.y, rect.w, rect.h),
            share=job.spec.share if held is None else held.share,
            token=secrets.token_urlsafe(32),
            extra=tuple(
                ExtraGpu(g, self._inventory.record(g).dispatcher_address)
                for g in placement.extra_gpu_ids
            ),
        )
        return job.advance(
            now,
            state=JobState.BINDING,
            binding=binding,
            policy=placement.policy,
            pending_reason="",
        )

    def _retry(self, now: float, ending: set[str]) -> list[tuple[Job, Job]]:
        """The pending jobs that may fit now, tried by the scheduler (not those ending);
        returns (placed job, job before) for those that found a place."""
        decided: Round = self.scheduler.decide(ending)
        metrics.PENDING_TRIES.inc(decided.tried)
        for waiting in decided.reasons:  # fresher reasons, kept in memory only
            job = self._live.get(waiting.ask.job_id)
            if job is not None and job.state is JobState.PENDING:
                self._live[job.job_id] = replace(job, pending_reason=waiting.reason)
        placed = []
        for decision in decided.placed:
            before = self._live[decision.ask.job_id]
            placed.append((self._binding(before, decision, now), before))
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
                    failed = job.binding.gpu_uuid
                    if isinstance(result, _BindFailed):
                        failed, message = result.gpu_uuid, result.message
                    elif isinstance(result, DomainError):
                        message = result.message
                    else:
                        message = repr(result)
                    reason = f"binding on GPU {failed} failed ({message}); will try again"
                    # Suspended first: the capacity given back is not offered on that GPU.
                    self._inventory.suspend(failed)
                    self.scheduler.bind_failed(ask_of(current), reason)
                    self._release_on_dispatcher(job.binding, job.job_id)
                    metrics.BIND_FAILURES.inc()
                    log.warning("binding failed", job=job.job_id, gpu=failed, error=message)
                    changed.append(
                        current.advance(
                            now,
                            state=JobState.PENDING,
                            binding=None,
                            policy="",
                            pending_reason=reason,
                        )
                    )
                else:
                    changed.append(
                        current.advance(
                            now,
                            state=JobState.ASSIGNED,
                            binding=_bound(job.binding, result),
                            started_at=now,
                        )
                    )
            # Recorded behind, with the next decision batch: the BINDING row already holds the
            # decision, and a restart binds it again (idempotently) if this write never lands.
            for job in changed:
                self._live[job.job_id] = job
                self._unsaved[job.job_id] = job
                self._publish(job)
            if any(job.state is JobState.PENDING for job in changed):
                self._wake.set()
        await self._answer(waiting)

    async def _reserve(self, job: Job) -> list[dict[str, str]]:
        """Reserve the job on the dispatcher of each of its GPUs: every environment, in the
        binding's order, or none: a failure releases the reservations made and raises
        _BindFailed naming the GPU (the first that failed)."""
        binding = job.binding
        assert binding is not None
        if not binding.extra:
            try:
                return [await self._reserve_on(job, binding.dispatcher_address)]
            except DomainError as error:
                raise _BindFailed(binding.gpu_uuid, error.message) from None
        addresses = [binding.dispatcher_address, *(g.dispatcher_address for g in binding.extra)]
        results = await asyncio.gather(
            *(self._reserve_on(job, address) for address in addresses), return_exceptions=True
        )
        environments: list[dict[str, str]] = []
        failure: _BindFailed | None = None
        for gpu_uuid, result in zip(binding.gpu_uuids, results, strict=True):
            if isinstance(result, BaseException):
                if failure is None:
                    message = result.message if isinstance(result, DomainError) else repr(result)
                    failure = _BindFailed(gpu_uuid, message)
            else:
                environments.append(result)
        if failure is not None:
            # The caller releases the job on every dispatcher of the binding (a release of
            # what a dispatcher does not hold is harmless).
            raise failure
        return environments

    async def _reserve_on(self, job: Job, address: str) -> dict[str, str]:
        binding = job.binding
        assert binding is not None
        return await self._dispatchers.reserve(address, bind_request(job, binding))

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

    def _release_on_dispatcher(self, binding: Binding, job_id: str) -> None:
        """Release the job on the dispatcher of each of its GPUs."""

        async def release(address: str) -> None:
            try:
                await self._dispatchers.release(address, job_id)
            except DomainError as error:
                # The dispatcher's next heartbeat lists the id, and is told to release it.
                log.info("release on dispatcher deferred", job=job_id, error=error.message)

        self._spawn(release(binding.dispatcher_address))
        for gpu in binding.extra:
            self._spawn(release(gpu.dispatcher_address))

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

    def _retire(self, before: Job, after: Job) -> None:
        """Forget a finished job: its capacity goes back, here and on the dispatcher."""
        self._live.pop(before.job_id, None)
        if before.spec.is_mig_batch:
            self.mig.forget(after)
        # The scheduler forgets it: a pending job stops waiting, a placed one gives its capacity
        # back (a MIG task holds no rectangle and no reservation: its run is the dispatcher's).
        if self.scheduler.end(before.job_id) and before.binding is not None:
            self._release_on_dispatcher(before.binding, before.job_id)
        self._publish(after)

    def _publish(self, job: Job) -> None:
        for queue in self._watchers.get(job.job_id, ()):
            queue.put_nowait(job)


def _bound(binding: Binding, environments: list[dict[str, str]]) -> Binding:
    """The binding once every GPU is reserved: the process runs with the first GPU's
    environment (the shim talks to one dispatcher); a job on several GPUs is also told all of
    them (CUDA_VISIBLE_DEVICES with every UUID the dispatchers set, GPULOOM_GPU_UUIDS and
    GPULOOM_DISPATCHER_ADDRESSES in GPU order)."""
    first = dict(environments[0])
    if not binding.extra:
        return replace(binding, environment=first)
    extra = tuple(
        replace(gpu, environment=dict(env))
        for gpu, env in zip(binding.extra, environments[1:], strict=True)
    )
    visible = [env["CUDA_VISIBLE_DEVICES"] for env in environments if "CUDA_VISIBLE_DEVICES" in env]
    if visible:
        first["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
    first[GPU_UUIDS_VARIABLE] = ",".join(binding.gpu_uuids)
    first[DISPATCHER_ADDRESSES_VARIABLE] = ",".join(
        [binding.dispatcher_address, *(g.dispatcher_address for g in binding.extra)]
    )
    return replace(binding, environment=first, extra=extra)


def ask_of(job: Job) -> Ask:
    """What an MPS or whole-GPU job asks of the scheduler."""
    spec = job.spec
    request = JobRequest(
        job_id=job.job_id,
        share=spec.share,
        gpu_model=spec.gpu_model,
        task_key=spec.task_key,
        shared_model=spec.shared_model,
        gpus=max(spec.whole_gpus, 1),
        cpu_milli=spec.cpu_milli,
        host_memory_bytes=spec.host_memory_bytes,
        nodes=frozenset(spec.nodes),
    )
    return Ask(request, policy=spec.policy, submitted_at=job.submitted_at)
