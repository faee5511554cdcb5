"""Start gpuloom services in this process: one named service (`gpuloom serve`) or the whole
control plane on the embedded default (`gpuloom up`); or only migrate the databases of the
services that keep state in one (`gpuloom migrate`, the one-shot job of compose and Kubernetes)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import structlog
from pydantic import BaseModel

from gpuloom.services.common.auth import ServerSecurity
from gpuloom.services.common.database import ensure_reachable, head_revision
from gpuloom.services.common.logging import configure_logging
from gpuloom.services.common.metrics import start_metrics_endpoint
from gpuloom.services.common.ports import PortInUse
from gpuloom.services.common.secure_start import secure_process
from gpuloom.services.common.server import wait_for_shutdown_signal
from gpuloom.services.common.settings import CommonSettings, load
from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.services.dispatcher.settings import DispatcherSettings
from gpuloom.services.k8s.app import DevicePluginApp, K8sApp
from gpuloom.services.k8s.settings import DevicePluginSettings, K8sSettings
from gpuloom.services.placement import storage as placement_storage
from gpuloom.services.placement.app import DATABASE_URL_VARIABLE as PLACEMENT_DATABASE_URL
from gpuloom.services.placement.app import PlacementApp
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.services.profile_store import storage as store_storage
from gpuloom.services.profile_store.app import DATABASE_URL_VARIABLE as STORE_DATABASE_URL
from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.services.profile_store.settings import ProfileStoreSettings
from gpuloom.services.profiler.app import ProfilerApp
from gpuloom.services.profiler.settings import ProfilerSettings

log = structlog.get_logger("gpuloom.launcher")

SERVICES = ("profile-store", "profiler", "placement", "dispatcher")
# gpuloom's Kubernetes components: run by `gpuloom serve` only (never by `gpuloom up`).
KUBERNETES_SERVICES = ("k8s", "device-plugin")
# The services with a database (and alembic migrations), in the order `gpuloom migrate` runs them.
DATABASE_SERVICES = ("profile-store", "placement")


@dataclass(frozen=True)
class Endpoint:
    name: str
    address: str


App = TypeVar("App", ProfileStoreApp, ProfilerApp, PlacementApp)
Settings = TypeVar("Settings", bound=BaseModel)


def _pointed_at(
    settings: Settings,
    started: Sequence[object],
    common: CommonSettings,
    keep: bool = True,
    **addresses: type[App],
) -> Settings:
    """`settings` with each address setting named in `addresses` set to that of the service of
    its kind started in this process, if there is one, unless (`keep`) it already names one."""
    update = {}
    for field, kind in addresses.items():
        app = next((app for app in started if isinstance(app, kind)), None)
        if app is not None and not (keep and getattr(settings, field)):
            update[field] = f"{common.bind_host}:{app.port}"
    return settings.model_copy(update=update) if update else settings


async def run(
    services: tuple[str, ...],
    announce: Callable[[list[Endpoint]], None],
    embedded: bool = False,
) -> None:
    """Start the named services, call `announce` with their endpoints, run until SIGINT/SIGTERM.
    `embedded` (`gpuloom up`): make the credentials directory if it is missing; otherwise it
    must be there, or other settings say how to serve (services/common/secure_start.py)."""
    common = load(CommonSettings)
    configure_logging(common.log_level, common.log_format)
    secure_process(services, common.bind_host, embedded)
    ServerSecurity.from_environment()  # TLS and token settings checked before anything starts
    started: list[
        ProfileStoreApp | ProfilerApp | PlacementApp | DispatcherApp | K8sApp | DevicePluginApp
    ] = []
    endpoints: list[Endpoint] = []
    port_variable = ""  # the setting of the port being bound
    try:
        if "profile-store" in services:
            port_variable = "GPULOOM_PROFILE_STORE_PORT"
            app = await ProfileStoreApp.start(
                load(ProfileStoreSettings), common.bind_host, common.data_dir
            )
            started.append(app)
            endpoints.append(Endpoint("profile-store (gRPC)", f"{common.bind_host}:{app.port}"))
        if "profiler" in services:
            port_variable = "GPULOOM_PROFILER_PORT"
            # The store in this process, wherever the settings say it listens.
            settings = _pointed_at(
                load(ProfilerSettings),
                started,
                common,
                keep=False,
                profile_store_address=ProfileStoreApp,
            )
            profiler = await ProfilerApp.start(settings, common.bind_host)
            started.append(profiler)
            endpoints.append(Endpoint("profiler (gRPC)", f"{common.bind_host}:{profiler.port}"))
        if "placement" in services:
            port_variable = "GPULOOM_PLACEMENT_PORT"
            settings = _pointed_at(
                load(PlacementSettings), started, common, profile_store_address=ProfileStoreApp
            )
            placement = await PlacementApp.start(settings, common.bind_host, common.data_dir)
            started.append(placement)
            endpoints.append(Endpoint("placement (gRPC)", f"{common.bind_host}:{placement.port}"))
        if "dispatcher" in services:
            port_variable = "GPULOOM_DISPATCHER_PORT"  # GPU i's dispatcher listens on it + i
            settings = _pointed_at(
                load(DispatcherSettings),
                started,
                common,
                profiler_address=ProfilerApp,
                profile_store_address=ProfileStoreApp,
                placement_address=PlacementApp,
            )
            dispatchers = await DispatcherApp.start(settings, common.bind_host, common.data_dir)
            started.append(dispatchers)
            for dispatcher in dispatchers.dispatchers:
                gpu = dispatcher.core.gpu
                endpoints.append(
                    Endpoint(
                        f"dispatcher GPU {gpu.index} {gpu.model} (gRPC)",
                        f"{common.bind_host}:{dispatcher.port}",
                    )
                )
        if "k8s" in services:
            port_variable = "GPULOOM_K8S_PORT"
            k8s = await K8sApp.start(load(K8sSettings), common.bind_host)
            started.append(k8s)
            endpoints.append(
                Endpoint("k8s webhook and extender (HTTP)", f"{common.bind_host}:{k8s.port}")
            )
        if "device-plugin" in services:
            plugin = await DevicePluginApp.start(load(DevicePluginSettings))
            started.append(plugin)
            endpoints.append(Endpoint("device plugin (kubelet gRPC)", f"unix://{plugin.socket}"))
        port_variable = "GPULOOM_METRICS_PORT"
        metrics_port = start_metrics_endpoint(common.bind_host, common.metrics_port)
        if metrics_port is not None:
            endpoints.append(
                Endpoint(
                    "metrics (Prometheus)", f"http://{common.bind_host}:{metrics_port}/metrics"
                )
            )
        # Start-up objects (modules, descriptors, pools) never die: moving them out of the
        # collector's view makes the full collections that run under load much shorter.
        gc.collect()
        gc.freeze()
        announce(endpoints)
        received = await wait_for_shutdown_signal()
        log.info("shutting down", signal=received.name)
    except PortInUse as error:
        # Name the setting that picks the port: the usual cause is a second `gpuloom up`.
        raise PortInUse(error.host, error.port, port_variable) from None
    finally:
        for app in reversed(started):
            await app.stop()
    log.info("stopped")


@dataclass(frozen=True)
class Migrated:
    service: str
    database: str  # its URL, password hidden
    revision: str  # the newest revision, which the database now has


async def migrate(services: tuple[str, ...]) -> list[Migrated]:
    """Bring the database of each named service (of DATABASE_SERVICES) to its newest alembic
    revision, with the settings the service itself would use (its DATABASE_URL and
    DATABASE_SCHEMA), and return what was migrated. Idempotent; safe beside running services
    (the migrations serialise on an advisory lock on PostgreSQL)."""
    common = load(CommonSettings)
    configure_logging(common.log_level, common.log_format)
    done: list[Migrated] = []
    for service in DATABASE_SERVICES:
        if service not in services:
            continue
        if service == "profile-store":
            store_settings = load(ProfileStoreSettings)
            engine = store_storage.create_engine(store_settings, common.data_dir)
            schema, variable = store_settings.database_schema, STORE_DATABASE_URL
            upgrade, migrations = store_storage.migrate, store_storage.MIGRATIONS
        else:
            placement_settings = load(PlacementSettings)
            engine = placement_storage.create_engine(placement_settings, common.data_dir)
            schema, variable = placement_settings.database_schema, PLACEMENT_DATABASE_URL
            upgrade, migrations = placement_storage.migrate, placement_storage.MIGRATIONS
        try:
            await ensure_reachable(engine, variable)
            await upgrade(engine, schema)
        finally:
            await engine.dispose()
        database = engine.url.render_as_string(hide_password=True)
        revision = head_revision(migrations)
        log.info("migrated", service=service, database=database, revision=revision)
        done.append(Migrated(service, database, revision))
    return done
