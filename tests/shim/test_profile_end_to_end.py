"""FIKIT measurement end to end with the C shim: a CUDA workload (the fake driver) runs T times
under a live dispatcher linked to the profiler; each run measures its kernels in the shim, the
dispatcher forwards them, and the stored kernel profile matches the fake GPU's durations."""

from __future__ import annotations

import asyncio

import pytest

from gpuloom.policies.profiling.kernels import (
    GRAPH_NODE_KERNEL,
    graph_kernel_id,
    graph_name,
    kernel_id,
)
from gpuloom.services.dispatcher.kernel_tables import table_from_profile
from gpuloom.v1 import (
    dispatcher_pb2,
    dispatcher_pb2_grpc,
    profile_store_pb2,
    profile_store_pb2_grpc,
    profiler_pb2,
    profiler_pb2_grpc,
)
from tests.dispatcher.conftest import reserve_request
from tests.profile_store.conftest import store_app, stub  # noqa: F401  (fixtures)
from tests.profiler.conftest import (  # noqa: F401  (fixtures)
    profiler,
    profiler_app,
    session_when_closed,
)
from tests.profiler.test_dispatcher_link import linked  # noqa: F401  (fixture)
from tests.shim.conftest import Runner, launch

RUNS = 10
ONE = (1, 1, 1)
DURATIONS_US = {"conv": 2000, "relu": 1000, "gemm": 3000}
# One run of the task: each kernel three times (the shim drops each kernel's first sample),
# each followed by a stream sync and 200 us of host work.
WORKLOAD = ["module", ",".join(f"{n}:{us}" for n, us in DURATIONS_US.items())]
for _ in range(3):
    for name in DURATIONS_US:
        WORKLOAD += launch("kernel", name, 1, (8, 1, 1), (128, 1, 1))
        WORKLOAD += ["ssync", "sleep", "200"]  # the GPU idles while the host works
WORKLOAD += ["sync"]


async def profile_runs(
    dispatcher_link: tuple[dispatcher_pb2_grpc.DispatcherStub, str],
    profiler_stub: profiler_pb2_grpc.ProfilerStub,
    run: Runner,
    task_key: str,
    workload: list[str],
) -> profiler_pb2.Session:
    """Opens a profiling session of `RUNS` runs for `task_key`, runs `workload` under the shim
    that many times, each in its own reservation, and returns the session once closed."""
    dispatcher, socket_path = dispatcher_link
    session = await profiler_stub.OpenSession(
        profiler_pb2.OpenSessionRequest(task_key=task_key, gpu_model="A100-80GB", runs=RUNS)
    )
    await asyncio.sleep(0.3)  # the dispatcher sees the open session
    for n in range(RUNS):
        request = reserve_request(sm=100, request=50, limit=100, assignment_id=f"{task_key}-{n}")
        request.task_key = task_key
        assignment = await dispatcher.Reserve(request)
        env = {
            "GPULOOM_DISPATCHER_SOCKET": socket_path,
            "GPULOOM_ASSIGNMENT_TOKEN": assignment.assignment_token,
        }
        result = await run.run_async(*workload, env=env)
        assert result.returncode == 0, result.stderr
        await dispatcher.Release(
            dispatcher_pb2.ReleaseRequest(assignment_id=assignment.assignment_id)
        )
    return await session_when_closed(profiler_stub, session.session_id)


