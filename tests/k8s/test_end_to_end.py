"""A Pod's whole path through gpuloom on Kubernetes, every component speaking its real protocol
to a stand-in (tests/k8s/standins.py) and real gpuloom services: created through the admission
webhook, scheduled through the extender (Filter, Prioritize, Bind), admitted by the kubelet
through the device plugin's Allocate, its process run under the shim registering with its
dispatcher, and its end ending its job. Also: deleted Pods, failed binds, full nodes, a
restarted placement, refusals at admission and at Allocate, metrics per Pod, and the token
kept out of the API server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import prometheus_client
import pytest
from kubernetes import client

from gpuloom.domain.errors import DomainError
from gpuloom.domain.placement import JobState
from gpuloom.kubelet import deviceplugin_pb2 as dp
from gpuloom.services.k8s.app import DevicePluginApp
from gpuloom.services.k8s.settings import DevicePluginSettings
from tests.k8s.conftest import CONTAINER_SHIM, K8S_USER, NODES, PLUGIN_USER, Cluster, until
from tests.k8s.standins import Kubelet, Refused, container_environment, pod_model, post, schedule
from tests.shim.conftest import Run, Runner

SHARE = {"gpuloom.io/sm": "24", "gpuloom.io/quota": "40", "gpuloom.io/memory": "2Gi"}
WHOLE = {"gpuloom.io/gpu": "1"}
KERNEL = "k_work_2000us"


async def create(cluster: Cluster, pod: client.V1Pod, user: str = "alice") -> dict:
    # The API server calls the webhook, which is served on this event loop: off the loop.
    return await asyncio.to_thread(cluster.api.create_pod, pod, user)


async def scheduled(cluster: Cluster, pod: dict, nodes: list[str] = NODES):
    return await asyncio.to_thread(
        schedule, cluster.extender, cluster.ca, pod, nodes, cluster.scheduler_cert
    )


async def run_in_container(
    cluster: Cluster, run: Runner, node: str, job_id: str, answer: dp.ContainerAllocateResponse
) -> Run:
    """The container's process, started with what Allocate answered: it registers with its
    GPU's dispatcher under the shim (awaited) and runs to the end (its result returned)."""
    process = asyncio.create_task(
        run.run_async(
            "module", KERNEL, "loop", "1.5", KERNEL, "1", env=container_environment(answer)
        )
    )
    dispatcher = cluster.dispatchers[node].dispatchers[0].core

    async def connected() -> bool:
        status, _ = await dispatcher.status()
        return any(c.reservation.assignment_id == job_id and c.connected for c in status.clients)

    await until(connected, "the Pod's process registered with its dispatcher")
    result = await process
    assert result.returncode == 0, result.stderr
    return result


def finished(container: str, code: int) -> dict:
    """A Pod's status once its container ended, as the kubelet reports it."""
    return {
        "phase": "Succeeded" if code == 0 else "Failed",
        "containerStatuses": [
            {
                "name": container,
                "image": "registry.example.com/serve:1",
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {
                    "terminated": {
                        "exitCode": code,
                        "reason": "Completed" if code == 0 else "Error",
                    }
                },
            }
        ],
    }


