"""Leader election of the k8s process's replicas on a coordination.k8s.io/v1 Lease, against
the API server stand-in (its Leases with resourceVersion concurrency, read back with the
official client): one holder at a time, a holder's lease taken over only once this replica
has seen it unchanged for its duration, a concurrent write refused, a handed-back lease taken
at once; and two k8s processes, of which only the leader is ready and serves, the other taking
over when it stops."""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from kubernetes import client

from gpuloom.services.k8s.app import K8sApp
from gpuloom.services.k8s.kubeapi import KubeApi, KubeApiConfig
from gpuloom.services.k8s.leader import LeaseElector
from tests.k8s.conftest import HOST, Cluster, until
from tests.k8s.standins import ApiServer

TOKEN = "k8s-token-0123456789"
NAMESPACE, LEASE = "gpuloom", "gpuloom-k8s"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def api_server(tmp_path) -> Iterator[tuple[ApiServer, str]]:  # type: ignore[no-untyped-def]
    server = ApiServer({TOKEN: "system:serviceaccount:gpuloom:gpuloom-k8s"})
    server.start()
    (tmp_path / "token").write_text(TOKEN)
    try:
        yield server, str(tmp_path / "token")
    finally:
        server.stop()


def elector(server: ApiServer, token_file: str, who: str, clock: Clock) -> LeaseElector:
    api = KubeApi(KubeApiConfig(server=server.url, token_file=token_file))
    return LeaseElector(api, NAMESPACE, LEASE, who, 15, 10, 2, clock=clock)


def read_lease(server: ApiServer) -> client.V1Lease:
    configuration = client.Configuration(
        host=server.url, api_key={"authorization": f"Bearer {TOKEN}"}
    )
    api = client.CoordinationV1Api(client.ApiClient(configuration))
    return api.read_namespaced_lease(LEASE, NAMESPACE)


async def test_one_holder_a_lapsed_lease_taken_over_and_a_handed_back_one_taken_at_once(
    api_server: tuple[ApiServer, str],
) -> None:
    server, token = api_server
    clock_a, clock_b = Clock(), Clock()
    a, b = elector(server, token, "k8s-a", clock_a), elector(server, token, "k8s-b", clock_b)
    assert await a.try_lead()  # none yet: created
    first = await asyncio.to_thread(read_lease, server)
    assert first.spec.holder_identity == "k8s-a" and first.spec.lease_transitions == 0
    assert first.spec.lease_duration_seconds == 15 and first.spec.renew_time is not None
    assert not await b.try_lead() and b.holder == "k8s-a"
    clock_a.now += 5
    assert await a.try_lead()  # renewed: the version moved
    renewed = await asyncio.to_thread(read_lease, server)
    assert renewed.spec.renew_time >= first.spec.renew_time
    assert renewed.metadata.resource_version != first.metadata.resource_version

    # a stops renewing. b judges by its own clock since it saw the lease change, so a's
    # renewTime (another node's clock) does not matter.
    clock_b.now += 14
    assert not await b.try_lead()  # b saw the renewal just now
    clock_b.now += 15
    assert await b.try_lead()  # unchanged for 15 s: taken over
    taken = await asyncio.to_thread(read_lease, server)
    assert taken.spec.holder_identity == "k8s-b" and taken.spec.lease_transitions == 1
    assert not await a.try_lead() and a.holder == "k8s-b"

    # A write from a stale read is refused (another replica wrote since): not held.
    stale = server.leases[(NAMESPACE, LEASE)] | {
        "metadata": {"name": LEASE, "namespace": NAMESPACE, "resourceVersion": "1"}
    }
    assert not await a._write(stale)
    assert (await asyncio.to_thread(read_lease, server)).spec.holder_identity == "k8s-b"

    # b hands it back (stopping): a takes it at once, without waiting out the duration.
    b.leading = True
    await b.release()
    assert (await asyncio.to_thread(read_lease, server)).spec.holder_identity in ("", None)
    assert await a.try_lead()
    assert (await asyncio.to_thread(read_lease, server)).spec.lease_transitions == 2


def get(url: str, ca_file: str, body: object = None) -> int:
    context = ssl.create_default_context(cafile=ca_file)
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


async def test_only_the_leading_k8s_process_is_ready_and_serves(cluster: Cluster) -> None:
    assert cluster.k8s_settings is not None
    apps: dict[str, K8sApp] = {}
    for who in ("k8s-1", "k8s-2"):
        settings = cluster.k8s_settings.model_copy(
            update={
                "port": 0,
                "leader_election": True,
                "leader_identity": who,
                "lease_duration_s": 3.0,
                "lease_renew_deadline_s": 2.0,
                "lease_retry_s": 0.2,
            }
        )
        apps[who] = await K8sApp.start(settings, HOST, cluster.k8s_transport)
    try:

        async def states() -> dict[str, int]:
            return {
                who: await asyncio.to_thread(
                    get, f"https://127.0.0.1:{app.port}/readyz", cluster.ca
                )
                for who, app in apps.items()
            }

        async def one_leads() -> bool:
            return sorted((await states()).values()) == [200, 503]

        await until(one_leads, "one replica leading")
        ready = await states()
        leader = next(w for w, s in ready.items() if s == 200)
        other = next(w for w in apps if w != leader)
        assert apps[leader].controller.rounds >= 1 and apps[other].controller.rounds == 0
        lease = cluster.api.leases[("gpuloom", "gpuloom-k8s")]
        assert lease["spec"]["holderIdentity"] == leader
        # The waiting replica serves nothing (kube-scheduler and the API server reach the
        # ready one through the Service).
        filter_call = {"Pod": {"metadata": {"uid": "u"}}, "NodeNames": []}
        code = await asyncio.to_thread(
            get, f"https://127.0.0.1:{apps[other].port}/filter", cluster.ca, filter_call
        )
        assert code == 503

        # The leader stops (a rollout): it hands the lease back, the other takes over.
        await apps.pop(leader).stop()
        await until(lambda: _ready(apps[other], cluster.ca), "the other replica leading")
        assert cluster.api.leases[("gpuloom", "gpuloom-k8s")]["spec"]["holderIdentity"] == other
        await until(lambda: apps[other].controller.rounds >= 1, "its first reconcile")
    finally:
        for app in apps.values():
            await app.stop()


async def _ready(app: K8sApp, ca_file: str) -> bool:
    url = f"https://127.0.0.1:{app.port}/readyz"
    return await asyncio.to_thread(get, url, ca_file) == 200
