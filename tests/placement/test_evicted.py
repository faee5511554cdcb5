"""What a dispatcher takes away stays taken (issue 34): a job whose reservation its dispatcher
evicts (EvictClient) ends EVICTED in placement, saying why, through the dispatcher's next
heartbeat; its runner (`gpuloom run`) sees that and stops its command, and the command's shim,
told by the dispatcher, launches nothing more."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.v1 import dispatcher_pb2, dispatcher_pb2_grpc
from gpuloom.v1 import placement_pb2 as pb
from tests.placement.conftest import Live, gpu_info, mps_spec, submit
from tests.plane import GPULOOM, running_plane
from tests.shim.conftest import PROGRAM

BUILD = PROGRAM.parent


async def test_an_evicted_job_ends_evicted_through_the_dispatchers_heartbeat(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    dispatcher = dispatchers.dispatchers[0]
    info = gpu_info(dispatchers, 0)
    uuid = info.ref.gpu_uuid
    await placement.stub.RegisterGpu(
        pb.RegisterGpuRequest(gpu=info, dispatcher_address=f"127.0.0.1:{dispatcher.port}")
    )
    job = await submit(placement.stub, mps_spec("evicted", 50, 50, memory_gib=4))
    kept = await submit(placement.stub, mps_spec("kept", 20, 20, memory_gib=4))
    assert job.state == kept.state == pb.JOB_STATE_ASSIGNED
    async with grpc.aio.insecure_channel(f"127.0.0.1:{dispatcher.port}") as channel:
        await dispatcher_pb2_grpc.DispatcherStub(channel).EvictClient(
            dispatcher_pb2.EvictClientRequest(assignment_id=job.job_id, reason="over its share")
        )
    evicted = dispatcher.core.unreported_evictions()
    assert evicted == {job.job_id: "over its share"}

    # A heartbeat with a bad eviction is refused, naming it, and changes nothing.
    bad = pb.Eviction(assignment_id=job.job_id, reason="x" * 1025)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await placement.stub.Heartbeat(pb.HeartbeatRequest(gpu_uuid=uuid, evictions=[bad]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "evictions[0].reason" in (refused.value.details() or "")
    still = await placement.stub.GetJob(pb.GetJobRequest(job_id=job.job_id))
    assert still.state == pb.JOB_STATE_ASSIGNED

    await placement.stub.Heartbeat(
        pb.HeartbeatRequest(
            gpu_uuid=uuid,
            assignment_ids=[kept.job_id],
            evictions=[
                pb.Eviction(assignment_id=i, reason=r)
                for i, r in [*evicted.items(), ("j-nobody", "gone"), ("notebook", "x")]
            ],
        )
    )
    ended = await placement.stub.GetJob(pb.GetJobRequest(job_id=job.job_id))
    assert ended.state == pb.JOB_STATE_EVICTED
    assert ended.message == f"evicted by the dispatcher of GPU {uuid}: over its share"
    other = await placement.stub.GetJob(pb.GetJobRequest(job_id=kept.job_id))
    assert other.state == pb.JOB_STATE_ASSIGNED  # only the evicted one
    listed = await placement.stub.ListJobs(pb.ListJobsRequest(states=[pb.JOB_STATE_EVICTED]))
    assert [j.job_id for j in listed.jobs] == [job.job_id]


def test_gpuloom_run_stops_and_the_job_shows_evicted(tmp_path: Path) -> None:
    with running_plane(tmp_path / "state", "A100-80GB", 1) as plane:
        fake = Path(tempfile.mkdtemp(prefix="gl-fake-"))
        env = {
            **plane.env,
            "LD_LIBRARY_PATH": str(BUILD / "fake"),
            "GPULOOM_FAKE_CUDA_DIR": str(fake),
        }
        runner = subprocess.Popen(
            [
                GPULOOM,
                "run",
                "--name",
                "to-evict",
                "--sm",
                "50",
                "--quota",
                "20",
                "--memory-gib",
                "1",
                "--shim",
                str(BUILD / "libgpuloom.so"),
                "--",
                str(PROGRAM),
                "module",
                "k_x_500us",
                "loop",
                "60",
                "k_x_500us",
                "1",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            job: dict[str, object] = {}
            while not job:
                assert time.monotonic() < deadline, "the job was never assigned"
                listed = subprocess.run(
                    [GPULOOM, "jobs", "--state", "assigned", "--json"],
                    env=plane.env,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                job = next(iter(json.loads(line) for line in listed.stdout.splitlines()), {})
                time.sleep(0.2)
            time.sleep(1.0)  # its command runs under the shim meanwhile
            gpu = job["assignment"]["gpu"]["gpu_uuid"]  # type: ignore[index]
            evicted = subprocess.run(
                [
                    GPULOOM,
                    "dispatcher",
                    "evict",
                    str(job["job_id"]),
                    "--gpu",
                    gpu,
                    "--reason",
                    "over its share",
                ],
                env=plane.env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert evicted.returncode == 0, evicted.stderr
            _, err = runner.communicate(timeout=60)
        finally:
            if runner.poll() is None:
                runner.kill()
        # The runner saw its job end and stopped its command, which its shim had already
        # cut off (its launches refused), well before the loop's 60 s.
        assert runner.returncode != 0, err
        assert "was evicted: evicted by the dispatcher of GPU" in err, err
        shown = subprocess.run(
            [GPULOOM, "job", str(job["job_id"]), "--json"],
            env=plane.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        ended = json.loads(shown.stdout)
        assert ended["state"] == "JOB_STATE_EVICTED"
        assert ended["message"].endswith(": over its share")
