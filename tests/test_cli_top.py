"""`gpuloom top` against a real `gpuloom up` (two simulated A100s, the second in MIG mode), with
processes holding shares through the Python shim client: the JSON and the text frame show what
placement and the dispatchers know, the live view refreshes on a terminal, an unreachable
placement is one line; and the gauges of the metrics endpoint match."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from rich.console import Console

from gpuloom.clients.cli.top import render
from gpuloom.clients.placement import PlacementClient
from gpuloom.clients.shim import ShimClient
from gpuloom.clients.top import FleetView
from gpuloom.convert.dispatcher import status_from_pb, status_to_pb
from gpuloom.domain.gpus import GpuInfo
from gpuloom.domain.placement import GpuEntry, JobKind, JobSpec, JobView
from gpuloom.domain.shares import share_of
from gpuloom.transport import open_channel
from gpuloom.v1 import dispatcher_pb2, dispatcher_pb2_grpc
from tests.plane import GPULOOM, PLANE_FLEET_ID, Plane, free_port, running_plane, wait_for

GIB = 1 << 30
GPU0, GPU1 = (f"SIM-A100-80GB-{i}-{PLANE_FLEET_ID}" for i in range(2))


@dataclass(frozen=True)
class Day:
    plane: Plane
    serve: JobView  # priority 1, SM 60 x quota 40 (limit 60), 4 GiB; reports 3 GiB in use
    batch: JobView  # priority 7, SM 60 x quota 10, 8 GiB; over its limit: blocked


@pytest.fixture(scope="module")
def day(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Day]:
    state = tmp_path_factory.mktemp("top")
    with running_plane(state, "A100-80GB,A100-80GB:mig", 2, metrics=True) as plane:
        with PlacementClient(plane.placement) as placement:
            serve = placement.submit(
                JobSpec(
                    name="serve",
                    kind=JobKind.INFERENCE,
                    share=share_of(60, 40, 60, memory_bytes=4 * GIB, priority=1),
                    mps=True,
                )
            )
            batch = placement.submit(
                JobSpec(
                    name="batch[red]",  # shown as written, not as rich markup
                    kind=JobKind.BATCH,
                    share=share_of(60, 10, memory_bytes=8 * GIB, priority=7),
                    mps=True,
                )
            )
            serve, batch = placement.get(serve.job_id), placement.get(batch.job_id)
        clients = [connect(serve), connect(batch)]
        try:
            serving, batching = clients
            serving.allocated_bytes = 3 * GIB
            serving.acquire()
            serving.record_usage(0.05)
            serving.release()  # the usage report carries the allocated bytes
            batching.acquire()
            batching.record_usage(30.0)  # far past its 10% limit: blocked for many windows
            batching.release()
            with pytest.raises(TimeoutError):
                batching.acquire(timeout_s=0.05)  # asked, and left waiting
            yield Day(plane, serve, batch)
        finally:
            for client in clients:
                client.close()


def connect(job: JobView) -> ShimClient:
    assert job.assignment is not None and job.assignment.gpu_uuid == GPU0, job
    env = job.assignment.environment
    return ShimClient.connect(env["GPULOOM_DISPATCHER_SOCKET"], env["GPULOOM_ASSIGNMENT_TOKEN"])


def top(day: Day, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [GPULOOM, "top", *args],
        env=day.plane.env if env is None else env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_json_is_one_object_with_every_gpu_and_process(day: Day) -> None:
    result = top(day, "--once", "--json")
    assert result.returncode == 0, result.stderr
    fleet = json.loads(result.stdout)  # one object, nothing else on stdout
    assert fleet["placement"] == day.plane.placement
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", fleet["taken_at"])
    assert fleet["jobs"] == {"pending": 0, "binding": 0, "assigned": 2}
    gpus = {g["entry"]["gpu"]["ref"]["gpu_uuid"]: g for g in fleet["gpus"]}
    assert set(gpus) == {GPU0, GPU1}

    shared = gpus[GPU0]
    assert shared["error"] == ""
    assert shared["entry"]["jobs"] == 2
    assert shared["entry"]["area_reserved_percent"] == pytest.approx((60 * 40 + 60 * 10) / 100)
    status = shared["status"]
    assert status["policy"] == "composed"
    assert status["quota_reserved_percent"] == pytest.approx(50)
    processes = {c["assignment"]["assignment_id"]: c for c in status["clients"]}
    serve, batch = processes[day.serve.job_id], processes[day.batch.job_id]
    assert serve["pid"] == batch["pid"] == os.getpid()
    assert serve["assignment"]["client_name"] == "serve"
    assert serve["assignment"]["priority"] == {"level": 1}
    assert int(serve["assignment"]["memory_cap_bytes"]) == 4 * GIB
    assert int(serve["memory_allocated_bytes"]) == 3 * GIB
    assert serve["state"] == "LEASE_STATE_IDLE" and serve["waiting_ms"] == 0
    assert batch["assignment"]["share"]["quota"]["request_percent"] == 10
    assert batch["state"] == "LEASE_STATE_BLOCKED"
    assert batch["waiting_ms"] > 0

    mig = gpus[GPU1]
    assert mig["entry"]["gpu"]["mig_enabled"] is True
    assert mig["status"]["clients"] == []


def test_the_json_status_is_the_dispatchers_answer(day: Day) -> None:
    """The converter loses nothing: GetGpuStatus through the domain and back is the same."""
    with open_channel(day.plane.dispatchers[0]) as channel:
        stub = dispatcher_pb2_grpc.DispatcherStub(channel)
        answer = stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    assert len(answer.clients) == 2
    assert status_to_pb(status_from_pb(answer)) == answer


def test_once_prints_one_frame_without_colour(day: Day) -> None:
    result = top(day, "--once")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "\x1b[" not in out  # not a terminal: no escape codes
    lines = out.splitlines()
    assert lines[0].startswith("gpuloom top ")
    assert f"placement {day.plane.placement}" in lines[0]
    assert "2 GPUs  jobs: 0 pending, 0 binding, 2 assigned" in lines[0]
    gpu0 = next(line for line in lines if GPU0 in line)
    assert re.search(r"schedulable\s+off\s+composed\s+2\s+0\s+30\.0\s+50\.0", gpu0), gpu0
    assert "12.0/80.0 GiB" in gpu0
    gpu1 = next(line for line in lines if GPU1 in line)
    assert re.search(r"\bMIG\s+on, no instances\b", gpu1), gpu1
    serve = next(line for line in lines if day.serve.job_id in line)
    assert re.search(
        rf"{os.getpid()}\s+{day.serve.job_id}\s+serve\s+1\s+share\s+idle\s+60\s+40-60\s", serve
    ), serve
    assert re.search(r"4\.00 GiB\s+3\.00 GiB\s+-$", serve), serve
    batch = next(line for line in lines if day.batch.job_id in line)
    assert re.search(r"batch\[red\]\s+7\s+share\s+blocked\s+60\s+10\s", batch), batch
    assert re.search(r"8\.00 GiB\s+-\s+\d+(\.\d)? (ms|s)$", batch), batch
    # By priority: the serving job's line comes first.
    assert lines.index(serve) < lines.index(batch)


def test_on_a_terminal_the_view_refreshes_until_interrupted(day: Day) -> None:
    controller, terminal = pty.openpty()
    # As from a terminal's foreground: Ctrl-C reaches top. A test run started in the
    # background (`... &`) ignores SIGINT, and a child would inherit that; with a handler of
    # ours in place while it starts, it starts with the default.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(
            [GPULOOM, "top", "--interval", "0.3"],
            env={**day.plane.env, "TERM": "xterm", "COLUMNS": "200", "LINES": "50"},
            stdin=terminal,
            stdout=terminal,
            stderr=terminal,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    os.close(terminal)
    seen = b""
    try:
        deadline = time.monotonic() + 20
        while seen.count(b"gpuloom top") < 3 and time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 0.5)
            if ready:
                seen += os.read(controller, 65536)
        assert seen.count(b"gpuloom top") >= 3, seen[-2000:]
        assert b"\x1b[" in seen  # a terminal: colour and cursor movement
        process.send_signal(signal.SIGINT)
        # Read on as a terminal does: top writes its last frame and restores the cursor on
        # the way out, which blocks while the terminal's buffer is full.
        deadline = time.monotonic() + 10
        while process.poll() is None and time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 0.1)
            if ready:
                try:
                    seen += os.read(controller, 65536)
                except OSError:  # EIO: the terminal's last writer closed it
                    break
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(controller)


@pytest.mark.parametrize("by", ["option", "variable"])
def test_an_unreachable_placement_is_one_line_naming_address_and_variable(
    day: Day, by: str
) -> None:
    address = f"127.0.0.1:{free_port()}"
    env = {**day.plane.env, "GPULOOM_PLACEMENT_ADDRESS": address}
    args = ("--once", "--placement", address) if by == "option" else ("--once",)
    result = top(day, *args, env=env)
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"Error: cannot reach placement at {address} ")
    assert "GPULOOM_PLACEMENT_ADDRESS" in lines[0] and "--placement" in lines[0]


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_the_metrics_endpoint_has_the_same_figures(day: Day) -> None:
    url = day.plane.metrics_url
    expected = {
        'gpuloom_placement_jobs{state="pending"}': 0.0,
        'gpuloom_placement_jobs{state="binding"}': 0.0,
        'gpuloom_placement_jobs{state="assigned"}': 2.0,
        f'gpuloom_placement_gpu_area_reserved_ratio{{gpu="{GPU0}",node="vm"}}': 0.3,
        f'gpuloom_placement_gpu_area_reserved_ratio{{gpu="{GPU1}",node="vm"}}': 0.0,
        f'gpuloom_placement_gpu_memory_reserved_bytes{{gpu="{GPU0}",node="vm"}}': 12.0 * GIB,
        'gpuloom_dispatcher_quota_reserved_ratio{gpu="0"}': 0.5,
        'gpuloom_dispatcher_quota_reserved_ratio{gpu="1"}': 0.0,
        'gpuloom_dispatcher_memory_reserved_bytes{gpu="0"}': 12.0 * GIB,
    }
    node = json.loads(top(day, "--json").stdout)["gpus"][0]["entry"]["gpu"]["ref"]["node"]
    expected = {k.replace('node="vm"', f'node="{node}"'): v for k, v in expected.items()}

    def matches() -> bool:
        samples = scrape(url)
        return all(samples.get(k) == pytest.approx(v) for k, v in expected.items())

    wait_for(matches, "the gauges to match")
    samples = scrape(url)
    # The blocked batch job was charged far past its quota in this window or carries it over.
    assert samples['gpuloom_dispatcher_quota_used_ratio{gpu="0"}'] > 0.1
    assert samples['gpuloom_dispatcher_quota_used_ratio{gpu="1"}'] == 0.0


class FakePlacement:
    """What FleetView asks placement: its GPUs and live jobs."""

    address = "fake:1"

    def __init__(self, entries: list[GpuEntry]) -> None:
        self.entries = entries

    def gpus(self) -> Iterator[GpuEntry]:
        return iter(self.entries)

    def list(self, states: object, page_size: int) -> Iterator[JobView]:
        return iter(())


def entry(uuid: str, dispatcher: str) -> GpuEntry:
    return GpuEntry(
        gpu=GpuInfo(uuid, "n1", "A100-80GB", 80 * GIB),
        dispatcher_address=dispatcher,
        schedulable=True,
        lost=False,
        last_heartbeat=0.0,
        utilization_percent=0.0,
        memory_used_bytes=0,
        memory_reserved_bytes=0,
        area_reserved_percent=0.0,
        jobs=0,
    )


def test_a_dispatcher_that_does_not_answer_is_named_and_the_rest_shown(day: Day) -> None:
    dead = f"127.0.0.1:{free_port()}"
    entries = [
        entry("GPU-dead", dead),
        entry("GPU-moved", day.plane.dispatchers[0]),  # that dispatcher serves GPU0
        entry(GPU1, day.plane.dispatchers[1]),
    ]
    placement = FakePlacement(entries)
    with FleetView(placement, dispatcher_timeout_s=2.0) as view:  # type: ignore[arg-type]
        snapshot = view.snapshot()
    dead_gpu, moved, alive = snapshot.gpus
    assert dead_gpu.status is None and dead_gpu.error.startswith(f"dispatcher at {dead}: ")
    assert moved.status is None and f"now serves GPU {GPU0}, not this one" in moved.error
    assert alive.status is not None and alive.error == ""
    frame = Console(width=200, file=io.StringIO())
    frame.print(render(snapshot))
    text = frame.file.getvalue()  # type: ignore[attr-defined]
    dead_line = next(line for line in text.splitlines() if "GPU-dead" in line)
    assert "no status" in dead_line
    assert f"n1/?: dispatcher at {dead}: " in text
