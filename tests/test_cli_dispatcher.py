"""`gpuloom dispatcher status|release|evict|suspend|resume` against a real `gpuloom up` (one
simulated GPU): what used to need grpcurl, by GPU UUID through placement or by the dispatcher's
address."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import json_format

from gpuloom.clients.shim import Evicted, ShimClient
from gpuloom.transport import open_channel
from gpuloom.v1 import (
    common_pb2,
    dispatcher_pb2,
    dispatcher_pb2_grpc,
    placement_pb2,
    placement_pb2_grpc,
    profile_store_pb2,
    profiler_pb2,
)
from tests.plane import GPULOOM, PLANE_FLEET_ID, Plane, free_port, running_plane, wait_for

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]
GPU0 = f"SIM-A100-80GB-0-{PLANE_FLEET_ID}"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    with running_plane(tmp_path_factory.mktemp("dispatcher"), "A100-80GB", 1) as plane:
        yield plane


def reserve(plane: Plane, assignment_id: str) -> dispatcher_pb2.Assignment:
    with open_channel(plane.dispatchers[0]) as channel:
        return dispatcher_pb2_grpc.DispatcherStub(channel).Reserve(
            dispatcher_pb2.ReserveRequest(
                assignment_id=assignment_id,
                client_name="by-hand",
                memory_cap_bytes=2 * GIB,
                priority=common_pb2.Priority(level=3),
                share=common_pb2.SpatioTemporalShare(
                    sm_percent=30,
                    quota=common_pb2.TimeQuota(request_percent=20, limit_percent=20),
                ),
            )
        )


def gpuloom(plane: Plane, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [GPULOOM, "dispatcher", *args], env=plane.env, capture_output=True, text=True, timeout=30
    )


def reserved_ids(plane: Plane) -> set[str]:
    with open_channel(plane.dispatchers[0]) as channel:
        stub = dispatcher_pb2_grpc.DispatcherStub(channel)
        answer = stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    return {c.assignment.assignment_id for c in answer.clients}


def test_status_by_gpu_and_by_address(plane: Plane) -> None:
    answer = reserve(plane, "by-hand-1")
    with ShimClient.connect(answer.socket_path, answer.assignment_token):
        by_gpu = gpuloom(plane, "status", "--gpu", GPU0)
        assert by_gpu.returncode == 0, by_gpu.stderr
        lines = by_gpu.stdout.splitlines()
        assert lines[0].startswith(f"GPU 0 {GPU0} on node ")
        assert "policy composed, window 1000 ms" in lines[1]
        assert "time quota reserved 20.0%" in lines[2] and "memory reserved 2.00 GiB" in lines[2]
        row = next(line for line in lines if "by-hand-1" in line)
        assert f" {os.getpid()} " in row and "by-hand" in row and " 3 " in row
        assert "2.00 GiB" in row

        as_json = gpuloom(plane, "status", "--dispatcher", plane.dispatchers[0], "--json")
        assert as_json.returncode == 0, as_json.stderr
        status = json.loads(as_json.stdout)
        (client,) = status["clients"]
        assert client["assignment"]["assignment_id"] == "by-hand-1"
        assert client["pid"] == os.getpid() and client["connected"] is True
        assert client["assignment"]["assignment_token"] == ""  # never listed
    release = gpuloom(plane, "release", "by-hand-1", "--gpu", GPU0)
    assert release.returncode == 0 and release.stdout == "released by-hand-1\n"


def test_release_is_idempotent_and_changes_the_dispatcher(plane: Plane) -> None:
    reserve(plane, "by-hand-2")
    assert "by-hand-2" in reserved_ids(plane)
    first = gpuloom(plane, "release", "by-hand-2", "--dispatcher", plane.dispatchers[0])
    assert first.returncode == 0 and first.stdout == "released by-hand-2\n"
    assert "by-hand-2" not in reserved_ids(plane)
    again = gpuloom(plane, "release", "by-hand-2", "--dispatcher", plane.dispatchers[0])
    assert again.returncode == 0
    assert again.stdout == "by-hand-2 was not reserved there (already released)\n"


def test_evict_tells_the_process_and_an_unknown_one_exits_1(plane: Plane) -> None:
    answer = reserve(plane, "by-hand-3")
    with ShimClient.connect(answer.socket_path, answer.assignment_token) as process:
        evicted = gpuloom(plane, "evict", "by-hand-3", "--gpu", GPU0, "--reason", "maintenance")
        assert evicted.returncode == 0, evicted.stderr
        assert evicted.stdout == "evicted by-hand-3\n"
        with pytest.raises(Evicted, match="maintenance"):
            process.acquire(timeout_s=5)
    assert "by-hand-3" not in reserved_ids(plane)
    unknown = gpuloom(plane, "evict", "by-hand-3", "--gpu", GPU0)
    assert unknown.returncode == 1
    assert unknown.stderr.splitlines() == [
        f"Error: no assignment 'by-hand-3' on this GPU (dispatcher at {plane.dispatchers[0]})"
    ]


def test_suspend_and_resume_by_hand(plane: Plane) -> None:
    reserve(plane, "by-hand-4")
    suspended = gpuloom(plane, "suspend", "by-hand-4", "--gpu", GPU0, "--reason", "by hand")
    assert suspended.returncode == 0, suspended.stderr
    # No process holds it: suspended at once, nothing held.
    assert suspended.stdout == "suspended by-hand-4 (not running, after 0 ms, holding -)\n"
    shown = json.loads(gpuloom(plane, "status", "--gpu", GPU0, "--json").stdout)
    (client,) = [c for c in shown["clients"] if c["assignment"]["assignment_id"] == "by-hand-4"]
    assert client["suspended"] and client["suspended_reason"] == "by hand"
    assert client["suspend_outcome"] == "not_running"
    resumed = gpuloom(plane, "resume", "by-hand-4", "--dispatcher", plane.dispatchers[0])
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout == "resumed by-hand-4\n"
    assert gpuloom(plane, "resume", "by-hand-4", "--gpu", GPU0).returncode == 0  # idempotent
    gpuloom(plane, "release", "by-hand-4", "--gpu", GPU0)
    for verb in ("suspend", "resume"):
        unknown = gpuloom(plane, verb, "by-hand-4", "--gpu", GPU0)
        assert unknown.returncode == 1
        assert unknown.stderr.splitlines() == [
            f"Error: no assignment 'by-hand-4' on this GPU (dispatcher at {plane.dispatchers[0]})"
        ]
    bad = gpuloom(plane, "suspend", "x", "--gpu", GPU0, "--max-wait-ms", "-5")
    assert bad.returncode == 2 and "--max-wait-ms" in bad.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["status"], "Error: gpuloom dispatcher status: give either --gpu UUID or --dispatcher"),
        (
            ["status", "--gpu", GPU0, "--dispatcher", "x:1"],
            "Error: gpuloom dispatcher status: give either --gpu UUID or --dispatcher",
        ),
        (["status", "--gpu", "GPU-nope"], "Error: no GPU GPU-nope registered with placement"),
        (["release", "--gpu", GPU0], "Error: gpuloom dispatcher release: Missing argument"),
    ],
)
def test_bad_targets_are_one_line(plane: Plane, args: list[str], expected: str) -> None:
    result = gpuloom(plane, *args)
    assert result.returncode in (1, 2)
    (line,) = result.stderr.splitlines()
    assert line.startswith(expected)


def test_an_unreachable_dispatcher_or_placement_is_one_line(plane: Plane) -> None:
    dead = f"127.0.0.1:{free_port()}"
    direct = gpuloom(plane, "status", "--dispatcher", dead)
    assert direct.returncode == 1
    (line,) = direct.stderr.splitlines()
    assert line.startswith(f"Error: cannot reach dispatcher at {dead}: ")
    through = gpuloom(plane, "status", "--gpu", GPU0, "--placement", dead)
    assert through.returncode == 1
    (line,) = through.stderr.splitlines()
    assert line.startswith(f"Error: cannot reach placement at {dead} ")
    assert "GPULOOM_PLACEMENT_ADDRESS" in line


def placement_sees_mig(plane: Plane) -> bool:
    listed = gpuloom_json(plane, "gpus", "--json")
    return bool(listed["gpu"]["mig_enabled"])


def gpuloom_json(plane: Plane, *args: str) -> dict:
    result = subprocess.run(
        [GPULOOM, *args], env=plane.env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_mig_mode_on_and_off_reaches_placement(plane: Plane) -> None:
    held = reserve(plane, "by-hand-4")
    refused = gpuloom(plane, "mig", "on", "--gpu", GPU0)
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == [
        "Error: GPU 0 holds 1 reservation(s); release them before turning MIG on "
        f"(dispatcher at {plane.dispatchers[0]})"
    ]
    assert gpuloom(plane, "release", held.assignment_id, "--gpu", GPU0).returncode == 0

    on = gpuloom(plane, "mig", "on", "--gpu", GPU0)
    assert on.returncode == 0, on.stderr
    assert on.stdout == f"MIG on (dispatcher at {plane.dispatchers[0]})\n"
    status = gpuloom_json(plane, "dispatcher", "status", "--gpu", GPU0, "--json")
    assert status["gpu"]["mig_enabled"] is True
    wait_for(lambda: placement_sees_mig(plane), "placement to see MIG on")
    again = gpuloom(plane, "mig", "on", "--dispatcher", plane.dispatchers[0])
    assert again.returncode == 0  # idempotent

    off = gpuloom(plane, "mig", "off", "--gpu", GPU0)
    assert off.returncode == 0, off.stderr
    wait_for(lambda: not placement_sees_mig(plane), "placement to see MIG off")


def test_json_is_the_protos_mapping_and_parses_back_into_the_message(plane: Plane) -> None:
    """`--json` of commands of four services: each parses back (json_format.Parse) into the
    message the service itself answers."""
    held = reserve(plane, "by-hand-json")
    try:
        with open_channel(plane.dispatchers[0]) as channel:
            served = dispatcher_pb2_grpc.DispatcherStub(channel).GetGpuStatus(
                dispatcher_pb2.GetGpuStatusRequest()
            )
        printed = gpuloom(plane, "status", "--gpu", GPU0, "--json").stdout
        status = json_format.Parse(printed, dispatcher_pb2.GpuStatus())
        assert status.gpu == served.gpu and [c.assignment for c in status.clients] == [
            c.assignment for c in served.clients
        ]
        reserved_at = json.loads(printed)["clients"][0]["assignment"]["reserved_at"]
        assert reserved_at.endswith("Z") and "T" in reserved_at  # RFC 3339
    finally:
        gpuloom(plane, "release", held.assignment_id, "--gpu", GPU0)

    with open_channel(plane.placement) as channel:
        entries = placement_pb2_grpc.PlacementStub(channel).ListGpus(
            placement_pb2.ListGpusRequest()
        )
    listed = run_json_lines(plane, "gpus", "--json")
    assert [json_format.Parse(line, placement_pb2.GpuEntry()).gpu for line in listed] == [
        e.gpu for e in entries.gpus
    ]

    opened = json_format.Parse(
        "\n".join(run_json_lines(plane, "profile", "open", "json-task", "A100-80GB", "--json")),
        profiler_pb2.Session(),
    )
    assert opened.state == profiler_pb2.SESSION_STATE_OPEN and opened.HasField("opened_at")
    sessions = run_json_lines(plane, "profile", "sessions", "--task-key", "json-task", "--json")
    assert [json_format.Parse(line, profiler_pb2.Session()) for line in sessions] == [opened]

    stored = run_json_lines(
        plane, "profile", "put", "mig", str(ROOT / "examples" / "lud-mig-profile.json")
    )
    assert stored and "stored mig profile 'lud'" in stored[0]
    shown = run_json_lines(plane, "profile", "show", "mig", "lud", "A100-80GB", "--json")
    profile = json_format.Parse("\n".join(shown), profile_store_pb2.MigProfileRecord())
    assert [(t.slices, t.exec_time_s) for t in profile.times] == [(1, 40.0), (7, 9.0)]


def run_json_lines(plane: Plane, *args: str) -> list[str]:
    result = subprocess.run(
        [GPULOOM, *args], env=plane.env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()