async def test_a_pods_whole_path(cluster: Cluster, run: Runner) -> None:
    pod = await create(cluster, pod_model("infer", SHARE, {"gpuloom.io/priority": "2"}))
    # Admission routed it to gpuloom's scheduler, labelled it, gave it one device to ask for.
    assert pod["spec"]["schedulerName"] == "gpuloom"
    assert pod["metadata"]["labels"] == {"gpuloom.io/managed": "true"}
    assert pod["spec"]["containers"][0]["resources"]["limits"]["gpuloom.io/gpu"] == "1"

    outcome = await scheduled(cluster, pod)
    assert outcome.node in ("node-a", "node-b") and not outcome.bind_error, outcome
    failed = outcome.filter_result["FailedAndUnresolvableNodes"]
    assert "no GPU of this node is registered" in failed["cpu-only"]
    node = outcome.node
    bound = cluster.api.pod("team-a", "infer")
    assert bound is not None and bound["spec"]["nodeName"] == node
    job = await cluster.job_of("team-a", "infer")
    assert job.state is JobState.ASSIGNED and job.assignment is not None
    assert job.assignment.node == node and job.spec.priority == 2
    assert job.spec.mps and job.spec.share.sm_percent == 24
    assert bound["metadata"]["annotations"]["gpuloom.io/job"] == job.job_id
    assert job.job_id in await cluster.held(node)

    answer = await cluster.kubelets[node].allocate(1)
    env = dict(answer.envs)
    token = env["GPULOOM_ASSIGNMENT_TOKEN"]
    assert env["GPULOOM_ASSIGNMENT_ID"] == job.job_id == env["GPULOOM_JOB_ID"]
    assert env["LD_PRELOAD"] == CONTAINER_SHIM
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "24"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"  # a simulated GPU: no device to expose
    mounts = {m.container_path: (m.host_path, m.read_only) for m in answer.mounts}
    assert mounts[CONTAINER_SHIM][1] and mounts[CONTAINER_SHIM][0].endswith("libgpuloom.so")
    socket_dir = env["GPULOOM_DISPATCHER_SOCKET"].rsplit("/", 1)[0]
    assert mounts[socket_dir] == (socket_dir, True)
    # The token went to the kubelet only: nowhere in what the API server holds.
    assert token not in cluster.api.everything()
    assert (
        "gpuloom.io/allocated"
        in (cluster.api.pod("team-a", "infer") or {})["metadata"]["annotations"]
    )
    labels = {
        "namespace": "team-a",
        "pod": "infer",
        "container": "main",
        "assignment": job.job_id,
        "gpu": job.assignment.gpu_uuid,
        "node": node,
    }
    registry = prometheus_client.REGISTRY
    assert registry.get_sample_value("gpuloom_pod_info", labels) == 1
    assert registry.get_sample_value("gpuloom_pod_sm_percent", labels) == 24

    # The container's process, under the shim, registers with its dispatcher and runs.
    result = await run_in_container(cluster, run, node, job.job_id, answer)
    assert "loop launches=" in result.stdout

    # The official client reads the Pod as the stand-in holds it.
    configuration = client.Configuration(
        host=cluster.api.url, api_key={"authorization": "Bearer alice-token"}
    )
    read = await asyncio.to_thread(
        client.CoreV1Api(client.ApiClient(configuration)).read_namespaced_pod, "infer", "team-a"
    )
    assert read.spec.node_name == node and read.metadata.annotations["gpuloom.io/job"] == job.job_id

    # The Pod ends: its job ends with the container's exit code, the dispatcher lets go.
    cluster.api.set_status("team-a", "infer", finished("main", 0))
    await cluster.reconcile()
    done = await cluster.jobs.get(job.job_id)
    assert done.state is JobState.SUCCEEDED and done.exit_code == 0
    assert "Pod team-a/infer succeeded" in done.message
    await until(lambda: _released(cluster, node, job.job_id), "the reservation released")
    await until(
        lambda: registry.get_sample_value("gpuloom_pod_info", labels) is None,
        "the Pod's metrics dropped",
    )


async def _released(cluster: Cluster, node: str, job_id: str) -> bool:
    return job_id not in await cluster.held(node)


async def test_a_deleted_pod_ends_its_job_and_a_failed_bind_gives_its_capacity_back(
    cluster: Cluster,
) -> None:
    pod = await create(cluster, pod_model("train", WHOLE, {"gpuloom.io/kind": "training"}))
    cluster.api.fail_bindings = 1
    first = await scheduled(cluster, pod, ["node-a"])
    assert (
        first.node == "node-a"
        and "binding Pod team-a/train to node node-a failed" in first.bind_error
    )
    assert (cluster.api.pod("team-a", "train") or {})["spec"].get("nodeName") is None
    cancelled = [
        j for j in await cluster.jobs.jobs([JobState.CANCELLED]) if j.spec.name == "team-a/train"
    ]
    assert (
        len(cancelled) == 1
        and "binding Pod team-a/train to node node-a failed" in cancelled[0].message
    )
    assert cancelled[0].job_id not in await cluster.held("node-a")
    # kube-scheduler tries again: a new job, bound this time.
    again = await scheduled(cluster, pod, ["node-a"])
    assert again.node == "node-a" and not again.bind_error
    job = await cluster.job_of("team-a", "train")
    assert job.job_id != cancelled[0].job_id and job.request_id.endswith("-2")
    assert job.job_id in await cluster.held("node-a")

    cluster.api.delete_pod("team-a", "train")
    await cluster.reconcile()
    ended = await cluster.jobs.get(job.job_id)
    assert ended.state is JobState.CANCELLED and "was deleted" in ended.message
    await until(lambda: _released(cluster, "node-a", job.job_id), "the reservation released")
    assert not [j for j in await cluster.jobs.jobs() if j.spec.name == "team-a/train"]


