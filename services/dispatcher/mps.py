"""The MPS control daemon of one GPU, supervised by its dispatcher (docs/dispatcher.md, "MPS").

On a GPU whose policy uses SM partitions the dispatcher runs `nvidia-cuda-mps-control -f`
(foreground, so it stays the dispatcher's child) with its own pipe and log directories, checks
that it answers, restarts it when it dies and tells it to `quit` on shutdown. Reservations are
answered with the environment that makes a share's SM percent and memory cap real for an MPS
client: `CUDA_MPS_PIPE_DIRECTORY`, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`,
`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`.

Commands reach the daemon as they do from a shell: the control program run without arguments,
one command per line on its stdin, with `CUDA_MPS_PIPE_DIRECTORY` naming the daemon. The
supervisor uses `get_server_list` (is it answering?) and `quit`.

Everything here is blocking and thread-safe: the supervisor has one watcher thread per daemon;
the dispatcher calls `start`/`stop` through `asyncio.to_thread`.
"""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import structlog

log = structlog.get_logger("gpuloom.dispatcher.mps")

MIB = 1 << 20
# A Unix socket path has 108 bytes; MPS puts its sockets inside the pipe directory.
MAX_PIPE_DIR_CHARS = 80
# A daemon that ran this long before dying is restarted after the initial back-off again.
STABLE_S = 60.0


@dataclass(frozen=True, slots=True)
class MpsConfig:
    control: Sequence[str]  # the control program (argv prefix), e.g. ["nvidia-cuda-mps-control"]
    pipe_dir: Path
    log_dir: Path
    # CUDA_VISIBLE_DEVICES for the daemon (the GPU's UUID on a real GPU); None: left as is.
    visible_device: str | None = None
    start_timeout_s: float = 5.0
    command_timeout_s: float = 5.0
    restart_backoff_s: float = 0.5  # doubles after each failed restart ...
    restart_backoff_max_s: float = 30.0  # ... up to this


def parse_control(command: str) -> list[str]:
    """The control program setting, split like a shell would; ValueError when empty/bad."""
    try:
        argv = shlex.split(command)
    except ValueError as error:
        raise ValueError(f"cannot split the MPS control command: {error}") from None
    if not argv:
        raise ValueError("the MPS control command is empty")
    return argv


def client_environment(pipe_dir: Path, sm_percent: int, memory_cap_bytes: int) -> dict[str, str]:
    """What an MPS client of this share runs with. The pinned limit is the cap in MiB rounded
    up (device 0: the process sees only its GPU); the shim enforces the exact cap."""
    return {
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(sm_percent),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={math.ceil(memory_cap_bytes / MIB)}M",
    }


