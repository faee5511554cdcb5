"""Measure mode against a live dispatcher: the shim times every kernel with a bounded pool of
CUDA events (collected off the launch path) and sends MeasurementBatch frames; the records
the dispatcher receives are checked against the fake GPU's own log of what ran."""

from __future__ import annotations

import asyncio
import re

import pytest

from gpuloom.policies.profiling.kernels import GRAPH_NODE_KERNEL, graph_kernel_id, graph_name
from gpuloom.v1 import shim_pb2
from tests.dispatcher.conftest import LiveDispatcher
from tests.shim.conftest import Runner, kernel_id, launch

ONE = (1, 1, 1)

MEASURE, OFF = 2, 3


def _env(live: LiveDispatcher, token: str, **extra: str) -> dict[str, str]:
    return {
        "GPULOOM_DISPATCHER_SOCKET": live.socket_path,
        "GPULOOM_ASSIGNMENT_TOKEN": token,
        **extra,
    }


async def _records(
    live: LiveDispatcher, assignment_id: str, expected: int, timeout: float = 5.0
) -> list[shim_pb2.KernelRecord]:
    """What the dispatcher received, sorted by start: once `expected` records are in (or the
    timeout passed), a short wait more, so that extra records would be seen too."""
    buffer = live.dispatcher.measurements
    assert buffer is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    records: list[shim_pb2.KernelRecord] = []
    while len(records) < expected and loop.time() < deadline:
        records += buffer.take(assignment_id)
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)
    records += buffer.take(assignment_id)
    return sorted(records, key=lambda r: (r.start_ns, r.end_ns))


def _dims(record: shim_pb2.KernelRecord) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    return (
        (record.grid.x, record.grid.y, record.grid.z),
        (record.block.x, record.block.y, record.block.z),
    )


MODULE = "k_a_12000us,k_b_10000us,k_c_8000us"
ROUND = [  # (launch kind, kernel, grid, block): k_c twice with other dimensions = 2 kernel IDs
    ("kernel", "k_a_12000us", (4, 2, 1), (128, 1, 1)),
    ("kernel", "k_b_10000us", (1, 1, 1), (32, 4, 2)),
    ("ex", "k_c_8000us", (2, 1, 1), (64, 1, 1)),
    ("coop", "k_c_8000us", (3, 1, 1), (64, 1, 1)),
]
ROUNDS, IDLE_US = 6, 10_000
# Absolute tolerance for near-zero gaps: the fake GPU's worker thread, not a GPU, moves from
# one kernel to the next, and on a busy machine it is sometimes scheduled late.
NS_TOLERANCE = 500_000


async def test_records_match_the_fake_gpu(live: LiveDispatcher, run: Runner) -> None:
    assignment = await live.reserve(mode=MEASURE)
    ops = ["module", MODULE]
    for _ in range(ROUNDS):  # four kernels back to back, then a sync and idle time
        for kind, name, grid, block in ROUND:
            ops += launch(kind, name, 1, grid, block)
        ops += ["ssync", "sleep", str(IDLE_US)]
    result = await run.run_async(*ops, env=_env(live, assignment.assignment_token))
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    assert any(line.startswith("registered mode 2") for line in result.shim_trace)

    pid = int(result.value("init", "pid"))
    truth = [(start, end) for p, _, start, end in run.engine_runs() if p == pid]
    launches = ROUND * ROUNDS
    assert len(truth) == len(launches)
    # The first launch of each kernel ID (the whole first round) is not measured.
    expected = launches[len(ROUND) :]
    truth = truth[len(ROUND) :]
    records = await _records(live, assignment.assignment_id, len(expected))
    assert len(records) == len(expected), [r.name for r in records]

    for record, (_, name, grid, block), (start, end) in zip(records, expected, truth, strict=True):
        assert record.name == name
        assert _dims(record) == (grid, block)
        assert record.kernel_id == kernel_id(name, grid, block)
        assert record.run_index == 0
        measured, real = record.end_ns - record.start_ns, end - start
        assert measured == pytest.approx(real, rel=0.05), (name, measured, real)
        # One timeline, on (about) the host's CLOCK_MONOTONIC like the fake's log.
        assert abs(record.start_ns - start) < 5_000_000, (record.start_ns, start)

    for i in range(len(records) - 1):
        gap = records[i + 1].start_ns - records[i].end_ns
        real_gap = truth[i + 1][0] - truth[i][1]
        assert abs(gap - real_gap) <= max(0.05 * real_gap, NS_TOLERANCE), (i, gap, real_gap)
        if (i + 1) % len(ROUND) == 0:  # the idle time the workload inserted
            assert IDLE_US * 1000 * 0.95 <= gap < IDLE_US * 1000 + 10_000_000, (i, gap)
        else:  # back to back
            assert gap < NS_TOLERANCE, (i, gap)


