"""The dispatcher's link to placement, against a fake Placement service on a real gRPC server:
registration, heartbeats with the assignments held, releases placement asks for, and what
happens when placement forgets the GPU, goes away or is not up yet."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs

from gpuloom.domain.errors import Unavailable
from gpuloom.services.common.server import RunningServer, ServiceRegistration, start_server
from gpuloom.services.common.settings import SettingsError, load
from gpuloom.services.dispatcher.app import GpuDispatcher, _stop, start_gpu_dispatcher
from gpuloom.services.dispatcher.gpu.backend import GpuUsage
from gpuloom.services.dispatcher.gpu.simulated import SimulatedBackend
from gpuloom.services.dispatcher.placement_link import (
    DEFAULT_INTERVAL_S,
    PlacementLink,
    advertised_address,
    clamp_interval,
)
from gpuloom.services.dispatcher.settings import DispatcherSettings
from gpuloom.v1 import dispatcher_pb2, dispatcher_pb2_grpc, placement_pb2, placement_pb2_grpc
from tests.conftest import free_port
from tests.dispatcher.conftest import GIB, dispatcher_settings, reserve_request, start_live
from tests.polling import eventually

INTERVAL_S = 0.05


class FakePlacement(placement_pb2_grpc.PlacementServicer):
    """Placement's dispatcher side, in memory: who registered, every heartbeat, and what to
    answer (forget the GPU: NOT_FOUND; ids to release)."""

    def __init__(self) -> None:
        self.registrations: list[placement_pb2.RegisterGpuRequest] = []
        self.heartbeats: list[placement_pb2.HeartbeatRequest] = []
        self.not_found = 0
        self.known: set[str] = set()
        self.release: list[str] = []

    def forget(self) -> None:
        self.known.clear()

    def heartbeat_ids(self) -> list[list[str]]:
        return [list(h.assignment_ids) for h in self.heartbeats]

    async def RegisterGpu(
        self, request: placement_pb2.RegisterGpuRequest, context: grpc.aio.ServicerContext
    ) -> placement_pb2.RegisterGpuResponse:
        self.registrations.append(request)
        self.known.add(request.gpu.ref.gpu_uuid)
        return placement_pb2.RegisterGpuResponse(heartbeat_interval_s=INTERVAL_S)

    async def Heartbeat(
        self, request: placement_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> placement_pb2.HeartbeatResponse:
        if request.gpu_uuid not in self.known:
            self.not_found += 1
            await context.abort(grpc.StatusCode.NOT_FOUND, f"GPU {request.gpu_uuid} unknown")
        self.heartbeats.append(request)
        return placement_pb2.HeartbeatResponse(release_assignment_ids=self.release)


class PlacementServer:
    """A fake placement behind a real gRPC server that can stop and start again on its port."""

    def __init__(self, fake: FakePlacement, port: int = 0) -> None:
        self.fake = fake
        self.port = port
        self._server: RunningServer | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, fake: FakePlacement | None = None) -> None:
        self.fake = fake or self.fake
        servicer = self.fake
        registration = ServiceRegistration(
            "gpuloom.v1.Placement",
            lambda server: placement_pb2_grpc.add_PlacementServicer_to_server(servicer, server),
        )
        self._server = await start_server([registration], "127.0.0.1", self.port)
        self.port = self._server.port

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
            self._server = None


@pytest.fixture
async def placement() -> AsyncIterator[PlacementServer]:
    server = PlacementServer(FakePlacement())
    await server.start()
    yield server
    await server.stop()


@dataclass
class Linked:
    dispatcher: GpuDispatcher
    stub: dispatcher_pb2_grpc.DispatcherStub

    @property
    def link(self) -> PlacementLink:
        assert self.dispatcher.placement_link is not None
        return self.dispatcher.placement_link

    async def assignment_ids(self) -> list[str]:
        status = await self.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
        return sorted(c.assignment.assignment_id for c in status.clients)


@asynccontextmanager
async def linked_dispatcher(
    data_dir: Path,
    placement_address: str,
    backend: SimulatedBackend | None = None,
    **overrides: object,
) -> AsyncIterator[Linked]:
    backend = backend or SimulatedBackend("A100-80GB")
    settings = dispatcher_settings(placement_address=placement_address, node="node-a", **overrides)
    dispatcher = await start_gpu_dispatcher(
        settings, backend, backend.gpu(0), "127.0.0.1", 0, data_dir
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{dispatcher.port}")
    try:
        yield Linked(dispatcher, dispatcher_pb2_grpc.DispatcherStub(channel))
    finally:
        await channel.close()
        await _stop(dispatcher, 0)


# ---- registration and heartbeats ----


async def test_registration_describes_the_gpu_and_where_to_reach_it(
    short_dir: Path, placement: PlacementServer
) -> None:
    fake = placement.fake
    async with linked_dispatcher(short_dir, placement.address) as linked:
        await eventually(lambda: len(fake.heartbeats) >= 2, "registration and heartbeats")
        (registration,) = fake.registrations
        assert registration.dispatcher_address == f"127.0.0.1:{linked.dispatcher.port}"
        gpu = registration.gpu
        assert gpu.ref.node == "node-a" and gpu.ref.gpu_uuid == "SIM-A100-80GB-0"
        assert gpu.model == "A100-80GB"
        assert gpu.memory_bytes == 80 * GIB and gpu.sm_count == 108
        assert gpu.mig_capable and not gpu.mig_enabled and len(gpu.mig_instances) == 0
        assert gpu.mps_enabled  # the default policy shares in space as well as time
        assert {h.gpu_uuid for h in fake.heartbeats} == {"SIM-A100-80GB-0"}
        assert linked.link.registered
        assert linked.link.interval_s == pytest.approx(INTERVAL_S)


async def test_registration_lists_mig_instances_the_policy_and_the_advertised_host(
    short_dir: Path, placement: PlacementServer
) -> None:
    backend = SimulatedBackend("A100-80GB", mig_enabled=True, time_scale=0)
    instance = backend.create_mig_instance(0, 3, 4)
    async with linked_dispatcher(
        short_dir, placement.address, backend, policy="exclusive", advertise_host="gpu-7.example"
    ) as linked:
        await eventually(lambda: placement.fake.registrations, "a registration")
        registration = placement.fake.registrations[0]
        assert registration.dispatcher_address == f"gpu-7.example:{linked.dispatcher.port}"
        assert registration.gpu.mig_enabled and not registration.gpu.mps_enabled
        assert [(i.slices, i.first_slice, i.uuid) for i in registration.gpu.mig_instances] == [
            (3, 4, instance.uuid)
        ]


async def test_heartbeats_carry_usage_and_the_assignments_held(
    short_dir: Path, placement: PlacementServer
) -> None:
    backend = SimulatedBackend("A100-80GB")
    backend.report_usage(0, 42.0, 3 * GIB)
    async with linked_dispatcher(short_dir, placement.address, backend) as linked:
        await linked.stub.Reserve(reserve_request(request=20, assignment_id="job-b"))
        unset = reserve_request(sm=30, request=20, limit=40, assignment_id="job-a")
        unset.ClearField("priority")  # gets the default, 5
        await linked.stub.Reserve(unset)
        await eventually(
            lambda: ["job-a", "job-b"] in placement.fake.heartbeat_ids(),
            "a heartbeat listing both assignments",
        )
        last = placement.fake.heartbeats[-1]
        assert last.utilization_percent == pytest.approx(42.0)
        assert last.memory_used_bytes == 3 * GIB
        # The reservations in full, for placement to count the ones it did not make.
        first = last.reservations[0]
        assert [r.assignment_id for r in last.reservations] == ["job-a", "job-b"]
        assert (first.priority.level, first.memory_cap_bytes) == (5, GIB)
        assert (first.share.sm_percent, first.share.quota.request_percent) == (30, 20)
        assert first.share.quota.limit_percent == 40


@pytest.mark.parametrize("library", ["fake", "fake_min", "off"])
async def test_heartbeats_say_whether_a_suspension_frees_memory(
    short_dir: Path, placement: PlacementServer, library: str
) -> None:
    """With the driver's checkpoint API (the fake driver's) a suspended client's memory is
    freed, so the book takes a time-slice group's memory in turns and says so; a driver
    without the API (fake_min), or the release switched off, keeps today's behaviour."""
    shim = Path(__file__).resolve().parents[2] / "shim" / "build"
    overrides = {
        "cuda_library": str(shim / ("fake" if library == "off" else library) / "libcuda.so.1"),
        "suspend_release_memory": library != "off",
    }
    async with linked_dispatcher(short_dir, placement.address, **overrides) as linked:
        await eventually(lambda: placement.fake.heartbeats, "a first heartbeat")
        frees = library == "fake"
        assert placement.fake.heartbeats[-1].suspend_releases_memory is frees
        assert linked.dispatcher.core.book.memory_in_turns is frees


