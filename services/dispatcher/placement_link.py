"""The dispatcher's link to the placement service: it registers this GPU and sends heartbeats.

Registration (RegisterGpu) describes the GPU (model, memory, SMs, MIG, whether MPS-style
spatial sharing is on) and the address placement should dial to reserve on it; placement
answers with the heartbeat interval. Registration and each heartbeat carry the reservations
the book holds (id, priority, memory cap, share): placement counts the ones it did not make
(reserved here directly) as occupied space on this GPU. Both also carry the models the GPU's
model store holds (name, bytes): placement counts their bytes once and places replicas of them
here first, charged less (a load or unload sends a heartbeat at once). Each heartbeat also
carries the GPU's
utilisation and the memory in use; placement answers with the ids of its own jobs it no longer
knows as live, which are released here.

Placement may forget the GPU (NOT_FOUND: register again) or go away (UNAVAILABLE, a deadline:
keep trying at the interval, and register again once it answers, since it may have restarted).
The link warns once per outage, says when placement is back, and never takes the dispatcher
down with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

import grpc
import structlog

from gpuloom.convert.placement import gpu_info_to_pb
from gpuloom.convert.shares import reservation_share_fields
from gpuloom.convert.training import report_to_pb
from gpuloom.domain.gpus import GpuInfo, MigInstance
from gpuloom.services.dispatcher.domain import Reservation
from gpuloom.services.dispatcher.gpu.backend import GpuUsage
from gpuloom.services.dispatcher.node_resources import NONE_REPORTED, NodeResources
from gpuloom.tasks import cancel_and_wait
from gpuloom.transport import open_aio_channel
from gpuloom.v1 import placement_pb2, placement_pb2_grpc

if TYPE_CHECKING:
    from gpuloom.services.dispatcher.core import DispatcherCore

log = structlog.get_logger("gpuloom.dispatcher.placement")

T = TypeVar("T")

# Bounds of the heartbeat interval placement asks for; 0 (unset) gets the default.
MIN_INTERVAL_S = 0.05
MAX_INTERVAL_S = 60.0
DEFAULT_INTERVAL_S = 5.0
# How often to try before placement has ever answered (it may start after the dispatcher).
FIRST_RETRY_S = 1.0
# The token policy that shares a GPU in space (SM percents) as well as time.
SPATIAL_POLICY = "spatiotemporal"
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
_UNREACHABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


def clamp_interval(seconds: float) -> float:
    """The heartbeat interval to use for what placement answered."""
    if math.isnan(seconds) or seconds <= 0:
        return DEFAULT_INTERVAL_S
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, seconds))


def advertised_address(advertise_host: str, bind_host: str, port: int) -> str:
    """host:port placement should dial: `advertise_host`, else the bind host, else (for a
    wildcard bind host) this machine's host name. IPv6 literals are bracketed."""
    host = advertise_host or bind_host
    if host in _WILDCARD_HOSTS:
        host = socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def check_advertise_host(host: str) -> str:
    """`host` if placement can dial it with a port appended; ValueError saying what is wrong."""
    if not host:
        return host
    if len(host) > 253:
        raise ValueError(f"must be at most 253 characters, got {len(host)}")
    if any(c.isspace() for c in host):
        raise ValueError("must not contain spaces")
    if "://" in host or "/" in host:
        raise ValueError("must be a host name or IP address without scheme or path, e.g. 10.0.0.7")
    if ":" in host:
        literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            ipaddress.IPv6Address(literal)
        except ValueError:
            raise ValueError(
                "must not include a port (the dispatcher's own port is added)"
            ) from None
    return host


