"""A MIG Pod's job is a MIG batch task (docs/placement.md, "MIG batches"): placement puts it in
a batch on a MIG GPU, and the GPU's dispatcher hands it its instance when its turn comes, but
only while someone follows the job (WatchJob); a task nobody follows then fails ("no runner
was following the job"). For a Pod that follower is the k8s process: it follows the job from
its submission (the extender's Filter) to its end, and again from the first reconcile after a
restart (the controller). When the instance is handed, the Pod is annotated
(`gpuloom.io/placed`) so that kube-scheduler tries it again at once: the extender's Filter
lets it through to the instance's node only from then on, and the device plugin gives the
container that instance."""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from gpuloom.domain.errors import DomainError, NotFound
from gpuloom.domain.placement import JobView
from gpuloom.kube.asks import PLACED
from gpuloom.services.k8s.jobs import PlacementJobs
from gpuloom.services.k8s.kubeapi import KubeApi, KubeApiError
from gpuloom.tasks import cancel_and_wait

log = structlog.get_logger("gpuloom.k8s")

RETRY_S = 1.0  # after a broken stream, before following again


def instance_of(job: JobView) -> str:
    """The MIG instance the job was handed ("" until its batch hands it one)."""
    slot = job.assignment.mig if job.assignment is not None else None
    return slot.instance_uuid if slot is not None else ""


class MigFollowers:
    """One WatchJob stream per live MIG job of a Pod, held until the job ends."""

    def __init__(self, jobs: PlacementJobs, api: KubeApi, retry_s: float = RETRY_S) -> None:
        self._jobs = jobs
        self._api = api
        self._retry_s = retry_s
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def followed(self) -> frozenset[str]:
        return frozenset(self._tasks)

    def follow(self, job: JobView, namespace: str, name: str) -> None:
        """Follow the Pod `namespace/name`'s MIG job (nothing if it is followed or ended)."""
        if not job.spec.is_mig_batch or job.state.finished or job.job_id in self._tasks:
            return
        self._tasks[job.job_id] = asyncio.create_task(
            self._follow(job.job_id, namespace, name), name=f"k8s-follow-{job.job_id}"
        )

    async def stop(self) -> None:
        for task in list(self._tasks.values()):
            await cancel_and_wait(task)
        self._tasks.clear()

    async def _follow(self, job_id: str, namespace: str, name: str) -> None:
        nudged = False
        try:
            while True:
                try:
                    async for job in self._jobs.watch(job_id):
                        if job.state.finished:
                            return
                        if instance_of(job) and not nudged:
                            nudged = await self._nudge(job, namespace, name)
                except NotFound:
                    return
                except DomainError as error:
                    log.info("following a MIG job again", job=job_id, error=str(error))
                await asyncio.sleep(self._retry_s)
        finally:
            self._tasks.pop(job_id, None)

    async def _nudge(self, job: JobView, namespace: str, name: str) -> bool:
        """The instance is there: have kube-scheduler try the Pod again now."""
        log.info(
            "MIG instance handed to a Pod's job",
            pod=f"{namespace}/{name}",
            job=job.job_id,
            instance=instance_of(job),
        )
        with contextlib.suppress(KubeApiError):
            await self._api.annotate_pod(namespace, name, {PLACED: job.job_id})
            return True
        return False