async def test_a_pod_waits_for_room_on_its_nodes_and_is_placed_when_it_frees(
    cluster: Cluster,
) -> None:
    first = await create(cluster, pod_model("first", WHOLE))
    assert (await scheduled(cluster, first, ["node-a"])).node == "node-a"
    second = await create(cluster, pod_model("second", WHOLE))
    waiting = await scheduled(cluster, second, ["node-a", "cpu-only"])
    assert waiting.node is None
    reason = waiting.filter_result["FailedAndUnresolvableNodes"]["node-a"]
    assert reason == "no GPU has 100% quota x 100% SM free, on its nodes (node-a)", reason
    job = await cluster.job_of("team-a", "second")
    assert job.state is JobState.PENDING and job.spec.nodes == ("node-a",)
    # The first Pod ends; its GPU frees; placement places the waiting job, and the
    # controller touches the Pod so that kube-scheduler tries it again now.
    cluster.api.set_status("team-a", "first", finished("main", 3))
    await cluster.reconcile()
    ended = await cluster.jobs.get(await _job_id(cluster, "first"))
    assert ended.state is JobState.FAILED and ended.exit_code == 3
    await until(lambda: _assigned(cluster, job.job_id), "the waiting job placed")
    await cluster.reconcile()
    touched = cluster.api.pod("team-a", "second") or {}
    assert touched["metadata"]["annotations"]["gpuloom.io/placed"] == job.job_id
    placed = await scheduled(cluster, second, ["node-a", "node-b"])
    assert placed.node == "node-a" and not placed.bind_error
    assert (await cluster.job_of("team-a", "second")).job_id == job.job_id  # no new attempt
    # Candidates that no longer hold a waiting job's place: a new attempt for the new ones.
    third = await create(cluster, pod_model("third", WHOLE))
    await scheduled(cluster, third, ["node-a"])
    old = await cluster.job_of("team-a", "third")
    moved = await scheduled(cluster, third, ["node-b"])
    assert moved.node == "node-b"
    assert (await cluster.jobs.get(old.job_id)).state is JobState.CANCELLED


async def _job_id(cluster: Cluster, name: str) -> str:
    jobs = await cluster.jobs.jobs(list(JobState))
    (job,) = [j for j in jobs if j.spec.name == f"team-a/{name}"]
    return job.job_id


async def _assigned(cluster: Cluster, job_id: str) -> bool:
    return (await cluster.jobs.get(job_id)).state is JobState.ASSIGNED


@pytest.mark.parametrize(
    ("limits", "annotations", "says"),
    [
        (
            {**SHARE, "gpuloom.io/sm": "120"},
            None,
            "spec.containers[0].resources.limits[gpuloom.io/sm]: must be within 1..100, got 120",
        ),
        (
            {**SHARE, "gpuloom.io/quota-limit": "20"},
            None,
            "limits[gpuloom.io/quota]: the quota (40) must not exceed",
        ),
        (
            {**SHARE, "gpuloom.io/memory": "100Gi"},
            None,
            "limits[gpuloom.io/memory]: 100 GiB is more than any GPU has",
        ),
        (
            {"gpuloom.io/gpu": "2"},
            None,
            "limits[gpuloom.io/gpu]: 2 GPUs on one node: no node has that many (the most: 1)",
        ),
        (
            WHOLE,
            {"gpuloom.io/gpu-model": "H100-80GB"},
            "metadata.annotations[gpuloom.io/gpu-model]: no registered GPU",
        ),
        (
            WHOLE,
            {"gpuloom.io/job": "j-someone-elses"},
            "metadata.annotations[gpuloom.io/job]: is written by gpuloom only",
        ),
    ],
)
async def test_impossible_asks_are_refused_at_admission_naming_the_field(
    cluster: Cluster, limits: dict, annotations: dict | None, says: str
) -> None:
    with pytest.raises(Refused) as caught:
        await create(cluster, pod_model("bad", limits, annotations))
    assert 'admission webhook "gpuloom" denied the request: gpuloom: ' in str(caught.value)
    assert says in str(caught.value), caught.value
    assert cluster.api.pod("team-a", "bad") is None
    assert not await cluster.jobs.jobs()  # nothing reached placement