async def test_registration_and_heartbeats_carry_the_models_the_store_holds(
    short_dir: Path, placement: PlacementServer
) -> None:
    held: list[tuple[str, int]] = [("bert", 3 * GIB)]
    async with linked_dispatcher(short_dir, placement.address) as linked:
        # A link of its own (the dispatcher's has an empty store), slow, woken by report_now.
        link = PlacementLink(
            placement.address, linked.dispatcher.core, "127.0.0.1:1", models=lambda: list(held)
        )
        await link.start()
        try:

            def mine() -> list[placement_pb2.RegisterGpuRequest]:
                return [
                    r for r in placement.fake.registrations if r.dispatcher_address == "127.0.0.1:1"
                ]

            def models_sent() -> list[list[tuple[str, int]]]:
                # The dispatcher's own link heartbeats too, with its empty store.
                return [[(m.name, m.bytes) for m in h.models] for h in placement.fake.heartbeats]

            await eventually(mine, "the link's registration")
            assert [(m.name, m.bytes) for m in mine()[0].models] == [("bert", 3 * GIB)]
            await eventually(lambda: [("bert", 3 * GIB)] in models_sent(), "a heartbeat")
            held.append(("vit", GIB))
            link.report_now()
            await eventually(
                lambda: [("bert", 3 * GIB), ("vit", GIB)] in models_sent(),
                "a heartbeat with both models",
            )
        finally:
            await link.stop()


