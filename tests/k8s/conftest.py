"""A Kubernetes cluster made of stand-ins (tests/k8s/standins.py) around real gpuloom services:
a profile store, placement, one dispatcher on a simulated A100 per GPU node (node-a, node-b),
gpuloom's k8s process (webhook, extender, controller) over HTTPS, and one device plugin per
GPU node registered with that node's kubelet stand-in. A third node, cpu-only, has no GPU.
`secured_cluster` is the same with mutual TLS and bearer tokens from a credentials directory of
`gpuloom credentials init --kubernetes`, each component with its own identity."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuloom.credentials import (
    ADMIN,
    KUBERNETES_SUBMITTER,
    SERVER_NAME,
    Credentials,
    ensure_kubernetes,
)
from gpuloom.domain.placement import JobView
from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.services.dispatcher.settings import DispatcherSettings
from gpuloom.services.k8s.app import DevicePluginApp, K8sApp
from gpuloom.services.k8s.jobs import PlacementJobs
from gpuloom.services.k8s.settings import DevicePluginSettings, K8sSettings
from gpuloom.services.placement.app import PlacementApp
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.services.profile_store.settings import ProfileStoreSettings
from gpuloom.transport import TransportSettings
from tests.k8s.standins import ApiServer, Kubelet, Webhook
from tests.polling import eventually
from tests.security import pki
from tests.shim.conftest import run, shim_build  # noqa: F401  (re-exported fixtures)

HOST = "127.0.0.1"
GPU_NODES = ("node-a", "node-b")
NODES = [*GPU_NODES, "cpu-only"]
CONTAINER_SHIM = "/opt/gpuloom/shim/libgpuloom.so"
SLOTS = 4
K8S_USER = "system:serviceaccount:gpuloom:gpuloom-k8s"
PLUGIN_USER = "system:serviceaccount:gpuloom:gpuloom-device-plugin"


@dataclass
class Cluster:
    root: Path
    api: ApiServer
    store: ProfileStoreApp
    placement: PlacementApp | None
    dispatchers: dict[str, DispatcherApp]
    k8s: K8sApp
    kubelets: dict[str, Kubelet]
    plugins: dict[str, DevicePluginApp]
    jobs: PlacementJobs  # the test's own view of placement
    ca: str
    k8s_settings: K8sSettings | None = None
    k8s_transport: TransportSettings | None = None
    # kube-scheduler's client certificate, where the extender requires one (secured).
    scheduler_cert: tuple[str, str] | None = None
    function_owner: str = ""  # placement's GPULOOM_PLACEMENT_FUNCTION_OWNER

    async def restart_k8s(self) -> None:
        """The k8s process stopped and started again on its port (its memory gone)."""
        assert self.k8s_settings is not None
        port = self.k8s.port
        await self.k8s.stop()
        settings = self.k8s_settings.model_copy(update={"port": port})
        self.k8s = await K8sApp.start(settings, HOST, self.k8s_transport)

    @property
    def extender(self) -> str:
        return f"https://127.0.0.1:{self.k8s.port}"

    @property
    def placement_address(self) -> str:
        assert self.placement is not None
        return f"{HOST}:{self.placement.port}"

    async def start_placement(self, port: int = 0) -> None:
        settings = PlacementSettings(
            port=port,
            database_url=f"sqlite:///{self.root / 'placement.db'}",
            profile_store_address=f"{HOST}:{self.store.port}",
            heartbeat_interval_s=0.5,
            function_owner=self.function_owner,
            mig_batch_window_s=1.0,  # a MIG Pod's batch is due a second after its submission
        )
        self.placement = await PlacementApp.start(settings, HOST, self.root)

    async def reconcile(self) -> None:
        await self.k8s.controller.reconcile()

    async def job_of(self, namespace: str, name: str) -> JobView:
        pod = self.api.pod(namespace, name)
        assert pod is not None
        uid = pod["metadata"]["uid"]
        job = self.k8s.controller._index.jobs.get(uid)
        assert job is not None, f"no job for {namespace}/{name}"
        return await self.jobs.get(job.job_id)

    async def held(self, node: str) -> set[str]:
        """The assignments the node's dispatcher holds."""
        dispatcher = self.dispatchers[node].dispatchers[0]
        return {r.assignment_id for r in dispatcher.core.book.all()}


async def until(check: Callable[[], Any], what: str, timeout_s: float = 15.0) -> Any:
    return await eventually(check, what, timeout_s, pause_s=0.05)


@dataclass(frozen=True)
class Secured:
    """A cluster whose gpuloom services serve mutual TLS and bearer tokens from a credentials
    directory made by `gpuloom credentials init --kubernetes` (ensure_kubernetes), as
    deploy/k8s runs them: the services with the services' certificate and token, the k8s
    process and the device plugins each with its own certificate and its token of the
    submitter `kubernetes`, placement giving auto-scaling's replicas to that submitter."""

    credentials: Credentials

    def transport(self, who: str, token: str | None = None) -> TransportSettings:
        """A client's settings: `who`'s certificate (admin, k8s, device-plugin, placement) and
        the token of `token` (a file name in the directory, default WHO.token)."""
        cert, key = self.credentials.certificate(who)
        return TransportSettings.model_construct(
            tls_ca_file=str(self.credentials.ca),
            tls_cert_file=str(cert),
            tls_key_file=str(key),
            tls_server_name=SERVER_NAME,
            auth_token_file=str(self.credentials.file(token or f"{who}.token")),
            auth_token="",
        )

    def environment(self) -> dict[str, str]:
        """What the gpuloom services are started with (placement's certificate for all)."""
        cert, key = self.credentials.certificate("placement")
        return {
            "GPULOOM_TLS_CERT_FILE": str(cert),
            "GPULOOM_TLS_KEY_FILE": str(key),
            "GPULOOM_TLS_CA_FILE": str(self.credentials.ca),
            "GPULOOM_TLS_SERVER_NAME": SERVER_NAME,
            "GPULOOM_AUTH_TOKENS_FILE": str(self.credentials.tokens),
            "GPULOOM_AUTH_TOKEN_FILE": str(self.credentials.service_token),
        }


