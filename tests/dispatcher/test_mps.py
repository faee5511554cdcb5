"""MPS under the dispatcher, against a fake control program (tests/dispatcher/fake_mps_control.py,
which speaks the control daemon's stdin command interface): the daemon is started with its own
pipe and log directories, restarted when it dies and told to quit on shutdown; Reserve answers
with the MPS client environment; a daemon that will not start refuses SM partitions with
FAILED_PRECONDITION naming the cause while whole-GPU shares are still served."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from pathlib import Path

import grpc
import pytest

from gpuloom.services.dispatcher.app import _stop
from gpuloom.services.dispatcher.mps import MpsConfig, MpsSupervisor, parse_control
from gpuloom.services.dispatcher.settings import DispatcherSettings
from gpuloom.sim.device import GpuConfig
from gpuloom.v1 import dispatcher_pb2
from tests.dispatcher.conftest import LiveDispatcher, start_live
from tests.polling import alive

FAKE = Path(__file__).with_name("fake_mps_control.py")
CONTROL = shlex.join([sys.executable, str(FAKE)])
REFUSAL = "nvidia-smi says: compute mode prohibited"
REFUSING = shlex.join(["env", f"FAKE_MPS_REFUSE={REFUSAL}", sys.executable, str(FAKE)])


def _supervisor(base: Path, control: str = CONTROL, timeout_s: float = 10.0) -> MpsSupervisor:
    config = MpsConfig(
        control=parse_control(control),
        pipe_dir=base / "pipe",
        log_dir=base / "log",
        start_timeout_s=timeout_s,
        restart_backoff_s=0.05,
    )
    return MpsSupervisor(config, "0")


def _wait(condition: object, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_the_daemon_runs_answers_commands_restarts_and_quits(short_dir: Path) -> None:
    mps = _supervisor(short_dir)
    told: list[bool] = []  # what the admission engine's harvesting follows
    mps.on_running = told.append
    try:
        assert mps.start()
        assert told == [True]
        assert mps.available() == (True, "")
        first = mps.pid
        assert first is not None
        assert (short_dir / "pipe" / "control").exists()
        assert mps.command("set_default_active_thread_percentage 40").strip() == "40.0"
        assert mps.command("get_default_active_thread_percentage").strip() == "40.0"
        with pytest.raises(OSError, match="Unrecognized command"):
            mps.command("start_server -uid 0")
        os.kill(first, signal.SIGKILL)  # the daemon dies: the supervisor starts a new one
        assert _wait(lambda: mps.pid not in (None, first)), mps.available()
        assert mps.restarts == 1
        assert told == [True, False, True]  # it died, then answered again
        assert mps.command("get_default_active_thread_percentage").strip() == "100.0"
        second = mps.pid
        assert second is not None
    finally:
        mps.stop()
    assert mps.available() == (False, "stopped")
    assert told == [True, False, True]  # nobody is told while it stops
    assert not alive(second)
    assert not (short_dir / "pipe" / "control").exists()  # it quit (removes its socket)
    log = (short_dir / "log" / "control.log").read_text()
    assert "quit -> ok" in log and log.count("control daemon started") == 2


@pytest.mark.parametrize(
    ("control", "cause"),
    [
        (REFUSING, f"exited with code 1 while starting ({REFUSAL})"),
        ("/nonexistent/nvidia-cuda-mps-control", "cannot start '/nonexistent/nvidia-cuda-mps"),
    ],
    ids=["refuses", "missing"],
)
def test_a_daemon_that_will_not_start_says_why(short_dir: Path, control: str, cause: str) -> None:
    mps = _supervisor(short_dir, control)
    try:
        assert not mps.start()
        running, why = mps.available()
        assert not running and cause in why
    finally:
        mps.stop()


def test_a_daemon_that_never_answers_is_given_up_after_the_start_timeout(short_dir: Path) -> None:
    mute = shlex.join(["env", "FAKE_MPS_MUTE=1", sys.executable, str(FAKE)])
    mps = _supervisor(short_dir, mute, timeout_s=1.5)
    mps.config = MpsConfig(**{**_fields(mps.config), "command_timeout_s": 0.5})
    try:
        started = time.monotonic()
        assert not mps.start()
        assert time.monotonic() - started < 5
        assert "did not answer within 1.5 s" in mps.available()[1]
    finally:
        mps.stop()


def _fields(config: MpsConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in config.__slots__}  # type: ignore[attr-defined]


def test_settings_choose_where_mps_runs() -> None:
    real, simulated = "GPU-8f3c", "SIM-A100-80GB-0"
    # Only spatiotemporal (SM partitions) runs MPS: on real GPUs, not on simulated ones (the
    # fake driver's live path runs without a daemon) unless told "on".
    auto = DispatcherSettings(policy="spatiotemporal")
    assert auto.runs_mps(real) and not auto.runs_mps(simulated)
    assert DispatcherSettings(policy="spatiotemporal", mps="on").runs_mps(simulated)
    assert not DispatcherSettings(policy="spatiotemporal", mps="off").runs_mps(real)
    # The default policy (composed) runs none, as the simulator's default GPU (docs/harvest.md,
    # "MPS or time slices"), nor do the baselines, whatever GPULOOM_DISPATCHER_MPS says.
    assert DispatcherSettings().policy == "composed"
    assert not DispatcherSettings().runs_mps(real)
    assert not DispatcherSettings().harvests(real)
    for policy in ("exclusive", "fifo", "fikit"):
        assert not DispatcherSettings(policy=policy, mps="on").runs_mps(real)
    # Composed runs MPS only when told "on" (auto is off for it), and its engine then asks the
    # spatial rule; spatiotemporal's MPS harvests nothing (it has no FIKIT half at work).
    assert not DispatcherSettings(policy="composed", mps="auto").runs_mps(real)
    on = DispatcherSettings(policy="composed", mps="on")
    assert on.runs_mps(real) and on.runs_mps(simulated) and on.harvests(real)
    assert not DispatcherSettings(policy="spatiotemporal", mps="on").harvests(real)
    with pytest.raises(ValueError, match="MPS control command is empty"):
        DispatcherSettings(mps_control="  ")


def test_the_spatial_rules_knobs_come_from_the_policy_arguments() -> None:
    settings = DispatcherSettings(mps="on", policy_args="harvest.max_holder_slowdown=1.1")
    assert settings.policy_arguments().harvest.max_holder_slowdown == 1.1
    assert DispatcherSettings().policy_arguments().harvest.max_holder_slowdown == 1.03
    with pytest.raises(ValueError, match=r"policy arguments harvest: stretch must be 1\.\.100"):
        DispatcherSettings(policy_args="harvest.stretch=0.5")


def test_the_simulators_default_gpu_is_the_default_deployments() -> None:
    # "Every GPU and MPS setting left at its default" in a scenario means the GPU the default
    # settings run: both without MPS (time slices), or both with it.
    assert GpuConfig().mps == DispatcherSettings().runs_mps("GPU-8f3c")


MPS_ON = {"mps": "on", "mps_control": CONTROL}


@pytest.mark.parametrize("live", [MPS_ON], indirect=True)
async def test_reserve_answers_with_the_mps_client_environment(live: LiveDispatcher) -> None:
    mps = live.dispatcher.mps
    assert mps is not None and mps.available()[0]
    pipe = live.data_dir / "dispatcher" / "mps" / "gpu-0" / "pipe"
    assert mps.config.pipe_dir == pipe.absolute()
    assignment = await live.reserve(sm=30, request=40.0, memory_gib=1.5)
    environment = dict(assignment.environment)
    assert environment["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert environment["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe.absolute())
    assert environment["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1536M"
    whole = dict((await live.reserve(sm=100, request=20.0)).environment)
    assert whole["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"


@pytest.mark.parametrize("live", [{"mps": "on", "mps_control": REFUSING}], indirect=True)
async def test_without_its_daemon_a_gpu_refuses_sm_partitions_and_serves_the_rest(
    live: LiveDispatcher,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await live.reserve(sm=50, assignment_id="partition-1")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details() or ""
    assert "needs MPS on GPU 0" in details
    assert REFUSAL in details
    status = await live.stub.ListClients(dispatcher_pb2.ListClientsRequest())
    assert not status.clients  # nothing changed
    # The whole GPU (a token share of 100% SM) is still served, as a plain CUDA context.
    whole = await live.reserve(sm=100, request=30.0)
    assert whole.assignment_token
    assert not any(key.startswith("CUDA_MPS") for key in whole.environment)


async def test_the_dispatcher_stops_its_daemon_on_shutdown(short_dir: Path) -> None:
    dispatcher, channel = await start_live(short_dir / "second", **MPS_ON)
    await channel.close()
    assert dispatcher.mps is not None
    pid = dispatcher.mps.pid
    assert pid is not None and alive(pid)
    await _stop(dispatcher, 0)
    assert not alive(pid)
    assert dispatcher.mps.available() == (False, "stopped")
