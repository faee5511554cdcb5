"""gpuloom on Kubernetes secured as deploy/k8s runs it: every service serves mutual TLS and
bearer tokens from a directory of `gpuloom credentials init --kubernetes`; the k8s process and
the device plugins call placement with their own certificates and their tokens of the
submitter `kubernetes`, never the services' token. A Pod's whole path works so (the device
plugin is told the assignment token of the job the k8s process submitted, the Pod's process
registers with it); the jobs are the submitter `kubernetes`'s; another submitter's jobs are
out of the components' sight and refused to their Pods; their tokens call nothing beyond a
submitter's RPCs; and auto-scaling's replicas, given to `kubernetes` by placement
(GPULOOM_PLACEMENT_FUNCTION_OWNER), start as Pods that get their replicas' tokens."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
from pathlib import Path

import grpc
import pytest

from gpuloom.credentials import KUBERNETES_SUBMITTER, add_token
from gpuloom.domain.errors import PermissionDenied
from gpuloom.domain.placement import JobKind, JobSpec, JobState
from gpuloom.domain.shares import share_of
from gpuloom.services.k8s.jobs import PlacementJobs
from gpuloom.transport import open_aio_channel
from gpuloom.v1 import dispatcher_pb2, dispatcher_pb2_grpc, placement_pb2, placement_pb2_grpc
from tests.k8s.conftest import Cluster, Secured
from tests.k8s.standins import pod_model, post, schedule
from tests.k8s.test_end_to_end import SHARE, create, finished, run_in_container, scheduled
from tests.k8s.test_scaling import FUNCTION, deployment, load, throughput
from tests.security import pki
from tests.shim.conftest import Runner


async def test_a_pods_whole_path_on_a_secured_cluster(
    secured_cluster: tuple[Cluster, Secured], run: Runner
) -> None:
    cluster, secured = secured_cluster
    pod = await create(cluster, pod_model("infer", SHARE))
    outcome = await scheduled(cluster, pod)
    assert outcome.node and not outcome.bind_error, outcome
    job = await cluster.job_of("team-a", "infer")
    # Submitted by the k8s process as the submitter `kubernetes`: not as the services.
    assert job.state is JobState.ASSIGNED and job.owner == KUBERNETES_SUBMITTER
    # The admin sees the job but, not its submitter, is never told its token.
    assert job.assignment is not None
    assert "GPULOOM_ASSIGNMENT_TOKEN" not in job.assignment.environment

    # The device plugin, with its own token of the same submitter, is told it.
    answer = await cluster.kubelets[outcome.node].allocate(1)
    token = answer.envs["GPULOOM_ASSIGNMENT_TOKEN"]
    assert token and answer.envs["GPULOOM_ASSIGNMENT_ID"] == job.job_id
    assert token not in cluster.api.everything()
    for name in ("k8s.token", "device-plugin.token", "service.token"):
        assert secured.credentials.file(name).read_text().strip() not in cluster.api.everything()

    # ... and it is the real one: the Pod's process registers with its dispatcher under it.
    await run_in_container(cluster, run, outcome.node, job.job_id, answer)

    cluster.api.set_status("team-a", "infer", finished("main", 0))
    await cluster.reconcile()
    assert (await cluster.jobs.get(job.job_id)).state is JobState.SUCCEEDED


async def test_another_submitters_jobs_are_out_of_the_components_sight(
    secured_cluster: tuple[Cluster, Secured],
) -> None:
    cluster, secured = secured_cluster
    directory = secured.credentials.directory
    add_token(directory, "mallory", "submitter")
    await asyncio.sleep(1.1)  # placement reads the tokens file again within a second
    mallory = PlacementJobs(
        cluster.placement_address, transport=secured.transport("admin", "mallory.token")
    )
    try:
        # A Pod bound by gpuloom, and a job of mallory's under the request id of that Pod's
        # next attempt, ready to be taken for the Pod's.
        pod = await create(cluster, pod_model("victim", SHARE))
        outcome = await scheduled(cluster, pod)
        assert outcome.node, outcome
        uid = pod["metadata"]["uid"]
        spec = JobSpec(
            name="team-a/victim",
            kind=JobKind.INFERENCE,
            share=share_of(sm_percent=24, quota_request_percent=40, memory_bytes=2 << 30),
            mps=True,
        )
        theirs = await mallory.submit(f"k8s-{uid}-2", spec)
        assert theirs.owner == "mallory"

        # The controller's view holds only its own jobs: mallory's stays as it is, and the
        # k8s process's job stays the Pod's.
        await cluster.reconcile()
        assert cluster.k8s.controller._index.jobs[uid].job_id != theirs.job_id
        assert (await cluster.jobs.get(theirs.job_id)).state is theirs.state
        k8s_view = PlacementJobs(cluster.placement_address, transport=cluster.k8s_transport)
        try:
            assert theirs.job_id not in {j.job_id for j in await k8s_view.jobs()}
            with pytest.raises(PermissionDenied):
                await k8s_view.get(theirs.job_id)
        finally:
            await k8s_view.close()

        # A Pod pointed at mallory's job (as if its annotation were forged) is refused at
        # Allocate: the device plugin cannot read another submitter's job.
        other = await create(cluster, pod_model("forged", {"gpuloom.io/gpu": "1"}))
        node = outcome.node
        await asyncio.to_thread(  # the webhook it calls is served on this event loop
            cluster.api.annotate,
            "team-a",
            "forged",
            {"gpuloom.io/job": theirs.job_id, "gpuloom.io/bound-at": "0"},
            user="system:serviceaccount:gpuloom:gpuloom-k8s",
        )
        with cluster.api.lock:
            cluster.api.pods[("team-a", "forged")]["spec"]["nodeName"] = node
        assert other["metadata"]["uid"]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await cluster.kubelets[node].allocate(1)
        assert "belongs to another submitter" in (refused.value.details() or "")
    finally:
        await mallory.close()


@pytest.mark.parametrize("who", ["k8s", "device-plugin"])
async def test_the_components_tokens_call_nothing_beyond_a_submitters_rpcs(
    secured_cluster: tuple[Cluster, Secured], who: str
) -> None:
    cluster, secured = secured_cluster
    settings = secured.transport(who)
    async with open_aio_channel(cluster.placement_address, settings=settings) as channel:
        placement = placement_pb2_grpc.PlacementStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await placement.SetFunctionLoad(load(100))
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "holds a submitter token" in (refused.value.details() or "")
        gpus = await placement.ListGpus(placement_pb2.ListGpusRequest())  # a submitter's RPC
        assert len(gpus.gpus) == 2
    dispatcher = cluster.dispatchers["node-a"].dispatchers[0]
    address = f"127.0.0.1:{dispatcher.port}"
    async with open_aio_channel(address, settings=settings) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await dispatcher_pb2_grpc.DispatcherStub(channel).ListClients(
                dispatcher_pb2.ListClientsRequest()
            )
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED


async def test_auto_scalings_replicas_are_the_components_and_start_as_pods(
    secured_cluster: tuple[Cluster, Secured],
) -> None:
    cluster, secured = secured_cluster
    await cluster.store.store.put(throughput(), None)
    cluster.api.create_deployment(deployment())
    async with open_aio_channel(
        cluster.placement_address, settings=secured.transport("admin")
    ) as channel:
        up = await placement_pb2_grpc.PlacementStub(channel).SetFunctionLoad(load(150))
    assert len(up.added) == 2 and {j.owner for j in up.added} == {KUBERNETES_SUBMITTER}

    await cluster.reconcile()
    assert cluster.api.deployments[("serving", FUNCTION)]["spec"]["replicas"] == 2
    await asyncio.to_thread(cluster.api.sync_replicasets)
    pods = [p for (ns, _), p in cluster.api.pods.items() if ns == "serving"]
    tokens = set()
    for pod in pods:
        outcome = await asyncio.to_thread(
            schedule,
            cluster.extender,
            cluster.ca,
            pod,
            ["node-a", "node-b"],
            cluster.scheduler_cert,
        )
        assert outcome.node and not outcome.bind_error, outcome
        answer = await cluster.kubelets[outcome.node].allocate(1)
        assert answer.envs["GPULOOM_ASSIGNMENT_ID"] in {j.job_id for j in up.added}
        tokens.add(answer.envs["GPULOOM_ASSIGNMENT_TOKEN"])
    assert len(tokens) == 2 and "" not in tokens


async def test_the_extender_takes_only_kube_schedulers_certificate(
    secured_cluster: tuple[Cluster, Secured], tmp_path: Path
) -> None:
    cluster, _ = secured_cluster
    pod = await create(cluster, pod_model("uninvited", SHARE))  # the webhooks need none
    args = {"Pod": pod, "NodeNames": ["node-a", "node-b"]}
    for verb in ("filter", "prioritize", "bind"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            await asyncio.to_thread(post, f"{cluster.extender}/{verb}", args, cluster.ca)
        assert refused.value.code == 403
    # A certificate of another CA does not get through the handshake.
    other = pki.write(tmp_path / "other", "mallory", pki.Authority.create(), "localhost")
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        await asyncio.to_thread(
            post,
            f"{cluster.extender}/filter",
            args,
            cluster.ca,
            (str(other.cert), str(other.key)),
        )
    # Nothing was submitted for the Pod; kube-scheduler's certificate gets it placed.
    assert not [j for j in await cluster.jobs.jobs() if j.spec.name == "team-a/uninvited"]
    outcome = await scheduled(cluster, pod)
    assert outcome.node and not outcome.bind_error, outcome
