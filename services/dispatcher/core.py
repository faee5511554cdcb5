"""The dispatcher's domain core, as the gRPC servicer sees it: reserve, release, evict, status,
events. State changes are made on the shim channel's thread (which owns the scheduler) or in
the thread-safe reservation book; this class only coordinates them from the asyncio side."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import structlog

from gpuloom.cudadrv import CudaError
from gpuloom.domain.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from gpuloom.domain.gpus import GpuInfo, find_model
from gpuloom.domain.mig_runs import TaskEnd, TaskStart
from gpuloom.domain.placement import ASSIGNMENT_TOKEN_VARIABLE
from gpuloom.domain.training import TIME_SLICE_REASON, TrainingCycle, TrainingReport
from gpuloom.policies.mig import Plan, UnknownPolicyError, get_planner
from gpuloom.policies.tokens.scheduler import SchedulerSnapshot
from gpuloom.services.dispatcher import metrics
from gpuloom.services.dispatcher.channel import ConnectedProcess, ShimChannel
from gpuloom.services.dispatcher.checkpoint import Checkpointer, CheckpointRefused, MemoryState
from gpuloom.services.dispatcher.domain import (
    LEASE_EVENTS,
    ClientStatus,
    DispatcherEvent,
    EventKind,
    GpuStatusView,
    LeaseState,
    MoveTarget,
    Reservation,
    ReserveSpec,
    Suspension,
)
from gpuloom.services.dispatcher.gpu.backend import GpuBackend, GpuUsage
from gpuloom.services.dispatcher.introspection import TrainingIntrospector
from gpuloom.services.dispatcher.mig_executor import (
    MigBatchTask,
    MigExecutor,
    MigRunReport,
    TaskHandoff,
    TaskRun,
    validate_batch,
)
from gpuloom.services.dispatcher.mps import MpsSupervisor
from gpuloom.services.dispatcher.profiling import ProfilerLink
from gpuloom.services.dispatcher.reservations import ReservationBook

log = structlog.get_logger("gpuloom.dispatcher")

T = TypeVar("T")
# A watcher that falls this far behind is cut off rather than slowing the dispatcher down.
MAX_PENDING_EVENTS = 10_000
# SuspendClient waits at most this long for a low-memory point, whatever it asks.
MAX_SUSPEND_WAIT_S = 600.0
# Evictions kept for placement while it cannot be reached (the oldest go first), and how long
# an eviction waits for placement to hear of it before it goes on without.
MAX_UNREPORTED_EVICTIONS = 1024
EVICTION_REPORT_S = 5.0


class EventStreamOverflow(ResourceExhausted):
    """The watcher did not keep up; its stream ends."""


@dataclass(eq=False)
class _Subscriber:
    queue: asyncio.Queue[DispatcherEvent | None]
    include_leases: bool


class DispatcherCore:
    def __init__(
        self,
        gpu: GpuInfo,
        node: str,
        backend: GpuBackend,
        book: ReservationBook,
        channel: ShimChannel,
        socket_path: str,
        policy: str,
        window_s: float,
        loop: asyncio.AbstractEventLoop,
        state_dir: Path,
        profiler_link: ProfilerLink | None = None,
        mps: MpsSupervisor | None = None,
        introspector: TrainingIntrospector | None = None,
        suspend_max_wait_s: float = 2.0,
        checkpointer: Checkpointer | None = None,
    ) -> None:
        self.gpu = gpu
        self.node = node
        self.backend = backend
        self.book = book
        self.channel = channel
        self.socket_path = socket_path
        self.policy = policy
        self.window_s = window_s
        self._loop = loop
        self._subscribers: list[_Subscriber] = []
        self._state_dir = state_dir
        self._profiler_link = profiler_link
        self._mig_running = False
        self.mps = mps
        self.introspector = introspector
        self.suspend_max_wait_s = suspend_max_wait_s
        # Suspension that frees memory (the driver's checkpoint API; None: off, memory stays
        # resident). What became of each suspended client's memory, by assignment id.
        self.checkpointer = checkpointer
        self._memory: dict[str, MemoryState] = {}
        self._memory_watch: asyncio.Task[None] | None = None
        # Told when the GPU's description changes (MIG mode): the placement link registers
        # the GPU again.
        self.on_gpu_changed: Callable[[], None] | None = None
        # Evictions placement has not heard of yet (assignment id -> reason, the latest
        # MAX_UNREPORTED_EVICTIONS): its next heartbeat carries them, and the jobs end EVICTED.
        self._evictions: dict[str, str] = {}
        # Tells placement of an eviction now (the placement link: a heartbeat carrying it).
        self.report_eviction: Callable[[str], Awaitable[None]] | None = None
        # This dispatcher's gRPC address as others reach it (set once the server listens): in
        # a process's environment, where `gpuloom.clients.models.attach` finds its GPU's store.
        self.grpc_address = ""

    # ---- commands ----

    async def reserve(self, spec: ReserveSpec) -> Reservation:
        spec.validate()
        self._check_mps(spec)
        # Shielded, as is an end: a caller that gives up (an RPC deadline) while the book's
        # thread or the channel is at work must not leave the two disagreeing (a share the
        # book forgot, or a reservation with no share), so the change is made, or rolled
        # back, in full; a retried Reserve then finds it.
        return await asyncio.shield(self._reserve(spec))

    async def _reserve(self, spec: ReserveSpec) -> Reservation:
        reservation, created = await asyncio.to_thread(self.book.reserve, spec)
        if created:

            def add() -> None:
                self.channel.add_reservation(reservation)
                if reservation.time_slice_of:
                    # A time-slice member starts suspended, in the same breath as it is added
                    # (no process can have registered yet: the suspension is immediate, and
                    # one that registers later parks at its first launch until ResumeClient),
                    # so it never runs beside the member of its group that runs. Not on a
                    # retry (created is False): it may have been resumed since.
                    self.channel.begin_suspend(
                        reservation.assignment_id, self.suspend_max_wait_s, TIME_SLICE_REASON
                    )

            try:
                await self._on_channel(add)
            except BaseException:
                await asyncio.to_thread(self.book.release, reservation.assignment_id)
                raise
            self.publish(self._event(EventKind.RESERVED, reservation.assignment_id))
            log.info(
                "reserved",
                assignment=reservation.assignment_id,
                client=reservation.client_name,
                sm_percent=reservation.share.sm_percent,
                quota_request=reservation.share.quota.request_percent,
                quota_limit=reservation.share.quota.limit_percent,
                memory_cap=reservation.share.memory_bytes,
                time_slice_of=reservation.time_slice_of or None,
            )
        return reservation

    def _check_mps(self, spec: ReserveSpec) -> None:
        """An SM partition (below 100%) needs the GPU's MPS daemon when this GPU runs one; the
        whole GPU (100%, token shares) is served without it. A repeated Reserve of a held
        assignment is answered as before (the book checks it is the same)."""
        if self.mps is None or spec.share.sm_percent >= 100:
            return
        running, cause = self.mps.available()
        if not running and self.book.get(spec.assignment_id) is None:
            raise FailedPrecondition(
                f"an SM partition ({spec.share.sm_percent}% SM) needs MPS on GPU "
                f"{self.gpu.index}, and its control daemon is not running: {cause}"
            )

    async def release(self, assignment_id: str) -> bool:
        return await self._end(assignment_id, "assignment released", EventKind.RELEASED)

    async def evict(self, assignment_id: str, reason: str) -> None:
        """Take a reservation away: placement hears of it first (its job ends EVICTED before
        the process, cut off at once, can report an end of its own), within
        EVICTION_REPORT_S; then the process is told and disconnected, and the book forgets it.
        A placement that cannot be reached meanwhile hears of it with a later heartbeat."""
        if self.book.get(assignment_id) is None:
            raise NotFound(f"no assignment {assignment_id!r} on this GPU")
        reason = reason or "evicted"
        self._evictions.pop(assignment_id, None)
        self._evictions[assignment_id] = reason
        while len(self._evictions) > MAX_UNREPORTED_EVICTIONS:
            del self._evictions[next(iter(self._evictions))]
        if self.report_eviction is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.report_eviction(assignment_id), EVICTION_REPORT_S)
        # False when placement, told, released it meanwhile: gone either way.
        await self._end(assignment_id, reason, EventKind.EVICTED)

    def unreported_evictions(self) -> dict[str, str]:
        """The evictions placement has not heard of yet (assignment id -> reason)."""
        return dict(self._evictions)

    def evictions_reported(self, assignment_ids: Iterable[str]) -> None:
        """Placement answered a heartbeat that carried these."""
        for assignment_id in assignment_ids:
            self._evictions.pop(assignment_id, None)

    async def _end(self, assignment_id: str, reason: str, kind: EventKind) -> bool:
        return await asyncio.shield(self._end_in_full(assignment_id, reason, kind))

    async def _end_in_full(self, assignment_id: str, reason: str, kind: EventKind) -> bool:
        reservation = await asyncio.to_thread(self.book.release, assignment_id)
        self._memory.pop(assignment_id, None)
        if reservation is None:
            return False
        await self._on_channel(
            lambda: self.channel.remove_reservation(assignment_id, reason, reservation.mode)
        )
        self.publish(self._event(kind, assignment_id, reason))
        log.info(kind.value, assignment=assignment_id, reason=reason)
        return True

    # ---- suspend and resume (Gandiva) ----

    async def suspend(self, assignment_id: str, max_wait_s: float, reason: str) -> ClientStatus:
        """Stop admitting the client's kernels at its next low-memory point, waiting at most
        max_wait_s (0: the default) for it; its memory stays resident. Idempotent."""
        if self.book.get(assignment_id) is None:
            raise NotFound(f"no assignment {assignment_id!r} on this GPU")
        if not math.isfinite(max_wait_s) or not 0 <= max_wait_s <= MAX_SUSPEND_WAIT_S:
            raise InvalidArgument(
                "max_wait_ms", f"must be within 0..{MAX_SUSPEND_WAIT_S * 1e3:.0f} ms"
            )
        wait_s = max_wait_s or self.suspend_max_wait_s
        await self._to_kernel_boundary(assignment_id, wait_s)
        pending = await self._on_channel(
            lambda: self.channel.begin_suspend(assignment_id, wait_s, reason)
        )
        if await asyncio.wrap_future(pending) is not None:
            await self._release_memory(assignment_id)
        return await self.client_status(assignment_id)

    async def resume(self, assignment_id: str) -> ClientStatus:
        """Admit the client's kernels again. Idempotent. A client whose memory was released
        gets it back first; if that fails (no room on the GPU, the driver failed) it stays
        suspended and its status says why."""
        if self.book.get(assignment_id) is None:
            raise NotFound(f"no assignment {assignment_id!r} on this GPU")
        if not await self._restore_memory(assignment_id):
            return await self.client_status(assignment_id)
        await self._on_channel(lambda: self.channel.resume(assignment_id))
        return await self.client_status(assignment_id)

    async def _to_kernel_boundary(self, assignment_id: str, wait_s: float) -> None:
        """Where the memory samples show no cycle (a caching allocator) but the shim found the
        loop's period in its kernel stream: wait until the host gap before the next iteration
        boundary (its middle), so that the process parks at the boundary's launch (at most
        one period, and never past `wait_s`)."""
        cycle = None if self.introspector is None else self.introspector.cycle(assignment_id)
        if cycle is not None and cycle.minibatch_s > 0:
            return  # the memory samples' low point is the suspension point
        if assignment_id in (await self._on_channel(self.channel.suspensions)):
            return
        period = await self._on_channel(lambda: self.channel.kernel_period(assignment_id))
        if period is None:
            return
        now = time.monotonic_ns()
        start, boundary = period.next_gap(now)
        target = start + (boundary - start) // 2
        if (target - now) / 1e9 > min(wait_s, period.period_ns * 2 / 1e9):
            return
        await asyncio.sleep(max(0, target - now) / 1e9)
        log.info(
            "suspending at the kernel stream's iteration boundary",
            assignment=assignment_id,
            kernels=period.kernels,
            period_ms=round(period.period_ns / 1e6, 3),
        )

    # ---- suspension that frees memory (services/dispatcher/checkpoint.py) ----

    async def _release_memory(self, assignment_id: str) -> None:
        """After the suspension point: the client's device memory to host memory, when the
        driver can (its process, as registered, is the one checkpointed)."""
        if assignment_id in self._memory and self._memory[assignment_id].released:
            return
        checkpointer = self.checkpointer
        if checkpointer is None:
            return
        connected = await self._on_channel(self.channel.connected)
        process = connected.get(assignment_id)
        if process is None:
            return  # nothing runs: nothing holds memory
        try:
            state = await asyncio.to_thread(checkpointer.release, process.pid, (process.pid,))
        except CheckpointRefused as error:  # cannot happen with the registered pid
            state = MemoryState(False, f"memory resident: {error}")
        self._memory[assignment_id] = state
        outcome = "released" if state.released else "resident"
        metrics.SUSPEND_MEMORY.labels(str(self.gpu.index), outcome).inc()
        log.info(
            "suspended client's memory " + outcome,
            assignment=assignment_id,
            pid=process.pid,
            note=state.note or None,
        )
        if state.released and self._memory_watch is None:
            self._memory_watch = asyncio.create_task(self._watch_released())

    async def _restore_memory(self, assignment_id: str) -> bool:
        """Before a resume: the released memory back. False: it could not be (still suspended,
        the reason in its status)."""
        state = self._memory.get(assignment_id)
        if state is None or not state.released or self.checkpointer is None:
            self._memory.pop(assignment_id, None)
            return True
        after = await asyncio.to_thread(self.checkpointer.restore, state)
        if after.restore_failed:
            self._memory[assignment_id] = after
            metrics.SUSPEND_MEMORY.labels(str(self.gpu.index), "restore_failed").inc()
            log.warning("suspended client's memory not restored", assignment=assignment_id,
                        why=after.note)  # fmt: skip
            return False
        del self._memory[assignment_id]
        metrics.SUSPEND_MEMORY.labels(str(self.gpu.index), "restored").inc()
        return True

    # ---- migration without a hook, on one node (docs/training.md) ----

    async def move_out(self, assignment_id: str, target: MoveTarget) -> ClientStatus:
        """Move a suspended client whose memory is checkpointed to another GPU of this node:
        restore it there (the driver's GPU pairs: this GPU -> the target), still locked, and
        tell its shim to register with the target's dispatcher under the target's token (the
        target's `unlock_moved` lets it run). On a restore that fails (no room there, another
        chip type) it stays suspended here, checkpointed, the reason in its status. The caller
        (placement) releases this reservation once the target has the process."""
        target.validate(self.gpu.gpu_uuid)
        if self.book.get(assignment_id) is None:
            raise NotFound(f"no assignment {assignment_id!r} on this GPU")
        state = self._memory.get(assignment_id)
        if state is None or not state.released or self.checkpointer is None:
            note = "" if state is None else f" ({state.note})"
            raise FailedPrecondition(
                f"assignment {assignment_id!r} is not suspended with its memory checkpointed"
                f"{note}: suspend it first"
            )
        pairs = [(self.gpu.gpu_uuid, target.gpu_uuid)]
        after = await asyncio.to_thread(self.checkpointer.restore_onto, state, pairs)
        if after.restore_failed:
            self._memory[assignment_id] = replace(state, note=after.note, restore_failed=True)
            metrics.SUSPEND_MEMORY.labels(str(self.gpu.index), "move_failed").inc()
            log.warning("suspended client not moved", assignment=assignment_id,
                        target=target.gpu_uuid, why=after.note)  # fmt: skip
            return await self.client_status(assignment_id)
        self._memory.pop(assignment_id, None)
        told = await self._on_channel(
            lambda: self.channel.move_client(assignment_id, target.socket_path, target.token)
        )
        metrics.SUSPEND_MEMORY.labels(str(self.gpu.index), "moved").inc()
        log.info("suspended client moved", assignment=assignment_id, pid=state.pid,
                 target=target.gpu_uuid, shim_told=told)  # fmt: skip
        return await self.client_status(assignment_id)

    async def unlock_moved(self, assignment_id: str) -> ClientStatus:
        """On the target GPU: let a process that `move_out` restored here run, once its shim
        registered for this reservation (only that process is ever unlocked)."""
        if self.book.get(assignment_id) is None:
            raise NotFound(f"no assignment {assignment_id!r} on this GPU")
        if self.checkpointer is None:
            raise FailedPrecondition("this dispatcher does not use the driver's checkpoint API")
        connected = await self._on_channel(self.channel.connected)
        process = connected.get(assignment_id)
        if process is None:
            raise FailedPrecondition(f"no process registered for {assignment_id!r} yet")
        try:
            await asyncio.to_thread(self.checkpointer.unlock_moved, process.pid, (process.pid,))
        except (CheckpointRefused, CudaError) as error:
            raise FailedPrecondition(f"cannot unlock pid {process.pid}: {error}") from None
        log.info("moved client runs here", assignment=assignment_id, pid=process.pid)
        return await self.client_status(assignment_id)

    async def _watch_released(self) -> None:
        """A process that dies while its memory is checkpointed: its reservation is freed
        (evicted: placement hears of it), so nothing stays held for it."""
        try:
            while any(state.released for state in self._memory.values()):
                await asyncio.sleep(1.0)
                for assignment_id, state in list(self._memory.items()):
                    if not state.released or self.checkpointer is None:
                        continue
                    if await asyncio.to_thread(self.checkpointer.alive, state):
                        continue
                    self._memory.pop(assignment_id, None)
                    if self.book.get(assignment_id) is not None:
                        await self.evict(
                            assignment_id,
                            "its process died while suspended with its GPU memory checkpointed",
                        )
        finally:
            self._memory_watch = None

    def _with_memory(self, assignment_id: str, suspension: Suspension | None) -> Suspension | None:
        state = self._memory.get(assignment_id)
        if suspension is None or state is None:
            return suspension
        return replace(suspension, memory_released=state.released, memory_note=state.note)

    async def training_reports(self) -> list[TrainingReport]:
        """Each reservation with a detected cycle or a suspension, by assignment id."""
        suspended = await self._on_channel(self.channel.suspensions)
        cycles = {} if self.introspector is None else self.introspector.cycles()
        reports = []
        for r in sorted(self.book.all(), key=lambda r: r.assignment_id):
            if r.assignment_id not in cycles and r.assignment_id not in suspended:
                continue
            held = r.assignment_id in suspended
            memory = self._memory.get(r.assignment_id, MemoryState(False)) if held else None
            reports.append(
                TrainingReport(
                    r.assignment_id,
                    cycles.get(r.assignment_id, TrainingCycle()),
                    held,
                    suspended[r.assignment_id].reason if held else "",
                    memory is not None and memory.released,
                    "" if memory is None else memory.note[:1024],
                    memory is not None and memory.released and memory.restore_failed,
                )
            )
        return reports

    # ---- queries ----

    async def client_status(self, assignment_id: str) -> ClientStatus:
        view, _ = await self.status(with_usage=False)
        for client in view.clients:
            if client.reservation.assignment_id == assignment_id:
                return client
        raise NotFound(f"no assignment {assignment_id!r} on this GPU")

    async def status(self, with_usage: bool = True) -> tuple[GpuStatusView, GpuUsage]:
        snapshot, connected, suspended = await self._on_channel(
            lambda: (
                self.channel.scheduler_snapshot(),
                self.channel.connected(),
                self.channel.suspensions(),
            )
        )
        usage = (
            await asyncio.to_thread(self.backend.usage, self.gpu.index)
            if with_usage
            else GpuUsage(0.0, 0)
        )
        cycles = {} if self.introspector is None else self.introspector.cycles()
        now = time.monotonic()
        clients = tuple(
            replace(
                self._client_status(reservation, snapshot, connected, now),
                training=cycles.get(reservation.assignment_id),
                suspension=self._with_memory(
                    reservation.assignment_id, suspended.get(reservation.assignment_id)
                ),
            )
            for reservation in sorted(self.book.all(), key=lambda r: r.reserved_at_unix_s)
        )
        view = GpuStatusView(
            policy=self.policy,
            window_s=self.window_s,
            clients=clients,
            waiting=snapshot.waiting,
            running_sm_percent=snapshot.running_sm_percent,
            memory_reserved_bytes=self.book.memory_reserved_bytes(),
            quota_reserved_percent=self.book.quota_reserved_percent(),
            window_elapsed_s=snapshot.now - snapshot.window_start,
        )
        return view, usage

    def _client_status(
        self,
        reservation: Reservation,
        snapshot: SchedulerSnapshot,
        connected: dict[str, ConnectedProcess],
        now: float,
    ) -> ClientStatus:
        process = connected.get(reservation.assignment_id)
        pid = 0 if process is None else process.pid
        if pid == 0 and reservation.bound is not None:
            pid = reservation.bound.pid
        allocated = 0 if process is None else process.allocated_bytes
        client = snapshot.clients.get(reservation.assignment_id)
        if client is None:  # not time-shared (measure/off modes)
            return ClientStatus(
                reservation, process is not None, pid, LeaseState.IDLE,
                0.0, 0.0, 0.0, 0, 0.0, 0.0, allocated,
            )  # fmt: skip
        lease = client.lease
        remaining = 0.0 if lease is None else max(0.0, lease.expires_at - now)
        state = LeaseState(client.state)
        waiting_s = 0.0
        if process is not None and process.asked_at is not None and state.asking:
            waiting_s = max(0.0, now - process.asked_at)
        return ClientStatus(
            reservation=reservation,
            connected=process is not None,
            pid=pid,
            state=state,
            used_fraction=client.used_s / self.window_s,
            lease_remaining_s=remaining if math.isfinite(remaining) else math.inf,
            lease_length_s=client.q_s,
            leases_granted=client.leases_granted,
            gpu_time_s=client.total_gpu_s,
            waiting_s=waiting_s,
            allocated_bytes=allocated,
        )

    def environment(self, reservation: Reservation) -> dict[str, str]:
        """What the process holding `reservation` must run with."""
        environment = {
            "GPULOOM_DISPATCHER_SOCKET": self.socket_path,
            ASSIGNMENT_TOKEN_VARIABLE: reservation.token,
            "GPULOOM_ASSIGNMENT_ID": reservation.assignment_id,
        }
        if self.grpc_address:
            environment["GPULOOM_DISPATCHER_ADDRESS"] = self.grpc_address
        # CUDA understands real GPU and MIG UUIDs; a simulated GPU has nothing to select.
        if self.gpu.gpu_uuid.startswith(("GPU-", "MIG-")):
            environment["CUDA_VISIBLE_DEVICES"] = self.gpu.gpu_uuid
        # With the daemon running, every process of this GPU is its client: the SM percent
        # and the memory cap become MPS limits. Without it, processes run as plain contexts.
        if self.mps is not None and self.mps.available()[0]:
            environment.update(
                self.mps.client_environment(
                    reservation.share.sm_percent, reservation.memory_cap_bytes
                )
            )
        return environment

    # ---- MIG ----

    async def set_mig_mode(self, enabled: bool) -> GpuInfo:
        """Turn MIG mode on or off (idempotent); the GPU as it is now."""
        if self._mig_running:
            raise FailedPrecondition("a MIG batch is running on this GPU")
        held = self.book.all()
        if enabled and held and not self.gpu.mig_enabled:
            raise FailedPrecondition(
                f"GPU {self.gpu.index} holds {len(held)} reservation(s); release them before "
                "turning MIG on"
            )
        await asyncio.to_thread(self.backend.set_mig_mode, self.gpu.index, enabled)
        if self.gpu.mig_enabled != enabled:
            self.gpu = replace(self.gpu, mig_enabled=enabled)
            log.info("MIG mode set", gpu=self.gpu.index, enabled=enabled)
            if self.on_gpu_changed is not None:
                self.on_gpu_changed()
        return self.gpu

    async def run_mig_batch(
        self,
        tasks: Sequence[MigBatchTask],
        policy: str,
        create_s: Mapping[int, float],
        destroy_s: Mapping[int, float],
        ends: AsyncIterator[TaskEnd],
    ) -> AsyncIterator[Plan | TaskStart | TaskRun | MigRunReport]:
        """Plan `tasks` and execute the plan on this GPU: yields the plan, each task as it is
        handed out (its instance: the caller starts it there) and as it ends, and the report.
        `ends` are the caller's reports of how its tasks ended; when they stop (or the caller
        goes away) no further task is handed out and the run winds down. The dispatcher starts
        no process of its own for any task."""
        model = find_model(self.gpu.model)
        if model is None or not model.mig_capable:
            raise FailedPrecondition(f"GPU {self.gpu.index} ({self.gpu.model}) is not MIG-capable")
        try:
            geometry = model.geometry().with_reconfig_times(create_s or None, destroy_s or None)
        except ValueError as error:
            raise InvalidArgument("create_seconds", str(error)) from None
        planned_tasks = validate_batch(tasks, geometry)
        try:
            planner = get_planner(policy or "far")
        except UnknownPolicyError as error:
            raise InvalidArgument("policy", str(error)) from None
        updates: asyncio.Queue[TaskStart | TaskRun] = asyncio.Queue()

        def announce(update: TaskStart | TaskRun) -> None:
            self._loop.call_soon_threadsafe(updates.put_nowait, update)

        handoff = TaskHandoff(announce)
        executor = MigExecutor(self.backend, self.gpu.index, geometry, handoff.run)
        if self._mig_running:
            raise FailedPrecondition("a MIG batch is already running on this GPU")
        self._mig_running = True
        try:
            await asyncio.to_thread(executor.check_ready)
            plan = await asyncio.to_thread(planner.plan, planned_tasks, geometry)
            yield plan
        except BaseException:
            self._mig_running = False
            raise
        # The GPU stays busy until the run's thread is done; the run stops handing out tasks
        # once the caller stops reporting (or hangs up), and then winds down.
        running = asyncio.ensure_future(
            asyncio.to_thread(executor.execute, plan, announce, handoff.stopped)
        )
        running.add_done_callback(lambda _: setattr(self, "_mig_running", False))
        reports = asyncio.ensure_future(_take_task_ends(ends, handoff))
        try:
            while not running.done() or not updates.empty():
                getter = asyncio.ensure_future(updates.get())
                waited = {getter, running} if reports.done() else {getter, running, reports}
                await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
                if reports.done() and not reports.cancelled() and reports.exception():
                    raise reports.exception()  # type: ignore[misc]
            yield running.result()
        finally:
            handoff.stop()
            reports.cancel()

    # ---- events ----

    def publish_from_channel(self, event: DispatcherEvent) -> None:
        """Called on the channel thread."""
        self._loop.call_soon_threadsafe(self.publish, event)

    def publish(self, event: DispatcherEvent) -> None:
        if self._profiler_link is not None:
            self._profiler_link.on_event(event)
        is_lease = event.kind in LEASE_EVENTS
        for subscriber in list(self._subscribers):
            if is_lease and not subscriber.include_leases:
                continue
            if subscriber.queue.qsize() >= MAX_PENDING_EVENTS:
                self._unsubscribe(subscriber)
                subscriber.queue.put_nowait(None)
                continue
            subscriber.queue.put_nowait(event)

    async def events(self, include_leases: bool) -> AsyncIterator[DispatcherEvent]:
        subscriber = _Subscriber(asyncio.Queue(), include_leases)
        self._subscribers.append(subscriber)
        self._update_lease_events()
        try:
            while True:
                event = await subscriber.queue.get()
                if event is None:
                    raise EventStreamOverflow(
                        f"event stream dropped: more than {MAX_PENDING_EVENTS} events unread"
                    )
                yield event
        finally:
            self._unsubscribe(subscriber)

    def _unsubscribe(self, subscriber: _Subscriber) -> None:
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)
            self._update_lease_events()

    def _update_lease_events(self) -> None:
        self.channel.lease_events_wanted = any(s.include_leases for s in self._subscribers)

    def _event(self, kind: EventKind, assignment_id: str, detail: str = "") -> DispatcherEvent:
        return DispatcherEvent(kind, time.time(), assignment_id, detail)

    async def _on_channel(self, function: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.channel.submit(function))


async def _take_task_ends(ends: AsyncIterator[TaskEnd], handoff: TaskHandoff) -> None:
    """Pass the caller's task ends to the run; when they stop, stop the run (what was started
    counts as ended, nothing more is handed out). A bad report (InvalidArgument) also stops it."""
    try:
        async for end in ends:
            handoff.end(end.task, end.exit_code)
    finally:
        handoff.stop()
