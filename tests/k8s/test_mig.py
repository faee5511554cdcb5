"""A MIG Pod's whole path, through the stand-ins and real gpuloom services, on a simulated A100
in MIG mode (node-b's, turned on through its dispatcher): created through the admission
webhook, its job a MIG batch task that waits for its batch while kube-scheduler's Filter finds
no node, followed by the k8s process so that its batch hands it an instance, let through to
that instance's node and bound, its container given the instance by the device plugin's
Allocate, and its end ending the task (the instance destroyed). A restarted k8s process
following a waiting MIG job again; a deleted MIG Pod's task cancelled. Refusals of MIG asks at
admission, naming the field."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import prometheus_client
import pytest

from gpuloom.domain.placement import JobState
from gpuloom.domain.profiles import MigProfile, MigTime
from gpuloom.kube.asks import PLACED
from tests.k8s.conftest import Cluster, until
from tests.k8s.standins import Refused, pod_model, schedule

MIG = {"gpuloom.io/mig": "1"}
TASK = {"gpuloom.io/task-key": "resize"}
COMMAND = [sys.executable, "-S", "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"]


async def mig_profile(cluster: Cluster) -> None:
    times = tuple(MigTime(s, t) for s, t in ((1, 4.0), (2, 2.0), (3, 1.5), (7, 1.0)))
    await cluster.store.store.put(MigProfile("resize", "A100-80GB", times), None)


async def mig_node(cluster: Cluster, node: str) -> None:
    """The node's GPU in MIG mode, registered so with placement, its devices healthy; a MIG
    profile for the task key."""
    await mig_mode(cluster, node)
    await mig_profile(cluster)


async def mig_mode(cluster: Cluster, node: str) -> None:
    core = cluster.dispatchers[node].dispatchers[0].core
    await core.set_mig_mode(True)

    async def registered() -> bool:
        return any(g.gpu.mig_enabled for g in await cluster.jobs.gpus(node))

    await until(registered, "the GPU registered in MIG mode")
    kubelet = cluster.kubelets[node]
    await until(
        lambda: kubelet.devices and set(kubelet.devices.values()) == {"Healthy"},
        "the MIG GPU's devices healthy",
    )


async def pod_annotation(cluster: Cluster, name: str, key: str) -> str | None:
    # Off the event loop: the stand-in holds its lock while it calls the webhook, which this
    # loop serves.
    pod = await asyncio.to_thread(cluster.api.pod, "team-a", name)
    return ((pod or {})["metadata"].get("annotations") or {}).get(key)


# No size: the planner chooses (one task alone: the largest instance, the fastest); a size asked
# with gpuloom.io/mig-size: an instance of that size.
@pytest.mark.parametrize(("size", "slices"), [(None, 7), ("2g.20gb", 2)])
async def test_a_mig_pods_whole_path(cluster: Cluster, size: str | None, slices: int) -> None:
    await mig_node(cluster, "node-b")
    model = pod_model(
        "resize", MIG, TASK if size is None else {**TASK, "gpuloom.io/mig-size": size}
    )
    model.spec.containers[0].command = COMMAND
    pod = await asyncio.to_thread(cluster.api.create_pod, model, "alice")
    assert pod["spec"]["schedulerName"] == "gpuloom"
    assert pod["spec"]["containers"][0]["resources"]["limits"]["gpuloom.io/gpu"] == "1"

    # First Filter: the job is a MIG batch task, waiting for its batch; no node passes.
    first = await asyncio.to_thread(
        schedule, cluster.extender, cluster.ca, pod, ["node-a", "node-b"], cluster.scheduler_cert
    )
    assert first.node is None, first
    job = await cluster.job_of("team-a", "resize")
    assert job.spec.is_mig_batch and job.spec.task_key == "resize"
    assert job.spec.command == tuple(COMMAND) and not job.spec.nodes
    reasons = first.filter_result["FailedAndUnresolvableNodes"]
    assert set(reasons) == {"node-a", "node-b"}
    assert "MIG" in reasons["node-b"], reasons

    # The k8s process follows the job: its batch hands it an instance (a task nobody follows
    # would fail), and the Pod is annotated so kube-scheduler tries it again.
    async def nudged() -> bool:
        return await pod_annotation(cluster, "resize", PLACED) == job.job_id

    await until(nudged, "the Pod annotated once its instance was handed", timeout_s=60)
    job = await cluster.jobs.get(job.job_id)
    assert job.state is JobState.ASSIGNED and job.assignment is not None
    slot = job.assignment.mig
    assert slot is not None and slot.instance_uuid.startswith("MIG-")
    assert slot.size == slices and job.spec.mig_size == (0 if size is None else slices)
    assert job.assignment.node == "node-b"

    # Filter again: only the instance's node passes; bound there.
    stored = await asyncio.to_thread(cluster.api.pod, "team-a", "resize")
    assert stored is not None
    again = await asyncio.to_thread(
        schedule,
        cluster.extender,
        cluster.ca,
        stored,
        ["node-a", "node-b"],
        cluster.scheduler_cert,
    )
    assert again.node == "node-b" and not again.bind_error, again
    assert "on node node-b" in again.filter_result["FailedAndUnresolvableNodes"]["node-a"]

    # Allocate: the container sees its MIG instance, and nothing of the shim or a token.
    answer = await cluster.kubelets["node-b"].allocate(1)
    env = dict(answer.envs)
    assert env == {
        "CUDA_VISIBLE_DEVICES": slot.instance_uuid,
        "NVIDIA_VISIBLE_DEVICES": slot.instance_uuid,
        "GPULOOM_JOB_ID": job.job_id,
    }
    assert not answer.mounts
    labels = {
        "namespace": "team-a",
        "pod": "resize",
        "container": "main",
        "assignment": job.job_id,
        "gpu": job.assignment.gpu_uuid,
        "node": "node-b",
    }
    registry = prometheus_client.REGISTRY
    assert registry.get_sample_value("gpuloom_pod_mig_slices", labels) == slot.size
    # The container's process, with the environment the runtime gives it, sees its instance.
    ran = await asyncio.to_thread(
        subprocess.run, COMMAND, env=env, capture_output=True, text=True, check=True
    )
    assert ran.stdout.strip() == slot.instance_uuid

    # The Pod ends: its task ends with the exit code, and the instance is destroyed.
    await asyncio.to_thread(
        cluster.api.set_status,
        "team-a",
        "resize",
        {
            "phase": "Succeeded",
            "containerStatuses": [
                {
                    "name": "main",
                    "image": "registry.example.com/serve:1",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
                }
            ],
        },
    )
    await cluster.reconcile()
    done = await cluster.jobs.get(job.job_id)
    assert done.state is JobState.SUCCEEDED and done.exit_code == 0, done
    core = cluster.dispatchers["node-b"].dispatchers[0].core
    await until(
        lambda: core.backend.mig_instances(core.gpu.index) == [], "the MIG instance destroyed"
    )
    await until(
        lambda: registry.get_sample_value("gpuloom_pod_mig_slices", labels) is None,
        "the Pod's metrics dropped",
    )


async def test_a_restarted_k8s_process_follows_a_waiting_mig_job_and_a_deleted_pod_ends_it(
    cluster: Cluster,
) -> None:
    """Submitted while no GPU is in MIG mode (the task waits), the k8s process restarted (its
    streams gone): its first reconcile follows the job again, so the instance is handed when a
    MIG GPU comes; the Pod deleted, its task is cancelled and the instance destroyed."""
    await mig_profile(cluster)
    model = pod_model("resize", MIG, TASK)
    pod = await asyncio.to_thread(cluster.api.create_pod, model, "alice")
    first = await asyncio.to_thread(
        schedule, cluster.extender, cluster.ca, pod, ["node-a", "node-b"], cluster.scheduler_cert
    )
    assert first.node is None
    job = await cluster.job_of("team-a", "resize")
    assert job.state is JobState.PENDING and job.job_id in cluster.k8s.followers.followed
    await cluster.restart_k8s()
    assert job.job_id in cluster.k8s.followers.followed  # its first reconcile

    await mig_mode(cluster, "node-b")

    async def nudged() -> bool:
        return await pod_annotation(cluster, "resize", PLACED) == job.job_id

    await until(nudged, "the instance handed to the followed job", timeout_s=60)
    handed = await cluster.jobs.get(job.job_id)
    assert handed.state is JobState.ASSIGNED and handed.assignment is not None
    assert handed.assignment.mig is not None and handed.assignment.mig.instance_uuid

    await asyncio.to_thread(cluster.api.delete_pod, "team-a", "resize")
    await cluster.reconcile()
    ended = await cluster.jobs.get(job.job_id)
    assert ended.state is JobState.CANCELLED and "was deleted" in ended.message
    core = cluster.dispatchers["node-b"].dispatchers[0].core
    await until(
        lambda: core.backend.mig_instances(core.gpu.index) == [], "the MIG instance destroyed"
    )
    await until(lambda: job.job_id not in cluster.k8s.followers.followed, "no longer followed")


@pytest.mark.parametrize(
    ("limits", "annotations", "says"),
    [
        (
            {**MIG, "gpuloom.io/sm": "50"},
            TASK,
            "spec.containers[0].resources.limits[gpuloom.io/sm]: a MIG instance brings",
        ),
        ({"gpuloom.io/mig": "3"}, TASK, "limits[gpuloom.io/mig]: must be within 1..1, got 3"),
        (MIG, {}, "metadata.annotations[gpuloom.io/task-key]: required with gpuloom.io/mig"),
    ],
)
async def test_bad_mig_asks_are_refused_at_admission(
    cluster: Cluster, limits: dict, annotations: dict, says: str
) -> None:
    with pytest.raises(Refused) as caught:
        await asyncio.to_thread(
            cluster.api.create_pod, pod_model("bad", limits, annotations or None), "alice"
        )
    assert says in str(caught.value), caught.value
    assert cluster.api.pod("team-a", "bad") is None
    assert not await cluster.jobs.jobs()