async def test_assignments_placement_no_longer_knows_are_released(
    short_dir: Path, placement: PlacementServer
) -> None:
    fake = placement.fake
    async with linked_dispatcher(short_dir, placement.address) as linked:
        await linked.stub.Reserve(reserve_request(request=20, assignment_id="stale"))
        await linked.stub.Reserve(reserve_request(request=20, assignment_id="live"))
        await eventually(lambda: ["live", "stale"] in fake.heartbeat_ids(), "both in a heartbeat")
        # An id the dispatcher does not hold is harmless: released is simply False.
        fake.release = ["stale", "ghost"]

        async def only_live_left() -> bool:
            return await linked.assignment_ids() == ["live"]

        await eventually(only_live_left, "the stale assignment released on the dispatcher")
        seen = len(fake.heartbeats)
        await eventually(lambda: len(fake.heartbeats) >= seen + 3, "heartbeats going on")
        assert fake.heartbeat_ids()[-1] == ["live"]
        assert await linked.assignment_ids() == ["live"]


async def test_a_gpu_placement_lost_is_registered_again(
    short_dir: Path, placement: PlacementServer
) -> None:
    fake = placement.fake
    async with linked_dispatcher(short_dir, placement.address):
        await eventually(lambda: len(fake.heartbeats) >= 1, "a first heartbeat")
        assert len(fake.registrations) == 1
        with capture_logs() as logs:
            fake.forget()
            await eventually(lambda: len(fake.registrations) == 2, "a second registration")
            seen = len(fake.heartbeats)
            await eventually(lambda: len(fake.heartbeats) >= seen + 3, "heartbeats accepted again")
        assert fake.not_found == 1
        assert len(fake.registrations) == 2  # registered again once, not on every heartbeat
        # Not an outage: placement answered; it registered again within the same round.
        events = [entry["event"] for entry in logs]
        assert "placement lost this GPU: registering again" in events
        assert not [e for e in events if e.startswith("placement unreachable")], events