class MpsSupervisor:
    """Starts, watches, restarts and stops one MPS control daemon."""

    def __init__(self, config: MpsConfig, gpu_label: str) -> None:
        self.config = config
        self.gpu_label = gpu_label
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._output: IO[bytes] | None = None
        self._running = False
        self._cause = "not started"
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self.restarts = 0
        # Told True when the daemon answers, False when it fails or dies (from the starting or
        # the watcher thread; not while stopping): what depends on MPS running follows it.
        self.on_running: Callable[[bool], None] | None = None

    # ---- state ----

    def available(self) -> tuple[bool, str]:
        """(running, why not): the cause names what failed, for FAILED_PRECONDITION answers."""
        with self._lock:
            return self._running, self._cause

    @property
    def pid(self) -> int | None:
        with self._lock:
            return self._process.pid if self._process is not None and self._running else None

    def client_environment(self, sm_percent: int, memory_cap_bytes: int) -> dict[str, str]:
        return client_environment(self.config.pipe_dir, sm_percent, memory_cap_bytes)

    # ---- lifecycle ----

    def start(self) -> bool:
        """Start the daemon and wait until it answers; False (the cause kept) when it does not.
        Either way a watcher thread keeps trying: it restarts a daemon that dies or failed."""
        started = self._start_once()
        if self._watcher is None:
            self._watcher = threading.Thread(
                target=self._watch, name=f"mps-gpu-{self.gpu_label}", daemon=True
            )
            self._watcher.start()
        return started

    def stop(self) -> None:
        """`quit`, then (if it does not go) terminate and kill. Idempotent."""
        self._stopping.set()
        with self._lock:
            process, self._running = self._process, False
            self._cause = "stopped"
        if process is not None and process.poll() is None:
            try:
                self.command("quit")
            except OSError as error:
                log.warning("MPS quit failed", gpu=self.gpu_label, error=str(error))
            _end(process, self.config.command_timeout_s)
            log.info("MPS control daemon stopped", gpu=self.gpu_label, pid=process.pid)
        if self._watcher is not None:
            self._watcher.join(timeout=self.config.command_timeout_s)
        if self._output is not None:
            self._output.close()
            self._output = None

    def command(self, line: str) -> str:
        """Send one command to the daemon; its answer. OSError when it does not answer."""
        try:
            done = subprocess.run(
                [*self.config.control],
                input=(line + "\n").encode(),
                capture_output=True,
                timeout=self.config.command_timeout_s,
                env=self._environment(),
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise OSError(
                f"{line!r}: no answer within {self.config.command_timeout_s:g} s"
            ) from None
        if done.returncode != 0:
            reason = (done.stderr or done.stdout).decode(errors="replace").strip()
            raise OSError(f"{line!r} failed with exit code {done.returncode}: {reason[-300:]}")
        return done.stdout.decode(errors="replace")

    # ---- inside ----

    def _environment(self) -> dict[str, str]:
        environment = dict(os.environ)
        environment["CUDA_MPS_PIPE_DIRECTORY"] = str(self.config.pipe_dir)
        environment["CUDA_MPS_LOG_DIRECTORY"] = str(self.config.log_dir)
        if self.config.visible_device:
            environment["CUDA_VISIBLE_DEVICES"] = self.config.visible_device
        return environment

    def _fail(self, cause: str) -> bool:
        with self._lock:
            self._running = False
            self._cause = cause
        log.error("MPS control daemon not running", gpu=self.gpu_label, cause=cause)
        self._tell(False)
        return False

    def _tell(self, running: bool) -> None:
        if self.on_running is not None and not self._stopping.is_set():
            self.on_running(running)

    def _start_once(self) -> bool:
        pipe_dir, log_dir = self.config.pipe_dir, self.config.log_dir
        if len(str(pipe_dir)) > MAX_PIPE_DIR_CHARS:
            return self._fail(
                f"MPS pipe directory {str(pipe_dir)!r} is longer than {MAX_PIPE_DIR_CHARS} "
                "characters (its sockets would not fit a Unix socket path)"
            )
        try:
            pipe_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            if self._output is None:
                self._output = open(log_dir / "daemon-output.log", "ab")  # noqa: SIM115
            process = subprocess.Popen(
                [*self.config.control, "-f"],
                stdin=subprocess.DEVNULL,
                stdout=self._output,
                stderr=self._output,
                env=self._environment(),
                start_new_session=True,  # a terminal's Ctrl-C goes to the dispatcher only
            )
        except OSError as error:
            return self._fail(f"cannot start {self.config.control[0]!r}: {error}")
        with self._lock:
            self._process = process
        deadline = time.monotonic() + self.config.start_timeout_s
        last_error = "no answer"
        while time.monotonic() < deadline and not self._stopping.is_set():
            code = process.poll()
            if code is not None:
                return self._fail(
                    f"{self.config.control[0]!r} exited with code {code} while starting "
                    f"({self._output_tail()})"
                )
            try:
                self.command("get_server_list")
            except OSError as error:
                last_error = str(error)
                time.sleep(0.05)
                continue
            with self._lock:
                self._running = True
                self._cause = ""
            log.info(
                "MPS control daemon running",
                gpu=self.gpu_label,
                pid=process.pid,
                pipe_dir=str(pipe_dir),
                log_dir=str(log_dir),
            )
            self._tell(True)
            return True
        _end(process, 1.0)
        return self._fail(
            f"{self.config.control[0]!r} did not answer within "
            f"{self.config.start_timeout_s:g} s: {last_error}"
        )

    def _watch(self) -> None:
        backoff = self.config.restart_backoff_s
        while not self._stopping.is_set():
            with self._lock:
                process, running = self._process, self._running
            if running and process is not None:
                began = time.monotonic()
                code = process.wait()
                if self._stopping.is_set():
                    return
                self.restarts += 1
                self._fail(f"the MPS control daemon died (exit code {code}); restarting")
                # One that keeps dying soon after starting is restarted ever more slowly.
                lived_s = time.monotonic() - began
                if lived_s >= STABLE_S:
                    backoff = self.config.restart_backoff_s
                else:
                    backoff = min(backoff * 2, self.config.restart_backoff_max_s)
            if self._stopping.wait(backoff):
                return
            if not self._start_once():
                backoff = min(backoff * 2, self.config.restart_backoff_max_s)

    def _output_tail(self) -> str:
        path = self.config.log_dir / "daemon-output.log"
        try:
            if self._output is not None:
                self._output.flush()
            lines = path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no output"
        return lines[-1][-300:] if lines else "no output"


def _end(process: subprocess.Popen[bytes], grace_s: float) -> None:
    try:
        process.wait(timeout=grace_s)
        return
    except subprocess.TimeoutExpired:
        process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
