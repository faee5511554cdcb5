"""`gpuloom up` on simulated GPUs in a child process, its banner read into endpoints: the plane
that scripts/demo's day and scripts/bench_fikit's composed pair run on. (tests/plane.py is the
tests' own, which also waits for every GPU to register with placement.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GPULOOM = str(Path(sys.executable).parent / "gpuloom")


class UpFailed(RuntimeError):
    """`gpuloom up` did not start; the message names its log."""


def up_environment(
    state: Path, sim_gpus: str, keep: tuple[str, ...] = (), **settings: str
) -> dict[str, str]:
    """This process's environment without its GPULOOM_ settings (except those in `keep`), and a
    plane's: its state in `state`, the simulated GPUs `sim_gpus`, every port chosen by the
    system, a heartbeat every 0.5 s (GPUs registered soon after the start); then `settings`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOOM_") or k in keep}
    env.update(
        GPULOOM_DATA_DIR=str(state),
        GPULOOM_PROFILE_STORE_PORT="0",
        GPULOOM_PROFILER_PORT="0",
        GPULOOM_PLACEMENT_PORT="0",
        GPULOOM_DISPATCHER_PORT="0",
        GPULOOM_METRICS_PORT="0",
        GPULOOM_DISPATCHER_BACKEND="simulated",
        GPULOOM_DISPATCHER_SIM_GPUS=sim_gpus,
        GPULOOM_PLACEMENT_HEARTBEAT_INTERVAL_S="0.5",
        **settings,
    )
    return env


class UpPlane:
    """`gpuloom up` in `env`, in a session of its own (so that a kill takes its children), its
    log written to `log`."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env = env
        self.log = log
        self.process: subprocess.Popen[str] | None = None
        self.header = ""
        self.endpoints: dict[str, str] = {}  # the banner's names ("dispatcher GPU 0") -> address

    def start(self, endpoints: int, timeout_s: float = 60.0) -> None:
        """Start it and read its banner: the header line, then `endpoints` lines of a name and
        an address. UpFailed if it ends first or takes longer than `timeout_s`."""
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [GPULOOM, "up"],
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        self.header = self.process.stdout.readline().rstrip()
        if not self.header.startswith("gpuloom is running"):
            self.stop()
            raise UpFailed(f"gpuloom up did not start; its log: {self.log}")
        while len(self.endpoints) < endpoints:
            line = self.process.stdout.readline()
            if not line or time.monotonic() > deadline:
                self.stop()
                raise UpFailed(f"gpuloom up stopped while starting; its log: {self.log}")
            name, _, address = line.strip().rpartition("  ")
            self.endpoints[name.strip()] = address.strip()

    def address(self, starting: str) -> str:
        """The address of the one endpoint whose name starts with `starting`."""
        (address,) = [a for n, a in self.endpoints.items() if n.startswith(starting)]
        return address

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM and its exit code; None when it had not ended within `timeout_s` and was
        killed with its children."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            return None