class PlacementLink:
    """Registers the GPU of `core` with placement at `address` and keeps it registered.

    `dispatcher_address` is the host:port of this dispatcher's gRPC server as placement should
    dial it. Every call to placement and every read of local state is bounded by `timeout_s`.
    """

    def __init__(
        self,
        address: str,
        core: DispatcherCore,
        dispatcher_address: str,
        timeout_s: float = 5.0,
        models: Callable[[], Sequence[tuple[str, int]]] | None = None,
        node: NodeResources = NONE_REPORTED,
    ) -> None:
        """`models` tells what the GPU's model store holds now, as (name, device bytes); it is
        called on the event loop. `node` is the node's CPU and memory for jobs, sent with
        every registration."""
        self._address = address
        self._models = models
        self._node = node
        self._core = core
        self._dispatcher_address = dispatcher_address
        self._timeout_s = timeout_s
        self._interval_s = FIRST_RETRY_S
        self._registered = False
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._beaten = asyncio.Condition()  # notified after each heartbeat placement answered
        self.failures = 0  # rounds that did not complete (placement away, a read failed)

    @property
    def registered(self) -> bool:
        """Whether the last exchange with placement left this GPU registered."""
        return self._registered

    @property
    def interval_s(self) -> float:
        return self._interval_s

    def register_again(self) -> None:
        """The GPU's description changed (MIG mode): register it again now (on the loop)."""
        self._registered = False
        self._wake.set()

    def report_now(self) -> None:
        """What the model store holds changed: send a heartbeat now (on the loop)."""
        self._wake.set()

    async def report_eviction(self, assignment_id: str) -> None:
        """Send a heartbeat now and return once placement has answered one that carried the
        eviction of `assignment_id` (the caller bounds the wait)."""
        self._wake.set()
        async with self._beaten:
            await self._beaten.wait_for(
                lambda: assignment_id not in self._core.unreported_evictions()
            )

    # ---- life cycle (asyncio) ----

    async def start(self) -> None:
        self._channel = open_aio_channel(
            self._address,
            options=[
                # A restarted placement is found again within seconds, not minutes.
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        stub = placement_pb2_grpc.PlacementStub(self._channel)
        self._task = asyncio.create_task(self._run(stub), name="placement-link")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # ---- the loop ----

    async def _run(self, stub: placement_pb2_grpc.PlacementStub) -> None:
        healthy = True  # warn once per outage, not once per attempt
        while True:
            try:
                await self._cycle(stub)
                if not healthy:
                    log.info("placement reachable again", address=self._address)
                healthy = True
            except grpc.aio.AioRpcError as error:
                self.failures += 1
                self._registered = False  # placement may have restarted: register again
                if healthy:
                    log.warning(
                        "placement unreachable: this GPU gets no new jobs until it answers"
                        if error.code() in _UNREACHABLE
                        else "placement refused this GPU's registration or heartbeat",
                        address=self._address,
                        code=error.code().name,
                        error=error.details(),
                    )
                healthy = False
            except Exception as error:  # a local read failed; the dispatcher goes on
                self.failures += 1
                if healthy:
                    log.warning(
                        "heartbeat to placement failed",
                        address=self._address,
                        error=repr(error),
                    )
                healthy = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
            self._wake.clear()

    async def _cycle(self, stub: placement_pb2_grpc.PlacementStub) -> None:
        """Register if needed, then one heartbeat; a GPU placement lost is registered again."""
        fresh = False
        if not self._registered:
            await self._register(stub)
            fresh = True
        try:
            await self._heartbeat(stub)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND or fresh:
                raise
            log.info("placement lost this GPU: registering again", address=self._address)
            self._registered = False
            await self._register(stub)
            await self._heartbeat(stub)

    async def _register(self, stub: placement_pb2_grpc.PlacementStub) -> None:
        gpu, instances = await self._bounded(asyncio.to_thread(self._describe_gpu))
        request = placement_pb2.RegisterGpuRequest(
            gpu=_registration(
                gpu, self._core.node, instances, self._core.policy == SPATIAL_POLICY, self._node
            ),
            dispatcher_address=self._dispatcher_address,
            reservations=[_reservation_to_pb(r) for r in self._reservations()],
            models=self._store_models(),
        )
        response = await stub.RegisterGpu(request, timeout=self._timeout_s)
        self._interval_s = clamp_interval(response.heartbeat_interval_s)
        self._registered = True
        log.info(
            "registered with placement",
            address=self._address,
            gpu=gpu.gpu_uuid,
            dispatcher=self._dispatcher_address,
            heartbeat_s=self._interval_s,
        )

    async def _heartbeat(self, stub: placement_pb2_grpc.PlacementStub) -> None:
        usage, reservations = await self._bounded(asyncio.to_thread(self._read_status))
        evicted = self._core.unreported_evictions()
        request = placement_pb2.HeartbeatRequest(
            gpu_uuid=self._core.gpu.gpu_uuid,
            utilization_percent=usage.utilization_percent,
            memory_used_bytes=usage.memory_used_bytes,
            # An assignment being evicted is on its way out here: not one to ask about.
            assignment_ids=[
                r.assignment_id for r in reservations if r.assignment_id not in evicted
            ],
            reservations=[_reservation_to_pb(r) for r in reservations],
            models=self._store_models(),
            training=[
                report_to_pb(report)
                for report in await self._bounded(self._core.training_reports())
            ],
            evictions=[
                placement_pb2.Eviction(assignment_id=assignment_id, reason=reason)
                for assignment_id, reason in evicted.items()
            ],
            suspend_releases_memory=self._core.book.memory_in_turns,
        )
        response = await stub.Heartbeat(request, timeout=self._timeout_s)
        self._core.evictions_reported(evicted)
        async with self._beaten:
            self._beaten.notify_all()
        for assignment_id in response.release_assignment_ids:
            await self._release(assignment_id)

    async def _release(self, assignment_id: str) -> None:
        try:
            # Shielded: a release cut off half-way would leave the book and channel apart.
            released = await self._bounded(asyncio.shield(self._core.release(assignment_id)))
        except Exception as error:
            log.warning(
                "release asked by placement failed", assignment=assignment_id, error=repr(error)
            )
            return
        log.info("released on placement's request", assignment=assignment_id, held=released)

    # ---- local state (called off the loop) ----

    def _describe_gpu(self) -> tuple[GpuInfo, list[MigInstance]]:
        """The GPU as it is now (MIG mode may have changed since start-up), and its MIG
        instances; what the dispatcher started with where the backend cannot tell."""
        core = self._core
        try:
            gpu = core.backend.gpu(core.gpu.index)
        except Exception as error:
            log.warning("cannot read the GPU's MIG mode", error=repr(error))
            gpu = core.gpu
        if not gpu.mig_enabled:
            return gpu, []
        try:
            return gpu, core.backend.mig_instances(core.gpu.index)
        except Exception as error:
            log.warning("cannot list the GPU's MIG instances", error=repr(error))
            return gpu, []

    def _read_status(self) -> tuple[GpuUsage, list[Reservation]]:
        return self._core.backend.usage(self._core.gpu.index), self._reservations()

    def _store_models(self) -> list[placement_pb2.ResidentModel]:
        if self._models is None:
            return []
        return [placement_pb2.ResidentModel(name=n, bytes=b) for n, b in self._models()]

    def _reservations(self) -> list[Reservation]:
        return sorted(self._core.book.all(), key=lambda r: r.assignment_id)

    async def _bounded(self, awaitable: Awaitable[T]) -> T:
        return await asyncio.wait_for(awaitable, self._timeout_s)


def _reservation_to_pb(reservation: Reservation) -> placement_pb2.DispatcherReservation:
    return placement_pb2.DispatcherReservation(
        assignment_id=reservation.assignment_id,
        **reservation_share_fields(reservation.share),
        task_key=reservation.task_key,
    )


def _registration(
    gpu: GpuInfo,
    node: str,
    instances: list[MigInstance],
    mps_enabled: bool,
    resources: NodeResources,
) -> placement_pb2.GpuInfo:
    """The GPU as the backend describes it, with what registering adds: the node, its MIG
    instances, MPS and the node's resources."""
    return gpu_info_to_pb(
        replace(
            gpu,
            node=node,
            mig_instances=tuple(instances),
            mps_enabled=mps_enabled,
            node_cpu_milli=resources.cpu_milli,
            node_memory_bytes=resources.memory_bytes,
        )
    )
