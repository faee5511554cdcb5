"""The controller's rules that the end-to-end tests do not reach, on fakes of placement and the
API server that keep what they are told: a migration placement asks of a Pod's training job
is answered failed at once (the job stays), and of two live attempts for one Pod the older is
cancelled."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gpuloom.domain.placement import Assignment, JobKind, JobSpec, JobState, JobView
from gpuloom.domain.shares import share_of
from gpuloom.domain.training import MigrationRequest, TrainingPhase, TrainingState
from gpuloom.kube.extender import request_id
from gpuloom.services.k8s.controller import NOT_MIGRATED, PodController
from gpuloom.services.k8s.migtasks import MigFollowers
from gpuloom.services.k8s.pods import PodJobs


@dataclass
class FakePlacement:
    live: list[JobView]
    cancelled: list[tuple[str, str]] = field(default_factory=list)
    checkpoints: list[tuple[str, str, bool, str]] = field(default_factory=list)

    async def jobs(self, states: object = None, function: str = "") -> list[JobView]:
        return list(self.live)

    async def cancel(self, job_id: str, reason: str) -> JobView:
        self.cancelled.append((job_id, reason))
        (job,) = [j for j in self.live if j.job_id == job_id]
        return replace(job, state=JobState.CANCELLED)

    async def report_checkpoint(
        self, job_id: str, migration_id: str, succeeded: bool, message: str
    ) -> JobView:
        self.checkpoints.append((job_id, migration_id, succeeded, message))
        return self.live[0]


@dataclass
class FakeApi:
    pods: list[dict]

    async def list_pods(self, field_selector: str = "", label_selector: str = "") -> list[dict]:
        assert field_selector == "spec.schedulerName=gpuloom"
        return self.pods

    async def list_deployments(self, label_selector: str) -> list[dict]:
        return []


def job(job_id: str, uid: str, attempt: int, training: TrainingState | None = None) -> JobView:
    spec = JobSpec(name="ns/p", kind=JobKind.TRAINING, share=share_of(), whole_gpus=1)
    assignment = Assignment("GPU-0", "node-a", "10.0.0.1:50060", job_id, 0)
    return JobView(
        job_id, request_id(uid, attempt), spec, JobState.ASSIGNED, 0.0, 0.0, 1,
        assignment=assignment, training=training,
    )  # fmt: skip


def pod(uid: str) -> dict:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": uid},
        "spec": {"nodeName": "node-a", "schedulerName": "gpuloom"},
        "status": {"phase": "Running"},
    }


async def test_a_migration_of_a_pods_job_is_answered_failed_and_an_older_attempt_cancelled() -> (
    None
):
    migration = MigrationRequest("m-1", "GPU-1", "node-b", "spread", 0.0, 60.0)
    training = TrainingState(phase=TrainingPhase.MIGRATING, migration=migration)
    older, newer = job("j-old", "u1", 1), job("j-new", "u1", 2, training)
    placement = FakePlacement([newer, older])
    index = PodJobs()
    api = FakeApi([pod("u1")])
    followers = MigFollowers(placement, api)  # type: ignore[arg-type]
    controller = PodController(placement, api, index, "gpuloom", 60, followers)  # type: ignore[arg-type]
    await controller.reconcile()
    assert placement.cancelled == [("j-old", "a newer attempt for its Pod was submitted")]
    assert placement.checkpoints == [("j-new", "m-1", False, NOT_MIGRATED)]
    assert index.jobs["u1"].job_id == "j-new" and index.attempts["u1"] == 2
    assert controller.healthy and controller.rounds == 1
