"""Run a command as a placed job: submit, wait for the assignment, start the command with the
job's environment, pass signals on, stop it if the job is cancelled or lost, report its end.

`gpuloom run` is a thin caller of `JobRunner`, and a submitter's own program can use it the same
way: docs/jobs.md ("Running a command as a job") has an example, which the tests run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from gpuloom.clients.placement import PlacementClient, SpecLike, WaitTimedOut
from gpuloom.domain.errors import DomainError
from gpuloom.domain.placement import JobState, JobView

# Exit codes a shell gives for a command it cannot run.
NOT_FOUND = 127
NOT_STARTED = 126


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How the command ended: `exit_code` is its exit status (128 + N if signal N killed it,
    127 if it was not found, 126 if it could not be started otherwise), `message` what was
    reported, and `job` the job as placement recorded the end (None if the report failed)."""

    exit_code: int
    message: str
    job: JobView | None


def _ignore(_message: str) -> None:
    pass


class JobRunner:
    """Runs commands as jobs of the placement service behind `client`.

    `shim_path`, if given, is put first in the command's LD_PRELOAD. `on_message` is told, in
    one line each, what the command's own output does not show: why the job is pending, that it
    was cancelled while the command ran, that the command could not be started or the end not
    be reported."""

    def __init__(
        self,
        client: PlacementClient,
        shim_path: str | None = None,
        on_message: Callable[[str], None] = _ignore,
    ) -> None:
        self.client = client
        self.shim_path = shim_path
        self._say = on_message

    def run(
        self, spec: SpecLike, command: Sequence[str], timeout_s: float | None = None
    ) -> RunOutcome:
        """Submit `spec`, wait until it is assigned and run `command` in it (see
        `wait_assigned` and `run_assigned`). Raises what `submit` and `wait_assigned` raise."""
        job = self.client.submit(spec)
        return self.run_assigned(self.wait_assigned(job, timeout_s), command)

    def wait_assigned(self, job: JobView, timeout_s: float | None = None) -> JobView:
        """The job once ASSIGNED, telling `on_message` why it waits. Raises JobNotAssigned if it
        ends instead; on WaitTimedOut (after `timeout_s`) and KeyboardInterrupt the job is
        cancelled first."""
        if job.state is JobState.ASSIGNED:
            return job
        shown = [""]

        def show(update: JobView) -> None:
            if update.state is JobState.PENDING and update.pending_reason != shown[0]:
                shown[0] = update.pending_reason
                reason = update.pending_reason or "waiting for capacity"
                self._say(f"job {update.job_id} pending: {reason}")

        try:
            return self.client.wait_assigned(job.job_id, timeout_s, on_update=show)
        except WaitTimedOut:
            self._cancel_quietly(job.job_id, f"gpuloom run: not assigned within {timeout_s:g} s")
            raise
        except KeyboardInterrupt:
            self._cancel_quietly(job.job_id, "gpuloom run: interrupted while waiting")
            raise

    def run_assigned(self, job: JobView, command: Sequence[str]) -> RunOutcome:
        """Run `command` as a child process in the assigned job and report how it ended.

        The child gets the assignment's environment, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for a
        share and the shim; SIGINT and SIGTERM sent to this process (when called from the main
        thread) are passed on to it, and it gets SIGTERM if the job is cancelled or lost."""
        stdin = sys.stdin if _has_fd(sys.stdin) else subprocess.DEVNULL
        out = None if _has_fd(sys.stdout) else subprocess.PIPE
        err = None if _has_fd(sys.stderr) else subprocess.PIPE
        try:
            child = subprocess.Popen(
                command, env=self.environment(job), stdin=stdin, stdout=out, stderr=err
            )
        except OSError as error:
            code = NOT_FOUND if isinstance(error, FileNotFoundError) else NOT_STARTED
            message = f"cannot start {command[0]!r}: {error.strerror or error}"
            self._say(message)
            return RunOutcome(code, message, self._report(job.job_id, code, message))
        relays = [
            _relay(pipe, stream)
            for pipe, stream in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))
            if pipe is not None
        ]
        finished = threading.Event()
        threading.Thread(
            target=self._stop_if_job_ends, args=(job.job_id, child, finished), daemon=True
        ).start()
        with _forwarding_signals(child):
            returncode = child.wait()
        finished.set()
        for relay in relays:
            relay.join()
        if returncode < 0:
            code = 128 - returncode
            message = f"{command[0]} was killed by {_signal_name(-returncode)}"
        else:
            code = returncode
            message = f"{command[0]} exited with code {code}"
        return RunOutcome(code, message, self._report(job.job_id, code, message))

    def environment(self, job: JobView) -> dict[str, str]:
        """What the job's process runs with: this process's environment plus the assignment's,
        the SM percent of a share for MPS, and the shim first in LD_PRELOAD."""
        assigned: Mapping[str, str] = job.assignment.environment if job.assignment else {}
        environment = {**os.environ, **assigned}
        share = job.spec.share
        if (
            share is not None
            and share.sm_percent < 100
            and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in assigned
        ):
            environment["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(share.sm_percent)
        if self.shim_path:
            preload = environment.get("LD_PRELOAD", "")
            if self.shim_path not in preload.replace(":", " ").split():
                environment["LD_PRELOAD"] = (
                    f"{self.shim_path}:{preload}" if preload else self.shim_path
                )
        return environment

    def _cancel_quietly(self, job_id: str, reason: str) -> None:
        with contextlib.suppress(DomainError):
            self.client.cancel(job_id, reason)

    def _report(self, job_id: str, code: int, message: str) -> JobView | None:
        try:
            return self.client.report_done(job_id, code == 0, code, message)
        except DomainError as error:
            self._say(f"could not report job {job_id} done: {error.message}")
            return None

    def _stop_if_job_ends(
        self, job_id: str, child: subprocess.Popen, finished: threading.Event
    ) -> None:
        """SIGTERM the child if the job is cancelled or lost while it runs."""
        try:
            for job in self.client.watch(job_id):
                if finished.is_set():
                    return
                if job.state.finished:
                    detail = f": {job.message}" if job.message else ""
                    self._say(f"job {job_id} was {job.state.value}{detail}; stopping the command")
                    with contextlib.suppress(ProcessLookupError):
                        child.terminate()
                    return
        except (DomainError, ValueError):
            return  # the channel closed, or placement went away: the child runs on


@contextlib.contextmanager
def _forwarding_signals(child: subprocess.Popen) -> Iterator[None]:
    """Pass SIGINT and SIGTERM on to the child while it runs (signal handlers can only be set
    in the main thread; elsewhere nothing is forwarded). A Ctrl-C at a terminal we share with
    the child already reached it, so it is not sent twice."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, _frame: object) -> None:
        if signum == signal.SIGINT and _terminal_reaches_child():
            return
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _terminal_reaches_child() -> bool:
    """Whether we are in the foreground of our terminal, so its Ctrl-C goes to the child too."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def _has_fd(stream: IO[Any] | None) -> bool:
    """Whether a stream is a real file the child can share (not one replaced in memory)."""
    try:
        return stream is not None and stream.fileno() >= 0
    except (OSError, ValueError, AttributeError):
        return False


def _relay(pipe: IO[bytes], stream: IO[Any]) -> threading.Thread:
    """Copy a child's output to a stream that has no file descriptor of its own."""

    def copy() -> None:
        binary = getattr(stream, "buffer", None)
        with pipe:
            while chunk := pipe.read1(65536):  # type: ignore[attr-defined]
                stream.flush()  # what was printed before goes first
                if binary is not None:
                    binary.write(chunk)
                    binary.flush()
                else:
                    stream.write(chunk.decode(errors="replace"))
                    stream.flush()

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
