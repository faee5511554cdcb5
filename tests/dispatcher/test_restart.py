"""`gpuloom serve dispatcher` as a real process: killed with SIGKILL and started again, it keeps
every reservation and the process each token is bound to."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpuloom.clients.shim import ShimChannelError, ShimClient
from gpuloom.v1 import dispatcher_pb2, dispatcher_pb2_grpc
from tests.conftest import free_port
from tests.dispatcher.conftest import reserve_request
from tests.dispatcher.test_channel import REPLAY

GPULOOM = str(Path(sys.executable).parent / "gpuloom")


class DispatcherProcess:
    def __init__(self, data_dir: Path) -> None:
        self.port = free_port()
        self.socket_path = str(data_dir / "dispatcher" / "gpu-0.sock")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOOM_")}
        self.env.update(
            GPULOOM_DATA_DIR=str(data_dir),
            GPULOOM_METRICS_PORT="0",
            GPULOOM_DISPATCHER_PORT=str(self.port),
            GPULOOM_DISPATCHER_BACKEND="simulated",
            GPULOOM_DISPATCHER_SIM_GPUS="A100-80GB",
            # Served open (the explicit opt-out): these tests kill and restart a dispatcher and
            # call it as placement would; how it is secured is tests/security's business.
            GPULOOM_INSECURE="true",
        )
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [GPULOOM, "serve", "dispatcher"],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.process.stdout is not None
        banner = self.process.stdout.readline()
        assert "gpuloom is running" in banner, banner

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def stub(self, channel: grpc.Channel) -> dispatcher_pb2_grpc.DispatcherStub:
        return dispatcher_pb2_grpc.DispatcherStub(channel)


@pytest.fixture
def dispatcher_process(short_dir: Path) -> Iterator[DispatcherProcess]:
    process = DispatcherProcess(short_dir)
    yield process
    if process.process is not None and process.process.poll() is None:
        process.kill()


def test_reservations_and_bindings_survive_a_killed_dispatcher(
    dispatcher_process: DispatcherProcess,
) -> None:
    dispatcher_process.start()
    address = f"127.0.0.1:{dispatcher_process.port}"
    with grpc.insecure_channel(address) as channel:
        stub = dispatcher_process.stub(channel)
        assignment = stub.Reserve(reserve_request(sm=40, request=30), timeout=10)
    token = assignment.assignment_token
    shim = ShimClient.connect(dispatcher_process.socket_path, token)
    shim.acquire(timeout_s=2)

    dispatcher_process.kill()
    shim.close()
    dispatcher_process.start()  # also clears the dead dispatcher's socket file

    with grpc.insecure_channel(address) as channel:
        status = dispatcher_process.stub(channel).GetGpuStatus(
            dispatcher_pb2.GetGpuStatusRequest(), timeout=10
        )
    (client,) = status.clients
    assert client.assignment.assignment_id == assignment.assignment_id
    assert client.assignment.share.sm_percent == 40
    assert not client.connected and client.pid == os.getpid()
    assert status.quota_reserved_percent == pytest.approx(30)

    # The process that held the assignment re-registers and gets leases again ...
    with ShimClient.connect(dispatcher_process.socket_path, token) as again:
        assert again.acquire(timeout_s=2) is not None
    # ... while the restart did not make the token usable by anyone else.
    result = subprocess.run(
        [sys.executable, "-c", REPLAY, dispatcher_process.socket_path, token],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 3 and "already used by pid" in result.stdout


def test_a_second_dispatcher_on_the_same_socket_refuses_to_start(
    dispatcher_process: DispatcherProcess,
) -> None:
    dispatcher_process.start()
    second = subprocess.run(
        [GPULOOM, "serve", "dispatcher"],
        env={**dispatcher_process.env, "GPULOOM_DISPATCHER_PORT": str(free_port())},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode == 1
    assert "another dispatcher is listening" in second.stderr
    with pytest.raises(ShimChannelError, match="unknown assignment token"):
        ShimClient.connect(dispatcher_process.socket_path, "y" * 43)  # the first still serves
