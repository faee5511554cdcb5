"""`gpuloom up` as a user runs it: a real process on the embedded default, stopped by SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from gpuloom.clients.profile_store import ProfileStoreClient
from gpuloom.v1 import dispatcher_pb2, dispatcher_pb2_grpc, placement_pb2, placement_pb2_grpc
from tests.conftest import free_port
from tests.plane import GPULOOM, clean_env, start_up, up_env
from tests.profile_store import samples


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return clean_env(GPULOOM_DATA_DIR=str(tmp_path / "state"), **extra)


def test_up_serves_the_embedded_default_and_stops_cleanly(tmp_path: Path) -> None:
    port, metrics = free_port(), free_port()
    env = up_env(  # the other ports: any free ones
        GPULOOM_DATA_DIR=str(tmp_path / "state"),
        GPULOOM_PROFILE_STORE_PORT=str(port),
        GPULOOM_METRICS_PORT=str(metrics),
        GPULOOM_DISPATCHER_SIM_GPUS="A100-80GB,H100-80GB",
    )
    process = start_up(env)
    try:
        assert process.stdout is not None
        banner = [process.stdout.readline() for _ in range(7)]
        assert f"127.0.0.1:{port}" in banner[1] and "profile-store" in banner[1]
        assert "profiler (gRPC)" in banner[2]
        assert "placement (gRPC)" in banner[3]
        assert "dispatcher GPU 0 A100-80GB" in banner[4]
        assert "dispatcher GPU 1 H100-80GB" in banner[5]
        assert f"http://127.0.0.1:{metrics}/metrics" in banner[6]
        dispatcher_address = banner[5].split()[-1]
        with grpc.insecure_channel(dispatcher_address) as channel:
            status = dispatcher_pb2_grpc.DispatcherStub(channel).GetGpuStatus(
                dispatcher_pb2.GetGpuStatusRequest(), timeout=10
            )
        assert status.gpu.model == "H100-80GB" and status.gpu.index == 1
        assert (tmp_path / "state" / "dispatcher" / "gpu-1.sock").is_socket()

        # The dispatchers registered their GPUs with placement on their own.
        with grpc.insecure_channel(banner[3].split()[-1]) as channel:
            stub = placement_pb2_grpc.PlacementStub(channel)
            deadline = time.monotonic() + 10
            while True:
                gpus = stub.ListGpus(placement_pb2.ListGpusRequest(), timeout=10).gpus
                if len(gpus) == 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        assert sorted(g.gpu.model for g in gpus) == ["A100-80GB", "H100-80GB"]
        assert all(g.schedulable and g.dispatcher_address for g in gpus)
        assert (tmp_path / "state" / "placement.db").exists()

        with ProfileStoreClient(f"127.0.0.1:{port}") as client:
            stored = client.put(samples.mig_profile())
            assert client.get(stored.KIND, stored.key, stored.gpu_model) == stored
        assert (tmp_path / "state" / "profiles.db").exists()  # SQLite, the embedded default
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read()
        assert (
            b'gpuloom_rpc_total{code="OK",method="PutMigProfile",service="gpuloom.v1.ProfileStore"}'
            in scraped
        )

        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert process.wait(timeout=15) == 0
        assert time.monotonic() - started < 10
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("command", "variable", "value", "said"),
    [
        ("up", "GPULOOM_PROFILE_STORE_PORT", "99999", "less than or equal to 65535"),
        ("dispatcher", "GPULOOM_DISPATCHER_SIM_GPUS", "3xB9000", "B9000"),
        ("profile-store", "GPULOOM_PROFILE_STORE_DATABASE_URL", "mysql://x", "postgresql://"),
        ("placement", "GPULOOM_PLACEMENT_DEFAULT_POLICY", "best-guess", "mra"),
        ("placement", "GPULOOM_TLS_CA_FILE", "/nonexistent/ca.crt", "cannot read"),
        ("dispatcher", "GPULOOM_AUTH_TOKEN", "not one token", "printable ASCII"),
        ("up", "GPULOOM_AUTH_TOKENS_FILE", "/nonexistent/tokens", "cannot read"),
    ],
)
def test_bad_configuration_fails_fast_naming_the_variable(
    tmp_path: Path, command: str, variable: str, value: str, said: str
) -> None:
    argv = [GPULOOM, "up"] if command == "up" else [GPULOOM, "serve", command]
    result = subprocess.run(
        argv, env=_env(tmp_path, **{variable: value}), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1
    assert variable in result.stderr and said in result.stderr


@pytest.mark.parametrize(
    "variable", ["GPULOOM_PROFILE_STORE_PORT", "GPULOOM_PLACEMENT_PORT", "GPULOOM_METRICS_PORT"]
)
def test_a_port_in_use_is_one_line_naming_the_port_and_its_variable(
    tmp_path: Path, variable: str
) -> None:
    ports = {
        name: "0"
        for name in (
            "GPULOOM_PROFILE_STORE_PORT",
            "GPULOOM_PROFILER_PORT",
            "GPULOOM_PLACEMENT_PORT",
            "GPULOOM_DISPATCHER_PORT",
            "GPULOOM_METRICS_PORT",
        )
    }
    with socket.socket() as taken:  # what a first `gpuloom up` holds
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports[variable] = str(port)
        env = _env(tmp_path, GPULOOM_DISPATCHER_SIM_GPUS="A100-80GB", **ports)
        result = subprocess.run(
            [GPULOOM, "up"], env=env, capture_output=True, text=True, timeout=60
        )
    assert result.returncode == 1, result.stderr
    [line] = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert line == (
        f"Error: cannot start: port {port} on 127.0.0.1 is in use (another gpuloom running?); "
        f"set {variable} to another port"
    )
    assert "Traceback" not in result.stderr + result.stdout