async def test_only_gpuloom_writes_its_annotations_and_other_pods_pass_untouched(
    cluster: Cluster,
) -> None:
    plain = await create(cluster, pod_model("web", {"cpu": "1"}))
    assert plain["spec"]["schedulerName"] == "default-scheduler"
    assert "labels" not in plain["metadata"] or not plain["metadata"]["labels"]
    pod = await create(cluster, pod_model("mine", WHOLE))
    with pytest.raises(Refused, match=r"gpuloom.io/job\]: is written by gpuloom only"):
        await asyncio.to_thread(cluster.api.annotate, "team-a", "mine", {"gpuloom.io/job": "j-x"})
    # Its own annotations are the author's to change.
    await asyncio.to_thread(cluster.api.annotate, "team-a", "mine", {"note": "ok"})
    # A device plugin's account changes gpuloom.io/allocated and nothing else of a Pod.
    for change, field in (
        ({"gpuloom.io/job": "j-x"}, "gpuloom.io/job"),
        ({"note": "mine now"}, "note"),
    ):
        refused = rf"annotations\[{field}\]: a device plugin may change only"
        with pytest.raises(Refused, match=refused):
            await asyncio.to_thread(cluster.api.annotate, "team-a", "mine", change, PLUGIN_USER)
    await asyncio.to_thread(
        cluster.api.annotate, "team-a", "mine", {"gpuloom.io/allocated": "1.0"}, PLUGIN_USER
    )
    await asyncio.to_thread(
        cluster.api.annotate, "team-a", "mine", {"gpuloom.io/allocated": None}, K8S_USER
    )
    assert (await scheduled(cluster, pod, ["node-b"])).node == "node-b"