BURST, BURST_KERNEL = 2000, "k_q_200us"


async def test_launch_path_never_waits_for_events(live: LiveDispatcher, run: Runner) -> None:
    """Many launches without a sync: launching takes about as long with measuring as without
    (a launch that waited for its events would take the kernel's 200 us, 400 ms in all)."""
    times = {}
    for mode in (OFF, MEASURE):
        assignment = await live.reserve(mode=mode)
        result = await run.run_async(
            "module",
            BURST_KERNEL,
            "burst",
            BURST_KERNEL,
            str(BURST),
            "sync",
            env=_env(live, assignment.assignment_token),
        )
        assert result.returncode == 0, result.stderr
        assert int(result.value("burst", "launches")) == BURST
        times[mode] = float(result.value("burst", "launch_ms"))
        records = await _records(
            live, assignment.assignment_id, BURST - 1 if mode == MEASURE else 0
        )
        if mode == OFF:
            assert records == []
        else:
            assert len(records) == BURST - 1  # the pool (4096 pairs) covers every launch
            sent = [int(line.split()[2]) for line in result.shim_trace if "measure sent" in line]
            assert sum(sent) == BURST - 1 and max(sent) <= 1000, sent  # batches of <= 1000
            assert all(r.name == BURST_KERNEL for r in records)
            pid = int(result.value("init", "pid"))
            real = sorted(end - start for p, _, start, end in run.engine_runs() if p == pid)
            durations = sorted(r.end_ns - r.start_ns for r in records)
            middle = len(durations) // 2
            assert durations[middle] == pytest.approx(real[middle], rel=0.5)
    # A generous bound: the fake's launch is a few microseconds, and measuring adds two event
    # records and a capture query to each; waiting on events would cost 200 us per launch.
    assert times[MEASURE] < max(10 * times[OFF], 50.0), times
    assert times[MEASURE] < 0.2 * BURST * 0.2, times


async def test_exhausted_pool_skips_launches_and_says_so(live: LiveDispatcher, run: Runner) -> None:
    assignment = await live.reserve(mode=MEASURE)
    kernel = "k_p_10000us"  # long: no pair completes while a burst is being launched
    result = await run.run_async(
        "module",
        kernel,
        "burst",
        kernel,
        "30",
        "sync",
        "burst",
        kernel,
        "10",
        "sync",
        env=_env(live, assignment.assignment_token, GPULOOM_SHIM_EVENT_POOL="4"),
    )
    assert result.returncode == 0, result.stderr
    match = re.search(r"launches not measured: (\d+) ", result.stderr)
    assert match, result.stderr
    skipped = int(match.group(1))
    records = await _records(live, assignment.assignment_id, 8)
    # Each burst fills the 4 pairs; the sync frees them for the next burst.
    assert len(records) >= 8
    assert len(records) + skipped == 40 - 1, (len(records), skipped)  # 1: the first launch
    exits = [line for line in result.shim_trace if line.startswith("measure exit")]
    assert exits == [f"measure exit sent {len(records)} skipped {skipped} dropped 0"], (
        exits,
        result.stderr,
    )


