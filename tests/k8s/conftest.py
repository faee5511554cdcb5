"""A Kubernetes cluster made of stand-ins (tests/k8s/standins.py) around real gpuloom services:
a profile store, placement, one dispatcher on a simulated A100 per GPU node (node-a, node-b),
gpuloom's k8s process (webhook, extender, controller) over HTTPS, and one device plugin per
GPU node registered with that node's kubelet stand-in. A third node, cpu-only, has no GPU."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

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
from tests.k8s.standins import ApiServer, Kubelet, Webhook
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

    async def restart_k8s(self) -> None:
        """The k8s process stopped and started again on its port (its memory gone)."""
        assert self.k8s_settings is not None
        port = self.k8s.port
        await self.k8s.stop()
        settings = self.k8s_settings.model_copy(update={"port": port})
        self.k8s = await K8sApp.start(settings, HOST)

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
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.fixture
async def cluster(shim_build: Path) -> AsyncIterator[Cluster]:  # noqa: F811
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
        cluster.jobs = PlacementJobs(cluster.placement_address)
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
        tls = pki.write(root / "tls", "k8s", pki.Authority.create(), "localhost")
        cluster.ca = str(tls.ca)
        cluster.k8s_settings = K8sSettings(
            port=0,
            tls_cert_file=str(tls.cert),
            tls_key_file=str(tls.key),
            placement_address=cluster.placement_address,
            api_server=api.url,
            api_token_file=str(root / "k8s.token"),
            resync_s=3600,  # the tests reconcile when they mean to
            fleet_ttl_s=0,
        )
        cluster.k8s = await K8sApp.start(cluster.k8s_settings, HOST)
        stops.append(lambda: cluster.k8s.stop())
        api.webhook = Webhook(f"{cluster.extender}/admission", cluster.ca)
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
                )
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