async def test_the_device_plugin_refuses_what_it_cannot_answer_and_changes_nothing(
    cluster: Cluster,
) -> None:
    kubelet = cluster.kubelets["node-a"]
    assert kubelet.plugin is not None
    registration = kubelet.registrations[0]
    assert (registration.version, registration.resource_name) == ("v1beta1", "gpuloom.io/gpu")
    assert len(kubelet.devices) == 4 and set(kubelet.devices.values()) == {"Healthy"}
    before = (await cluster.jobs.jobs(), await cluster.held("node-a"))

    async def allocate(*ids: str) -> grpc.aio.AioRpcError:
        request = dp.AllocateRequest(
            container_requests=[dp.ContainerAllocateRequest(devices_ids=list(ids))]
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await kubelet.plugin.Allocate(request)
        return caught.value

    unknown = await allocate("GPU-not-here-0")
    assert (
        unknown.code() is grpc.StatusCode.NOT_FOUND
        and "is not one of the 4 gpuloom devices" in unknown.details()
    )
    nobody = await allocate(sorted(kubelet.devices)[0])
    assert nobody.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "no Pod bound by gpuloom on node node-a waits" in nobody.details()
    # A Pod bound to another Pod's job (as if the webhook had been bypassed) gets nothing.
    victim = await create(cluster, pod_model("victim", WHOLE))
    await scheduled(cluster, victim, ["node-a"])
    victim_job = await cluster.job_of("team-a", "victim")
    thief = await create(cluster, pod_model("thief", WHOLE))
    with cluster.api.lock:
        stored = cluster.api.pods[("team-a", "thief")]
        stored["spec"]["nodeName"] = "node-a"
        stored["metadata"].setdefault("annotations", {})["gpuloom.io/job"] = victim_job.job_id
        stored["metadata"]["annotations"]["gpuloom.io/bound-at"] = "0"
    stolen = await allocate(sorted(kubelet.devices)[0])
    assert (
        stolen.code() is grpc.StatusCode.PERMISSION_DENIED
        and "is not Pod team-a/thief's" in stolen.details()
    )
    assert (
        victim_job.assignment is not None
        and victim_job.assignment.environment["GPULOOM_ASSIGNMENT_TOKEN"] not in stolen.details()
    )
    jobs, held = await cluster.jobs.jobs(), await cluster.held("node-a")
    assert {j.job_id for j in jobs} - {j.job_id for j in before[0]} == {victim_job.job_id}
    assert held - before[1] == {victim_job.job_id}
    assert thief["metadata"]["uid"] not in json.dumps([j.request_id for j in jobs])


async def test_a_restarted_placement_loses_nothing_and_places_nothing_twice(
    cluster: Cluster,
) -> None:
    pod = await create(cluster, pod_model("steady", SHARE))
    meta = pod["metadata"]
    # kube-scheduler's Filter places the job; placement restarts before the Bind.
    args = {"Pod": pod, "NodeNames": ["node-b"]}
    filtered = await asyncio.to_thread(post, f"{cluster.extender}/filter", args, cluster.ca)
    assert filtered["NodeNames"] == ["node-b"]
    job = await cluster.job_of("team-a", "steady")
    assert cluster.placement is not None
    port = cluster.placement.port
    await cluster.placement.stop(0)
    with pytest.raises(DomainError):  # placement away: the reconcile says so
        await cluster.reconcile()
    assert not cluster.k8s.controller.healthy
    await cluster.start_placement(port)
    await until(lambda: _gpus_back(cluster), "the dispatchers registered again")
    await until(lambda: _reconciled(cluster), "a reconcile with placement back")
    # A Filter again (kube-scheduler retried the cycle) and the Bind: the same job.
    filtered = await asyncio.to_thread(post, f"{cluster.extender}/filter", args, cluster.ca)
    assert filtered["NodeNames"] == ["node-b"]
    binding = {
        "PodName": "steady",
        "PodNamespace": "team-a",
        "PodUID": meta["uid"],
        "Node": "node-b",
    }
    assert await asyncio.to_thread(post, f"{cluster.extender}/bind", binding, cluster.ca) == {}
    # A retried Bind whose first try landed is no error either.
    assert await asyncio.to_thread(post, f"{cluster.extender}/bind", binding, cluster.ca) == {}
    live = [j for j in await cluster.jobs.jobs() if j.spec.name == "team-a/steady"]
    assert [j.job_id for j in live] == [job.job_id]
    assert await cluster.held("node-b") == {job.job_id}
    answer = await cluster.kubelets["node-b"].allocate(1)
    assert answer.envs["GPULOOM_ASSIGNMENT_ID"] == job.job_id


async def _reconciled(cluster: Cluster) -> bool:
    try:
        await cluster.reconcile()
    except DomainError:
        return False
    return True


async def _gpus_back(cluster: Cluster) -> bool:
    try:
        return sum(1 for g in await cluster.jobs.gpus() if not g.lost) == 2
    except DomainError:  # the channel finds the restarted placement after its back-off
        return False


async def test_the_device_plugin_registers_again_when_the_kubelet_restarts(
    cluster: Cluster,
) -> None:
    kubelet = cluster.kubelets["node-a"]
    plugin = cluster.plugins["node-a"]
    assert len(kubelet.registrations) == 1
    # A restarted kubelet empties its device plugin directory (the plugin's socket with it).
    Path(plugin.socket).unlink()
    await until(lambda: len(kubelet.registrations) == 2, "the plugin registered again")
    await kubelet.wait_devices(4)
    # The plugin counts its registration once the kubelet's answer is back (after the kubelet
    # recorded it).
    await until(lambda: plugin.server.registrations == 2, "the plugin counted it")
    assert len(kubelet.registrations) == 2


async def test_a_device_plugin_started_before_its_kubelet_registers_once_it_is_up(
    cluster: Cluster, shim_build: Path
) -> None:
    directory = cluster.root / "kubelet-late"
    directory.mkdir()
    plugin = await DevicePluginApp.start(
        DevicePluginSettings(
            node="node-b",
            placement_address=cluster.placement_address,
            kubelet_dir=str(directory),
            shim_host_path=str(shim_build / "libgpuloom.so"),
            api_server=cluster.api.url,
            api_token_file=str(cluster.root / "plugin.token"),
        )
    )
    kubelet = Kubelet(directory)
    try:
        assert plugin.server.registrations == 0  # no kubelet yet: it keeps trying
        await kubelet.start()
        await until(lambda: kubelet.registrations, "the late registration")
        await kubelet.wait_devices(16)  # the default: 16 per GPU
    finally:
        await plugin.stop()
        await kubelet.stop()


async def test_a_restarted_k8s_process_finds_its_pods_jobs_again(cluster: Cluster) -> None:
    pod = await create(cluster, pod_model("kept", WHOLE))
    args = {"Pod": pod, "NodeNames": ["node-a"]}
    filtered = await asyncio.to_thread(post, f"{cluster.extender}/filter", args, cluster.ca)
    assert filtered["NodeNames"] == ["node-a"]
    job = await cluster.job_of("team-a", "kept")
    await cluster.restart_k8s()  # between kube-scheduler's Filter and its Bind
    assert (await cluster.job_of("team-a", "kept")).job_id == job.job_id  # its first reconcile
    again = await scheduled(cluster, pod, ["node-a"])
    assert again.node == "node-a" and not again.bind_error
    live = [j for j in await cluster.jobs.jobs() if j.spec.name == "team-a/kept"]
    assert [j.job_id for j in live] == [job.job_id]
    assert await cluster.held("node-a") == {job.job_id}
