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
from gpuloom.domain.training import CheckpointHook, MigrationRequest, gpus_text

# Exit codes a shell gives for a command it cannot run.
NOT_FOUND = 127
NOT_STARTED = 126
# What a checkpoint hook's command is told: the process id of the job's command.
PID_VARIABLE = "GPULOOM_JOB_PID"
STOP_GRACE_S = 10.0  # after a command hook: SIGTERM, then SIGKILL after this long


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How the command ended: `exit_code` is its exit status (128 + N if signal N killed it,
    127 if it was not found, 126 if it could not be started otherwise), `message` what was
    reported, and `job` the job as placement recorded the end (as it ended, if it was cancelled,
    evicted or lost meanwhile; None if the report failed)."""

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
        if job.state is JobState.ASSIGNED and not job.spec.is_mig_batch:
            return job
        shown: set[str] = set()

        def show(update: JobView) -> None:
            # Each reason once: a dispatcher that keeps failing to bind would otherwise have
            # its failure and the wait after it told again on every retry.
            if update.state is JobState.PENDING and update.pending_reason not in shown:
                shown.add(update.pending_reason)
                reason = update.pending_reason or "waiting for capacity"
                self._say(f"job {update.job_id} pending: {reason}")
            slot = update.assignment.mig if update.assignment else None
            if update.state is JobState.ASSIGNED and slot and not slot.instance_uuid:
                waiting = f"in a MIG batch on {update.assignment.gpu_uuid}"  # type: ignore[union-attr]
                if waiting not in shown:
                    shown.add(waiting)
                    self._say(f"job {update.job_id} {waiting}; waiting for its instance")

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
        thread) are passed on to it, and it gets SIGTERM if the job is cancelled or lost.

        A training job with a checkpoint hook may be migrated, or resized (an elastic job under
        grow-shrink: restarted on more or fewer GPUs of its node), the same way
        (docs/training.md): when placement asks for it, the hook runs (its command, or its
        signal sent to the child, which must save its state and exit 0), placement is told how
        it went (ReportCheckpoint), and on success the command starts again with the new
        assignment's environment. A hook that
        fails or times out leaves the child running where it is (a child that exited non-zero
        after the signal is started again where it was)."""
        while True:
            ran = self._run_once(job, command)
            if isinstance(ran, RunOutcome):
                return ran
            job = ran

    def _run_once(self, job: JobView, command: Sequence[str]) -> RunOutcome | JobView:
        """One run of the child: how the job ended, or the job to run it again in."""
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
        run = _Run(job, child)
        threading.Thread(target=self._follow, args=(run,), daemon=True).start()
        with _forwarding_signals(child):
            returncode = child.wait()
        if run.checkpointing.is_set():
            run.decided.wait()  # the watcher decides: run it again, here or elsewhere
        run.finished.set()
        for relay in relays:
            relay.join()
        if run.next_job is not None:
            return run.next_job
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
            job.spec.mps
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
            refused = error.message
        # Ended meanwhile (cancelled, evicted, lost) before the watcher said so: say how.
        with contextlib.suppress(DomainError):
            job = self.client.get(job_id)
            if job.state.finished:
                detail = f": {job.message}" if job.message else ""
                self._say(f"job {job_id} was {job.state.value}{detail}")
                return job
        self._say(f"could not report job {job_id} done: {refused}")
        return None

    def _follow(self, run: _Run) -> None:
        """Watch the job while its child runs: SIGTERM the child if the job is cancelled or
        lost; run the checkpoint hook when placement asks for a migration."""
        job_id = run.job.job_id
        handled: set[str] = set()
        try:
            for job in self.client.watch(job_id):
                if run.finished.is_set():
                    return
                if job.state.finished:
                    detail = f": {job.message}" if job.message else ""
                    self._say(f"job {job_id} was {job.state.value}{detail}; stopping the command")
                    with contextlib.suppress(ProcessLookupError):
                        run.child.terminate()
                    return
                migration = job.training.migration if job.training else None
                hook = run.job.spec.checkpoint
                if (
                    migration is not None
                    and hook is not None
                    and migration.migration_id not in handled
                ):
                    handled.add(migration.migration_id)
                    if self._checkpoint(run, hook, migration.migration_id, migration):
                        return
        except (DomainError, ValueError):
            return  # the channel closed, or placement went away: the child runs on

    def _checkpoint(
        self, run: _Run, hook: CheckpointHook, migration_id: str, migration: MigrationRequest
    ) -> bool:
        """Run the hook and report it; True when the child was stopped (to run again)."""
        job_id = run.job.job_id
        if migration.gpus:
            self._say(
                f"job {job_id}: checkpointing to {migration.reason} to {gpus_text(migration.gpus)} "
                f"(first GPU {migration.target_gpu_uuid})"
            )
        else:
            self._say(
                f"job {job_id}: checkpointing to move to GPU {migration.target_gpu_uuid} "
                f"({migration.reason})"
            )
        timeout_s = hook.effective_timeout_s
        if hook.signal:
            run.checkpointing.set()
            with contextlib.suppress(ProcessLookupError):
                run.child.send_signal(hook.signal_number)
            try:
                code = run.child.wait(timeout_s)
            except subprocess.TimeoutExpired:
                run.checkpointing.clear()
                self._hook_failed(
                    run,
                    migration_id,
                    f"the job did not exit within {timeout_s:g} s of {hook.signal}",
                )
                return False
            if code != 0:
                # It stopped without a usable checkpoint: it starts again where it was.
                self._hook_failed(
                    run, migration_id, f"the job exited with {_exit_text(code)} after {hook.signal}"
                )
                run.next_job = run.job
                run.decided.set()
                return True
            moved = self._moved(run, migration_id)
            run.next_job = moved or run.job
            run.decided.set()
            return True
        environment = {**self.environment(run.job), PID_VARIABLE: str(run.child.pid)}
        try:
            done = subprocess.run(
                hook.command,
                env=environment,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            self._hook_failed(run, migration_id, f"the hook did not finish within {timeout_s:g} s")
            return False
        except OSError as error:
            self._hook_failed(
                run, migration_id, f"cannot start {hook.command[0]!r}: {error.strerror or error}"
            )
            return False
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
            detail = f": {tail[0][:200]}" if tail[0] else ""
            self._hook_failed(
                run, migration_id, f"the hook exited with {_exit_text(done.returncode)}{detail}"
            )
            return False
        moved = self._moved(run, migration_id)
        if moved is None:
            return False  # placement kept it where it is: it runs on
        run.checkpointing.set()
        run.next_job = moved
        with contextlib.suppress(ProcessLookupError):
            run.child.terminate()
        try:
            run.child.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            run.child.kill()
        run.decided.set()
        return True

    def _moved(self, run: _Run, migration_id: str) -> JobView | None:
        """Report a checkpoint that succeeded: the job on its new assignment, or None when
        placement refused (the migration was given up meanwhile)."""
        try:
            moved = self.client.report_checkpoint(run.job.job_id, migration_id, True)
        except DomainError as error:
            self._say(f"job {run.job.job_id}: the migration was not done: {error.message}")
            return None
        gpus = moved.assignment.gpu_uuids if moved.assignment else ("?",)
        where = f"GPU {gpus[0]}" if len(gpus) == 1 else f"GPUs {','.join(gpus)}"
        self._say(f"job {run.job.job_id}: moved to {where}; starting the command again")
        return moved

    def _hook_failed(self, run: _Run, migration_id: str, message: str) -> None:
        self._say(f"job {run.job.job_id}: checkpoint hook failed ({message}); it stays where it is")
        with contextlib.suppress(DomainError):
            self.client.report_checkpoint(run.job.job_id, migration_id, False, message)


class _Run:
    """One run of a job's child, shared by the thread that waits for it and its watcher."""

    def __init__(self, job: JobView, child: subprocess.Popen) -> None:
        self.job = job
        self.child = child
        self.finished = threading.Event()  # the run is over: the watcher stops
        self.checkpointing = threading.Event()  # the child exits for a checkpoint
        self.decided = threading.Event()  # ... and the watcher has decided what follows
        self.next_job: JobView | None = None  # run the command again in this job


def _exit_text(code: int) -> str:
    return f"signal {_signal_name(-code)}" if code < 0 else f"code {code}"


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
