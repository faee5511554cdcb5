"""kill -9 of placement at random moments of a stream of submissions, cancellations and
reports (not only right after an answer), then a restart on the same database (PostgreSQL, and
the embedded default's SQLite), a few times over. Submitters behave well: each call is retried,
with the same request id, until it is answered. Afterwards:

- no acknowledged job is lost, and no acknowledged end is undone;
- no job is placed twice: each request id made one job, and each live job is held by exactly one
  dispatcher, the one placement says;
- no reservation leaks: once every job has ended, the dispatchers hold nothing.

The kill delays and each worker's choices come from a seeded generator: GPULOOM_FAULT_SEED
fixes them (the seed is in the failure message); the interleaving with the service still
varies from run to run.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.v1 import placement_pb2 as pb
from gpuloom.v1 import placement_pb2_grpc
from tests.conftest import POSTGRES_URL, free_port
from tests.placement.conftest import PostgresSchema, mps_spec
from tests.placement.test_restart import PlacementProcess, dispatchers_registering_with

WORKERS = 8
MAX_JOBS_PER_WORKER = 200  # the stream runs until the kills are over, at most this long
KILLS = 3
RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)
CANCELLED, SUCCEEDED = pb.JOB_STATE_CANCELLED, pb.JOB_STATE_SUCCEEDED


@pytest.fixture(params=["postgres", "sqlite"])
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[dict[str, str]]:
    """The placement process's database settings."""
    if request.param == "sqlite":
        yield {"GPULOOM_PLACEMENT_DATABASE_URL": f"sqlite:///{tmp_path / 'placement.db'}"}
        return
    created = PostgresSchema()
    yield {
        "GPULOOM_PLACEMENT_DATABASE_URL": POSTGRES_URL,
        "GPULOOM_PLACEMENT_DATABASE_SCHEMA": created.name,
    }
    await created.drop()


class Ledger:
    """What the submitters were told: the only truth the checks may rely on."""

    def __init__(self) -> None:
        self.accepted: dict[str, str] = {}  # request id -> job id
        self.ended: dict[str, int] = {}  # job id -> the end state placement acknowledged
        self.calls = 0
        self.stop = asyncio.Event()


async def _until_answered(call: object) -> object:
    """Call until placement answers (any answer but a transport failure)."""
    while True:
        try:
            return await call()  # type: ignore[operator]
        except grpc.aio.AioRpcError as error:
            if error.code() not in RETRYABLE:
                raise
        await asyncio.sleep(0.05)


async def _end(stub: placement_pb2_grpc.PlacementStub, job_id: str, state: int) -> None:
    """Cancel or report a job, retrying; an end whose answer was lost to a kill shows as
    'already finished' in that same state on the retry."""
    while True:
        try:
            if state == CANCELLED:
                await stub.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=5)
            else:
                request = pb.ReportJobDoneRequest(job_id=job_id, succeeded=True)
                await stub.ReportJobDone(request, timeout=5)
            return
        except grpc.aio.AioRpcError as error:
            if error.code() in RETRYABLE:
                await asyncio.sleep(0.05)
                continue
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            job = await _until_answered(
                lambda: stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=5)
            )
            if job.state == state:  # type: ignore[attr-defined]
                return  # the earlier attempt was applied; its answer was lost
            # Reports need ASSIGNED: a job re-bound after a restart is BINDING for a moment.
            assert "only an assigned job can finish" in (error.details() or ""), error
            await asyncio.sleep(0.05)


async def _submitter(
    stub: placement_pb2_grpc.PlacementStub, worker: int, rng: random.Random, ledger: Ledger
) -> None:
    for number in range(MAX_JOBS_PER_WORKER):
        if ledger.stop.is_set():
            return
        name = f"w{worker}-{number}"
        spec = mps_spec(name, sm=5, quota=5, memory_gib=1)
        request = pb.SubmitJobRequest(request_id=name, spec=spec)
        job = await _until_answered(lambda r=request: stub.SubmitJob(r, timeout=5))
        job_id = job.job_id  # type: ignore[attr-defined]
        assert ledger.accepted.setdefault(request.request_id, job_id) == job_id
        ledger.calls += 1
        choice = rng.random()
        if choice < 0.35:
            await _end(stub, job_id, CANCELLED)
            ledger.ended[job_id] = CANCELLED
        elif choice < 0.7:
            await _end(stub, job_id, SUCCEEDED)
            ledger.ended[job_id] = SUCCEEDED


async def _all_jobs(stub: placement_pb2_grpc.PlacementStub) -> list[pb.Job]:
    jobs: list[pb.Job] = []
    token = ""
    while True:
        page = await stub.ListJobs(pb.ListJobsRequest(page_size=100, page_token=token), timeout=10)
        jobs += page.jobs
        token = page.next_page_token
        if not token:
            return jobs


