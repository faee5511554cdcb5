"""A real `gpuloom up` in a child process (the embedded plane on simulated GPUs), for tests
that use the CLI and the services as a user does."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpuloom.services.dispatcher.gpu.simulated import FLEET_ID_FILE
from gpuloom.v1 import placement_pb2 as pb
from gpuloom.v1 import placement_pb2_grpc
from tests.polling import wait_for

GPULOOM = str(Path(sys.executable).parent / "gpuloom")
# The id of every plane's simulated fleet, written before it starts (a dispatcher makes a
# random one otherwise), so that tests know the UUIDs: SIM-A100-80GB-0-{PLANE_FLEET_ID}.
PLANE_FLEET_ID = "0a1b2c3d"


@dataclass(frozen=True)
class Plane:
    placement: str
    dispatchers: list[str]
    env: dict[str, str]  # for clients: GPULOOM_PLACEMENT_ADDRESS set, no GPULOOM_DATA_DIR
    metrics_url: str  # "" without a metrics endpoint
    store: str = ""  # the profile store's address
    profiler: str = ""  # the profiler's address


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any GPULOOM_ variable, and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOOM_")}
    env.update(extra)
    return env


def up_env(**extra: str) -> dict[str, str]:
    """`gpuloom up`'s environment: simulated GPUs and every port chosen by the system, then
    `extra` (which may set any of them)."""
    return clean_env(
        **{
            "GPULOOM_PROFILE_STORE_PORT": "0",
            "GPULOOM_PROFILER_PORT": "0",
            "GPULOOM_PLACEMENT_PORT": "0",
            "GPULOOM_DISPATCHER_PORT": "0",
            "GPULOOM_METRICS_PORT": "0",
            "GPULOOM_DISPATCHER_BACKEND": "simulated",
            **extra,
        }
    )


def start_up(env: dict[str, str]) -> subprocess.Popen[str]:
    """`gpuloom up` in `env`, its banner and its log to read through pipes."""
    return subprocess.Popen(
        [GPULOOM, "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def placement_in_banner(process: subprocess.Popen[str]) -> str:
    """The placement address in the banner of `gpuloom up` (one GPU: six lines, read here)."""
    assert process.stdout is not None
    banner = [process.stdout.readline() for _ in range(6)]
    return next(line for line in banner if "placement" in line).split()[-1]


def stop_up(process: subprocess.Popen[str], timeout_s: float = 30) -> None:
    """SIGTERM, then SIGKILL if it has not ended within `timeout_s`; its pipes drained."""
    process.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.communicate(timeout=timeout_s)
    if process.poll() is None:
        process.kill()
        process.communicate()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def running_plane(
    state: Path,
    sim_gpus: str,
    gpu_count: int,
    metrics: bool = False,
    extra_env: dict[str, str] | None = None,
    log: Path | None = None,
) -> Iterator[Plane]:
    """`gpuloom up` on `sim_gpus` (GPULOOM_DISPATCHER_SIM_GPUS, `gpu_count` GPUs, fleet id
    PLANE_FLEET_ID), until every GPU is registered with placement; stopped with SIGTERM
    afterwards. `extra_env` goes to the plane and its clients; its log goes to `log` (else
    nowhere)."""
    (state / "dispatcher").mkdir(parents=True, exist_ok=True)
    (state / "dispatcher" / FLEET_ID_FILE).write_text(PLANE_FLEET_ID + "\n")
    env = up_env(
        GPULOOM_DATA_DIR=str(state),
        GPULOOM_METRICS_PORT=str(free_port()) if metrics else "0",
        GPULOOM_DISPATCHER_SIM_GPUS=sim_gpus,
        GPULOOM_PLACEMENT_HEARTBEAT_INTERVAL_S="0.2",
        **(extra_env or {}),
    )
    log_file = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(
        [GPULOOM, "up"], env=env, stdout=subprocess.PIPE, stderr=log_file, text=True
    )
    try:
        assert process.stdout is not None
        banner = [process.stdout.readline() for _ in range(4 + gpu_count + int(metrics))]
        placement = banner[3].split()[-1]
        dispatchers = [line.split()[-1] for line in banner[4 : 4 + gpu_count]]
        assert "placement" in banner[3], banner
        assert all("dispatcher GPU" in b for b in banner[4 : 4 + gpu_count]), banner
        metrics_url = banner[-1].split()[-1] if metrics else ""
        assert metrics_url.startswith("http://") or not metrics, banner
        with grpc.insecure_channel(placement) as channel:
            stub = placement_pb2_grpc.PlacementStub(channel)
            wait_for(
                lambda: len(stub.ListGpus(pb.ListGpusRequest()).gpus) == gpu_count,
                f"{gpu_count} GPUs",
            )
        store, profiler = banner[1].split()[-1], banner[2].split()[-1]
        assert "profile-store" in banner[1] and "profiler" in banner[2], banner
        client_env = {k: v for k, v in env.items() if k != "GPULOOM_DATA_DIR"}
        yield Plane(
            placement,
            dispatchers,
            {
                **client_env,
                "GPULOOM_PLACEMENT_ADDRESS": placement,
                "GPULOOM_PROFILE_STORE_ADDRESS": store,
                "GPULOOM_PROFILER_ADDRESS": profiler,
            },
            metrics_url,
            store,
            profiler,
        )
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if log is not None:
            log_file.close()  # type: ignore[union-attr]
