"""Iteration boundaries from the kernel stream (shim/src/kperiod.c): a training loop that
allocates once and reuses (as PyTorch's caching allocator does) shows no cycle in its memory
samples, but its launches repeat every mini-batch: the shim finds the loop's period there (in
kernels and in time) and publishes it in its admission region and its trace."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from gpuloom.v1 import dispatcher_pb2
from tests.dispatcher.conftest import LiveDispatcher
from tests.shim.conftest import Runner

KERNELS = "k_fwd_200us,k_bwd_300us,k_opt_100us"


def _detections(trace: list[str]) -> list[tuple[int, int]]:
    found = []
    for line in trace:
        if line.startswith("kperiod "):
            fields = dict(part.split("=", 1) for part in line.split()[1:])
            found.append((int(fields["kernels"]), int(fields["period_ns"])))
    return found


@pytest.mark.parametrize(("layers", "period_ms"), [(4, 20), (2, 35)])
async def test_the_loops_period_is_found_in_the_kernel_stream_within_5_percent(
    live: LiveDispatcher, run: Runner, layers: int, period_ms: int
) -> None:
    assignment = await live.reserve(memory_gib=1.0)
    steps = 1200 // (2 * layers + 1) + 10  # enough launches for a few detections
    result = await run.run_async(
        "module", KERNELS, "steady", str(steps), str(period_ms * 1000), str(layers),
        str(1 << 20), KERNELS,
        env={
            "GPULOOM_DISPATCHER_SOCKET": live.socket_path,
            "GPULOOM_ASSIGNMENT_TOKEN": assignment.assignment_token,
        },
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    detections = _detections(result.shim_trace)
    assert detections, result.shim_trace[-20:]
    # Every detection (the first after 256 launches) finds the loop, not a run of one kernel,
    # and its period within 5% of the loop's own: the nominal period where the loaded machine
    # kept pace, else the mean step interval the loop printed over some window of the length
    # the detector looks at.
    starts = [int(line.rsplit("t=", 1)[1]) for line in result.stdout.splitlines()
              if line.startswith("steady step ")]  # fmt: skip
    window = 256 // (2 * layers + 1) + 1
    means = [(starts[i + window] - starts[i]) / window for i in range(len(starts) - window)]
    low, high = min([period_ms * 1e6, *means]), max([period_ms * 1e6, *means])
    for kernels, period_ns in detections:
        assert kernels == 2 * layers + 1, detections  # forward and backward per layer, the step
        assert 0.95 * low <= period_ns <= 1.05 * high, (detections, low, high)


def test_without_the_dispatcher_sampling_nothing_is_detected(run: Runner) -> None:
    """Outside training introspection (no dispatcher here) the launch path records nothing."""
    result = run("module", KERNELS, "steady", "120", "1000", "4", str(1 << 20), KERNELS)
    assert result.returncode == 0, result.stderr
    assert not _detections(result.shim_trace)


BUSY = "k_fwd_2000us,k_bwd_3000us,k_opt_1000us"  # 21 ms of kernels in a 60 ms mini-batch


async def test_a_suspension_lands_at_the_iteration_boundary_the_kernel_stream_shows(
    live: LiveDispatcher, run: Runner
) -> None:
    """A loop whose launches are spread over its mini-batch (a sync after each) and whose
    memory is flat: suspended three times, it parks each time at the boundary's launch (the
    first forward kernel), never in the middle of a mini-batch, as the fake GPU's engine log
    shows. Suspended at a random moment it would land mid-batch about a third of the time."""
    assignment = await live.reserve(memory_gib=1.0)
    env = {
        "GPULOOM_DISPATCHER_SOCKET": live.socket_path,
        "GPULOOM_ASSIGNMENT_TOKEN": assignment.assignment_token,
        "CUDART_LIKE_SYNC_EACH": "1",
    }
    job = asyncio.create_task(
        run.run_async(
            "module",
            BUSY,
            "steady",
            "100",
            "60000",
            "4",
            str(1 << 20),
            BUSY,
            env=env,
            timeout=120,
        )
    )
    request = dispatcher_pb2.SuspendClientRequest(assignment_id=assignment.assignment_id)
    await asyncio.sleep(3.5)  # a few detections first (one every 256 launches, 9 a batch)
    for _ in range(3):
        suspended = await live.stub.SuspendClient(request)
        assert suspended.suspended
        await asyncio.sleep(0.6)
        await live.stub.ResumeClient(
            dispatcher_pb2.ResumeClientRequest(assignment_id=assignment.assignment_id)
        )
        await asyncio.sleep(0.5)
    result = await job
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].endswith("failed=0 corrupt=0 damaged_layers=0")
    runs = sorted((start, end, name) for _, name, start, end in run.engine_runs())
    gaps = sorted(((b[0] - a[1], a[2], b[2]) for a, b in itertools.pairwise(runs)), reverse=True)
    for gap_ns, before, after in gaps[:3]:  # the three suspensions
        assert gap_ns > 400e6, gaps[:4]
        assert (before, after) == ("k_opt_1000us", "k_fwd_2000us"), gaps[:4]