def _held(dispatchers: DispatcherApp) -> dict[str, list[str]]:
    held: dict[str, list[str]] = {}
    for dispatcher in dispatchers.dispatchers:
        for reservation in dispatcher.core.book.all():
            held.setdefault(reservation.assignment_id, []).append(dispatcher.core.gpu.gpu_uuid)
    return held


async def _eventually(check: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        problem = await check()  # type: ignore[operator]
        if problem is None:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: {problem}")
        await asyncio.sleep(0.1)


async def test_kill_9_of_placement_mid_stream_loses_nothing_and_leaks_nothing(
    database: dict[str, str], tmp_path: Path, short_dir: Path
) -> None:
    seed = int(os.environ.get("GPULOOM_FAULT_SEED", random.randrange(1 << 32)))
    rng = random.Random(seed)
    port = free_port()
    placement = PlacementProcess(port, "", tmp_path)
    placement.env.pop("GPULOOM_PLACEMENT_DATABASE_SCHEMA")
    placement.env.update(database)
    placement.start()
    dispatchers = await dispatchers_registering_with(port, "2xA100-80GB", short_dir)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = placement_pb2_grpc.PlacementStub(channel)
    ledger = Ledger()
    kills: list[tuple[float, int]] = []  # (seconds into the stream, answers before the kill)
    try:

        async def registered() -> str | None:
            try:
                gpus = (await stub.ListGpus(pb.ListGpusRequest(), timeout=2)).gpus
            except grpc.aio.AioRpcError as error:
                return error.code().name
            return None if len(gpus) == 2 else f"{len(gpus)} GPUs registered"

        await _eventually(registered, 30, "the dispatchers did not register")

        started = time.monotonic()
        stream = asyncio.gather(
            *(_submitter(stub, w, random.Random(rng.random()), ledger) for w in range(WORKERS))
        )
        for _ in range(KILLS):
            answered = ledger.calls
            assert not stream.done(), f"the stream ended before kill {len(kills) + 1}"
            async with asyncio.timeout(60):
                while ledger.calls == answered:  # placement serves again: the stream flows
                    await asyncio.sleep(0.02)
            await asyncio.sleep(rng.uniform(0.0, 0.8))
            kills.append((round(time.monotonic() - started, 2), ledger.calls))
            placement.kill()
            await asyncio.sleep(rng.uniform(0.0, 0.3))
            placement.start()
        answered = ledger.calls
        async with asyncio.timeout(60):
            while ledger.calls == answered:
                await asyncio.sleep(0.02)
        ledger.stop.set()
        async with asyncio.timeout(60):
            await stream
        context = f"seed {seed}, kills at (s, answers) {kills} of {ledger.calls}"
        assert kills[-1][1] < ledger.calls, f"the last kill came after the stream; {context}"

        # No acknowledged job lost, none made twice, no acknowledged end undone.
        jobs = {job.job_id: job for job in await _all_jobs(stub)}
        assert sorted(j.request_id for j in jobs.values()) == sorted(ledger.accepted), context
        assert set(jobs) == set(ledger.accepted.values()), context
        for job_id, state in ledger.ended.items():
            assert jobs[job_id].state == state, (job_id, jobs[job_id], context)

        # Every live job ends up ASSIGNED and held by exactly the dispatcher placement names
        # (what a killed placement reserved but never recorded is released by heartbeats).
        async def held_as_placement_says() -> str | None:
            live = {
                j.job_id: j for j in await _all_jobs(stub) if j.state not in (CANCELLED, SUCCEEDED)
            }
            if any(j.state != pb.JOB_STATE_ASSIGNED for j in live.values()):
                return "not all live jobs are ASSIGNED yet"
            where = {
                job_id: (
                    await stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=5)
                ).assignment.gpu.gpu_uuid
                for job_id in live
            }
            held = _held(dispatchers)
            if held != {job_id: [gpu] for job_id, gpu in where.items()}:
                return f"dispatchers hold {held}, placement says {where}"
            return None

        await _eventually(held_as_placement_says, 20, f"reservations disagree; {context}")

        # End everything: no reservation is left behind.
        for job_id in jobs:
            if job_id not in ledger.ended:
                await _end(stub, job_id, CANCELLED)

        async def nothing_held() -> str | None:
            held = _held(dispatchers)
            return None if not held else f"still held: {held}"

        await _eventually(nothing_held, 10, f"reservations leaked; {context}")
    finally:
        await channel.close()
        await dispatchers.stop(0)
        placement.stop()
