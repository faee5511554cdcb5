"""gpuloom's Kubernetes components as processes: `gpuloom serve k8s` (the admission webhook,
the scheduler extender and the Pod controller, one Deployment) and `gpuloom serve
device-plugin` (one per GPU node, beside the dispatcher)."""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass

import structlog

from gpuloom.kube.admission import AdmissionPolicy
from gpuloom.kube.asks import priority_classes_from_text
from gpuloom.policies.placement import POLICIES
from gpuloom.services.common.settings import SettingsError
from gpuloom.services.k8s.controller import PodController
from gpuloom.services.k8s.deviceplugin import DevicePlugin, DevicePluginConfig, DevicePluginServer
from gpuloom.services.k8s.extender import Extender, GpuNodes
from gpuloom.services.k8s.http import JsonServer, Route, server_tls
from gpuloom.services.k8s.jobs import PlacementJobs
from gpuloom.services.k8s.kubeapi import KubeApi, KubeApiConfig, KubeApiError
from gpuloom.services.k8s.leader import LeaseElector
from gpuloom.services.k8s.migtasks import MigFollowers
from gpuloom.services.k8s.pods import PodJobs
from gpuloom.services.k8s.settings import DevicePluginSettings, K8sSettings
from gpuloom.services.k8s.webhook import AdmissionWebhook
from gpuloom.transport import TransportSettings

log = structlog.get_logger("gpuloom.k8s")


@dataclass
class K8sApp:
    server: JsonServer
    controller: PodController
    extender: Extender
    jobs: PlacementJobs
    followers: MigFollowers
    elector: LeaseElector | None = None

    @property
    def port(self) -> int:
        return self.server.port

    @classmethod
    async def start(
        cls, settings: K8sSettings, host: str, transport: TransportSettings | None = None
    ) -> K8sApp:
        """`transport`: how placement is called (None: this process's GPULOOM_TLS_* and
        GPULOOM_AUTH_TOKEN_FILE)."""
        api = _api(settings.api_server, settings.api_token_file, settings.api_ca_file, "K8S")
        jobs = PlacementJobs(settings.placement_address, transport=transport)
        classes = priority_classes_from_text(settings.priority_classes)
        index = PodJobs()
        followers = MigFollowers(jobs, api)
        extender = Extender(
            jobs,
            api,
            index,
            GpuNodes(jobs, settings.fleet_ttl_s, time.monotonic),
            POLICIES,
            classes,
            followers,
        )
        webhook = AdmissionWebhook(
            AdmissionPolicy(
                POLICIES,
                settings.scheduler_name,
                settings.users,
                classes,
                plugin_users=settings.plugin_users,
            ),
            jobs,
            settings.fleet_ttl_s,
            time.monotonic,
        )
        controller = PodController(
            jobs, api, index, settings.scheduler_name, settings.resync_s, followers
        )
        elector = _elector(settings, api)

        async def lead() -> None:
            try:
                await controller.start()
            except Exception as error:  # placement or the API server away: the loop retries
                log.warning("first reconcile failed; serving anyway", error=str(error))
                await controller.start_loop()

        async def stop_leading() -> None:
            await controller.stop()
            await followers.stop()

        if elector is None:
            await lead()
        else:
            await elector.start(lead, stop_leading)
        server = JsonServer(
            routes(webhook, extender),
            certified=EXTENDER_ROUTES if settings.extender_client_ca_file else (),
            ready=lambda: elector is None or elector.leading,
        )
        tls = (
            server_tls(
                settings.tls_cert_file, settings.tls_key_file, settings.extender_client_ca_file
            )
            if settings.tls_cert_file
            else None
        )
        await server.start(host, settings.port, tls)
        log.info(
            "k8s webhook and extender listening",
            address=f"{'https' if tls else 'http'}://{host}:{server.port}",
            placement=settings.placement_address,
            api_server=api.server,
        )
        return cls(server, controller, extender, jobs, followers, elector)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.server.stop()
        await self.controller.stop()
        await self.followers.stop()
        if self.elector is not None:
            await self.elector.stop()
        with contextlib.suppress(Exception):
            await self.jobs.close()


EXTENDER_ROUTES = ("/filter", "/prioritize", "/bind")


def routes(webhook: AdmissionWebhook, extender: Extender) -> dict[str, Route]:
    """What the k8s process serves (POST): the webhooks' paths (deploy/k8s/base/webhooks.yaml)
    and the extender's verbs (the scheduler's urlPrefix + "/" + verb, scheduler.yaml)."""
    return {
        "/admission": webhook.review,
        "/validate": webhook.validate,
        "/filter": extender.filter,
        "/prioritize": extender.prioritize,
        "/bind": extender.bind,
    }


@dataclass
class DevicePluginApp:
    server: DevicePluginServer
    jobs: PlacementJobs

    @classmethod
    async def start(
        cls, settings: DevicePluginSettings, transport: TransportSettings | None = None
    ) -> DevicePluginApp:
        """`transport`: as K8sApp.start's."""
        api = _api(
            settings.api_server, settings.api_token_file, settings.api_ca_file, "DEVICE_PLUGIN"
        )
        jobs = PlacementJobs(settings.placement_address, transport=transport)
        config = DevicePluginConfig(
            node=settings.node,
            kubelet_dir=settings.kubelet_dir,
            socket_name=settings.socket_name,
            slots_per_gpu=settings.slots_per_gpu,
            shim_host_path=settings.shim_host_path,
            shim_container_path=settings.shim_container_path,
            scheduler_name=settings.scheduler_name,
            refresh_s=settings.refresh_s,
        )
        server = DevicePluginServer(DevicePlugin(config, jobs, api))
        await server.start()
        return cls(server, jobs)

    @property
    def socket(self) -> str:
        return self.server.plugin.config.socket

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.server.stop()
        with contextlib.suppress(Exception):
            await self.jobs.close()


def _elector(settings: K8sSettings, api: KubeApi) -> LeaseElector | None:
    if not settings.leader_election:
        return None
    return LeaseElector(
        api,
        settings.lease_namespace,
        settings.lease_name,
        settings.leader_identity or socket.gethostname(),
        settings.lease_duration_s,
        settings.lease_renew_deadline_s,
        settings.lease_retry_s,
    )


def _api(server: str, token_file: str, ca_file: str, prefix: str) -> KubeApi:
    """The API server client; SettingsError naming the variables when none can be found."""
    try:
        return KubeApi(KubeApiConfig(server, token_file, ca_file))
    except KubeApiError as error:
        raise SettingsError(
            f"GPULOOM_{prefix}_API_SERVER: {error.message} (set it, with "
            f"GPULOOM_{prefix}_API_TOKEN_FILE and GPULOOM_{prefix}_API_CA_FILE, outside a cluster)"
        ) from None