async def test_kernels_running_at_exit_are_collected(live: LiveDispatcher, run: Runner) -> None:
    """No sync before exit: the exit handler waits (boundedly) for the pairs in flight."""
    assignment = await live.reserve(mode=MEASURE)
    kernel = "k_" + "long" * 25 + "_5000us"  # a record over 127 bytes
    result = await run.run_async(
        "module", kernel, "burst", kernel, "6", env=_env(live, assignment.assignment_token)
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    records = await _records(live, assignment.assignment_id, 5)
    assert len(records) == 5
    pid = int(result.value("init", "pid"))
    truth = [(start, end) for p, _, start, end in run.engine_runs() if p == pid]
    assert len(truth) == 6
    for record, (start, end) in zip(records, truth[1:], strict=True):
        assert record.name == kernel
        assert record.end_ns - record.start_ns == pytest.approx(end - start, rel=0.05)


async def test_graph_is_one_record_and_captures_are_not_measured(
    live: LiveDispatcher, run: Runner
) -> None:
    assignment = await live.reserve(mode=MEASURE)
    kernel = "k_g_5000us"
    result = await run.run_async(
        "module",
        kernel,
        "stream",
        "capture",
        kernel,
        "3",
        "ssync",
        "capture",
        kernel,
        "3",
        "ssync",
        env=_env(live, assignment.assignment_token),
    )
    assert result.returncode == 0, result.stderr
    assert result.line("graph") == "graph rc=0"
    assert "fake cuEventRecord captured" not in result.fake_trace
    pid = int(result.value("init", "pid"))
    truth = [(start, end) for p, _, start, end in run.engine_runs() if p == pid]
    assert len(truth) == 6
    records = await _records(live, assignment.assignment_id, 1)
    # The first graph launch is the warm-up of the graph's ID; the second is measured whole,
    # under the ID its structure gives it (what admission looks up).
    assert len(records) == 1, records
    (record,) = records
    assert record.name == graph_name([(GRAPH_NODE_KERNEL, kernel_id(kernel, ONE, ONE))] * 3)
    assert _dims(record) == ((0, 0, 0), (0, 0, 0))
    assert record.kernel_id == graph_kernel_id(record.name)
    real = truth[5][1] - truth[3][0]
    assert record.end_ns - record.start_ns == pytest.approx(real, rel=0.05)


async def test_two_streams_are_collected_independently(live: LiveDispatcher, run: Runner) -> None:
    """A stream whose kernels are still running does not hold back another stream's records."""
    assignment = await live.reserve(mode=MEASURE)
    result = await run.run_async(
        "module",
        "k_x_150000us,k_y_2000us",
        *launch("kernel", "k_x_150000us", 2),  # the default stream: 300 ms
        "stream",
        *launch("kernel", "k_y_2000us", 4),  # a stream of its own: 8 ms
        "ssync",  # k_x is still running: k_y's records are collected here, and sent...
        "sync",  # ... while this waits for k_x
        env=_env(live, assignment.assignment_token),
    )
    assert result.returncode == 0, result.stderr
    pid = int(result.value("init", "pid"))
    records = await _records(live, assignment.assignment_id, 4)
    assert [r.name for r in records].count("k_y_2000us") == 3
    assert [r.name for r in records].count("k_x_150000us") == 1
    for name in ("k_x_150000us", "k_y_2000us"):
        truth = sorted((s, e) for p, n, s, e in run.engine_runs() if p == pid and n == name)
        measured = [r for r in records if r.name == name]
        for record, (start, end) in zip(measured, truth[1:], strict=True):
            assert record.end_ns - record.start_ns == pytest.approx(end - start, rel=0.05)
    # k_y's records went out in a batch of their own, before k_x was done.
    sent = [line for line in result.shim_trace if line.startswith("measure sent")]
    assert sent == ["measure sent 3", "measure sent 1"], sent


async def test_dispatcher_gone_while_measuring(live: LiveDispatcher, run: Runner) -> None:
    assignment = await live.reserve(mode=MEASURE)
    env = _env(live, assignment.assignment_token, GPULOOM_SHIM_WAIT_MS="300")
    task = asyncio.create_task(
        run.run_async("module", "k_l_500us", "loop", "1.5", "k_l_500us", "1", env=env)
    )
    await asyncio.sleep(0.6)
    await asyncio.to_thread(live.dispatcher.channel.stop)
    result = await task
    assert result.returncode == 0, result.stderr
    assert "lost the dispatcher" in result.stderr, result.stderr
    # It ran on after the loss (about 2,500 launches on an idle machine); no launch waited for
    # the dispatcher (the bound is for a busy machine's scheduling, not for a wait).
    assert int(result.value("loop", "launches")) > 500
    assert float(result.value("loop", "max_launch_ms")) < 1000, result.stdout
    # What was measured before the loss arrived.
    buffer = live.dispatcher.measurements
    assert buffer is not None
    records = buffer.take(assignment.assignment_id)
    assert len(records) > 20
    assert all(r.name == "k_l_500us" and r.end_ns >= r.start_ns for r in records)
