"""The placement scheduler: which job goes where, and which waits, as a pure state machine.

It holds the `Fleet` (every GPU's free space) and the jobs waiting for room, and answers events
with decisions, plain data in and out: no I/O, no clock (times come in with the jobs), no
asyncio. The placement service wraps it with persistence, binding on the dispatchers, watchers
and heartbeats; a test or a simulator drives it directly.

Events:

- `submit(ask)`: a new job; placed now (`Placed`, its capacity taken) or kept waiting
  (`Waiting`, with the reason);
- `restore(ask, reason)`: a job that was waiting before a restart, kept waiting unasked;
- `end(job_id)`: a job ended, or its decision was taken back: it stops waiting, or its capacity
  goes back;
- `bind_failed(ask, reason)`: a placed job could not be bound: its capacity goes back and it
  waits again (the caller stops the GPU from taking work);
- `take_back(job_id, ...)`: a decision the caller could not record is undone;
- `capacity_changed(gpu_id)`: a GPU came, came back, or changed what it holds outside jobs;
- `decide(skip)`: try the waiting jobs that may fit now, highest priority and oldest first;
  returns the placed ones and the fresher reasons of those still waiting.

**The pending index.** Waiting jobs are kept in buckets of identical requests: the same policy,
GPU model, quota x SM shape, memory, priority, task key, number of GPUs, node CPU and host
memory, and shared model (everything a policy looks at but the id). A release marks dirty only
the buckets whose request the freed GPU can now hold (its model, a free rectangle of the shape,
the memory it would be charged there; for a request of node resources or of several GPUs, what
the GPU's whole node has free); `decide` tries dirty buckets only, and a bucket whose head does
not fit stops there: its other jobs ask exactly the same and can fit no better, since within one
`decide` the fleet only fills. So a release costs a look at the buckets of the GPU's model, and
the jobs tried are those that can now be placed, plus at most one per dirty bucket.
This relies on each policy being deterministic in the request (never in the job id) and
complete for its shape: refusing only when no GPU it may use has the room, which holds for
every registered policy (gap-aware falls back to MRA).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from gpuloom.policies.placement.context import NO_PROFILES, PlacementContext
from gpuloom.policies.placement.fleet import Fleet, PlacementPolicy
from gpuloom.policies.placement.model import (
    JobRequest,
    Placement,
    Unplaceable,
    model_alternatives,
    quota_steps,
    replica_memory,
)

NO_GPU_YET = "no GPU is registered yet"


@dataclass(frozen=True, slots=True)
class Ask:
    """A job as the scheduler sees it: its request, the policy that places it ("" = the
    scheduler's default) and when it was submitted (the queue is by priority, then this)."""

    request: JobRequest
    policy: str = ""
    submitted_at: float = 0.0

    @property
    def job_id(self) -> str:
        return self.request.job_id

    @property
    def order(self) -> tuple[int, float, str]:
        return (self.request.priority, self.submitted_at, self.request.job_id)


@dataclass(frozen=True, slots=True)
class Placed:
    """The job has a place; its capacity is taken in the fleet."""

    ask: Ask
    placement: Placement


@dataclass(frozen=True, slots=True)
class Waiting:
    """The job waits for room; `reason` is for people."""

    ask: Ask
    reason: str


@dataclass(frozen=True, slots=True)
class Round:
    """What one `decide` did: the jobs it placed (in the order placed), the waiting jobs whose
    reason changed, and how many placements it tried (for tests and metrics)."""

    placed: tuple[Placed, ...] = ()
    reasons: tuple[Waiting, ...] = ()
    tried: int = 0


# Everything a policy looks at in a request but its id: jobs with the same key get the same
# answer from the same fleet. (policy, gpu model, quota steps, SM %, memory, priority, task key,
# GPUs, node CPU milli, node host memory, shared model, nodes)
BucketKey = tuple[str, str, int, int, int, int, str, int, int, int, str, frozenset[str]]


@dataclass(slots=True, eq=False)
class _Bucket:
    key: BucketKey
    queue: list[tuple[tuple[int, float, str], Ask]] = field(default_factory=list)  # by order
    reason: str = ""

    @property
    def models(self) -> tuple[str, ...]:
        """The GPU models whose releases may let it fit ("" = any model)."""
        return model_alternatives(self.key[1]) or ("",)


class Scheduler:
    """Placement's decisions on one fleet. Not thread-safe: the caller serialises events."""

    def __init__(
        self,
        policies: Mapping[str, PlacementPolicy],
        default_policy: str,
        fleet: Fleet | None = None,
        context: PlacementContext = NO_PROFILES,
    ) -> None:
        if default_policy not in policies:
            raise ValueError(f"default policy {default_policy!r} is not among {sorted(policies)}")
        self.fleet = Fleet() if fleet is None else fleet
        self.context = context
        self._policies = dict(policies)
        self._default = default_policy
        self._waiting: dict[str, tuple[Ask, BucketKey]] = {}
        self._buckets: dict[BucketKey, _Bucket] = {}
        self._by_model: dict[str, set[BucketKey]] = {}  # gpu model ("" = any) -> bucket keys
        self._dirty: set[BucketKey] = set()

    # ---- reading ----

    def __contains__(self, job_id: object) -> bool:
        """Whether the job is waiting."""
        return job_id in self._waiting

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def buckets(self) -> int:
        return len(self._buckets)

    @property
    def wants_decide(self) -> bool:
        """Whether some waiting jobs may fit now (`decide` would try them)."""
        return bool(self._dirty)

    def reason(self, job_id: str) -> str | None:
        """Why a waiting job waits: the reason last given for its request (every job of one
        bucket shares it; a job enqueued with its own reason, as by `bind_failed`, sets it until
        the bucket is tried, and a try that changes it lists every job of the bucket in the
        `Round`). None if the job is not waiting."""
        entry = self._waiting.get(job_id)
        return None if entry is None else self._buckets[entry[1]].reason

    def policy_name(self, ask: Ask) -> str:
        return ask.policy or self._default

    # ---- events ----

    def submit(self, ask: Ask) -> Placed | Waiting:
        """A new job: placed now, or waiting with the reason."""
        job_id = ask.job_id
        if job_id in self._waiting or self.fleet.gpu_of(job_id) is not None:
            raise ValueError(f"job {job_id} is already known to the scheduler")
        key = self._key(ask)  # checks the policy before anything changes
        decision = self._try(ask)
        if isinstance(decision, Placed):
            return decision
        self._enqueue(ask, key, decision.reason)
        return decision

    def restore(self, ask: Ask, reason: str) -> None:
        """A job that waited before a restart waits again (tried at the next `decide`)."""
        if ask.job_id in self._waiting:
            raise ValueError(f"job {ask.job_id} is already waiting")
        key = self._key(ask)
        self._enqueue(ask, key, reason)
        self._dirty.add(key)

    def end(self, job_id: str) -> bool:
        """The job is gone (ended, or its decision taken back): it stops waiting, or its
        capacity goes back. Returns whether capacity went back; an unknown id is harmless."""
        if job_id in self._waiting:
            self._dequeue(job_id)
            return False
        return self._release(job_id)

    def bind_failed(self, ask: Ask, reason: str) -> None:
        """A placed job could not be bound: its capacity goes back and it waits again, to be
        tried at the next `decide` (the caller keeps its GPU from taking work meanwhile)."""
        self._release(ask.job_id)
        key = self._key(ask)
        self._enqueue(ask, key, reason)
        self._dirty.add(key)

    def take_back(self, job_id: str, ask: Ask | None = None, reason: str = "") -> None:
        """Undo a decision the caller could not record: the job's capacity goes back (or it
        stops waiting), and nothing is marked to be tried again for it (a caller whose records
        fail must not spin on retries); with `ask`, the job waits again with `reason` (it
        waited before the decision). It is tried at the next change of capacity."""
        if job_id in self._waiting:
            self._dequeue(job_id)
        else:
            self.fleet.release(job_id)
        if ask is not None:
            self._enqueue(ask, self._key(ask), reason)

    def capacity_changed(self, gpu_id: str | None = None) -> None:
        """A GPU came, came back or changed (None: any, or several): the waiting jobs it may now
        hold are tried at the next `decide`."""
        if gpu_id is None or gpu_id not in self.fleet:
            self._dirty.update(self._buckets)
        else:
            self._freed(gpu_id)

    def decide(self, skip: Collection[str] = ()) -> Round:
        """Try the waiting jobs that may fit now (not those in `skip`), highest priority and
        oldest first; the placed ones stop waiting and hold their capacity."""
        heap: list[tuple[tuple[int, float, str], int, BucketKey]] = []
        untried: set[BucketKey] = set()  # every job in them skipped: tried once not skipped
        for key in self._dirty:
            position = self._next(self._buckets[key], 0, skip)
            if position is None:
                untried.add(key)
            else:
                heap.append((*position, key))
        self._dirty = untried
        heapq.heapify(heap)
        placed: list[Placed] = []
        reasons: list[Waiting] = []
        tried = 0
        while heap:
            _, at, key = heapq.heappop(heap)
            bucket = self._buckets[key]
            ask = bucket.queue[at][1]
            tried += 1
            decision = self._try(ask)
            if isinstance(decision, Waiting):  # the rest of the bucket asks the same
                if decision.reason != bucket.reason:
                    bucket.reason = decision.reason
                    reasons.extend(Waiting(a, decision.reason) for _, a in bucket.queue)
                continue
            placed.append(decision)
            del bucket.queue[at]
            del self._waiting[ask.job_id]
            if not bucket.queue:
                self._drop(bucket)
                continue
            position = self._next(bucket, at, skip)
            if position is None:
                untried.add(key)  # only skipped jobs are left, and they may fit
            else:
                heapq.heappush(heap, (*position, key))
        return Round(tuple(placed), tuple(reasons), tried)

    # ---- inside ----

    def _key(self, ask: Ask) -> BucketKey:
        name = self.policy_name(ask)
        if name not in self._policies:
            raise ValueError(
                f"unknown policy {name!r} (known: {', '.join(sorted(self._policies))})"
            )
        r = ask.request
        return (
            name,
            r.gpu_model,
            quota_steps(r.quota_request_percent),
            r.sm_percent,
            r.memory_bytes,
            r.priority,
            r.task_key,
            r.gpus,
            r.cpu_milli,
            r.host_memory_bytes,
            r.shared_model,
            r.nodes,
        )

    def _try(self, ask: Ask) -> Placed | Waiting:
        if not len(self.fleet):
            return Waiting(ask, NO_GPU_YET)
        policy = self._policies[self.policy_name(ask)]
        decision = self.fleet.place(ask.request, policy, self.context)
        if isinstance(decision, Unplaceable):
            return Waiting(ask, decision.reason)
        return Placed(ask, decision)

    def _enqueue(self, ask: Ask, key: BucketKey, reason: str) -> None:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(key, reason=reason)
            for model in bucket.models:
                self._by_model.setdefault(model, set()).add(key)
        bucket.reason = reason
        insort(bucket.queue, (ask.order, ask), key=lambda entry: entry[0])
        self._waiting[ask.job_id] = (ask, key)

    def _dequeue(self, job_id: str) -> None:
        ask, key = self._waiting.pop(job_id)
        bucket = self._buckets[key]
        del bucket.queue[bisect_left(bucket.queue, ask.order, key=lambda entry: entry[0])]
        if not bucket.queue:
            self._drop(bucket)

    def _drop(self, bucket: _Bucket) -> None:
        del self._buckets[bucket.key]
        for model in bucket.models:
            keys = self._by_model[model]
            keys.discard(bucket.key)
            if not keys:
                del self._by_model[model]
        self._dirty.discard(bucket.key)

    def _release(self, job_id: str) -> bool:
        gpu_ids = self.fleet.gpus_of(job_id)
        if not gpu_ids:
            return False
        self.fleet.release(job_id)
        for gpu_id in gpu_ids:
            self._freed(gpu_id)
        return True

    def _freed(self, gpu_id: str) -> None:
        """Mark dirty the buckets whose request the GPU can hold now."""
        if not self._buckets:
            return
        slot = self.fleet.slot(gpu_id)
        node = self.fleet.node(slot.node)
        # A GPU that takes no work (its binding failed) gives back its node's CPU and host
        # memory all the same: a request of them may fit another GPU of the node now.
        here = slot.schedulable
        if not here and not any(self.fleet.slot(g).schedulable for g in node.gpu_ids):
            return
        boxes = [(b[2] - b[0], b[3] - b[1]) for b in slot.free.boxes()]
        whole: int | None = None  # the node's GPUs with nothing on them, counted once
        # CPU and host memory freed here may let a job onto another GPU of the node, of
        # another model: requests of node resources or whole GPUs look at every model there.
        models = {slot.model} | {self.fleet.slot(g).model for g in node.gpu_ids}
        for model in ("", *sorted(models)):
            for key in self._by_model.get(model, ()):
                if key in self._dirty:
                    continue
                gpus, cpu, host_memory, shared, nodes = key[7], key[8], key[9], key[10], key[11]
                if nodes and node.name not in nodes:
                    continue
                if model and model != slot.model and gpus == 1 and not (cpu or host_memory):
                    continue
                if cpu > node.cpu_free or host_memory > node.memory_free:
                    continue
                if gpus > 1:
                    if whole is None:
                        whole = sum(
                            1
                            for g in node.gpu_ids
                            if self.fleet.slot(g).schedulable and not self.fleet.slot(g).allocations
                        )
                    if whole >= gpus:
                        self._dirty.add(key)
                    continue
                if cpu or host_memory:  # CPU freed here may let it onto another GPU of the node
                    self._dirty.add(key)
                    continue
                if not here:
                    continue  # only the node's resources came back, and it asks for none
                # A replica is charged less where its model is resident.
                need = replica_memory(key[4], slot.models.get(shared, 0)) if shared else key[4]
                if need > slot.memory_free:
                    continue
                w, h = key[2], key[3]
                if any(bw >= w and bh >= h for bw, bh in boxes):
                    self._dirty.add(key)

    def _next(
        self, bucket: _Bucket, start: int, skip: Collection[str]
    ) -> tuple[tuple[int, float, str], int] | None:
        """The bucket's first job at or after `start` that is not skipped: (order, position)."""
        queue = bucket.queue
        for at in range(start, len(queue)):
            if not skip or queue[at][1].job_id not in skip:
                return queue[at][0], at
        return None
