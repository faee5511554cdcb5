"""Gandiva's live mechanisms for training jobs (docs/training.md, "Live"): placement's side.

- **Training state**: every heartbeat's `training` reports (a dispatcher's view of each training
  process's mini-batch cycle and suspension) update the training state of the job that holds
  the assignment (`Job.training`: phase, mini-batch times, packing trials, migrations, the last
  hook error). Kept in memory; a restarted placement starts it again from the next heartbeats.
- **The driver** (opt-in, GPULOOM_PLACEMENT_TRAINING_POLICY): every tick it shows the training
  policy (gpuloom/policies/training, the same objects as `gpuloom sim training`) the training
  jobs and GPUs as a cluster (gpuloom/policies/training/live.py), and turns its decisions into
  dispatcher calls: time-slicing a GPU shared by several training jobs round-robin
  (SuspendClient / ResumeClient, one quantum each, over the highest priority present only),
  packing two of them (both resumed) with a trial that compares their mini-batch times alone
  and packed and an undo when packing loses to time-slicing, and migrations.
- **Migration**: placement reserves the target GPU (fleet and dispatcher), then asks the job's
  runner to checkpoint (`Job.training.migration`, seen through WatchJob); the runner answers
  with ReportCheckpoint. On success the job's binding moves to the target (the old reservation
  is released) and the runner restarts the job there; on failure or without an answer by the
  deadline the target is given back and the job stays where it is, running, with the error in
  its training state, a metric and a log line. A one-GPU job without a checkpoint hook moves
  only to a GPU of its node and model, both dispatchers freeing a suspended job's memory:
  placement suspends it (checkpointed), MoveClient restores it onto the target and moves its
  shim there, UnlockMovedClient lets it run on; no runner is asked, nothing restarts.
- **Grow-shrink** (`gandiva-gs`, elastic jobs: `JobSpec.max_gpus`): a resize is a migration
  whose first GPU stays. A grow takes the idle GPUs in the fleet (as further GPUs of the job)
  and reserves them on their dispatchers before the runner is asked; a shrink asks at once.
  On the runner's success the first GPU's reservation is made again with a new token (the old
  one is bound to the process that stopped), the GPUs a shrink drops are released, and the
  runner restarts the job on the new set; a failure leaves it as it was, as for a migration.

This module holds what is not pure around the policy: the per-job bookkeeping, the calls to
dispatchers, and the fleet and job changes, made through `TrainingCluster`
(services/placement/training_cluster.py), the narrow interface to placement's jobs and
capacity, under the decisions' lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import grpc
import structlog

from gpuloom.domain.errors import DomainError, FailedPrecondition, InvalidArgument, NotFound
from gpuloom.domain.placement import JobKind, JobState
from gpuloom.domain.training import (
    MAX_PACKINGS_SHOWN,
    TIME_SLICE_REASON,
    MigrationRequest,
    PackingTrial,
    TrainingPhase,
    TrainingReport,
    TrainingState,
)
from gpuloom.policies.placement import Rect
from gpuloom.policies.placement.fleet import InvalidPlacementError
from gpuloom.policies.placement.model import gang_member_id
from gpuloom.policies.training.gandiva import GROW_IDLE_S, GandivaKnobs
from gpuloom.policies.training.live import (
    LiveGpu,
    LiveGroupState,
    LiveJob,
    LivePending,
    LiveView,
    live_plan,
    live_view,
)
from gpuloom.policies.training.model import (
    ServiceHistory,
    TrainingPolicy,
    packed_gain,
    round_robin_turn,
    slice_efficiency,
)
from gpuloom.policies.training.registry import get_policy
from gpuloom.services.placement import metrics
from gpuloom.services.placement.decisions import _bound, ask_of
from gpuloom.services.placement.dispatchers import (
    DispatcherChannels,
    Dispatchers,
    _domain_error,
    bind_request,
)
from gpuloom.services.placement.domain import Binding, ExtraGpu, Job
from gpuloom.services.placement.inventory import allocation
from gpuloom.services.placement.training_cluster import TrainingCluster
from gpuloom.tasks import cancel_and_wait
from gpuloom.v1 import dispatcher_pb2

log = structlog.get_logger("gpuloom.placement")

OFF = "off"
SWITCH_REASON = TIME_SLICE_REASON  # the reason the driver's suspensions carry
SWITCH_S = 1.0  # one suspend + resume, as the simulator counts it (docs/training.md)
# A job whose migration failed is not moved again for this many quanta; one time-sliced into
# a GPU that then failed to bind it (it waits again) is not time-sliced in again as long.
RETRY_QUANTA = 5
MOVE_SUFFIX = "@move"  # the fleet id of the capacity a migrating job holds on its target
# A move without a hook (the driver's checkpoint API, docs/training.md): the longest a
# restore onto the target may take (beyond the dispatcher call timeout), how long the moved
# shim has to register with the target's dispatcher, and the reason its suspension carries.
MOVE_CALL_S = 60.0
MOVE_REGISTER_S = 10.0
MOVE_REASON = "gandiva: migration"


class TrainingControl(Protocol):
    """Gandiva's suspend/resume on the dispatchers (SuspendClient / ResumeClient)."""

    async def suspend(
        self, address: str, assignment_id: str, max_wait_ms: float, reason: str
    ) -> bool:
        """Suspend the client; returns whether it is suspended now. Raises a DomainError."""
        ...

    async def resume(self, address: str, assignment_id: str) -> bool:
        """Resume the client; returns whether it is still suspended. Raises a DomainError."""
        ...

    async def move(
        self, address: str, assignment_id: str, target_gpu_uuid: str, socket_path: str, token: str
    ) -> str:
        """MoveClient: restore a client suspended with its memory checkpointed onto another GPU
        of its node and move its shim there; returns "" when moved, else why it stays
        suspended where it is. Raises a DomainError (not checkpointed, bad target)."""
        ...

    async def unlock_moved(self, address: str, assignment_id: str) -> None:
        """UnlockMovedClient on the target. Raises a DomainError (FailedPrecondition before
        the moved process registered there)."""
        ...


