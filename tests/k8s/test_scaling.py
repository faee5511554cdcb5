"""FaST-GShare's auto-scaling starts Pods: `gpuloom scale` (placement's SetFunctionLoad) adds
replicas of a function, the controller scales the function's Deployment to them (its scale
subresource), the ReplicaSet's Pods go the same path as any Pod and each adopts one placed
replica (Filter, Bind, Allocate with that replica's assignment); scaled down, the Pods of the
removed replicas are deleted and the Deployment shrinks."""

from __future__ import annotations

import asyncio

import grpc
from kubernetes import client

from gpuloom.domain import profiles as d
from gpuloom.domain.placement import JobState
from gpuloom.v1 import common_pb2, placement_pb2, placement_pb2_grpc
from tests.k8s.conftest import NODES, Cluster
from tests.k8s.standins import schedule
from tests.profile_store.samples import throughput_profile

MODEL = "A100-80GB"
FUNCTION = "resnet"


def throughput() -> d.ThroughputProfile:
    # (12 % SM, 40 % quota) serves 100 requests/s: the most efficient configuration.
    points = (
        d.ThroughputPoint(12, 40.0, 100.0, 8.0, 20.0),
        d.ThroughputPoint(50, 60.0, 400.0, 3.0, 8.0),
    )
    return throughput_profile(FUNCTION, MODEL, points)


def load(rps: float) -> placement_pb2.SetFunctionLoadRequest:
    template = placement_pb2.JobSpec(
        name="resnet-replica",
        kind=placement_pb2.JOB_KIND_INFERENCE,
        priority=common_pb2.Priority(level=1),
        resources=common_pb2.Resources(
            memory_bytes=2 << 30,
            mps=common_pb2.SpatioTemporalShare(
                sm_percent=12, quota=common_pb2.TimeQuota(request_percent=40)
            ),
        ),
        gpu_model=MODEL,
    )
    return placement_pb2.SetFunctionLoadRequest(
        function=FUNCTION, requests_per_s=rps, template=template
    )


def deployment() -> client.V1Deployment:
    labels = {"app": FUNCTION}
    return client.V1Deployment(
        api_version="apps/v1",
        kind="Deployment",
        metadata=client.V1ObjectMeta(
            name=FUNCTION, namespace="serving", labels={"gpuloom.io/function": FUNCTION}
        ),
        spec=client.V1DeploymentSpec(
            replicas=0,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(
                    labels=labels, annotations={"gpuloom.io/function": FUNCTION}
                ),
                spec=client.V1PodSpec(
                    containers=[client.V1Container(name="serve", image="serve:1")]
                ),
            ),
        ),
    )


async def test_gpuloom_scale_starts_pods_of_the_functions_deployment(cluster: Cluster) -> None:
    await cluster.store.store.put(throughput(), None)
    cluster.api.create_deployment(deployment())
    async with grpc.aio.insecure_channel(cluster.placement_address) as channel:
        stub = placement_pb2_grpc.PlacementStub(channel)
        up = await stub.SetFunctionLoad(load(350))
        assert len(up.added) == 4  # 3 x 100 requests/s, and one for the last 50
        await cluster.reconcile()
        assert cluster.api.deployments[("serving", FUNCTION)]["spec"]["replicas"] == 4
        await asyncio.to_thread(cluster.api.sync_replicasets)
        pods = [p for (ns, _), p in cluster.api.pods.items() if ns == "serving"]
        assert len(pods) == 4 and all(p["spec"]["schedulerName"] == "gpuloom" for p in pods)

        # Each Pod goes the same path and adopts a replica of its own.
        adopted: dict[str, str] = {}
        for pod in pods:
            outcome = await asyncio.to_thread(schedule, cluster.extender, cluster.ca, pod, NODES)
            assert outcome.node and not outcome.bind_error, outcome
            name = pod["metadata"]["name"]
            stored = cluster.api.pod("serving", name) or {}
            adopted[name] = stored["metadata"]["annotations"]["gpuloom.io/job"]
        assert sorted(adopted.values()) == sorted(j.job_id for j in up.added)
        for node in ("node-a", "node-b"):
            on_node = [p for p in cluster.api.pods.values() if p["spec"].get("nodeName") == node]
            for _ in on_node:
                answer = await cluster.kubelets[node].allocate(1)
                assert answer.envs["GPULOOM_ASSIGNMENT_ID"] in adopted.values()
                assert answer.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "12"

        # Scaled down: the Pods of the removed replicas go, the Deployment shrinks.
        down = await stub.SetFunctionLoad(load(150))
        removed = {j.job_id for j in down.removed}
        assert len(removed) == 2
        await cluster.reconcile()
        left = {n: j for n, j in adopted.items() if cluster.api.pod("serving", n) is not None}
        assert set(left.values()) == set(adopted.values()) - removed
        assert cluster.api.deployments[("serving", FUNCTION)]["spec"]["replicas"] == 2
        await asyncio.to_thread(cluster.api.sync_replicasets)
        assert len([k for k in cluster.api.pods if k[0] == "serving"]) == 2
        live = [j for j in await cluster.jobs.jobs() if j.function == FUNCTION]
        assert {j.job_id for j in live} == set(left.values())
        assert all(j.state is JobState.ASSIGNED for j in live)