@pytest.fixture
async def cluster(shim_build: Path) -> AsyncIterator[Cluster]:  # noqa: F811
    async with _cluster(shim_build, None) as made:
        yield made


@pytest.fixture
async def secured_cluster(
    shim_build: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> AsyncIterator[tuple[Cluster, Secured]]:
    secured = Secured(ensure_kubernetes(tmp_path / "credentials"))
    for variable in [v for v in os.environ if v.startswith("GPULOOM_")]:
        monkeypatch.delenv(variable)
    for variable, value in secured.environment().items():
        monkeypatch.setenv(variable, value)
    async with _cluster(shim_build, secured) as made:
        yield made, secured


@contextlib.asynccontextmanager
async def _cluster(
    shim_build: Path,  # noqa: F811
    secured: Secured | None,
) -> AsyncIterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="gl-k8s-", dir="/tmp"))
    stops: list[Callable[[], Any]] = []
    try:
        store = await ProfileStoreApp.start(
            ProfileStoreSettings(port=0, database_url=f"sqlite:///{root / 'profiles.db'}"),
            HOST,
            root,
        )
        stops.append(lambda: store.stop(0))
        cluster = Cluster(root, ApiServer({}), store, None, {}, None, {}, {}, None, "")  # type: ignore[arg-type]
        if secured is not None:
            cluster.function_owner = KUBERNETES_SUBMITTER
        await cluster.start_placement()
        stops.append(lambda: cluster.placement.stop(0) if cluster.placement else None)
        for i, node in enumerate(GPU_NODES):
            # GPU i of a simulated fleet of two: a UUID of its own (SIM-A100-80GB-i).
            settings = DispatcherSettings(
                port=0,
                backend="simulated",
                sim_gpus="2xA100-80GB",
                gpus=str(i),
                node=node,
                placement_address=cluster.placement_address,
            )
            (root / node).mkdir()
            app = await DispatcherApp.start(settings, HOST, root / node)
            cluster.dispatchers[node] = app
            stops.append(lambda app=app: app.stop(0))
        # The test's own view of placement: an admin's, where tokens are taken.
        cluster.jobs = PlacementJobs(
            cluster.placement_address,
            transport=secured.transport(ADMIN) if secured else None,
        )
        stops.append(cluster.jobs.close)
        await until(lambda: _gpus(cluster, len(GPU_NODES)), "the GPUs registered")

        tokens = {"k8s": "k8s-token-0123456789", "plugin": "plugin-token-0123456789"}
        for name, token in tokens.items():
            (root / f"{name}.token").write_text(token + "\n")
        api = ApiServer(
            {tokens["k8s"]: K8S_USER, tokens["plugin"]: PLUGIN_USER, "alice-token": "alice"}
        )
        api.start()
        stops.append(api.stop)
        cluster.api = api
        if secured is None:
            tls = pki.write(root / "tls", "k8s", pki.Authority.create(), "localhost")
            cluster.ca, cert, key = str(tls.ca), str(tls.cert), str(tls.key)
        else:  # the webhook and extender serve with the k8s process's own certificate
            cluster.ca = str(secured.credentials.ca)
            cert, key = map(str, secured.credentials.certificate("k8s"))
            scheduler = secured.credentials.certificate("scheduler")
            cluster.scheduler_cert = (str(scheduler[0]), str(scheduler[1]))
        cluster.k8s_transport = secured.transport("k8s") if secured else None
        cluster.k8s_settings = K8sSettings(
            port=0,
            tls_cert_file=cert,
            tls_key_file=key,
            extender_client_ca_file=cluster.ca if secured else "",
            placement_address=cluster.placement_address,
            api_server=api.url,
            api_token_file=str(root / "k8s.token"),
            resync_s=3600,  # the tests reconcile when they mean to
            fleet_ttl_s=0,
        )
        cluster.k8s = await K8sApp.start(cluster.k8s_settings, HOST, cluster.k8s_transport)
        stops.append(lambda: cluster.k8s.stop())
        api.webhook = Webhook(f"{cluster.extender}/admission", cluster.ca)
        api.validating = Webhook(f"{cluster.extender}/validate", cluster.ca)
        for node in GPU_NODES:
            directory = root / f"kubelet-{node}"
            directory.mkdir()
            kubelet = Kubelet(directory)
            await kubelet.start()
            stops.append(kubelet.stop)
            cluster.kubelets[node] = kubelet
            plugin = await DevicePluginApp.start(
                DevicePluginSettings(
                    node=node,
                    placement_address=cluster.placement_address,
                    kubelet_dir=str(directory),
                    slots_per_gpu=SLOTS,
                    shim_host_path=str(shim_build / "libgpuloom.so"),
                    shim_container_path=CONTAINER_SHIM,
                    api_server=api.url,
                    api_token_file=str(root / "plugin.token"),
                    refresh_s=0.2,
                ),
                secured.transport("device-plugin") if secured else None,
            )
            stops.append(plugin.stop)
            cluster.plugins[node] = plugin
            await kubelet.wait_devices(SLOTS)
        yield cluster
    finally:
        for stop in reversed(stops):
            result = stop()
            if asyncio.iscoroutine(result):
                await result
        shutil.rmtree(root, ignore_errors=True)


async def _gpus(cluster: Cluster, count: int) -> bool:
    return len(await cluster.jobs.gpus()) == count
