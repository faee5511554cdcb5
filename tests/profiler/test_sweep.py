"""`gpuloom profile sweep` end to end: a load generator runs under each (SM, quota) point
through a live dispatcher, the profiler stores the points, and a rerun resumes."""

from __future__ import annotations

import asyncio
import functools
import os
import shlex
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.services.profiler.app import ProfilerApp
from gpuloom.v1 import profile_store_pb2, profile_store_pb2_grpc
from tests.dispatcher.conftest import start_live, stop_live
from tests.shim.conftest import shim_build  # noqa: F401  (fixture)

GPULOOM = str(Path(sys.executable).parent / "gpuloom")
LOADGEN = str(Path(__file__).with_name("loadgen.py"))
FAKE_MPS = Path(__file__).parents[1] / "dispatcher" / "fake_mps_control.py"


@pytest.fixture
async def dispatcher_address(short_dir: Path) -> AsyncIterator[str]:
    dispatcher, channel = await start_live(short_dir)
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


async def _stored(
    stub: profile_store_pb2_grpc.ProfileStoreStub, key: str
) -> profile_store_pb2.ThroughputProfile:
    """The throughput profile stored for `key` on the A100-80GB."""
    request = profile_store_pb2.GetProfileRequest(key=key, gpu_model="A100-80GB")
    return await stub.GetThroughputProfile(request)


async def test_a_sweep_stores_every_point_and_resumes(
    dispatcher_address: str,
    profiler_app: ProfilerApp,
    store_app: ProfileStoreApp,
    stub: profile_store_pb2_grpc.ProfileStoreStub,
) -> None:
    sweep = functools.partial(_sweep, dispatcher_address, profiler_app, store_app)
    code, output = await sweep("--sm", "50", "--quotas", "20,80")
    assert code == 0, output
    assert "[1/2] SM 50% quota 20%" in output and "[2/2] SM 50% quota 80%" in output
    profile = await _stored(stub, "toy-infer")
    by_quota = {p.quota_percent: p for p in profile.points}
    assert set(by_quota) == {20.0, 80.0}
    # The time quota really limits the load generator: about 100 vs 400 requests/s.
    low, high = by_quota[20.0].requests_per_s, by_quota[80.0].requests_per_s
    assert 2.5 < high / low < 6, (low, high)
    assert by_quota[20.0].p99_latency_ms >= by_quota[20.0].p50_latency_ms > 0

    code, output = await sweep("--sm", "50", "--quotas", "20,40,80")
    assert code == 0, output
    assert "skipping 2 points already measured" in output and "[1/1] SM 50% quota 40%" in output
    profile = await _stored(stub, "toy-infer")
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
        await _stored(stub, "toy-infer")


async def test_the_sm_axis_is_real_with_mps_on_the_fake_driver(
    short_dir: Path,
    profiler_app: ProfilerApp,
    store_app: ProfileStoreApp,
    stub: profile_store_pb2_grpc.ProfileStoreStub,
    shim_build: Path,  # noqa: F811
) -> None:
    """The dispatcher runs (a fake) MPS and answers with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; the
    fake driver slows a kernel that needs the whole GPU on a smaller SM share; so the sweep's
    throughput grows with the SM percent."""
    dispatcher, channel = await start_live(
        short_dir, mps="on", mps_control=shlex.join([sys.executable, str(FAKE_MPS)])
    )
    try:
        assert dispatcher.mps is not None and dispatcher.mps.available()[0]
        process = await asyncio.create_subprocess_exec(
            GPULOOM, "profile", "sweep", "--function", "fake-infer",
            "--shim", str(shim_build / "libgpuloom.so"),
            "--dispatcher", f"127.0.0.1:{dispatcher.port}",
            "--profiler", f"127.0.0.1:{profiler_app.port}",
            "--profile-store", f"127.0.0.1:{store_app.port}",
            "--sm", "25,50,100", "--quotas", "100",
            "--", str(shim_build / "cudart_like"), "module", "k_full:2000:100",
            "infer", "40", "0", "0", "k_full",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={
                **os.environ,
                "LD_LIBRARY_PATH": str(shim_build / "fake"),
                "GPULOOM_FAKE_CUDA_DIR": str(short_dir / "fake-gpu"),
            },
        )  # fmt: skip
        _, err = await asyncio.wait_for(process.communicate(), timeout=120)
        assert process.returncode == 0, err.decode()
    finally:
        await channel.close()
        await stop_live(dispatcher)
    profile = await _stored(stub, "fake-infer")
    by_sm = {p.sm_percent: p.requests_per_s for p in profile.points}
    assert sorted(by_sm) == [25, 50, 100]
    assert by_sm[25] < by_sm[50] < by_sm[100], by_sm
    # 8 ms, 4 ms and 2 ms of GPU work per request (plus the host's share of each request).
    assert by_sm[100] / by_sm[25] > 2.5, by_sm