async def test_t_runs_of_a_cuda_workload_become_its_kernel_profile(
    linked: tuple[dispatcher_pb2_grpc.DispatcherStub, str],  # noqa: F811
    profiler: profiler_pb2_grpc.ProfilerStub,  # noqa: F811
    stub: profile_store_pb2_grpc.ProfileStoreStub,  # noqa: F811
    run: Runner,
) -> None:
    done = await profile_runs(linked, profiler, run, "fake-cnn", WORKLOAD)
    assert done.state == profiler_pb2.SESSION_STATE_COMPLETE, done
    assert done.records == RUNS * 2 * len(DURATIONS_US)  # 3 launches each, first dropped

    stored = await stub.GetKernelProfile(
        profile_store_pb2.GetProfileRequest(key="fake-cnn", gpu_model="A100-80GB")
    )
    by_name = {k.name: k for k in stored.kernels}
    assert set(by_name) == set(DURATIONS_US)
    # Ground truth: what the fake GPU really ran (its kernels sleep, and a busy machine makes
    # some sleeps longer than asked), less each process's first run of each kernel.
    truth: dict[str, list[int]] = {name: [] for name in DURATIONS_US}
    first_seen: set[tuple[int, str]] = set()
    for pid, name, start, end in run.engine_runs():
        if (pid, name) in first_seen:
            truth[name].append(end - start)
        first_seen.add((pid, name))
    for name, us in DURATIONS_US.items():
        true_mean = sum(truth[name]) / len(truth[name])
        assert true_mean >= us * 1000 * 0.99
        assert by_name[name].mean_duration_ns == pytest.approx(true_mean, rel=0.05), name
        assert by_name[name].sample_count == 2 * RUNS
        assert by_name[name].grid.x == 8 and by_name[name].block.x == 128
    # After every kernel the host waits for it and then works 200 us: the GPU idles at least
    # that long (plus the launch's own latency) before the next kernel.
    for name in DURATIONS_US:
        assert 200_000 <= by_name[name].mean_gap_after_ns < 2_000_000, name


GRAPH_NODES = 2
GRAPH_WORKLOAD = ["module", "g_step:1500", "stream"]
GRAPH_WORKLOAD += ["capture", "g_step", str(GRAPH_NODES), "ssync"]  # the warm-up launch
for _ in range(2):
    GRAPH_WORKLOAD += ["glaunch", "ssync", "sleep", "300"]
GRAPH_WORKLOAD += ["sync"]


async def test_a_measured_graph_is_stored_under_the_id_admission_looks_up(
    linked: tuple[dispatcher_pb2_grpc.DispatcherStub, str],  # noqa: F811
    profiler: profiler_pb2_grpc.ProfilerStub,  # noqa: F811
    stub: profile_store_pb2_grpc.ProfileStoreStub,  # noqa: F811
    run: Runner,
) -> None:
    """A task that runs a CUDA graph: each run measures the graph as one unit; the stored
    profile holds it by its structure's ID, with the fake GPU's duration for the whole graph,
    and the kernel table the arbiter gets from that profile has it."""
    done = await profile_runs(linked, profiler, run, "fake-graph", GRAPH_WORKLOAD)
    assert done.state == profiler_pb2.SESSION_STATE_COMPLETE, done

    stored = await stub.GetKernelProfile(
        profile_store_pb2.GetProfileRequest(key="fake-graph", gpu_model="A100-80GB")
    )
    name = graph_name([(GRAPH_NODE_KERNEL, kernel_id("g_step", ONE, ONE))] * GRAPH_NODES)
    (graph,) = stored.kernels
    assert (graph.name, graph.kernel_id) == (name, graph_kernel_id(name))
    assert (graph.grid.x, graph.grid.y, graph.grid.z) == (0, 0, 0)
    assert (graph.block.x, graph.block.y, graph.block.z) == (0, 0, 0)
    assert graph.sample_count == 2 * RUNS
    # The whole graph: both nodes back to back on the fake GPU, from the first's start to the
    # second's end (each process's first launch is its warm-up).
    runs = run.engine_runs()
    truth = []
    for pid in {pid for pid, _, _, _ in runs}:
        mine = [(start, end) for p, _, start, end in runs if p == pid]
        truth += [mine[k + 1][1] - mine[k][0] for k in range(2, len(mine), GRAPH_NODES)]
    assert len(truth) == 2 * RUNS
    assert graph.mean_duration_ns == pytest.approx(sum(truth) / len(truth), rel=0.05)
    assert graph.mean_duration_ns >= 2 * 1500 * 1000 * 0.99
    (timing,) = table_from_profile(stored)
    assert timing.kernel_id == graph_kernel_id(name)
    assert timing.duration_ns == int(graph.mean_duration_ns)
