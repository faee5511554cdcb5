"""CUDA graphs admitted as units of known length, live: real processes under the C shim on the
fake driver, a real dispatcher and its native arbiter, kernel tables from a real profile store
holding each graph under the ID its structure gives it (shim/src/graphs.c).

A high-priority holder launches a graph of three kernels, then its host works 2 ms; a
low-priority filler launches its own graph back to back. The holder's graph opens a gap window
of its known length; the filler's graph fills it only if its profiled length fits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gpuloom.policies.profiling.kernels import (
    GRAPH_NODE_KERNEL,
    graph_kernel_id,
    graph_name,
    kernel_id,
)
from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.v1 import common_pb2, dispatcher_pb2_grpc, profile_store_pb2
from gpuloom.v1 import profile_store_pb2_grpc as store_grpc
from tests.dispatcher.conftest import LiveDispatcher, start_live, stop_live
from tests.profile_store.conftest import store_app, stub  # noqa: F401  (fixtures)
from tests.shim.conftest import Runner
from tests.shim.test_fikit_live import Fikit, put_kernel_profile

HOLDER_KERNEL, HOLDER_NODES = "k_gh_300us", 3
FILLER_KERNEL, FILLER_NODES = "k_gf_150us", 2
PAUSE_US = 2000  # the holder's host work after each graph
ONE = (1, 1, 1)
NO_DIM = common_pb2.Dim3(x=0, y=0, z=0)
# The arbiter learns the holder's kernels only once another task shares the GPU (alone, a
# holder posts no IDs): the filler's first few graphs may run before the holder's next launch.
SETTLE_NS = 200_000_000


def _graph_id(kernel: str, nodes: int) -> tuple[str, int]:
    name = graph_name([(GRAPH_NODE_KERNEL, kernel_id(kernel, ONE, ONE))] * nodes)
    return name, graph_kernel_id(name)


def _graph_stats(kernel: str, nodes: int, duration_us: float, gap_us: float):
    name, graph = _graph_id(kernel, nodes)
    return profile_store_pb2.KernelStats(
        kernel_id=graph,
        name=name,
        grid=NO_DIM,
        block=NO_DIM,
        sample_count=100,
        mean_duration_ns=duration_us * 1e3,
        p50_duration_ns=duration_us * 1e3,
        p95_duration_ns=duration_us * 1e3,
        mean_gap_after_ns=gap_us * 1e3,
    )


@pytest.fixture
async def stores(
    short_dir: Path,
    store_app: ProfileStoreApp,  # noqa: F811
    stub: store_grpc.ProfileStoreStub,  # noqa: F811
) -> AsyncIterator[tuple[Path, ProfileStoreApp, store_grpc.ProfileStoreStub]]:
    yield short_dir, store_app, stub


async def _run_pair(
    stores: tuple[Path, ProfileStoreApp, store_grpc.ProfileStoreStub],
    run: Runner,
    filler_us: float,
    policy: str,
):
    """The holder and the filler side by side, the filler's graph profiled at `filler_us`;
    returns the arbiter's core counters and stats, and how many filler kernels the fake GPU
    ran while the holder worked (from SETTLE_NS after the filler came)."""
    short_dir, app, store = stores
    dispatcher, channel = await start_live(
        short_dir, profile_store_address=f"127.0.0.1:{app.port}", policy=policy
    )
    try:
        model = dispatcher.core.gpu.model
        holder_us = 300 * HOLDER_NODES
        holder_stats = _graph_stats(HOLDER_KERNEL, HOLDER_NODES, holder_us, PAUSE_US)
        await put_kernel_profile(store, "g-holder", model, [holder_stats])
        filler_stats = _graph_stats(FILLER_KERNEL, FILLER_NODES, filler_us, 0)
        await put_kernel_profile(store, "g-filler", model, [filler_stats])
        fikit = Fikit(LiveDispatcher(dispatcher, dispatcher_pb2_grpc.DispatcherStub(channel),
                                     short_dir))  # fmt: skip
        holder = fikit.env(await fikit.token("g-holder", 0))
        filler = fikit.env(await fikit.token("g-filler", 5))
        module = ["module", f"{HOLDER_KERNEL},{FILLER_KERNEL}", "stream"]
        holding = asyncio.create_task(
            run.run_async(*module, "capture", HOLDER_KERNEL, str(HOLDER_NODES), "ssync",
                          "gloop", "3", str(PAUSE_US), env=holder, timeout=40)
        )  # fmt: skip
        await asyncio.sleep(0.3)
        joined = time.monotonic_ns()
        filling = await run.run_async(
            *module, "capture", FILLER_KERNEL, str(FILLER_NODES), "ssync", "gloop", "1.5", "0",
            env=filler, timeout=40,
        )  # fmt: skip
        held = await holding
        for result in (held, filling):
            assert result.returncode == 0, result.stderr
            assert int(result.value("gloop", "launches")) > 0, result.stdout
        runs = run.engine_runs()
        holder_end = max(end for _, name, _, end in runs if name == HOLDER_KERNEL)
        settled = joined + SETTLE_NS
        filled = sum(
            1
            for _, name, start, _ in runs
            if name == FILLER_KERNEL and settled < start < holder_end
        )
        await fikit.release_all()
        return dispatcher.engine.core_counters(), dispatcher.engine.fikit_stats(), filled
    finally:
        await channel.close()
        await stop_live(dispatcher)


@pytest.mark.parametrize("policy", ["fikit", "composed"])
async def test_a_holders_graph_opens_a_window_a_fitting_filler_graph_fills(
    stores, run: Runner, policy: str
) -> None:
    counters, stats, filled = await _run_pair(stores, run, filler_us=300, policy=policy)
    # Every graph ID posted was found in its task's table (a holder alone posts none) ...
    assert stats.unknown_kernels == 0, stats
    # ... the holder's graphs opened windows, and the filler's graphs went into them.
    assert counters.windows_opened > 0 and counters.granted_window > 0, counters
    assert filled > 20 * FILLER_NODES, filled


async def test_a_filler_graph_longer_than_the_holders_gap_does_not_fill_it(
    stores, run: Runner
) -> None:
    """Side by side: the same workloads, the filler's graph profiled to fit the holder's gap,
    then three times longer than it. Only the first goes into the holder's windows (the
    second may still run when the holder looks idle: a 2 ms host pause on a loaded machine
    can outlast its predicted gap and the idle margin)."""
    fitting, _, _ = await _run_pair(stores, run, filler_us=300, policy="fikit")
    counters, stats, _ = await _run_pair(stores, run, filler_us=3 * PAUSE_US, policy="fikit")
    assert stats.unknown_kernels == 0, stats
    assert counters.windows_opened > 0, counters
    print(f"window fills: fitting {fitting.granted_window}, too long {counters.granted_window}")
    assert fitting.granted_window > 20
    assert counters.granted_window * 10 <= fitting.granted_window, (fitting, counters)