# ---- placement away ----


async def test_a_restarted_placement_gets_the_gpu_registered_again(
    short_dir: Path, placement: PlacementServer
) -> None:
    async with linked_dispatcher(short_dir, placement.address) as linked:
        await eventually(lambda: placement.fake.heartbeats, "a first heartbeat")
        with capture_logs() as logs:
            await placement.stop()
            await eventually(lambda: linked.link.failures >= 3, "several failed heartbeats")
            assert not linked.link.registered
            # The dispatcher serves on while placement is away.
            await linked.stub.Reserve(reserve_request(request=20, assignment_id="during-outage"))
            restarted = FakePlacement()  # a restarted placement remembers nothing
            await placement.start(restarted)
            await eventually(
                lambda: ["during-outage"] in restarted.heartbeat_ids(),
                "registration and a heartbeat at the restarted placement",
            )
            # The link logs its recovery once the heartbeat's answer is back, which can be a
            # moment after the placement recorded it.
            await eventually(
                lambda: any(entry["event"] == "placement reachable again" for entry in logs),
                "the recovery logged",
            )
        assert restarted.not_found == 0  # it registered before sending heartbeats
        assert len(restarted.registrations) == 1
        events = [entry["event"] for entry in logs]
        warnings = [e for e in events if e.startswith("placement unreachable")]
        assert len(warnings) == 1, events  # once per outage, not once per attempt
        assert events.count("placement reachable again") == 1


async def test_a_placement_not_up_yet_is_waited_for(short_dir: Path) -> None:
    placement = PlacementServer(FakePlacement(), free_port())
    async with linked_dispatcher(short_dir, placement.address) as linked:
        await linked.stub.Reserve(reserve_request(request=20, assignment_id="early"))
        await eventually(lambda: linked.link.failures >= 1, "a failed attempt")
        await placement.start()
        try:
            await eventually(
                lambda: ["early"] in placement.fake.heartbeat_ids(), "a heartbeat once it is up"
            )
        finally:
            await placement.stop()
        assert len(placement.fake.registrations) == 1


class FlakyUsageBackend(SimulatedBackend):
    """A simulated GPU whose driver can be told to stop answering usage queries."""

    failing = False

    def usage(self, index: int) -> GpuUsage:
        if self.failing:
            raise Unavailable("driver not answering")
        return super().usage(index)


async def test_a_failing_status_read_skips_heartbeats_without_stopping_anything(
    short_dir: Path, placement: PlacementServer
) -> None:
    backend = FlakyUsageBackend("A100-80GB")
    fake = placement.fake
    async with linked_dispatcher(short_dir, placement.address, backend) as linked:
        await eventually(lambda: fake.heartbeats, "a first heartbeat")
        backend.failing = True
        failures = linked.link.failures
        await eventually(lambda: linked.link.failures >= failures + 2, "skipped heartbeats")
        await linked.stub.Reserve(reserve_request(request=20, assignment_id="served"))
        backend.failing = False
        await eventually(lambda: ["served"] in fake.heartbeat_ids(), "heartbeats again")
        assert len(fake.registrations) == 1  # placement never went away: no re-registration


async def test_without_a_placement_address_there_is_no_link(short_dir: Path) -> None:
    dispatcher, channel = await start_live(short_dir)
    try:
        assert dispatcher.placement_link is None
    finally:
        await channel.close()
        await _stop(dispatcher, 0)


# ---- settings and helpers ----


