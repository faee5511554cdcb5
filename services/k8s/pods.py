"""Which placement job is each gpuloom Pod's: the extender's memory of it, rebuilt from
placement and the API server by every reconcile (services/k8s/controller.py), so a restarted
k8s component finds what it did before.

A Pod's own jobs are submitted under `k8s-<Pod UID>-<attempt>` (gpuloom/kube/extender.py): a
new attempt when kube-scheduler's candidate nodes no longer hold the last one's place, or its
bind failed. A replica of an auto-scaled function instead adopts a replica job placement made
(`gpuloom scale`); the adoption is written on the Pod (`gpuloom.io/job`) at Bind."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuloom.domain.placement import JobView
from gpuloom.kube.extender import parse_request_id


@dataclass(slots=True)
class PodJobs:
    # Pod UID -> its live job (its own, or the replica it adopted).
    jobs: dict[str, JobView] = field(default_factory=dict)
    # Pod UID -> the highest attempt of its own jobs seen.
    attempts: dict[str, int] = field(default_factory=dict)
    # Replica job id -> the UID of the Pod that adopted it.
    adopted: dict[str, str] = field(default_factory=dict)

    def record(self, uid: str, job: JobView) -> None:
        self.jobs[uid] = job
        parsed = parse_request_id(job.request_id)
        if parsed is not None and parsed[0] == uid:
            self.attempts[uid] = max(self.attempts.get(uid, 0), parsed[1])
        if job.function:
            self.adopted[job.job_id] = uid

    def forget(self, uid: str) -> None:
        job = self.jobs.pop(uid, None)
        if job is not None and self.adopted.get(job.job_id) == uid:
            del self.adopted[job.job_id]

    def next_attempt(self, uid: str) -> int:
        return self.attempts.get(uid, 0) + 1
