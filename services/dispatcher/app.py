"""Wiring of the dispatchers: settings -> GPU backend -> per GPU: reservation book, token
scheduler, shim channel thread, core and gRPC server (port base + GPU index)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from gpuloom.domain.gpus import GpuInfo
from gpuloom.policies.admission.levels import LevelScheduler
from gpuloom.policies.tokens.registry import get_policy
from gpuloom.policies.tokens.scheduler import TokenScheduler
from gpuloom.services.common.server import RunningServer, ServiceRegistration, start_server
from gpuloom.services.dispatcher.admission_engine import AdmissionEngine
from gpuloom.services.dispatcher.channel import ChannelLimits, ShimChannel
from gpuloom.services.dispatcher.checkpoint import Checkpointer
from gpuloom.services.dispatcher.core import DispatcherCore
from gpuloom.services.dispatcher.domain import DispatcherEvent
from gpuloom.services.dispatcher.gpu import open_backend
from gpuloom.services.dispatcher.gpu.backend import GpuBackend
from gpuloom.services.dispatcher.gpu.simulated import fleet_id
from gpuloom.services.dispatcher.introspection import IntrospectionConfig, TrainingIntrospector
from gpuloom.services.dispatcher.kernel_tables import KernelTables
from gpuloom.services.dispatcher.measurements import MeasurementBuffer
from gpuloom.services.dispatcher.model_store import ModelStore, StoreConfig
from gpuloom.services.dispatcher.mps import MpsConfig, MpsSupervisor, parse_control
from gpuloom.services.dispatcher.node_resources import node_resources
from gpuloom.services.dispatcher.placement_link import PlacementLink, advertised_address
from gpuloom.services.dispatcher.profiling import ProfilerLink
from gpuloom.services.dispatcher.reservations import ReservationBook
from gpuloom.services.dispatcher.servicer import SERVICE, DispatcherServicer
from gpuloom.services.dispatcher.settings import (
    COMPOSED_POLICY,
    FIKIT_POLICY,
    DispatcherSettings,
)
from gpuloom.v1 import dispatcher_pb2_grpc as pb_grpc

log = structlog.get_logger("gpuloom.dispatcher")


@dataclass
class GpuDispatcher:
    core: DispatcherCore
    channel: ShimChannel
    server: RunningServer
    # Where measure-mode records go: to the profiler, or (without one) a bounded buffer.
    measurements: MeasurementBuffer | None
    profiler_link: ProfilerLink | None
    # The GPU's native admission engine (every policy), and under fikit and composed where its
    # FIKIT half's kernel tables come from.
    engine: AdmissionEngine
    # Registration and heartbeats to placement; None without GPULOOM_DISPATCHER_PLACEMENT_ADDRESS.
    placement_link: PlacementLink | None = None
    kernel_tables: KernelTables | None = None
    # SM-partition policies with MPS on: the GPU's supervised MPS control daemon.
    mps: MpsSupervisor | None = None
    # The GPU's model store (its process starts on the first LoadModel).
    models: ModelStore | None = None

    @property
    def port(self) -> int:
        return self.server.port


def _follow_mps(engine: AdmissionEngine, running: bool) -> None:
    with contextlib.suppress(RuntimeError):  # the engine stopped first, at shutdown
        engine.set_harvesting(running)


def mps_supervisor(settings: DispatcherSettings, gpu: GpuInfo, data_dir: Path) -> MpsSupervisor:
    base = (settings.mps_dir or data_dir / "dispatcher" / "mps") / f"gpu-{gpu.index}"
    config = MpsConfig(
        control=parse_control(settings.mps_control),
        pipe_dir=base.absolute() / "pipe",
        log_dir=base.absolute() / "log",
        visible_device=gpu.gpu_uuid if gpu.gpu_uuid.startswith(("GPU-", "MIG-")) else None,
        start_timeout_s=settings.mps_start_timeout_s,
    )
    return MpsSupervisor(config, str(gpu.index))


async def start_gpu_dispatcher(
    settings: DispatcherSettings,
    backend: GpuBackend,
    gpu: GpuInfo,
    host: str,
    port: int,
    data_dir: Path,
) -> GpuDispatcher:
    """One dispatcher: the GPU's reservations live in data_dir/dispatcher/gpu-INDEX/."""
    state_dir = data_dir / "dispatcher" / f"gpu-{gpu.index}"
    state_dir.mkdir(parents=True, exist_ok=True)
    socket_dir = settings.socket_dir or data_dir / "dispatcher"
    socket_path = (socket_dir / f"gpu-{gpu.index}.sock").absolute()
    book = ReservationBook(gpu.memory_bytes, state_dir / "reservations.json")
    arguments = settings.policy_arguments()
    config = arguments.tokens
    composed = settings.policy == COMPOSED_POLICY
    fikit = composed or settings.policy == FIKIT_POLICY
    scheduler: TokenScheduler | LevelScheduler
    if composed:
        # The arbiter between priority levels; within each level, spatio-temporal leases.
        scheduler = LevelScheduler("spatiotemporal", config, time.monotonic())
    else:
        # Under fikit no share is leased (kernels are admitted natively); the token scheduler
        # only serves the channel's lease path, which FIKIT shims do not use.
        token_policy = "exclusive" if fikit else settings.policy
        scheduler = TokenScheduler(get_policy(token_policy), config, time.monotonic())
    # One engine for every policy: a token policy adds no FIKIT task, so its FIKIT half idles.
    # Where composed runs MPS, it also admits fill kernels beside the holder's running one.
    harvest = None
    if settings.harvests(gpu.gpu_uuid):
        if gpu.sm_count > 0:
            harvest = arguments.harvest
        else:
            log.warning("spatial harvesting off: the GPU's SM count is unknown", gpu=gpu.index)
    engine = AdmissionEngine(arguments.fikit, harvest=harvest, sms=gpu.sm_count)
    kernel_tables = None
    if fikit and settings.profile_store_address:
        kernel_tables = KernelTables(
            settings.profile_store_address,
            gpu.model,
            asyncio.get_running_loop(),
        )
    link = None
    measurements = None
    if settings.profiler_address:
        link = ProfilerLink(settings.profiler_address, gpu.model, settings.profiler_poll_s)
        sink = link.records
    else:
        measurements = MeasurementBuffer()
        sink = measurements
    loop = asyncio.get_running_loop()
    mps = None
    if settings.runs_mps(gpu.gpu_uuid):
        # A daemon that does not start is reported and retried; the GPU is served anyway
        # (SM-partition reservations are refused until it runs).
        mps = mps_supervisor(settings, gpu, data_dir)
        if harvest is not None:
            # Kernels co-run only among MPS clients: the rule is asked while the daemon runs.
            engine.set_harvesting(False)
            mps.on_running = functools.partial(_follow_mps, engine)
        await asyncio.to_thread(mps.start)
    core: DispatcherCore

    def on_event(event: DispatcherEvent) -> None:
        core.publish_from_channel(event)  # the channel emits only once started, after `core`

    introspector = None
    if settings.training_sample_us:
        introspector = TrainingIntrospector(
            str(gpu.index),
            IntrospectionConfig(
                sample_period_s=settings.training_sample_us / 1e6,
                window_s=settings.training_window_s,
                analyze_s=settings.training_analyze_ms / 1e3,
            ),
        )
    channel = ShimChannel(
        gpu_label=str(gpu.index),
        socket_path=socket_path,
        book=book,
        scheduler=scheduler,
        on_event=on_event,
        measurements=sink,
        limits=ChannelLimits(
            max_frame_bytes=settings.max_frame_bytes,
            register_timeout_s=settings.register_timeout_s,
            max_connections_per_uid=settings.max_connections_per_uid,
        ),
        window_s=config.window_s,
        choose_mode=None if link is None else link.choose_mode,
        engine=engine,
        fikit=fikit,
        composed=composed,
        kernel_tables=kernel_tables,
        introspector=introspector,
        harvest_window_s=settings.harvest_window_s,
    )
    checkpointer = None
    if settings.suspend_release_memory:
        checkpointer = Checkpointer(settings.cuda_library, settings.suspend_lock_timeout_ms)
        # Loaded now, not at the first suspension: whether a suspended client's memory is freed
        # decides whether a time-slice group's members take their memory in turns (the book,
        # and placement through the heartbeats).
        book.memory_in_turns = await asyncio.to_thread(checkpointer.driver) is not None
    core = DispatcherCore(
        gpu=gpu,
        node=settings.node,
        backend=backend,
        book=book,
        channel=channel,
        socket_path=str(socket_path),
        policy=settings.policy,
        window_s=config.window_s,
        loop=loop,
        state_dir=state_dir,
        profiler_link=link,
        mps=mps,
        introspector=introspector,
        suspend_max_wait_s=settings.suspend_max_wait_ms / 1e3,
        checkpointer=checkpointer,
    )

    def store_environment() -> dict[str, str]:
        # With the GPU's MPS daemon running, the store process is one of its clients (whole GPU).
        if mps is None or not mps.available()[0]:
            return {}
        return mps.client_environment(100, gpu.memory_bytes)

    models = ModelStore(
        gpu,
        book,
        StoreConfig(
            settings.models_dir,
            settings.cuda_library,
            state_dir / "model-store.log",
            store_environment,
        ),
    )
    channel.start()
    if link is not None:
        await link.start()
    try:
        servicer = DispatcherServicer(core, models)
        registration = ServiceRegistration(
            SERVICE, lambda server: pb_grpc.add_DispatcherServicer_to_server(servicer, server)
        )
        server = await start_server([registration], host, port, settings.max_message_bytes)
    except BaseException:
        channel.stop()
        if link is not None:
            await link.stop()
        await _stop_engine(engine, kernel_tables)
        await models.close()
        if mps is not None:
            await asyncio.to_thread(mps.stop)
        raise
    core.grpc_address = advertised_address(settings.advertise_host, host, server.port)
    placement_link = None
    if settings.placement_address:  # after the server is up: placement dials its real port
        placement_link = PlacementLink(
            settings.placement_address,
            core,
            core.grpc_address,
            models=lambda: [(m.name, m.nbytes) for m in models.list()],
            node=node_resources(settings.node_cpu_milli, settings.node_memory_bytes),
        )
        core.on_gpu_changed = placement_link.register_again
        models.on_change = placement_link.report_now
        core.report_eviction = placement_link.report_eviction
        await placement_link.start()
    log.info(
        "dispatcher ready",
        gpu=gpu.index,
        model=gpu.model,
        uuid=gpu.gpu_uuid,
        backend=backend.name,
        policy=settings.policy,
        port=server.port,
        socket=str(socket_path),
        reservations=len(book.all()),
        placement=settings.placement_address or None,
        mps=None if mps is None else ("running" if mps.available()[0] else "not running"),
    )
    return GpuDispatcher(
        core,
        channel,
        server,
        measurements,
        link,
        engine,
        placement_link,
        kernel_tables,
        mps,
        models,
    )


