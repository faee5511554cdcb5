"""The kube-scheduler extender: kube-scheduler keeps everything that is not a gpuloom resource
(its own filters and scores: CPU, memory, affinity, taints, volumes, ...) and asks here, for the
Pods of gpuloom's scheduler profile, which of the nodes it found fit may take the Pod's GPU
share. Placement decides:

- **Filter**: the Pod's job is submitted to placement restricted to the candidate nodes that
  have a registered GPU (`JobSpec.nodes`), under `k8s-<Pod UID>-<attempt>`. Placed: only its
  node passes. Waiting: no node passes, each with placement's reason (and the Pod stays
  Pending, with that reason in its events). A job placed on a node kube-scheduler no longer
  finds fit, or waiting for another set of nodes, is cancelled and a new attempt submitted.
- **Prioritize**: the job's node scores 10, the others 0.
- **Bind**: the Pod is annotated with its job (`gpuloom.io/job`, read by the device plugin) and
  bound to the node (the Pod's binding subresource). A bind that fails cancels the job (its
  capacity goes back; the message says why) and kube-scheduler's next try submits a new one.

A MIG Pod's job (`gpuloom.io/mig`) is a MIG batch task: submitted without candidate nodes
(the batch planner chooses its GPU), followed by the k8s process (services/k8s/migtasks.py),
and let through to its node only once its batch has handed it its instance.

A replica of an auto-scaled function (`gpuloom.io/function`) adopts a placed replica job of
its function instead of submitting one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

import structlog

from gpuloom.domain.errors import AlreadyExists, DomainError, InvalidArgument
from gpuloom.domain.placement import JobState, JobView
from gpuloom.kube import extender as wire
from gpuloom.kube.asks import BOUND_AT, JOB, PodAsk, pod_ask
from gpuloom.services.k8s import metrics
from gpuloom.services.k8s.jobs import LIVE, PlacementJobs
from gpuloom.services.k8s.kubeapi import KubeApi, KubeApiError
from gpuloom.services.k8s.migtasks import MigFollowers, instance_of
from gpuloom.services.k8s.pods import PodJobs

log = structlog.get_logger("gpuloom.k8s")

MAX_ATTEMPTS = 64  # request ids tried past ones a restarted component cannot know are used
BIND_WAIT_S = 10.0  # a job still binding on its dispatcher when kube-scheduler binds the Pod


class GpuNodes:
    """The nodes that have a GPU registered with placement, read at most every `ttl_s`."""

    def __init__(self, jobs: PlacementJobs, ttl_s: float, clock: Callable[[], float]) -> None:
        self._jobs = jobs
        self._ttl_s = ttl_s
        self._clock = clock
        self._nodes: frozenset[str] = frozenset()
        self._read_at = -float("inf")

    async def get(self) -> frozenset[str]:
        if self._clock() - self._read_at >= self._ttl_s:
            self._nodes = frozenset(g.gpu.node for g in await self._jobs.gpus() if not g.lost)
            self._read_at = self._clock()
        return self._nodes


class Extender:
    def __init__(
        self,
        jobs: PlacementJobs,
        api: KubeApi,
        index: PodJobs,
        gpu_nodes: GpuNodes,
        policies: Collection[str],
        priority_classes: Mapping[str, int],
        followers: MigFollowers,
    ) -> None:
        self._jobs = jobs
        self._followers = followers
        self._api = api
        self._index = index
        self._gpu_nodes = gpu_nodes
        self._policies = policies
        self._priority_classes = priority_classes
        self._locks: dict[str, asyncio.Lock] = {}

    # ---- the verbs (JSON in, JSON out) ----

    async def filter(self, document: object) -> tuple[int, object]:
        try:
            args = wire.parse_args(document)
        except ValueError as error:
            return 400, {"Error": str(error)}
        started = time.perf_counter()
        try:
            ask = pod_ask(args.pod, self._policies, self._priority_classes)
            if not ask.uid:
                raise InvalidArgument("metadata.uid", "the Pod has no UID")
            async with self._lock(ask.uid):
                job, failed = await self._decide(args, ask)
        except (DomainError, KubeApiError) as error:
            metrics.EXTENDER_CALLS.labels("filter", "error").inc()
            return 200, wire.filter_result(args, (), {}, error=f"gpuloom: {error}")
        finally:
            metrics.EXTENDER_SECONDS.labels("filter").observe(time.perf_counter() - started)
        if job is None or job.assignment is None or not job.state.holds_capacity:
            metrics.EXTENDER_CALLS.labels("filter", "waiting").inc()
            return 200, wire.filter_result(args, (), failed)
        node = job.assignment.node
        reason = f"gpuloom placed the Pod's job {job.job_id} on node {node}"
        others = {**{n: reason for n in args.node_names if n != node}, **failed}
        metrics.EXTENDER_CALLS.labels("filter", "placed").inc()
        return 200, wire.filter_result(args, (node,), others)

    async def prioritize(self, document: object) -> tuple[int, object]:
        try:
            args = wire.parse_args(document)
        except ValueError as error:
            return 400, {"Error": str(error)}
        job = self._index.jobs.get(args.pod_uid)
        node = job.assignment.node if job and job.assignment else ""
        metrics.EXTENDER_CALLS.labels("prioritize", "ok").inc()
        return 200, wire.priorities(args, {node: wire.MAX_PRIORITY} if node else {})

    async def bind(self, document: object) -> tuple[int, object]:
        try:
            args = wire.parse_binding(document)
        except ValueError as error:
            return 400, {"Error": str(error)}
        async with self._lock(args.pod_uid):
            error = await self._bind(args)
        metrics.EXTENDER_CALLS.labels("bind", "error" if error else "bound").inc()
        return 200, wire.binding_result(error)

    # ---- inside ----

    def _lock(self, uid: str) -> asyncio.Lock:
        lock = self._locks.get(uid)
        if lock is None:
            if len(self._locks) > 10_000:  # drop the idle ones
                self._locks = {k: v for k, v in self._locks.items() if v.locked()}
            lock = self._locks[uid] = asyncio.Lock()
        return lock

    async def _decide(
        self, args: wire.ExtenderArgs, ask: PodAsk
    ) -> tuple[JobView | None, dict[str, str]]:
        """The Pod's job for these candidates, or None with why each candidate fails."""
        gpu_nodes = await self._gpu_nodes.get()
        candidates = tuple(sorted(n for n in set(args.node_names) if n in gpu_nodes))
        no_gpu = "no GPU of this node is registered with gpuloom placement"
        failed = {n: no_gpu for n in args.node_names if n not in gpu_nodes}
        if not candidates:
            return None, failed
        if ask.function:
            job, reason = await self._adopt(ask, candidates)
        else:
            job = await self._own_job(ask, candidates)
            reason = job.pending_reason or f"the Pod's job {job.job_id} is {job.state.value}"
            if ask.mig:
                self._followers.follow(job, ask.namespace, ask.name)
                if job.state.holds_capacity and not instance_of(job):
                    failed.update({n: _waiting_for_instance(job) for n in candidates})
                    return None, failed
        if job is None or not job.state.holds_capacity:
            failed.update({n: reason for n in candidates})
        return job, failed

    async def _own_job(self, ask: PodAsk, candidates: tuple[str, ...]) -> JobView:
        current = self._index.jobs.get(ask.uid)
        if current is not None:
            current = await self._jobs.get(current.job_id)
            if current.state.holds_capacity and current.assignment is not None:
                if current.assignment.node in candidates:
                    self._index.record(ask.uid, current)
                    return current
                await self._end(
                    current,
                    f"kube-scheduler no longer finds node {current.assignment.node} fit for "
                    f"Pod {ask.pod}; a new job follows",
                )
            elif current.state is JobState.PENDING:
                # A MIG task goes where the batch planner puts it (no candidate nodes).
                if ask.mig or set(current.spec.nodes) == set(candidates):
                    return current
                await self._end(current, f"Pod {ask.pod}'s candidate nodes changed")
        spec = ask.spec if ask.mig else replace(ask.spec, nodes=candidates)
        attempt = self._index.next_attempt(ask.uid)
        for _ in range(MAX_ATTEMPTS):
            request_id = wire.request_id(ask.uid, attempt)
            try:
                job = await self._jobs.submit(request_id, spec)
            except AlreadyExists:
                job = None  # this request id was used with other candidates before
            if job is not None and not job.state.finished:
                self._index.record(ask.uid, job)
                log.info(
                    "pod job submitted",
                    pod=ask.pod,
                    job=job.job_id,
                    state=job.state.value,
                    attempt=attempt,
                )
                return job
            self._index.attempts[ask.uid] = attempt
            attempt += 1
        raise DomainError(f"no fresh request id for Pod {ask.pod} after {MAX_ATTEMPTS} attempts")

    async def _adopt(self, ask: PodAsk, candidates: tuple[str, ...]) -> tuple[JobView | None, str]:
        """A placed replica of the Pod's function that no other Pod holds, on a candidate."""
        current = self._index.jobs.get(ask.uid)
        replicas = await self._jobs.jobs(LIVE, function=ask.function)
        if current is not None:
            for job in replicas:
                assignment = job.assignment
                if job.job_id == current.job_id and assignment and assignment.node in candidates:
                    self._index.record(ask.uid, job)
                    return job, ""
            self._index.forget(ask.uid)
        free = [
            j
            for j in sorted(replicas, key=lambda j: j.job_id)
            if j.state is JobState.ASSIGNED
            and j.assignment is not None
            and j.assignment.node in candidates
            and self._index.adopted.get(j.job_id) in (None, ask.uid)
        ]
        if not free:
            held = sum(1 for j in replicas if j.job_id in self._index.adopted)
            return None, (
                f"no placed replica of function {ask.function!r} without a Pod on these nodes "
                f"({len(replicas)} live, {held} with a Pod; `gpuloom scale` sets how many)"
            )
        self._index.record(ask.uid, free[0])
        return free[0], ""

    async def _bind(self, args: wire.BindingArgs) -> str:
        pod = f"{args.pod_namespace}/{args.pod_name}"
        job = self._index.jobs.get(args.pod_uid)
        if job is None:
            return f"gpuloom: Pod {pod} has no job (Filter first)"
        deadline = time.monotonic() + BIND_WAIT_S
        job = await self._jobs.get(job.job_id)
        while job.state is JobState.BINDING and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            job = await self._jobs.get(job.job_id)
        if job.state is not JobState.ASSIGNED or job.assignment is None:
            self._index.forget(args.pod_uid)
            return f"gpuloom: Pod {pod}'s job {job.job_id} is {job.state.value}, not assigned"
        if job.spec.is_mig_batch and not instance_of(job):
            return f"gpuloom: Pod {pod}'s MIG job {job.job_id} has no instance yet"
        if job.assignment.node != args.node:
            return (
                f"gpuloom: Pod {pod}'s job {job.job_id} is on node {job.assignment.node}, "
                f"not {args.node}"
            )
        try:
            await self._api.annotate_pod(
                args.pod_namespace,
                args.pod_name,
                {JOB: job.job_id, BOUND_AT: f"{time.time():.6f}"},
            )
            await self._bind_pod(args)
        except KubeApiError as error:
            if not job.function:
                await self._end(job, f"binding Pod {pod} to node {args.node} failed: {error}")
            self._index.forget(args.pod_uid)
            log.warning("pod bind failed", pod=pod, job=job.job_id, error=str(error))
            return f"gpuloom: binding Pod {pod} to node {args.node} failed: {error.message}"
        log.info("pod bound", pod=pod, job=job.job_id, node=args.node)
        return ""

    async def _bind_pod(self, args: wire.BindingArgs) -> None:
        """POST the binding; a Pod already bound to this very node (a retried Bind whose first
        try landed) counts as bound."""
        try:
            await self._api.bind_pod(args.pod_namespace, args.pod_name, args.pod_uid, args.node)
        except KubeApiError as error:
            if error.status != 409:
                raise
            pod = await self._api.get_pod(args.pod_namespace, args.pod_name)
            meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
            if meta.get("uid") != args.pod_uid or spec.get("nodeName") != args.node:
                raise

    async def _end(self, job: JobView, reason: str) -> None:
        """Cancel one of a Pod's own jobs (never a function's replica: auto-scaling owns it)."""
        if job.function or job.state.finished:
            return
        try:
            await self._jobs.cancel(job.job_id, reason)
        except DomainError as error:  # it ended meanwhile
            log.info("pod job not cancelled", job=job.job_id, reason=str(error))


def _waiting_for_instance(job: JobView) -> str:
    assert job.assignment is not None
    slot = job.assignment.mig
    planned = f" ({slot.size} slices from slice {slot.first_slice})" if slot else ""
    return (
        f"the Pod's MIG job {job.job_id} is in a batch on GPU {job.assignment.gpu_uuid} of node "
        f"{job.assignment.node}, waiting for its instance{planned}"
    )