@pytest.mark.parametrize(
    ("host", "problem"),
    [
        ("http://gpu-1", "without scheme"),
        ("gpu 1", "spaces"),
        ("g" * 254, "at most 253"),
        ("gpu-1:50060", "port"),
        ("gpu-1/x", "without scheme or path"),
    ],
)
def test_a_bad_advertise_host_is_refused(
    host: str, problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValidationError, match=problem):
        DispatcherSettings(advertise_host=host)
    monkeypatch.setenv("GPULOOM_DISPATCHER_ADVERTISE_HOST", host)
    with pytest.raises(SettingsError, match="GPULOOM_DISPATCHER_ADVERTISE_HOST"):
        load(DispatcherSettings)


@pytest.mark.parametrize("host", ["", "gpu-1.example", "10.0.0.7", "fd00::7", "[fd00::7]"])
def test_good_advertise_hosts_are_accepted(host: str) -> None:
    assert DispatcherSettings(advertise_host=host).advertise_host == host


@pytest.mark.parametrize(
    ("advertise", "bind", "expected"),
    [
        ("", "127.0.0.1", "127.0.0.1:50060"),
        ("", "0.0.0.0", f"{socket.gethostname()}:50060"),
        ("", "::", f"{socket.gethostname()}:50060"),
        ("gpu-7", "0.0.0.0", "gpu-7:50060"),
        ("fd00::7", "::", "[fd00::7]:50060"),
        ("[fd00::7]", "::", "[fd00::7]:50060"),
    ],
)
def test_the_advertised_address(advertise: str, bind: str, expected: str) -> None:
    assert advertised_address(advertise, bind, 50060) == expected


@pytest.mark.parametrize(
    ("answered", "used"),
    [
        (2.0, 2.0),
        (0.001, 0.05),
        (3600.0, 60.0),
        (0.0, DEFAULT_INTERVAL_S),
        (float("nan"), DEFAULT_INTERVAL_S),
    ],
)
def test_the_heartbeat_interval_is_clamped(answered: float, used: float) -> None:
    assert clamp_interval(answered) == used


async def test_heartbeats_carry_training_cycles_and_suspensions(
    short_dir: Path, placement: PlacementServer
) -> None:
    async with linked_dispatcher(short_dir, placement.address) as linked:
        for name in ("job-t", "job-s", "job-idle"):
            await linked.stub.Reserve(reserve_request(request=20, assignment_id=name))
        introspector = linked.dispatcher.core.introspector
        assert introspector is not None
        # Three seconds of a 100 ms training cycle, as the channel would have read them from the
        # process's ring: 40 ms up and down between 64 and 192 MiB, 60 ms at the floor.
        now = time.monotonic_ns()
        samples = []
        for cycle in range(30):
            start = now - 3_000_000_000 + cycle * 100_000_000
            for i in range(16):
                level = i + 1 if i < 8 else 15 - i
                samples.append((start + i * 2_500_000, (64 + 16 * level) << 20))
        introspector.feed("job-t", samples)
        introspector.analyze("job-t")
        await linked.stub.SuspendClient(
            dispatcher_pb2.SuspendClientRequest(assignment_id="job-s", reason="test")
        )
        # A heartbeat built before the suspension may still arrive: wait for one after it.
        await eventually(
            lambda: any(r.suspended for r in placement.fake.heartbeats[-1].training),
            "a heartbeat with the suspension",
        )
        reports = {r.assignment_id: r for r in placement.fake.heartbeats[-1].training}
        assert sorted(reports) == ["job-s", "job-t"]  # job-idle: nothing to report
        assert reports["job-t"].cycle.minibatch_s == pytest.approx(0.1, rel=0.05)
        assert reports["job-t"].cycle.low_memory_bytes == pytest.approx(64 << 20, rel=0.05)
        assert not reports["job-t"].suspended
        assert reports["job-s"].suspended and not reports["job-s"].HasField("cycle")
        assert reports["job-s"].suspended_reason == "test"
        assert reports["job-t"].suspended_reason == ""
