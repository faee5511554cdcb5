"""The job's life follows the Pod's, and auto-scaled replicas become Pods: one reconcile, run
every `resync_s`, level-triggered (it compares what placement holds with what the API server
holds and mends the difference, so a missed event or a restart loses nothing):

- a Pod's own job (`k8s-<UID>-<n>`) whose Pod is gone: cancelled ("Pod ns/name was deleted");
  whose Pod Succeeded or Failed: reported done with the container's exit code (a job still
  waiting is cancelled); an older live attempt beside a newer one: cancelled;
- a MIG Pod's live job: followed (services/k8s/migtasks.py), so a restarted k8s process
  follows it again;
- a Pod not yet bound whose waiting job placement has placed since: annotated
  (`gpuloom.io/placed`), which makes kube-scheduler try it again now rather than after its
  back-off;
- a migration placement asks of a Pod's training job: answered failed at once (a Pod is not
  moved; docs/deploy.md), so the job stays where it runs;
- a Deployment labelled `gpuloom.io/function=F`: scaled (its scale subresource) to the number
  of F's live replicas (FaST-GShare's auto-scaling, `gpuloom scale`); a Pod holding a replica
  auto-scaling removed is deleted (with the lowest pod-deletion-cost first, so that a
  scale-down takes it rather than a serving one).

Jobs are listed before Pods, so a job submitted for a Pod that exists is never taken for an
orphan."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Mapping
from typing import Any

import structlog

from gpuloom.domain.errors import DomainError
from gpuloom.domain.placement import JobState, JobView
from gpuloom.kube.asks import FUNCTION, JOB, PLACED
from gpuloom.kube.extender import parse_request_id
from gpuloom.services.k8s import metrics
from gpuloom.services.k8s.jobs import LIVE, PlacementJobs
from gpuloom.services.k8s.kubeapi import KubeApi, KubeApiError
from gpuloom.services.k8s.migtasks import MigFollowers, instance_of
from gpuloom.services.k8s.pods import PodJobs
from gpuloom.tasks import cancel_and_wait

log = structlog.get_logger("gpuloom.k8s")

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
FUNCTION_LABEL = "gpuloom.io/function"
NOT_MIGRATED = (
    "a Pod is not migrated: its process cannot move to another node (docs/deploy.md); "
    "it keeps running where it is"
)


class PodController:
    def __init__(
        self,
        jobs: PlacementJobs,
        api: KubeApi,
        index: PodJobs,
        scheduler_name: str,
        resync_s: float,
        followers: MigFollowers,
    ) -> None:
        self._jobs = jobs
        self._followers = followers
        self._api = api
        self._index = index
        self._scheduler_name = scheduler_name
        self._resync_s = resync_s
        self._task: asyncio.Task[None] | None = None
        self._nudged: set[str] = set()
        self.rounds = 0  # reconciles completed
        self.healthy = False  # whether the last reconcile completed

    async def start(self) -> None:
        """One reconcile first (the extender needs its memory), then one every resync_s."""
        await self.reconcile()
        await self.start_loop()

    async def start_loop(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="k8s-reconcile")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._resync_s)
            with contextlib.suppress(Exception):
                await self.reconcile()

    async def reconcile(self) -> None:
        try:
            await self._reconcile()
        except (DomainError, KubeApiError) as error:
            self.healthy = False
            log.warning("reconcile failed; trying again", error=str(error))
            raise
        except Exception:
            self.healthy = False
            log.exception("reconcile failed; trying again")
            raise
        self.healthy = True
        self.rounds += 1

    async def _reconcile(self) -> None:
        live = await self._jobs.jobs(LIVE)  # before the Pods: see the module's docstring
        pods = await self._api.list_pods(
            field_selector=f"spec.schedulerName={self._scheduler_name}"
        )
        by_uid = {_meta(p).get("uid", ""): p for p in pods}
        own: dict[str, list[JobView]] = {}
        for job in live:
            parsed = parse_request_id(job.request_id)
            if parsed is not None:
                own.setdefault(parsed[0], []).append(job)
        for uid, jobs in own.items():
            await self._follow_own(uid, sorted(jobs, key=_attempt), by_uid.get(uid))
        for uid in [u for u in self._index.jobs if u not in by_uid]:
            self._index.forget(uid)
        await self._follow_replicas(live, pods)
        await self._scale_functions(live)

    async def _follow_own(
        self, uid: str, jobs: list[JobView], pod: Mapping[str, Any] | None
    ) -> None:
        *older, job = jobs
        for stale in older:
            await self._cancel(stale, "a newer attempt for its Pod was submitted", None)
        if pod is None:
            self._index.forget(uid)
            await self._cancel(job, f"its Pod (UID {uid}) was deleted", "pod_gone")
            return
        name = _name(pod)
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            self._index.forget(uid)
            if job.state is not JobState.ASSIGNED or (
                job.spec.is_mig_batch and not instance_of(job)
            ):
                await self._cancel(
                    job, f"Pod {name} {phase.lower()} before its job was placed", None
                )
                return
            code, detail = _exit_of(pod)
            succeeded = phase == "Succeeded"
            with contextlib.suppress(DomainError):
                await self._jobs.report_done(
                    job.job_id, succeeded, code, f"Pod {name} {phase.lower()}{detail}"
                )
                metrics.POD_JOB_ENDS.labels("pod_succeeded" if succeeded else "pod_failed").inc()
                log.info("pod job done", pod=name, job=job.job_id, phase=phase, exit_code=code)
            return
        self._index.record(uid, job)
        unbound = not (pod.get("spec") or {}).get("nodeName")
        ns, pod_name = _meta(pod).get("namespace", ""), _meta(pod).get("name", "")
        if job.spec.is_mig_batch:
            # Its follower nudges the Pod when the instance is handed.
            self._followers.follow(job, ns, pod_name)
        elif job.state is JobState.ASSIGNED and unbound and job.job_id not in self._nudged:
            with contextlib.suppress(KubeApiError):
                await self._api.annotate_pod(ns, pod_name, {PLACED: job.job_id})
                self._nudged.add(job.job_id)
        migration = job.training.migration if job.training else None
        if migration is not None:
            with contextlib.suppress(DomainError):
                await self._jobs.report_checkpoint(
                    job.job_id, migration.migration_id, False, NOT_MIGRATED
                )

    async def _follow_replicas(self, live: list[JobView], pods: list[dict]) -> None:
        replicas = {j.job_id: j for j in live if j.function}
        for pod in pods:
            annotations = _meta(pod).get("annotations") or {}
            job_id, uid = annotations.get(JOB, ""), _meta(pod).get("uid", "")
            if not annotations.get(FUNCTION) or not job_id:
                continue
            phase = (pod.get("status") or {}).get("phase")
            job = replicas.get(job_id)
            if job is not None and phase not in ("Succeeded", "Failed"):
                self._index.record(uid, job)
                continue
            self._index.forget(uid)
            if job is None and not _meta(pod).get("deletionTimestamp"):
                # Auto-scaling removed its replica: the Pod goes, first of its Deployment.
                ns, name = _meta(pod).get("namespace", ""), _meta(pod).get("name", "")
                with contextlib.suppress(KubeApiError):
                    await self._api.annotate_pod(ns, name, {DELETION_COST: "-1000000"})
                    await self._api.delete_pod(ns, name, uid)
                    log.info("replica pod deleted", pod=f"{ns}/{name}", job=job_id)

    async def _scale_functions(self, live: list[JobView]) -> None:
        wanted = Counter(j.function for j in live if j.function)
        try:
            deployments = await self._api.list_deployments(FUNCTION_LABEL)
        except KubeApiError as error:
            log.warning("cannot list function deployments", error=str(error))
            return
        for deployment in deployments:
            meta = _meta(deployment)
            function = (meta.get("labels") or {}).get(FUNCTION_LABEL, "")
            replicas = (deployment.get("spec") or {}).get("replicas")
            if not function or replicas == wanted[function]:
                continue
            await self._api.set_scale(
                meta.get("namespace", ""), meta.get("name", ""), wanted[function]
            )
            metrics.FUNCTION_SCALES.inc()
            log.info(
                "function scaled",
                function=function,
                deployment=f"{meta.get('namespace')}/{meta.get('name')}",
                replicas=wanted[function],
            )

    async def _cancel(self, job: JobView, reason: str, why: str | None) -> None:
        try:
            await self._jobs.cancel(job.job_id, reason)
        except DomainError as error:
            log.info("pod job not cancelled", job=job.job_id, error=str(error))
            return
        if why:
            metrics.POD_JOB_ENDS.labels(why).inc()
        log.info("pod job cancelled", job=job.job_id, reason=reason)


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _name(pod: Mapping[str, Any]) -> str:
    return f"{_meta(pod).get('namespace', '')}/{_meta(pod).get('name', '')}"


def _attempt(job: JobView) -> int:
    parsed = parse_request_id(job.request_id)
    return parsed[1] if parsed else 0


def _exit_of(pod: Mapping[str, Any]) -> tuple[int, str]:
    """The exit code of the Pod's gpuloom container (the first that terminated with one) and a
    few words on it."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for status in statuses:
        terminated = (status.get("state") or {}).get("terminated")
        if terminated is not None:
            code = int(terminated.get("exitCode", 0))
            reason = terminated.get("reason") or ""
            detail = f" ({reason})" if reason else ""
            return code, f": container {status.get('name')} exited with code {code}{detail}"
    return 0, ""