class GrpcTrainingControl:
    def __init__(self, channels: DispatcherChannels, timeout_s: float) -> None:
        self._channels = channels
        self._timeout_s = timeout_s

    async def suspend(
        self, address: str, assignment_id: str, max_wait_ms: float, reason: str
    ) -> bool:
        request = dispatcher_pb2.SuspendClientRequest(
            assignment_id=assignment_id, max_wait_ms=max_wait_ms, reason=reason
        )
        try:
            status = await self._channels.stub(address).SuspendClient(
                request, timeout=self._timeout_s + max_wait_ms / 1000
            )
        except grpc.aio.AioRpcError as error:
            raise _domain_error(address, error) from None
        return status.suspended

    async def resume(self, address: str, assignment_id: str) -> bool:
        request = dispatcher_pb2.ResumeClientRequest(assignment_id=assignment_id)
        try:
            status = await self._channels.stub(address).ResumeClient(
                request, timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise _domain_error(address, error) from None
        return status.suspended

    async def move(
        self, address: str, assignment_id: str, target_gpu_uuid: str, socket_path: str, token: str
    ) -> str:
        request = dispatcher_pb2.MoveClientRequest(
            assignment_id=assignment_id,
            target_gpu_uuid=target_gpu_uuid,
            target_socket_path=socket_path,
            target_token=token,
        )
        try:
            status = await self._channels.stub(address).MoveClient(
                request, timeout=self._timeout_s + MOVE_CALL_S
            )
        except grpc.aio.AioRpcError as error:
            raise _domain_error(address, error) from None
        return status.suspended_memory_note if status.suspended_memory_note else ""

    async def unlock_moved(self, address: str, assignment_id: str) -> None:
        request = dispatcher_pb2.UnlockMovedClientRequest(assignment_id=assignment_id)
        try:
            await self._channels.stub(address).UnlockMovedClient(
                request, timeout=self._timeout_s + MOVE_CALL_S
            )
        except grpc.aio.AioRpcError as error:
            raise _domain_error(address, error) from None


@dataclass(frozen=True, slots=True)
class TrainingConfig:
    policy: str = OFF  # "off", "gandiva", "gandiva:HEIGHT", "fifo"
    quantum_s: float = 60.0  # a time slice of the round-robin
    pack_trial_s: float = 120.0  # packed this long before the mini-batch times are compared
    suspend_wait_ms: float = 2000.0  # how long a suspension may wait for a low-memory point
    hook_grace_s: float = 30.0  # beyond the hook's timeout, before a migration is given up
    tick_s: float = 1.0
    grow_idle_s: float = GROW_IDLE_S  # grow-shrink: a GPU free this long may be grown onto
    # gandiva's rules of time (over-subscription, preemption): the policy's arguments.
    gandiva: GandivaKnobs = field(default_factory=GandivaKnobs)

    @property
    def enabled(self) -> bool:
        return self.policy != OFF


@dataclass(slots=True)
class _Move:
    migration_id: str
    target: Binding
    reason: str
    requested_at: float
    deadline: float
    reserved: bool = False  # the target's dispatcher holds it: the runner has been asked
    # A resize (grow-shrink): the job's GPUs from now on (its first GPU stays); the GPUs a grow
    # adds are taken in the fleet as its further GPUs and reserved before the runner is asked.
    gpus: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    committing: bool = False  # the runner reported success: the first GPU is re-reserved
    # Without a hook: moved by placement through the driver's checkpoint API (same node, same
    # GPU model, one GPU), not by the runner.
    hookless: bool = False

    @property
    def resize(self) -> bool:
        return bool(self.gpus)


@dataclass(slots=True)
class _Track:
    """The driver's bookkeeping of one training job."""

    minibatch_s: float = 0.0
    minibatches: int = 0
    reported_at: float = 0.0
    observed_suspended: bool = False
    commanded_suspended: bool | None = None  # None: never commanded
    commanded_at: float = 0.0  # when its dispatcher last answered a suspend or resume
    solo_minibatch_s: float = 0.0
    packed_minibatch_s: float = 0.0
    utilisation: float = 1.0
    packings: list[PackingTrial] = field(default_factory=list)
    migrations: int = 0
    failed_migrations: int = 0
    resizes: int = 0
    last_hook_error: str = ""
    last_hook_error_at: float = 0.0
    move: _Move | None = None
    retry_at: float = 0.0  # after a failed migration: not moved again before
    published: TrainingState | None = None  # as its last revision showed it
    call_failed_at: float | None = None  # the last suspend/resume call failed (logged once)
    alone_since: float | None = None  # running, the other training jobs of its GPU suspended
    service_s: float = 0.0  # the seconds it was seen running (not suspended): its service
    service_at: float | None = None  # when service_s was last brought up to date
    gpus: int = 1  # its GPU count, as the policy sees it (for the lengths of ended jobs)
    memory_released: bool = False  # suspended with its device memory in host memory
    memory_note: str = ""  # suspended: its dispatcher's note on its memory
    restore_failed: bool = False  # suspended: restoring its checkpointed memory failed
    # Moved without a hook but not unlocked on its new GPU yet: that dispatcher's address
    # (UnlockMovedClient is tried again every tick until it answers).
    unlock_at: str = ""
    unlocking: bool = False  # a retry is under way


@dataclass(slots=True)
class _GpuState:
    packed: bool = False
    trial_started: float = 0.0
    gain: float | None = None
    turn: int = 0
    turn_started: float = 0.0


class TrainingDriver:
    def __init__(
        self,
        cluster: TrainingCluster,
        dispatchers: Dispatchers,
        control: TrainingControl | None,
        config: TrainingConfig = TrainingConfig(),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._cluster = cluster  # placement's jobs and capacity, through a narrow interface
        self._dispatchers = dispatchers
        self._control = control
        self.config = config
        self._clock = clock
        self.policy: TrainingPolicy | None = (
            get_policy(config.policy, config.gandiva) if config.enabled else None
        )
        self._efficiency = slice_efficiency(config.quantum_s, SWITCH_S)
        self._tracks: dict[str, _Track] = {}
        self._gpus: dict[str, _GpuState] = {}
        self._idle_since: dict[str, float] = {}  # free GPUs: since when (grow-shrink)
        self._sliced_at: dict[str, float] = {}  # pending jobs time-sliced in: when (retries)
        # GPU -> whether its dispatcher frees a suspended job's memory (its heartbeats say):
        # then a time-slice group's members take the GPU's memory in turns.
        self._memory_in_turns: dict[str, bool] = {}
        # Head-of-queue preemption: preempted job -> the head that took its GPUs; it stays
        # suspended while the head is there.
        self._preempted_by: dict[str, str] = {}
        # The service of the training jobs seen to succeed since this service started, per
        # GPU count: gandiva's Gittins rule reads it (kept in memory: a restart starts empty).
        self._ended = ServiceHistory()
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    # ---- life cycle ----

    def start(self) -> None:
        if self.config.enabled and self._control is not None:
            self._task = asyncio.create_task(self._loop(), name="placement-training")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        if self._background:
            await asyncio.wait(self._background, timeout=5)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            try:
                await self.tick()
            except Exception:
                log.exception("training tick failed")

    # ---- heartbeats ----

    def ingest(self, gpu_uuid: str, reports: Sequence[TrainingReport]) -> None:
        """A heartbeat's training reports (validated by the caller): the jobs on that GPU get
        their mini-batch times; reports of other assignments are ignored."""
        now = self._clock()
        record = self._cluster.record(gpu_uuid)
        mine: list[tuple[Job, TrainingReport]] = []
        for report in reports:
            job = self._cluster.job(report.assignment_id)
            if (
                job is None
                or job.state is not JobState.ASSIGNED
                or job.spec.kind is not JobKind.TRAINING
                or job.binding is None
                or job.binding.gpu_uuid != gpu_uuid
            ):
                continue
            # Every job's suspension first: whether one runs alone depends on the others'.
            track = self._tracks.setdefault(job.job_id, _Track())
            track.observed_suspended = report.suspended
            track.memory_released = report.suspended and report.memory_released
            track.memory_note = report.memory_note if report.suspended else ""
            track.restore_failed = report.suspended and report.restore_failed
            if (
                report.suspended
                and report.suspended_reason == SWITCH_REASON
                and track.commanded_suspended is None
            ):
                # Suspended for time-slicing by this service before it started again: it is
                # resumed in its turn (one suspended by hand, for another reason, is left so).
                track.commanded_suspended = True
            mine.append((job, report))
        for job, report in mine:
            track = self._tracks[job.job_id]
            cycle = report.cycle
            track.minibatches = cycle.minibatches
            track.reported_at = now
            alone = not report.suspended and self._runs_alone(job.job_id, gpu_uuid)
            if not alone:
                track.alone_since = None
            elif track.alone_since is None:
                track.alone_since = now
            if cycle.minibatch_s > 0:
                track.minibatch_s = cycle.minibatch_s
                gpu = self._gpus.get(gpu_uuid)
                if gpu is not None and gpu.packed:
                    settled = gpu.trial_started + self.config.pack_trial_s / 2
                    if now >= settled:
                        track.packed_minibatch_s = cycle.minibatch_s
                elif (
                    track.alone_since is not None
                    and now >= track.alone_since + self.config.quantum_s / 2
                ):
                    # Its time alone: measured once it has run alone for half a quantum (the
                    # cycle the dispatcher reports spans a window; right after the others'
                    # suspension it still holds their company).
                    track.solo_minibatch_s = cycle.minibatch_s
            if alone:
                util = record.utilization_percent
                if util == util:  # not NaN
                    track.utilisation = min(1.0, max(0.0, util / 100))
            self._show(job.job_id, publish=False)

    def note_suspend_memory(self, gpu_uuid: str, releases: bool) -> None:
        """A heartbeat's word on whether the GPU's dispatcher frees a suspended job's memory
        (the driver's checkpoint API): time-slicing there takes the memory in turns."""
        self._memory_in_turns[gpu_uuid] = releases

    def memory_in_turns(self, gpu_uuids: Sequence[str]) -> bool:
        """Whether jobs time-sliced on all these GPUs take their memory in turns."""
        return bool(gpu_uuids) and all(self._memory_in_turns.get(u, False) for u in gpu_uuids)

    def _runs_alone(self, job_id: str, gpu_uuid: str) -> bool:
        others = [j for j in self._training_on(gpu_uuid) if j.job_id != job_id]
        return all(self._tracks.get(j.job_id, _Track()).observed_suspended for j in others)

    # ---- the tick ----

    async def tick(self) -> None:
        """One round: expire migrations, ask the policy, pack / unpack / migrate, then
        time-slice."""
        calls: list[tuple[Job, bool]] = []
        starts: list[tuple[Job, _Move]] = []
        async with self._cluster.lock:
            now = self._clock()
            await self._learn_lengths(self._forget_ended())
            self._account_service(now)
            for job_id, track in list(self._tracks.items()):
                move = track.move
                if move is not None and not move.committing and now > move.deadline:
                    waited = move.deadline - move.requested_at
                    self._fail_move(job_id, track, f"no checkpoint report within {waited:g} s")
            managed = self._managed()
            self._measure(now)
            self._note_idle(now)
            if self.policy is not None:
                plan = live_plan(self._view(managed, now), self.policy)
                for gpu_uuid in plan.unpack:
                    self._unpack(gpu_uuid)
                preempting = {gpu_uuid for _, gpu_uuid, _ in plan.preemptions}
                for gpu_uuid in plan.pack:
                    if gpu_uuid not in preempting and not self._preemption_on(gpu_uuid):
                        self._pack(gpu_uuid, now)
                for job_id, target, reason in plan.moves:
                    start = self._begin_move(job_id, target, reason, now)
                    if start is not None:
                        starts.append(start)
                for job_id, gpus, reason in plan.resizes:
                    start = self._begin_resize(job_id, gpus, reason, now)
                    if start is not None:
                        starts.append(start)
                for job_id, gpu_uuid in plan.slices:
                    self._slice_in(job_id, gpu_uuid, now)
                for head, gpu_uuid, victim in plan.preemptions:
                    self._preempt(head, gpu_uuid, victim, now)
                starts += self._elsewhere_when_not_restored(now)
                calls = self._switches(now)
            managed = self._managed()
            for job in managed:
                self._show(job.job_id, publish=True)
            self._count_suspend_memory(managed)
        for job, move in starts:
            self._spawn(self._reserve_target(job, move))
        async with self._cluster.lock:
            for job_id, track in self._tracks.items():
                if track.unlock_at and not track.unlocking:
                    track.unlocking = True
                    self._spawn(self._unlock_again(job_id, track.unlock_at))
        await self._switch(calls)

    def _count_suspend_memory(self, managed: Sequence[Job]) -> None:
        """The metric: GPUs holding training jobs, by whether a suspension frees the memory."""
        gpus = {u for j in managed if j.binding is not None for u in j.binding.gpu_uuids}
        freed = sum(self._memory_in_turns.get(u, False) for u in gpus)
        metrics.TRAINING_SUSPEND_MEMORY.labels("freed").set(freed)
        metrics.TRAINING_SUSPEND_MEMORY.labels("resident").set(len(gpus) - freed)

    def _account_service(self, now: float) -> None:
        """Bring every assigned training job's service up to date: the time since the last
        tick counts if the job was running (as its dispatcher last reported)."""
        for job in self._managed():
            track = self._tracks.setdefault(job.job_id, _Track())
            if track.service_at is not None and not track.observed_suspended:
                track.service_s += now - track.service_at
            track.service_at = now
            track.gpus = max(job.spec.whole_gpus, 1)

    def _note_idle(self, now: float) -> None:
        """Since when each GPU that holds nothing and takes work has been free."""
        free = set()
        for record in self._cluster.records():
            uuid_ = record.info.gpu_uuid
            if (
                self._cluster.has_gpu(uuid_)
                and not self._cluster.slot(uuid_).allocations
                and self._cluster.slot(uuid_).schedulable
                and not self._cluster.is_down(record)
            ):
                free.add(uuid_)
                self._idle_since.setdefault(uuid_, now)
        for uuid_ in [u for u in self._idle_since if u not in free]:
            del self._idle_since[uuid_]

    def _forget_ended(self) -> list[tuple[str, _Track]]:
        """Forget the jobs no longer assigned; returns the finished ones seen running."""
        finished: list[tuple[str, _Track]] = []
        for victim, head in list(self._preempted_by.items()):
            for job_id in (victim, head):
                job = self._cluster.job(job_id)
                if job is None or job.state not in (JobState.BINDING, JobState.ASSIGNED):
                    # The head ended (or its binding failed), or the preempted job ended:
                    # the round-robin takes over again.
                    self._preempted_by.pop(victim, None)
        for job_id in list(self._sliced_at):
            job = self._cluster.job(job_id)
            if job is None or job.state not in (JobState.PENDING, JobState.BINDING):
                del self._sliced_at[job_id]
        for job_id in list(self._tracks):
            job = self._cluster.job(job_id)
            if job is None or job.state is not JobState.ASSIGNED:
                track = self._tracks.pop(job_id)
                if job is None and track.service_s > 0:
                    finished.append((job_id, track))
                if track.move is not None:
                    self._give_back(job_id, track.move)
                    metrics.TRAINING_MIGRATIONS.labels("abandoned").inc()
        held = {j.binding.gpu_uuid for j in self._managed() if j.binding is not None}
        for gpu_uuid in list(self._gpus):
            if gpu_uuid not in held:
                del self._gpus[gpu_uuid]
        return finished

    async def _learn_lengths(self, finished: list[tuple[str, _Track]]) -> None:
        """Add the service of the finished jobs that succeeded to what gandiva's Gittins rule
        reads: only a job seen running to its end says how long such jobs run (one that
        failed or was cancelled does not)."""
        for job_id, track in finished:
            with contextlib.suppress(NotFound):
                if (await self._cluster.get(job_id)).state is JobState.SUCCEEDED:
                    self._ended.add(track.gpus, track.service_s)

    def _managed(self) -> list[Job]:
        """The assigned training jobs (not MIG batch tasks), in submission order."""
        jobs = [
            j
            for j in self._cluster.live_jobs()
            if j.state is JobState.ASSIGNED
            and j.spec.kind is JobKind.TRAINING
            and j.binding is not None
            and j.binding.mig is None
        ]
        return sorted(jobs, key=lambda j: (j.submitted_at, j.job_id))

    def _training_on(self, gpu_uuid: str) -> list[Job]:
        """The assigned training jobs on a GPU, in submission order (read from the fleet's
        allocations there: no scan of every job)."""
        if not self._cluster.has_gpu(gpu_uuid):
            return []
        jobs = []
        for allocation_id in self._cluster.slot(gpu_uuid).allocations:
            job = self._cluster.job(allocation_id)
            if (
                job is not None
                and job.state is JobState.ASSIGNED
                and job.spec.kind is JobKind.TRAINING
                and job.binding is not None
                and job.binding.gpu_uuid == gpu_uuid
            ):
                jobs.append(job)
        return sorted(jobs, key=lambda j: (j.submitted_at, j.job_id))

    def _view(self, managed: Sequence[Job], now: float) -> LiveView:
        mine: dict[str, set[str]] = {}  # GPU -> the allocations managed jobs hold there
        for job in managed:
            assert job.binding is not None
            for i, uuid_ in enumerate(job.binding.gpu_uuids):
                held = job.job_id if i == 0 else gang_member_id(job.job_id, i)
                mine.setdefault(uuid_, set()).add(held)
        gpus = []
        for record in self._cluster.records():
            uuid_ = record.info.gpu_uuid
            if not self._cluster.has_gpu(uuid_):
                continue
            slot = self._cluster.slot(uuid_)
            ours = mine.get(uuid_, set())
            other = any(a_id not in ours for a_id in slot.allocations)
            busy = other or not slot.schedulable or self._cluster.is_down(record)
            gpus.append(
                LiveGpu(uuid_, record.info.node, record.info.model, record.info.memory_bytes, busy)
            )
        jobs = []
        for j in managed:
            assert j.binding is not None
            track = self._tracks.get(j.job_id, _Track())
            jobs.append(
                LiveJob(
                    job_id=j.job_id,
                    gpu_uuid=j.binding.gpu_uuid,
                    job_type=j.spec.task_key or j.spec.name,
                    memory_bytes=j.spec.memory_bytes,
                    submitted_at=j.submitted_at,
                    utilisation=track.utilisation,
                    gpu_model=j.spec.gpu_model,
                    measured=track.solo_minibatch_s > 0,
                    movable=(j.spec.checkpoint is not None or self._movable_without_hook(j))
                    and now >= track.retry_at,
                    extra_gpus=tuple(g.gpu_uuid for g in j.binding.extra),
                    gpus=max(j.spec.whole_gpus, 1),
                    max_gpus=j.spec.max_gpus,
                    attained_s=track.service_s,
                )
            )
        groups = {
            uuid_: LiveGroupState(state.packed, state.gain) for uuid_, state in self._gpus.items()
        }
        return live_view(
            gpus,
            jobs,
            groups,
            now,
            self._efficiency,
            idle_since=self._idle_since,
            grow_idle_s=self.config.grow_idle_s,
            pending=self._pending(every=any(j.spec.elastic for j in managed)),
            ended=self._ended,
            preempt=True,
        )

    def _pending(self, every: bool) -> list[LivePending]:
        """The jobs placement's scheduler has not placed (MPS and whole-GPU ones), with the
        nodes whose CPU and host memory they fit: the training jobs (sliceable: not elastic,
        no shared model's replica), and with `every` (grow-shrink: a shrink may make room) all
        of them."""
        nodes = self._cluster.nodes
        pending = []
        for job in self._cluster.live_jobs():
            spec = job.spec
            if job.state is not JobState.PENDING or spec.is_mig_batch:
                continue
            sliceable = spec.kind is JobKind.TRAINING and not spec.elastic and not spec.shared_model
            if not (sliceable or every):
                continue
            fitting = None
            if spec.cpu_milli or spec.host_memory_bytes:
                fitting = frozenset(
                    name
                    for name, node in nodes.items()
                    if node.cpu_free >= spec.cpu_milli
                    and node.memory_free >= spec.host_memory_bytes
                )
            pending.append(
                LivePending(
                    job.job_id,
                    max(spec.whole_gpus, 1),
                    spec.memory_bytes,
                    job.submitted_at,
                    spec.gpu_model,
                    fitting,
                    sliceable,
                )
            )
        return pending

    # ---- over-subscription ----

    def _slice_in(self, job_id: str, gpu_uuid: str, now: float) -> None:
        """Time-slice a pending training job into the round-robin of the training jobs whose
        first GPU is `gpu_uuid` (under the lock): on each of their GPUs it joins, in the fleet,
        the time-slice group of a job there of its GPU count whose rectangle holds its share
        (its memory beside theirs, or in turns with theirs where the dispatchers free a
        suspended job's memory), stops waiting, and is bound like any placed job;
        its dispatchers reserve it suspended (`time_slice_of`), and the round-robin gives it
        its turns."""
        job = self._cluster.job(job_id)
        if job is None or job.state is not JobState.PENDING or not self._cluster.waiting(job_id):
            return
        if now < self._sliced_at.get(job_id, -math.inf) + RETRY_QUANTA * self.config.quantum_s:
            return  # its binding failed (it waits again): not at once into the same failure
        on_gpu = self._training_on(gpu_uuid)
        if any(other.spec.priority != job.spec.priority for other in on_gpu):
            # Round-robin turns go to the highest priority present only: a lower one would
            # never run there, and a higher one would take every turn from the jobs there.
            log.debug("training job not time-sliced in: other priorities", job=job_id)
            return
        request = ask_of(job).request
        refusals = []
        in_turns = False
        for host in on_gpu:
            assert host.binding is not None
            uuids = host.binding.gpu_uuids
            if len(uuids) != request.gpus:
                continue
            # Where the dispatchers free a suspended job's memory, the group takes the memory
            # in turns: jobs whose memory sums above the GPU may take turns.
            in_turns = self.memory_in_turns(uuids)
            groups = []
            for i, uuid_ in enumerate(uuids):
                held = self._cluster.allocation(
                    host.job_id if i == 0 else gang_member_id(host.job_id, i)
                )
                if held is not None:
                    groups.append((uuid_, held.slice_group))
            try:
                if len(groups) != len(uuids):
                    raise InvalidPlacementError(f"{host.job_id} holds not all of its GPUs")
                joined = self._cluster.join_time_slice(request, groups, in_turns)
            except InvalidPlacementError as error:
                refusals.append(str(error))
                continue
            break
        else:
            # Asked again every tick while the policy wants it: not worth a line each time.
            log.debug("training job not time-sliced in", job=job_id, gpu=gpu_uuid, why=refusals)
            return
        self._sliced_at[job_id] = now
        first = joined[0]
        assert first.rect is not None
        records = [self._cluster.record(uuid_) for uuid_ in uuids]
        rect = first.rect
        binding = Binding(
            gpu_uuid=gpu_uuid,
            node=records[0].info.node,
            dispatcher_address=records[0].dispatcher_address,
            rect=(rect.x, rect.y, rect.w, rect.h),
            share=first.share,
            token=secrets.token_urlsafe(32),
            extra=tuple(ExtraGpu(r.info.gpu_uuid, r.dispatcher_address) for r in records[1:]),
            memory_in_turns=in_turns,
            # Its group on every GPU's dispatcher: the assignment id (the job id) of the
            # group's first job, which holds that id on each of its GPUs.
            time_slice_of=first.slice_of,
        )
        assert self.policy is not None
        self._cluster.bind_time_sliced(  # it stops waiting
            job.advance(
                now,
                state=JobState.BINDING,
                binding=binding,
                policy=self.policy.name,
                pending_reason="",
            )
        )
        metrics.TRAINING_SLICES.inc()
        log.info(
            "training job time-sliced in",
            job=job_id,
            gpus=list(uuids),
            group=first.slice_of,
            memory="in turns" if in_turns else "beside",
        )

    # ---- head-of-queue preemption ----

    def _preempt(self, head: str, gpu_uuid: str, victim: str, now: float) -> None:
        """The policy's preemption for the head of the queue, through suspension: the head
        joins the time-slice group of `victim`'s GPU(s) (with the memory in turns where the
        dispatcher frees a suspended job's memory) and runs there; `victim` stays suspended
        (its memory checkpointed) until the head ends, then runs on."""
        job = self._cluster.job(victim)
        if job is None or job.state is not JobState.ASSIGNED or victim in self._preempted_by:
            return
        self._slice_in(head, gpu_uuid, now)
        joined = self._cluster.job(head)
        if joined is None or joined.state is JobState.PENDING:
            return  # refused (memory, priority, shape): it waits on
        self._preempted_by[victim] = head
        metrics.TRAINING_PREEMPTIONS.inc()
        log.info("head of the queue preempts a training job", head=head, preempted=victim)

    def _preemption_on(self, gpu_uuid: str) -> bool:
        heads = set(self._preempted_by.values())
        return any(j.job_id in heads for j in self._training_on(gpu_uuid))

    # ---- packing ----

    def _pack(self, gpu_uuid: str, now: float) -> None:
        jobs = self._training_on(gpu_uuid)
        if len(jobs) != 2:
            return
        state = self._gpus.setdefault(gpu_uuid, _GpuState())
        state.packed, state.trial_started, state.gain = True, now, None
        for job, partner in ((jobs[0], jobs[1]), (jobs[1], jobs[0])):
            track = self._tracks.setdefault(job.job_id, _Track())
            track.packed_minibatch_s = 0.0
            track.packings.append(PackingTrial(partner.job_id, now, track.solo_minibatch_s))
            del track.packings[:-MAX_PACKINGS_SHOWN]
        metrics.TRAINING_PACKINGS.labels("started").inc()
        log.info("training jobs packed", gpu=gpu_uuid, jobs=[j.job_id for j in jobs])

    def _unpack(self, gpu_uuid: str) -> None:
        state = self._gpus.get(gpu_uuid)
        if state is None or not state.packed:
            return
        state.packed, state.gain = False, None
        state.turn_started = 0.0  # a fresh turn
        for job in self._training_on(gpu_uuid):
            track = self._tracks.get(job.job_id)
            if track is not None and track.packings:
                track.packings[-1] = replace(track.packings[-1], undone=True)
        metrics.TRAINING_PACKINGS.labels("undone").inc()
        log.info("packing undone: back to time-slicing", gpu=gpu_uuid)

    def _measure(self, now: float) -> None:
        """Close the packing trials whose window has passed and whose times are measured."""
        for gpu_uuid, state in self._gpus.items():
            if not state.packed or state.gain is not None:
                continue
            if now < state.trial_started + self.config.pack_trial_s:
                continue
            jobs = self._training_on(gpu_uuid)
            tracks = [self._tracks.get(j.job_id) for j in jobs]
            if len(jobs) != 2 or any(
                t is None or t.solo_minibatch_s <= 0 or t.packed_minibatch_s <= 0 for t in tracks
            ):
                continue  # not measured (yet): it stays packed
            solo = [t.solo_minibatch_s for t in tracks]  # type: ignore[union-attr]
            packed = [t.packed_minibatch_s for t in tracks]  # type: ignore[union-attr]
            state.gain = packed_gain(solo, packed)
            for track in tracks:
                assert track is not None
                if track.packings:
                    track.packings[-1] = replace(
                        track.packings[-1],
                        solo_minibatch_s=track.solo_minibatch_s,
                        packed_minibatch_s=track.packed_minibatch_s,
                        gain=state.gain,
                    )
            log.info("packing trial measured", gpu=gpu_uuid, gain=round(state.gain, 3))

    # ---- time-slicing ----

    def _switches(self, now: float) -> list[tuple[Job, bool]]:
        """The suspend (True) / resume (False) calls that make each GPU's training jobs run
        as decided: alone or packed, all resumed; time-sliced, one of the highest priority
        present per quantum; a migrating job keeps running (it must checkpoint)."""
        calls: list[tuple[Job, bool]] = []
        by_gpu: dict[str, list[Job]] = {}
        for job in self._managed():
            assert job.binding is not None
            by_gpu.setdefault(job.binding.gpu_uuid, []).append(job)
        for gpu_uuid, jobs in by_gpu.items():
            state = self._gpus.setdefault(gpu_uuid, _GpuState())
            # A job preempted for the head of the queue waits suspended while the head is
            # there; the others take turns as usual.
            takers = [j for j in jobs if j.job_id not in self._preempted_by]
            if len(takers) < len(jobs):
                state.packed = False
            if len(takers) < 2 or (state.packed and len(jobs) == 2):
                running = {j.job_id for j in takers}
            else:
                state.packed = False
                if not state.turn_started or now - state.turn_started >= self.config.quantum_s:
                    if state.turn_started:
                        state.turn += 1
                    state.turn_started = now
                taker_ids = {j.job_id for j in takers}
                order = [i for i, j in enumerate(jobs) if j.job_id in taker_ids]
                turn = round_robin_turn(
                    order, {i: jobs[i].spec.priority for i in order}, state.turn
                )
                running = {jobs[turn].job_id}
            for job in jobs:
                track = self._tracks.setdefault(job.job_id, _Track())
                if track.move is not None and track.move.hookless:
                    continue  # placement suspends and moves it itself
                suspend = job.job_id not in running and track.move is None
                if track.commanded_suspended is None and not suspend:
                    continue  # never suspended by us: nothing to resume
                failed_at = track.call_failed_at
                if failed_at is not None and now - failed_at < self.config.quantum_s:
                    continue  # its dispatcher failed the last call: again next quantum
                if track.commanded_suspended != suspend:
                    calls.append((job, suspend))
                elif (
                    suspend
                    and not track.observed_suspended
                    and track.reported_at > track.commanded_at
                ):
                    # Reported running since it was suspended: its dispatcher restarted (it
                    # keeps no suspension across one). Left so, a job of lower priority would
                    # run beside the higher one for good.
                    log.warning(
                        "a suspended training job runs again; suspended again",
                        job=job.job_id,
                        gpu=gpu_uuid,
                    )
                    calls.append((job, True))
        # Suspensions first, so that two jobs of a round-robin never run at once.
        return sorted(calls, key=lambda call: not call[1])

    async def _switch(self, calls: Sequence[tuple[Job, bool]]) -> None:
        assert self._control is not None or not calls
        for job, suspend in calls:
            binding = job.binding
            assert binding is not None and self._control is not None
            track = self._tracks.setdefault(job.job_id, _Track())
            try:
                if suspend:
                    now_suspended = await self._control.suspend(
                        binding.dispatcher_address,
                        job.job_id,
                        self.config.suspend_wait_ms,
                        SWITCH_REASON,
                    )
                else:
                    now_suspended = await self._control.resume(
                        binding.dispatcher_address, job.job_id
                    )
            except DomainError as error:
                if track.call_failed_at is None:
                    log.warning(
                        "training switch failed; tried again each quantum",
                        job=job.job_id,
                        call="suspend" if suspend else "resume",
                        error=error.message,
                    )
                track.call_failed_at = self._clock()
                continue
            track.call_failed_at = None
            metrics.TRAINING_SWITCHES.labels("suspend" if suspend else "resume").inc()
            track.commanded_suspended = now_suspended
            track.observed_suspended = now_suspended
            track.commanded_at = self._clock()
        if calls:
            async with self._cluster.lock:
                for job, _ in calls:
                    self._show(job.job_id, publish=True)

    # ---- migration ----

    def _elsewhere_when_not_restored(self, now: float) -> list[tuple[Job, _Move]]:
        """A job without a hook whose checkpointed memory could not be restored (a resume with
        no room on its GPU, or a move that failed, once its back-off is over) is moved to
        another GPU of its node of the same model that has the room, the first by UUID (under
        the lock; the policy's own moves come first)."""
        starts = []
        for job in self._managed():
            track = self._tracks.get(job.job_id)
            binding = job.binding
            if (
                track is None
                or not track.restore_failed
                or track.move is not None
                or job.spec.checkpoint is not None
                or binding is None
            ):
                continue
            model = self._cluster.record(binding.gpu_uuid).info.model
            for record in sorted(self._cluster.records(), key=lambda r: r.info.gpu_uuid):
                info = record.info
                if (
                    info.gpu_uuid == binding.gpu_uuid
                    or info.node != binding.node
                    or info.model != model
                    or self._cluster.is_down(record)
                ):
                    continue
                reason = f"its memory could not be restored on {binding.gpu_uuid}: "
                start = self._begin_move(job.job_id, info.gpu_uuid, reason + track.memory_note, now)
                if start is not None:
                    starts.append(start)
                    break
        return starts

    def _movable_without_hook(self, job: Job) -> bool:
        """A job without a checkpoint hook can move through the driver's checkpoint API: one
        GPU, whose dispatcher frees a suspended job's memory."""
        binding = job.binding
        return (
            binding is not None
            and not binding.extra
            and self._memory_in_turns.get(binding.gpu_uuid, False)
        )

    def _begin_move(
        self, job_id: str, target_uuid: str, reason: str, now: float
    ) -> tuple[Job, _Move] | None:
        """Take the target's capacity in the fleet for a job with a checkpoint hook, or one
        without that can move through the driver's checkpoint API to a GPU of its node of the
        same model (under the lock); None when the job cannot move now."""
        job = self._cluster.job(job_id)
        if job is None or job.binding is None:
            return None
        hookless = job.spec.checkpoint is None
        if hookless and not self._movable_without_hook(job):
            return None
        track = self._tracks.setdefault(job_id, _Track())
        if track.move is not None or now < track.retry_at or not self._cluster.has_gpu(target_uuid):
            return None
        record = self._cluster.record(target_uuid)
        if hookless:
            source = self._cluster.record(job.binding.gpu_uuid)
            if (
                record.info.node != job.binding.node
                or record.info.model != source.info.model
                or not self._memory_in_turns.get(target_uuid, False)
            ):
                return None
        current = allocation(job)
        wanted = replace(
            current,
            allocation_id=job_id + MOVE_SUFFIX,
            rect=None,
            slice_of="",
            turn_charge_bytes=None,
        )
        if record.info.node == job.binding.node:  # its node's CPU and memory are held already
            wanted = replace(wanted, cpu_milli=0, host_memory_bytes=0)
        held = self._cluster.hold(target_uuid, wanted)
        if held is None or held.rect is None:
            return None
        rect = held.rect
        move = _Move(
            migration_id=uuid.uuid4().hex[:16],
            target=Binding(
                gpu_uuid=target_uuid,
                node=record.info.node,
                dispatcher_address=record.dispatcher_address,
                rect=(rect.x, rect.y, rect.w, rect.h),
                share=job.binding.share,
                token=secrets.token_urlsafe(32),
            ),
            reason=reason,
            requested_at=now,
            deadline=now
            + (
                MOVE_CALL_S + MOVE_REGISTER_S
                if job.spec.checkpoint is None
                else job.spec.checkpoint.effective_timeout_s
            )
            + self.config.hook_grace_s,
            hookless=hookless,
        )
        track.move = move
        self._cluster.note_moving(job_id, (target_uuid,))
        return job, move

    def _begin_resize(
        self, job_id: str, gpus: tuple[str, ...], reason: str, now: float
    ) -> tuple[Job, _Move] | None:
        """Grow-shrink (under the lock): a grow takes its new GPUs in the fleet, as further GPUs
        of the job (the caller reserves them on their dispatchers, then asks the runner); a
        shrink asks the runner at once. None when the job cannot be resized now."""
        job = self._cluster.job(job_id)
        if job is None or job.binding is None or job.spec.checkpoint is None:
            return None
        binding = job.binding
        spec = job.spec
        if (
            not spec.elastic
            or not max(spec.whole_gpus, 1) <= len(gpus) <= spec.max_gpus
            or gpus[0] != binding.gpu_uuid
            or len(set(gpus)) != len(gpus)
            or gpus == binding.gpu_uuids
        ):
            return None
        track = self._tracks.setdefault(job_id, _Track())
        if track.move is not None or now < track.retry_at:
            return None
        now_on = binding.gpu_uuids
        shrink = len(gpus) < len(now_on)
        if shrink and gpus != now_on[: len(gpus)]:
            return None  # a shrink keeps a prefix of its GPUs (their fleet ids stay)
        if not shrink and gpus[: len(now_on)] != now_on:
            return None  # a grow keeps its GPUs and adds some
        added = () if shrink else gpus[len(now_on) :]
        taken: list[str] = []
        for i, uuid_ in enumerate(added, start=len(now_on)):
            if not self._cluster.has_gpu(uuid_) or self._cluster.record(uuid_).info.node != (
                binding.node
            ):
                break
            member = replace(
                allocation(job),
                allocation_id=gang_member_id(job_id, i),
                rect=None,
                cpu_milli=0,
                host_memory_bytes=0,
                gang=job_id,
            )
            if self._cluster.hold(uuid_, member) is None:
                break
            taken.append(member.allocation_id)
        if len(taken) != len(added):
            for member_id in taken:
                self._cluster.release(member_id)
            return None
        records = {u: self._cluster.record(u) for u in gpus}
        kept = {g.gpu_uuid: g for g in binding.extra}
        target = replace(
            binding,
            token=secrets.token_urlsafe(32),
            environment={},
            extra=tuple(
                kept.get(u) or ExtraGpu(u, records[u].dispatcher_address) for u in gpus[1:]
            ),
        )
        move = _Move(
            migration_id=uuid.uuid4().hex[:16],
            target=target,
            reason=reason,
            requested_at=now,
            deadline=now + spec.checkpoint.effective_timeout_s + self.config.hook_grace_s,
            reserved=shrink,  # nothing to reserve first: the runner is asked at once
            gpus=gpus,
            added=added,
        )
        track.move = move
        if added:
            self._cluster.note_moving(job_id, added)
        log.info(
            "resize begun" if added else "resize asked for",
            job=job_id,
            reason=reason,
            gpus=len(gpus),
            was=len(now_on),
            migration=move.migration_id,
        )
        self._show(job_id, publish=True)
        return (job, move) if added else None

    async def _reserve_target(self, job: Job, move: _Move) -> None:
        """Reserve the target on its dispatcher, then ask the runner to checkpoint (or give
        the target back when the dispatcher refuses)."""
        target = move.target
        try:
            if move.resize:
                # A grow: its new GPUs, under the new token (the first GPU is reserved again
                # with it once the runner has stopped the job).
                addresses = {g.gpu_uuid: g.dispatcher_address for g in target.extra}
                environments = await asyncio.gather(
                    *(
                        self._dispatchers.reserve(addresses[u], bind_request(job, target))
                        for u in move.added
                    )
                )
                fresh = dict(zip(move.added, environments, strict=True))
                move.target = target = replace(
                    target,
                    extra=tuple(
                        replace(g, environment=dict(fresh[g.gpu_uuid]))
                        if g.gpu_uuid in fresh
                        else g
                        for g in target.extra
                    ),
                )
                environment = dict(target.environment)
            else:
                environment = await self._dispatchers.reserve(
                    target.dispatcher_address, bind_request(job, target)
                )
        except DomainError as error:
            environment = None
            message = error.message
        async with self._cluster.lock:
            track = self._tracks.get(job.job_id)
            if track is None or track.move is not move:
                if environment is not None:  # ended meanwhile: let the target go too
                    self._release_targets(job.job_id, move)
                return
            if environment is None:
                log.warning("migration target refused", job=job.job_id, error=message)
                self._give_back(job.job_id, move)
                track.move = None
                metrics.TRAINING_MIGRATIONS.labels("abandoned").inc()
                return
            if not move.resize:
                move.target = replace(target, environment=environment)
            move.reserved = True
            if move.hookless:
                move.committing = True  # placement moves it: no runner's report to wait for
                self._spawn(self._move_without_hook(job, move))
            log.info(
                "migration asked for",
                job=job.job_id,
                target=target.gpu_uuid,
                reason=move.reason,
                migration=move.migration_id,
                hook=not move.hookless,
            )
            self._show(job.job_id, publish=True)

    async def _move_without_hook(self, job: Job, move: _Move) -> None:
        """The target is reserved: suspend the job at its source (its memory checkpointed),
        MoveClient there (restored onto the target, its shim registers with the target's
        dispatcher), UnlockMovedClient at the target once it registered, then commit the move.
        A failure leaves it suspended where it was, with the reason; the target is given back
        and it is not moved again for RETRY_QUANTA quanta (then to wherever the policy says)."""
        assert self._control is not None and job.binding is not None
        source, target = job.binding, move.target
        note = ""
        try:
            await self._control.suspend(
                source.dispatcher_address, job.job_id, self.config.suspend_wait_ms, MOVE_REASON
            )
            note = await self._control.move(
                source.dispatcher_address,
                job.job_id,
                target.gpu_uuid,
                target.environment.get("GPULOOM_DISPATCHER_SOCKET", ""),
                target.token,
            )
        except DomainError as error:
            note = error.message
        unlock_error = ""
        if not note:
            unlock_error = await self._unlock_when_registered(target.dispatcher_address, job.job_id)
        async with self._cluster.lock:
            track = self._tracks.get(job.job_id)
            if track is None or track.move is not move:
                self._release_targets(job.job_id, move)  # ended meanwhile
                return
            if note:
                self._fail_move(job.job_id, track, f"move without a hook failed: {note}")
                track.commanded_suspended = True  # suspended at its source: resumed there
                track.commanded_at = self._clock()
            else:
                self._commit_move(job.job_id, track, move)
                if unlock_error:  # it is on the target, locked: said, and tried every tick
                    self._not_unlocked(job.job_id, track, target.dispatcher_address, unlock_error)
            self._show(job.job_id, publish=True)

    def _not_unlocked(self, job_id: str, track: _Track, address: str, error: str) -> None:
        track.unlock_at = address
        track.last_hook_error = f"moved, but not unlocked yet: {error}"[:4096]
        track.last_hook_error_at = self._clock()
        log.error("moved job not unlocked; tried again every tick", job=job_id, error=error)

    async def _unlock_again(self, job_id: str, address: str) -> None:
        """One more UnlockMovedClient for a job moved without a hook whose unlock failed."""
        error = await self._unlock_when_registered(address, job_id)
        async with self._cluster.lock:
            track = self._tracks.get(job_id)
            if track is None:
                return
            track.unlocking = False
            if not error:
                track.unlock_at = ""
                track.last_hook_error = ""
                log.info("moved job unlocked", job=job_id)
                self._show(job_id, publish=True)

    async def _unlock_when_registered(self, address: str, assignment_id: str) -> str:
        """UnlockMovedClient, retried until the moved shim registered (MOVE_REGISTER_S at
        most). Returns "" when unlocked, else the last error."""
        assert self._control is not None
        deadline = time.monotonic() + MOVE_REGISTER_S
        while True:
            try:
                await self._control.unlock_moved(address, assignment_id)
                return ""
            except DomainError as error:
                if time.monotonic() >= deadline:
                    return error.message
            await asyncio.sleep(0.1)

    async def report_checkpoint(
        self, job_id: str, migration_id: str, succeeded: bool, message: str
    ) -> Job:
        """The runner's answer to a migration: move the job, or keep it where it is."""
        if not migration_id:
            raise InvalidArgument("migration_id", "required")
        async with self._cluster.lock:
            job = self._cluster.job(job_id)
            if job is None:
                raise NotFound(f"no live job {job_id!r}")
            track = self._tracks.get(job_id)
            move = None if track is None else track.move
            if move is None or move.migration_id != migration_id or not move.reserved:
                raise FailedPrecondition(
                    f"job {job_id} has no migration {migration_id!r} in progress"
                )
            assert track is not None and job.binding is not None
            if move.hookless:
                raise FailedPrecondition(
                    f"job {job_id}: migration {migration_id} is placement's own (no hook): "
                    "nothing to report"
                )
            if not succeeded:
                self._fail_move(job_id, track, message or "the checkpoint hook failed")
                self._show(job_id, publish=True)
                job = self._cluster.job(job_id)
                assert job is not None
                return job
            if move.resize:
                if move.committing:
                    raise FailedPrecondition(f"job {job_id}: resize {migration_id} is under way")
                move.committing = True
            else:
                moved = self._commit_move(job_id, track, move)
        if move.resize:
            return await self._commit_resize(job, track, move)
        moved = self._cluster.job(job_id) or moved
        return moved

    def _commit_move(self, job_id: str, track: _Track, move: _Move) -> Job:
        """A migration succeeded (under the lock): the job's binding and capacity move to the
        target, the source is released."""
        job = self._cluster.job(job_id)
        assert job is not None and job.binding is not None
        old = job.binding
        self._cluster.release(job_id + MOVE_SUFFIX)
        self._cluster.release(job_id, old.gpu_uuid)  # the source has room again
        x, y, w, h = move.target.rect
        current = allocation(job)
        self._cluster.hold(
            move.target.gpu_uuid,
            replace(
                current,
                rect=Rect(x, y, w, h),
                slice_of="",
                turn_charge_bytes=None,  # alone on its target
            ),
        )
        self._moved(job_id, track)
        track.migrations += 1
        moved = job.advance(self._clock(), binding=move.target)
        self._cluster.update_live(moved)
        self._show(job_id, publish=True)
        self._release(old, job_id)
        metrics.TRAINING_MIGRATIONS.labels("moved").inc()
        log.info(
            "training job migrated",
            job=job_id,
            source=old.gpu_uuid,
            target=move.target.gpu_uuid,
            reason=move.reason,
            hook=not move.hookless,
        )
        return moved

    async def _commit_resize(self, job: Job, track: _Track, move: _Move) -> Job:
        """The runner stopped the job for a resize: reserve its first GPU again under the new
        token (released first: the old token is bound to the stopped process), then move the
        binding to the new set of GPUs and let the dropped ones go. If the first GPU cannot be
        reserved again, the old reservation is made again (its token unbound now, so the job
        restarts where it was) and the resize fails like a hook."""
        job_id = job.job_id
        old = job.binding
        assert old is not None
        first = old.dispatcher_address
        try:
            await self._dispatchers.release(first, job_id)
            environment = await self._dispatchers.reserve(first, bind_request(job, move.target))
        except DomainError as error:
            with contextlib.suppress(DomainError):
                await self._dispatchers.reserve(first, bind_request(job, old))
            async with self._cluster.lock:
                if track.move is move:
                    self._fail_move(
                        job_id, track, f"reserving GPU {old.gpu_uuid} again failed: {error.message}"
                    )
                    self._show(job_id, publish=True)
            raise FailedPrecondition(
                f"job {job_id}: the {move.reason} was not done ({error.message}); it restarts "
                "where it was"
            ) from None
        async with self._cluster.lock:
            job_now = self._cluster.job(job_id)
            if job_now is None or track.move is not move or job_now.binding is None:
                # Ended meanwhile: the new reservation goes too.
                self._release(replace(move.target, extra=()), job_id)
                raise FailedPrecondition(f"job {job_id} ended during its {move.reason}")
            environments = [environment, *(dict(g.environment) for g in move.target.extra)]
            target = _bound(move.target, environments)
            dropped = [
                (i, g) for i, g in enumerate(old.extra, start=1) if g.gpu_uuid not in move.gpus
            ]
            for i, gpu in dropped:
                self._cluster.release(gang_member_id(job_id, i), gpu.gpu_uuid)
            self._moved(job_id, track)
            track.resizes += 1
            resized = job_now.advance(self._clock(), binding=target)
            self._cluster.update_live(resized)
            self._show(job_id, publish=True)
            for _, gpu in dropped:
                self._release_at(gpu.dispatcher_address, job_id)
            if dropped:
                self._cluster.wake()  # the pending job that needed them may be placed now
            metrics.TRAINING_RESIZES.labels(move.reason).inc()
            log.info(
                "training job resized",
                job=job_id,
                reason=move.reason,
                gpus=list(target.gpu_uuids),
            )
        return self._cluster.job(job_id) or resized

    def _fail_move(self, job_id: str, track: _Track, error: str) -> None:
        move = track.move
        assert move is not None
        self._give_back(job_id, move)
        track.move = None
        track.failed_migrations += 1
        track.last_hook_error = error[:4096]
        track.last_hook_error_at = self._clock()
        track.retry_at = track.last_hook_error_at + RETRY_QUANTA * self.config.quantum_s
        metrics.TRAINING_MIGRATIONS.labels("move_failed" if move.hookless else "hook_failed").inc()
        log.warning(
            "move without a hook failed: the job stays where it is"
            if move.hookless
            else "checkpoint hook failed: the job stays where it is",
            job=job_id,
            migration=move.migration_id,
            target=move.target.gpu_uuid,
            error=error[:200],
        )

    def _give_back(self, job_id: str, move: _Move) -> None:
        """The target's capacity goes back, in the fleet and on its dispatcher (a grow: the
        GPUs it was adding)."""
        self._cluster.done_moving(job_id)
        if move.resize:
            start = len(move.gpus) - len(move.added)
            for i, uuid_ in enumerate(move.added, start=start):
                self._cluster.release(gang_member_id(job_id, i), uuid_)
        else:
            self._cluster.release(job_id + MOVE_SUFFIX, move.target.gpu_uuid)
        self._release_targets(job_id, move)

    def _release_targets(self, job_id: str, move: _Move) -> None:
        """What a move reserved on dispatchers before the runner was asked is released."""
        if not move.resize:
            self._release(move.target, job_id)
            return
        addresses = {g.gpu_uuid: g.dispatcher_address for g in move.target.extra}
        for uuid_ in move.added:
            self._release_at(addresses[uuid_], job_id)

    def _release(self, binding: Binding, job_id: str) -> None:
        self._release_at(binding.dispatcher_address, job_id)

    def _release_at(self, address: str, job_id: str) -> None:
        async def release() -> None:
            try:
                await self._dispatchers.release(address, job_id)
            except DomainError as error:
                log.info("release on dispatcher deferred", job=job_id, error=error.message)

        self._spawn(release())

    def _spawn(self, coroutine: object) -> None:
        task = asyncio.ensure_future(coroutine)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- what jobs show ----

    def _state(self, job_id: str, job: Job) -> TrainingState:
        track = self._tracks.setdefault(job_id, _Track())
        assert job.binding is not None
        on = self._training_on(job.binding.gpu_uuid)
        gpu = self._gpus.get(job.binding.gpu_uuid)
        packed_with = ""
        if gpu is not None and gpu.packed and len(on) == 2:
            packed_with = next(j.job_id for j in on if j.job_id != job_id)
        move = track.move
        if move is not None and move.reserved:
            phase = TrainingPhase.MIGRATING
        elif packed_with:
            phase = TrainingPhase.PACKED
        elif track.observed_suspended or track.commanded_suspended:
            phase = TrainingPhase.SUSPENDED
        else:
            phase = TrainingPhase.RUNNING
        migration = None
        if phase is TrainingPhase.MIGRATING:
            assert move is not None
            migration = MigrationRequest(
                move.migration_id,
                move.target.gpu_uuid,
                move.target.node,
                move.reason,
                move.requested_at,
                move.deadline,
                len(move.gpus),
            )
        return TrainingState(
            phase=phase,
            packed_with=packed_with,
            minibatch_s=track.minibatch_s,
            solo_minibatch_s=track.solo_minibatch_s,
            height=max(1, len(on)),
            minibatches=track.minibatches,
            packings=tuple(track.packings),
            migrations=track.migrations,
            failed_migrations=track.failed_migrations,
            resizes=track.resizes,
            last_hook_error=track.last_hook_error,
            last_hook_error_at=track.last_hook_error_at,
            migration=migration,
            preempted_by=self._preempted_by.get(job_id, ""),
            memory_note=track.memory_note if phase is TrainingPhase.SUSPENDED else "",
            memory_in_turns=self.memory_in_turns(job.binding.gpu_uuids),
            memory_released=track.memory_released and phase is TrainingPhase.SUSPENDED,
        )

    def _moved(self, job_id: str, track: _Track) -> None:
        """A migration or resize is done: the job runs where it now is, unsuspended, to be
        measured afresh (its mini-batch times were of its old GPUs)."""
        self._cluster.done_moving(job_id)
        track.move = None
        track.commanded_suspended = None
        track.observed_suspended = False
        track.solo_minibatch_s = track.packed_minibatch_s = 0.0

    def _show(self, job_id: str, *, publish: bool) -> None:
        """Put the job's training state on it. `publish` (under the lock only): a change
        other than its mini-batch figures becomes a new revision, which watchers (its runner)
        see; without it, or for new figures only, the job is updated in place."""
        job = self._cluster.job(job_id)
        if job is None or job.state is not JobState.ASSIGNED or job.binding is None:
            return
        track = self._tracks.setdefault(job_id, _Track())
        state = self._state(job_id, job)
        if publish and _without_figures(state) != _without_figures(track.published):
            track.published = state
            self._cluster.set_training(job_id, state, publish=True)
        elif state != job.training:
            self._cluster.set_training(job_id, state, publish=False)


def _without_figures(state: TrainingState | None) -> TrainingState | None:
    if state is None:
        return None
    return replace(state, minibatch_s=0.0, solo_minibatch_s=0.0, minibatches=0)


def validate_training_policy(name: str) -> str:
    """A setting's training policy: "off" or a name the training registry knows."""
    if name == OFF:
        return name
    try:
        get_policy(name)
    except ValueError as error:
        raise ValueError(f"{error} (or off)") from None
    return name
