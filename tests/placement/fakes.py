"""In-memory stand-ins for what placement talks to: the dispatchers it binds on (the
`Dispatchers` protocol: each GPU's reservations, told to refuse, checking that nothing is
reserved twice under different tokens), dispatchers running MIG batches (`MigRunner`), and a
profile store with MIG profiles (`ProfileSource`)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator

from gpuloom.domain.errors import AlreadyExists, FailedPrecondition, Unavailable
from gpuloom.domain.mig_runs import TaskEnd, TaskRun, TaskStart
from gpuloom.services.placement.dispatchers import (
    BindRequest,
    MigRunRequest,
    MigRunStarted,
)


class FakeDispatchers:
    def __init__(self) -> None:
        self.held: dict[str, dict[str, BindRequest]] = defaultdict(dict)  # address -> id -> req
        self.down: set[str] = set()
        self.reserve_calls = 0

    async def reserve(self, address: str, request: BindRequest) -> dict[str, str]:
        self.reserve_calls += 1
        if address in self.down:
            raise Unavailable(f"dispatcher {address} unreachable")
        held = self.held[address]
        prior = held.get(request.assignment_id)
        if prior is not None and prior != request:
            raise AlreadyExists(f"assignment {request.assignment_id} exists with another request")
        held[request.assignment_id] = request
        return {"GPULOOM_ASSIGNMENT_ID": request.assignment_id, "GPULOOM_DISPATCHER": address}

    async def release(self, address: str, assignment_id: str) -> None:
        if address in self.down:
            raise Unavailable(f"dispatcher {address} unreachable")
        self.held[address].pop(assignment_id, None)

    def all_held(self) -> dict[str, str]:
        """assignment id -> dispatcher address, over every dispatcher."""
        return {aid: address for address, held in self.held.items() for aid in held}


class FakeProfiles:
    """A profile store with MIG profiles only: (task key, model) -> size -> seconds."""

    def __init__(self) -> None:
        self.mig: dict[tuple[str, str], dict[int, float]] = {}
        self.mig_lookups = 0

    async def kernel_times(self, task_key: str, gpu_model: str) -> None:
        return None

    async def throughput(self, function: str, gpu_model: str) -> None:
        return None

    async def mig_times(self, task_key: str, gpu_model: str) -> dict[int, float] | None:
        self.mig_lookups += 1
        if gpu_model:
            return self.mig.get((task_key, gpu_model))
        return next((t for (key, _), t in self.mig.items() if key == task_key), None)

    async def close(self) -> None:
        pass


class FakeMigRunner:
    """Dispatchers running MIG batches (the `MigRunner` protocol), as RunMigBatch does: one
    batch at a time per dispatcher (a second one is refused); each task, in the batch's order,
    is handed out on its smallest timed size and ends with the exit code its runner reports.
    Runs hand out their tasks only once `go` is set; `refuse` makes a dispatcher refuse,
    `break_after_start` makes its stream fail once the batch started."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, MigRunRequest]] = []
        self.refuse: set[str] = set()
        self.break_after_start: set[str] = set()
        self.go = asyncio.Event()
        self.go.set()
        self.running: set[str] = set()
        self.overlaps = 0  # batches refused because one was running on the same dispatcher
        self.ends: list[TaskEnd] = []  # every end its runner reported, in order

    async def run_mig_batch(
        self, address: str, request: MigRunRequest, ends: AsyncIterator[TaskEnd]
    ) -> AsyncIterator[MigRunStarted | TaskStart | TaskRun]:
        if address in self.refuse:
            raise Unavailable(f"dispatcher {address} unreachable")
        if address in self.running:
            self.overlaps += 1
            raise FailedPrecondition("a MIG batch is already running on this GPU")
        self.requests.append((address, request))
        self.running.add(address)
        reported = aiter(ends)
        try:
            yield MigRunStarted(planned_makespan_s=1.0)
            if address in self.break_after_start:
                raise Unavailable(f"dispatcher {address}: stream reset")
            await self.go.wait()
            for offset, task in enumerate(request.tasks):
                size = min(task.seconds_by_size)
                seconds = task.seconds_by_size[size]
                instance = f"MIG-{address}-{size}g"
                yield TaskStart(
                    task.name, size, 0, instance, float(offset), offset + seconds, offset + 0.01
                )
                end = await anext(reported, None)
                if end is None:
                    return  # its runner stopped: nothing more is handed out
                assert end.task == task.name
                self.ends.append(end)
                yield TaskRun(
                    task=task.name,
                    size=size,
                    first_slice=0,
                    instance_uuid=instance,
                    planned_start_s=float(offset),
                    planned_end_s=offset + seconds,
                    start_s=offset + 0.01,
                    end_s=offset + seconds + 0.02,
                    exit_code=end.exit_code,
                )
        finally:
            self.running.discard(address)
