"""kill -9 of `gpuloom serve dispatcher`: while shims take leases from its lease desk (no shim
waits past its bound, GPULOOM_SHIM_WAIT_MS; each does what its loss policy says; restarted, it
holds every reservation and no more), and in the middle of a MIG batch (its runner stops the
tasks it started; restarted, it runs the next batch)."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from gpuloom.clients.mig_run import MigBatch, MigBatchRunner, MigBatchTask
from gpuloom.domain.errors import DomainError
from gpuloom.v1 import dispatcher_pb2
from tests.dispatcher.conftest import reserve_request
from tests.dispatcher.test_restart import DispatcherProcess
from tests.polling import alive
from tests.shim.conftest import CUDA_ERROR_NOT_PERMITTED, Runner

WAIT_MS = 300
KERNEL = "k_l_500us"


@pytest.mark.parametrize("policy", ["open", "closed"])
async def test_kill_9_of_the_dispatcher_mid_lease_keeps_every_shim_to_its_bound(
    short_dir: Path, run: Runner, policy: str
) -> None:
    dispatcher = DispatcherProcess(short_dir)
    # Windows short enough that a share out of quota waits well within the bound for the next.
    dispatcher.env.update(
        GPULOOM_DISPATCHER_WINDOW_MS="200",
        GPULOOM_DISPATCHER_POLICY_ARGS="tokens.lease_initial_s=0.01,tokens.lease_max_s=0.02",
    )
    dispatcher.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{dispatcher.port}") as channel:
            stub = dispatcher.stub(channel)
            # Two small shares that fit together: leases come from the desk, and each process
            # waits for one most of the time, so the kill likely finds them waiting.
            assignments = [
                stub.Reserve(reserve_request(sm=50, request=20.0, limit=20.0)) for _ in range(2)
            ]
            runs = [
                asyncio.create_task(
                    run.run_async(
                        "module",
                        KERNEL,
                        "loop",
                        "3.0",
                        KERNEL,
                        "1",
                        env={
                            "GPULOOM_DISPATCHER_SOCKET": dispatcher.socket_path,
                            "GPULOOM_ASSIGNMENT_TOKEN": a.assignment_token,
                            "GPULOOM_SHIM_WAIT_MS": str(WAIT_MS),
                            "GPULOOM_ON_DISPATCHER_LOSS": policy,
                        },
                    )
                )
                for a in assignments
            ]
            await asyncio.sleep(1.0)
            killed_ns = time.monotonic_ns()
            dispatcher.kill()
            results = await asyncio.gather(*runs)
        for result in results:
            assert "lost the dispatcher" in result.stderr, result.stderr
            # No launch of either waited longer than the bound, before or after the kill.
            assert float(result.value("loop", "max_launch_ms")) < WAIT_MS + 100, result.stdout
            if policy == "open":
                assert result.returncode == 0, result.stderr
                assert "UNTHROTTLED" in result.stderr
            else:
                assert result.returncode == 3, result.stderr
                assert f"rc={CUDA_ERROR_NOT_PERMITTED}" in result.line("loop")
                pid = int(result.value("init", "pid"))
                last_start = max(s for p, _, s, _ in run.engine_runs() if p == pid)
                assert (last_start - killed_ns) / 1e6 < WAIT_MS, (last_start - killed_ns) / 1e6
        # Started again, it holds the two reservations, and once released, nothing.
        dispatcher.start()
        with grpc.insecure_channel(f"127.0.0.1:{dispatcher.port}") as channel:
            stub = dispatcher.stub(channel)
            status = stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest(), timeout=10)
            held = sorted(c.assignment.assignment_id for c in status.clients)
            assert held == sorted(a.assignment_id for a in assignments)
            for a in assignments:
                stub.Release(dispatcher_pb2.ReleaseRequest(assignment_id=a.assignment_id))
            status = stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest(), timeout=10)
            assert list(status.clients) == []
    finally:
        if dispatcher.process is not None and dispatcher.process.poll() is None:
            dispatcher.kill()


# A MIG task that writes down its pid, then runs far longer than the test.
LONG_TASK = "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(60)\n"


def test_kill_9_of_the_dispatcher_mid_mig_batch_leaves_no_task_behind(short_dir: Path) -> None:
    """The batch's runner (gpuloom mig run's) sees its stream break and stops the tasks it
    started, so the restarted dispatcher finds its GPU free: nothing holds the instances, and a
    new batch runs."""
    dispatcher = DispatcherProcess(short_dir)
    dispatcher.env.update(GPULOOM_DISPATCHER_SIM_GPUS="A100-80GB:mig")
    dispatcher.start()
    pids = [short_dir / f"task-{i}.pid" for i in range(2)]
    try:
        address = f"127.0.0.1:{dispatcher.port}"
        tasks = tuple(
            MigBatchTask(
                f"long-{i}", {3: 60.0, 4: 60.0}, (sys.executable, "-S", "-c", LONG_TASK, str(pid))
            )
            for i, pid in enumerate(pids)
        )
        instant = {3: 0.0, 4: 0.0}
        runner = MigBatchRunner(address, short_dir / "logs")
        outcome: list[BaseException] = []

        def run() -> None:
            try:
                runner.run(MigBatch(tasks, create_seconds=instant, destroy_seconds=instant))
            except BaseException as error:
                outcome.append(error)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not all(p.exists() and p.read_text() for p in pids):
            assert time.monotonic() < deadline, "the batch's tasks did not start"
            time.sleep(0.05)
        running = [int(p.read_text()) for p in pids]
        assert all(alive(pid) for pid in running)
        dispatcher.kill()
        thread.join(30)
        assert not thread.is_alive() and isinstance(outcome[0], DomainError)
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in running):
            assert time.monotonic() < deadline, "a task outlived its run"
            time.sleep(0.05)
        dispatcher.start()
        quick = MigBatchTask("quick", {7: 0.1}, (sys.executable, "-S", "-c", "pass"))
        report = MigBatchRunner(address, short_dir / "logs").run(MigBatch((quick,)))
        assert [(t.task, t.exit_code) for t in report.tasks] == [("quick", 0)]
        with grpc.insecure_channel(address) as channel:
            status = dispatcher.stub(channel).GetGpuStatus(
                dispatcher_pb2.GetGpuStatusRequest(), timeout=10
            )
            assert list(status.clients) == []
    finally:
        if dispatcher.process is not None and dispatcher.process.poll() is None:
            dispatcher.kill()


@pytest.mark.parametrize("event", ["kill", "hang"])
@pytest.mark.parametrize("policy", ["spatiotemporal", "exclusive", "fikit"])
async def test_fail_closed_within_the_bound_of_a_dead_or_hung_dispatcher(
    short_dir: Path, run: Runner, policy: str, event: str
) -> None:
    """GPULOOM_ON_DISPATCHER_LOSS=closed: a process fails within GPULOOM_SHIM_WAIT_MS of its
    dispatcher's death (kill -9: its socket closes) or hang (SIGSTOP: its socket stays open,
    its heartbeat stops), whether it waits for leases, holds one until further notice
    (`exclusive`) or holds the GPU under FIKIT, asking for nothing."""
    dispatcher = DispatcherProcess(short_dir)
    dispatcher.env.update(GPULOOM_DISPATCHER_POLICY=policy)
    dispatcher.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{dispatcher.port}") as channel:
            token = (
                dispatcher.stub(channel)
                .Reserve(reserve_request(sm=100, request=50.0, limit=50.0))
                .assignment_token
            )
        env = {
            "GPULOOM_DISPATCHER_SOCKET": dispatcher.socket_path,
            "GPULOOM_ASSIGNMENT_TOKEN": token,
            "GPULOOM_SHIM_WAIT_MS": str(WAIT_MS),
            "GPULOOM_ON_DISPATCHER_LOSS": "closed",
        }
        task = asyncio.create_task(
            run.run_async("module", KERNEL, "loop", "8.0", KERNEL, "1", env=env, timeout=30)
        )
        await asyncio.sleep(1.0)
        lost_ns = time.monotonic_ns()
        assert dispatcher.process is not None
        dispatcher.process.send_signal(signal.SIGKILL if event == "kill" else signal.SIGSTOP)
        result = await task
        failed_after_ms = (time.monotonic_ns() - lost_ns) / 1e6
    finally:
        if dispatcher.process is not None and dispatcher.process.poll() is None:
            dispatcher.process.send_signal(signal.SIGCONT)
            dispatcher.kill()
    assert result.returncode == 3, (result.returncode, result.stderr)
    assert f"rc={CUDA_ERROR_NOT_PERMITTED}" in result.line("loop")
    # It failed within the bound (and the time to exit on a loaded machine), not at the end of
    # its 8 s loop; no kernel of it started on the GPU later than the bound after the loss.
    assert failed_after_ms < WAIT_MS + 700, failed_after_ms
    pid = int(result.value("init", "pid"))
    last_start = max(start for p, _, start, _ in run.engine_runs() if p == pid)
    assert (last_start - lost_ns) / 1e6 < WAIT_MS + 100, (last_start - lost_ns) / 1e6
