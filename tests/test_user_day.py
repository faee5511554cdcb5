"""The README's day against a real `gpuloom up` (the embedded plane, two simulated GPUs): its
`gpuloom run` line as written, and a share reserved on a dispatcher directly, which placement
must count."""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuloom.transport import open_channel
from gpuloom.v1 import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc, placement_pb2_grpc
from gpuloom.v1 import placement_pb2 as pb
from tests.plane import GPULOOM, Plane, running_plane, wait_for

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    with running_plane(tmp_path_factory.mktemp("plane"), "2xA100-80GB", 2) as plane:
        yield plane


def readme_run_line() -> list[str]:
    lines = [
        x
        for x in (ROOT / "README.md").read_text().splitlines()
        if x.startswith(".venv/bin/gpuloom run ")
    ]
    assert len(lines) == 1, lines
    return shlex.split(lines[0].split("#")[0])


def test_the_readmes_run_line_runs_as_written(plane: Plane) -> None:
    argv = readme_run_line()
    assert argv[0] == ".venv/bin/gpuloom" and (ROOT / argv[-1]).is_file()
    result = subprocess.run(
        [GPULOOM, *argv[1:]],
        cwd=ROOT,
        env={**plane.env, "SERVE_REQUESTS": "5"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"served 5 requests on a 24% SM share: .* failures 0", result.stdout)
    assert "no shim found" not in result.stderr  # the shim was preloaded into the example


def test_a_share_reserved_on_a_dispatcher_directly_is_counted_by_placement(
    plane: Plane,
) -> None:
    with open_channel(plane.dispatchers[0]) as channel:
        dispatcher = dispatcher_pb2_grpc.DispatcherStub(channel)
        gpu0 = dispatcher.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest()).gpu.ref.gpu_uuid
        # The README's Reserve example.
        dispatcher.Reserve(
            dispatcher_pb2.ReserveRequest(
                assignment_id="resnet-1",
                memory_cap_bytes=4 * GIB,
                share=common_pb2.SpatioTemporalShare(
                    sm_percent=24,
                    quota=common_pb2.TimeQuota(request_percent=40, limit_percent=60),
                ),
            )
        )
    with open_channel(plane.placement) as channel:
        placement = placement_pb2_grpc.PlacementStub(channel)

        def entry() -> pb.GpuEntry:
            gpus = placement.ListGpus(pb.ListGpusRequest()).gpus
            return next(g for g in gpus if g.gpu.ref.gpu_uuid == gpu0)

        wait_for(lambda: entry().direct_reservations == 1, "the direct reservation in ListGpus")
        seen = entry()
        assert seen.jobs == 0 and seen.memory_reserved_bytes == 4 * GIB
        assert seen.area_reserved_percent == pytest.approx(24 * 40 / 100)
        shown = subprocess.run(
            [GPULOOM, "gpus"], env=plane.env, capture_output=True, text=True, timeout=30
        )
        assert "DIRECT" in shown.stdout.splitlines()[0]
        assert re.search(rf"{gpu0}\s.*\s0\s+1\s+9\.6", shown.stdout), shown.stdout

        # Whole-GPU jobs go elsewhere: the first to GPU 1, the next waits rather than trying
        # GPU 0.
        whole = pb.JobSpec(
            name="trainer",
            kind=pb.JOB_KIND_TRAINING,
            resources=common_pb2.Resources(whole_gpus=1),
        )
        first = placement.SubmitJob(pb.SubmitJobRequest(request_id="whole-1", spec=whole))
        second = placement.SubmitJob(pb.SubmitJobRequest(request_id="whole-2", spec=whole))
        try:
            assert first.state == pb.JOB_STATE_ASSIGNED
            assert first.assignment.gpu.gpu_uuid != gpu0
            assert second.state == pb.JOB_STATE_PENDING
        finally:
            for job in (first, second):
                placement.CancelJob(pb.CancelJobRequest(job_id=job.job_id))
