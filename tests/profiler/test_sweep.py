"""`gpuloom profile sweep` end to end: a load generator runs under each (SM, quota) point
through a live dispatcher, the profiler stores the points, and a rerun resumes."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.services.profiler.app import ProfilerApp
from gpuloom.v1 import profile_store_pb2, profile_store_pb2_grpc
from tests.dispatcher.conftest import start_live

GPULOOM = str(Path(sys.executable).parent / "gpuloom")
LOADGEN = str(Path(__file__).with_name("loadgen.py"))


@pytest.fixture
async def dispatcher_address(short_dir: Path) -> AsyncIterator[str]:
    dispatcher, channel = await start_live(short_dir, lease_initial_ms=10.0, lease_max_ms=20.0)
    try:
        yield f"127.0.0.1:{dispatcher.port}"
    finally:
        await channel.close()
        await dispatcher.server.stop(0)
        dispatcher.channel.stop()


async def _sweep(
    dispatcher: str, profiler: ProfilerApp, store: ProfileStoreApp, *options: str
) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        GPULOOM, "profile", "sweep", "--function", "toy-infer", "--no-shim",
        "--dispatcher", dispatcher, "--profiler", f"127.0.0.1:{profiler.port}",
        "--profile-store", f"127.0.0.1:{store.port}", *options,
        "--", sys.executable, LOADGEN, "0.6",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode or 0, err.decode()


async def test_a_sweep_stores_every_point_and_resumes(
    dispatcher_address: str,
    profiler_app: ProfilerApp,
    store_app: ProfileStoreApp,
    stub: profile_store_pb2_grpc.ProfileStoreStub,
) -> None:
    code, output = await _sweep(
        dispatcher_address, profiler_app, store_app, "--sm", "50", "--quotas", "20,80"
    )
    assert code == 0, output
    assert "[1/2] SM 50% quota 20%" in output and "[2/2] SM 50% quota 80%" in output
    profile = await stub.GetThroughputProfile(
        profile_store_pb2.GetProfileRequest(key="toy-infer", gpu_model="A100-80GB")
    )
    by_quota = {p.quota_percent: p for p in profile.points}
    assert set(by_quota) == {20.0, 80.0}
    # The time quota really limits the load generator: about 100 vs 400 requests/s.
    low, high = by_quota[20.0].requests_per_s, by_quota[80.0].requests_per_s
    assert 2.5 < high / low < 6, (low, high)
    assert by_quota[20.0].p99_latency_ms >= by_quota[20.0].p50_latency_ms > 0

    code, output = await _sweep(
        dispatcher_address, profiler_app, store_app, "--sm", "50", "--quotas", "20,40,80"
    )
    assert code == 0, output
    assert "skipping 2 points already measured" in output and "[1/1] SM 50% quota 40%" in output
    profile = await stub.GetThroughputProfile(
        profile_store_pb2.GetProfileRequest(key="toy-infer", gpu_model="A100-80GB")
    )
    assert sorted(p.quota_percent for p in profile.points) == [20.0, 40.0, 80.0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--sm", "0", "--quotas", "50"), "SM percents must be within 1..100"),
        (("--sm", "50", "--quotas", "120"), "quotas must be in (0, 100]"),
        (("--sm", "fifty"), "comma-separated list of numbers"),
    ],
)
async def test_bad_grids_are_refused_before_anything_runs(
    dispatcher_address: str,
    profiler_app: ProfilerApp,
    store_app: ProfileStoreApp,
    stub: profile_store_pb2_grpc.ProfileStoreStub,
    options: tuple[str, ...],
    message: str,
) -> None:
    code, output = await _sweep(dispatcher_address, profiler_app, store_app, *options)
    assert code != 0 and message in output
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.GetThroughputProfile(
            profile_store_pb2.GetProfileRequest(key="toy-infer", gpu_model="A100-80GB")
        )
