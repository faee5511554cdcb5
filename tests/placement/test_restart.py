"""Kill the placement service (SIGKILL) in the middle of a stream of submissions and start it
again on the same PostgreSQL database: every accepted job is still there, none is placed
twice, and what the dispatchers hold matches what placement recorded."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.services.dispatcher.settings import DispatcherSettings
from gpuloom.v1 import placement_pb2, placement_pb2_grpc
from tests.conftest import POSTGRES_URL, free_port
from tests.placement.conftest import PostgresSchema, eventually, mps_spec

GPULOOM = str(Path(sys.executable).parent / "gpuloom")
JOBS = 160


class PlacementProcess:
    def __init__(self, port: int, schema: str, data_dir: Path) -> None:
        self.port = port
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOOM_")}
        env.update(
            GPULOOM_DATA_DIR=str(data_dir),
            GPULOOM_PLACEMENT_PORT=str(port),
            GPULOOM_PLACEMENT_DATABASE_URL=POSTGRES_URL,
            GPULOOM_PLACEMENT_DATABASE_SCHEMA=schema,
            GPULOOM_PLACEMENT_HEARTBEAT_INTERVAL_S="0.2",
            GPULOOM_PLACEMENT_HEARTBEAT_TIMEOUT_S="30",
            GPULOOM_METRICS_PORT="0",
            GPULOOM_INSECURE="true",  # served open: this test is about kills and restarts
        )
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [GPULOOM, "serve", "placement"],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
async def schema() -> AsyncIterator[str]:
    created = PostgresSchema()
    yield created.name
    await created.drop()


async def _submit_until_accepted(
    stub: placement_pb2_grpc.PlacementStub, number: int, accepted: dict[str, str]
) -> None:
    """A well-behaved submitter: on any failure, retry with the same request id."""
    request = placement_pb2.SubmitJobRequest(
        request_id=f"stream-{number}", spec=mps_spec(f"job-{number}", 10, 10, memory_gib=1)
    )
    while True:
        try:
            job = await stub.SubmitJob(request, timeout=5)
        except grpc.aio.AioRpcError as error:
            assert error.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED,
            ), error
            await asyncio.sleep(0.05)
            continue
        previous = accepted.setdefault(request.request_id, job.job_id)
        assert previous == job.job_id  # the same request id never makes a second job
        return


async def dispatchers_registering_with(port: int, sim_gpus: str, short_dir: Path) -> DispatcherApp:
    """Simulated dispatchers of node n1 that register with the placement on `port`."""
    return await DispatcherApp.start(
        DispatcherSettings(
            port=0,
            backend="simulated",
            sim_gpus=sim_gpus,
            node="n1",
            placement_address=f"127.0.0.1:{port}",
        ),
        "127.0.0.1",
        short_dir,
    )


async def test_killing_placement_mid_stream_loses_no_job_and_places_none_twice(
    schema: str, tmp_path: Path, short_dir: Path
) -> None:
    port = free_port()
    placement = PlacementProcess(port, schema, tmp_path)
    placement.start()
    dispatchers = await dispatchers_registering_with(port, "4xA100-80GB", short_dir)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = placement_pb2_grpc.PlacementStub(channel)
    try:
        async with asyncio.timeout(60):
            while True:
                try:
                    listing = await stub.ListGpus(placement_pb2.ListGpusRequest(), timeout=2)
                    if len(listing.gpus) == 4:
                        break
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.1)

        accepted: dict[str, str] = {}
        stream = asyncio.gather(*(_submit_until_accepted(stub, n, accepted) for n in range(JOBS)))
        await eventually(lambda: len(accepted) >= JOBS // 3, timeout_s=60)
        placement.kill()
        killed_after = len(accepted)
        await asyncio.sleep(0.5)
        placement.start()
        async with asyncio.timeout(120):
            await stream
        assert killed_after < JOBS  # the kill really came in the middle

        jobs = []
        token = ""
        while True:
            page = await stub.ListJobs(
                placement_pb2.ListJobsRequest(page_size=50, page_token=token), timeout=10
            )
            jobs += page.jobs
            token = page.next_page_token
            if not token:
                break
        # Every accepted job is there, once.
        assert sorted(j.request_id for j in jobs) == sorted(accepted)
        assert {j.job_id for j in jobs} == set(accepted.values())
        # Each one is bound (they all fit), after the restart re-bound what was in flight.
        for job in jobs:
            for _ in range(200):
                if job.state == placement_pb2.JOB_STATE_ASSIGNED:
                    break
                await asyncio.sleep(0.05)
                job = await stub.GetJob(placement_pb2.GetJobRequest(job_id=job.job_id))
            assert job.state == placement_pb2.JOB_STATE_ASSIGNED, job

        # No job is held by two dispatchers, and what the dispatchers hold is what placement
        # assigned, on the GPU it says (stale reservations are released by heartbeats).
        def holders() -> dict[str, list[str]]:
            held: dict[str, list[str]] = {}
            for d in dispatchers.dispatchers:
                for r in d.core.book.all():
                    held.setdefault(r.assignment_id, []).append(d.core.gpu.gpu_uuid)
            return held

        final = {
            j.job_id: (
                await stub.GetJob(placement_pb2.GetJobRequest(job_id=j.job_id))
            ).assignment.gpu.gpu_uuid
            for j in jobs
        }
        await eventually(lambda: {k: v[0] for k, v in holders().items()} == final, timeout_s=20)
        assert all(len(v) == 1 for v in holders().values())
        for d in dispatchers.dispatchers:
            area = sum(
                r.share.sm_percent * r.share.quota.request_percent for r in d.core.book.all()
            )
            assert area <= 100 * 100
    finally:
        await channel.close()
        await dispatchers.stop(0)
        placement.stop()