@dataclass
class DispatcherApp:
    backend: GpuBackend
    dispatchers: list[GpuDispatcher]

    @classmethod
    async def start(cls, settings: DispatcherSettings, host: str, data_dir: Path) -> DispatcherApp:
        fleet = ""
        if settings.backend != "nvml":  # simulated GPUs, unique to this data directory
            try:
                fleet = fleet_id(data_dir / "dispatcher")
            except ValueError as error:
                raise OSError(str(error)) from None
        backend = await asyncio.to_thread(
            open_backend, settings.backend, settings.sim_gpus, fleet_id=fleet
        )
        dispatchers: list[GpuDispatcher] = []
        try:
            gpus = backend.gpus()
            try:
                indexes = settings.gpu_indexes(len(gpus))
            except ValueError as error:
                raise OSError(str(error)) from None
            for index in indexes:
                port = settings.port + index if settings.port else 0
                dispatchers.append(
                    await start_gpu_dispatcher(settings, backend, gpus[index], host, port, data_dir)
                )
        except BaseException:
            for dispatcher in dispatchers:
                await _stop(dispatcher, 0)
            backend.close()
            raise
        return cls(backend, dispatchers)

    async def stop(self, grace_s: float = 5.0) -> None:
        for dispatcher in self.dispatchers:
            await _stop(dispatcher, grace_s)
        self.backend.close()


async def _stop(dispatcher: GpuDispatcher, grace_s: float) -> None:
    # First: releases placement asks for must not reach a channel that is stopping.
    if dispatcher.placement_link is not None:
        await dispatcher.placement_link.stop()
    await dispatcher.server.stop(grace_s)
    await asyncio.to_thread(dispatcher.channel.stop)
    if dispatcher.profiler_link is not None:
        await dispatcher.profiler_link.stop()
    await _stop_engine(dispatcher.engine, dispatcher.kernel_tables)
    if dispatcher.models is not None:  # after the server: no load can start a new process
        await dispatcher.models.close()
    if dispatcher.mps is not None:  # last: its clients were the processes stopped above
        await asyncio.to_thread(dispatcher.mps.stop)


async def _stop_engine(engine: AdmissionEngine, kernel_tables: KernelTables | None) -> None:
    if kernel_tables is not None:
        await kernel_tables.close()
    engine.stop()
