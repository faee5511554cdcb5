"""Suspend that frees GPU memory: a suspended client's device memory goes to host memory
through the CUDA driver's checkpoint API (lock + checkpoint, by the process's pid) and comes
back at resume (restore + unlock), so another job can use the GPU's memory meanwhile
(docs/training.md, "Suspend that frees memory"). Where the driver lacks the API (older than
r570, or switched off) a suspension keeps the memory resident, as before, and says so.

The driver calls block (a lock waits for the process's calls in flight): they run in a worker
thread. Only the process registered for the reservation is ever checkpointed; a pid that is not
its process is refused before the driver is called."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import structlog

from gpuloom.cudadrv import CheckpointDriver, CheckpointUnsupported, CudaError, ProcessState

log = structlog.get_logger("gpuloom.dispatcher")

# How long a lock may wait for the process's CUDA calls in flight (a kernel, a copy) before
# the suspension gives up freeing the memory (the process stays suspended, memory resident).
DEFAULT_LOCK_TIMEOUT_MS = 10_000


class CheckpointRefused(Exception):
    """A checkpoint asked for a pid that is not the reservation's process."""


@dataclass(frozen=True, slots=True)
class MemoryState:
    """What became of a suspended client's device memory."""

    released: bool  # in host memory; the GPU's memory is free
    note: str = ""  # why not released, or why a resume could not restore it
    pid: int = 0  # the process checkpointed (0: none)
    restore_failed: bool = False  # a resume tried and failed: still suspended


class Checkpointer:
    """The driver's checkpoint API for one dispatcher (loaded once, when first needed)."""

    def __init__(
        self,
        library: str,
        lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
        driver: Callable[[str], CheckpointDriver] = CheckpointDriver,
    ) -> None:
        if not 0 <= lock_timeout_ms <= 3_600_000:
            raise ValueError(f"lock_timeout_ms must be within 0..3600000, got {lock_timeout_ms}")
        self.library = library
        self.lock_timeout_ms = lock_timeout_ms
        self._make = driver
        self._driver: CheckpointDriver | None = None
        self._unsupported = ""
        self._lock = threading.Lock()

    def driver(self) -> CheckpointDriver | None:
        """The driver's API, or None (then `unsupported` says why)."""
        with self._lock:
            if self._driver is None and not self._unsupported:
                try:
                    self._driver = self._make(self.library)
                except (CheckpointUnsupported, CudaError, OSError) as error:
                    self._unsupported = str(error)
                    log.warning("suspended clients keep their GPU memory", why=self._unsupported)
            return self._driver

    @property
    def unsupported(self) -> str:
        return self._unsupported

    def release(self, pid: int, owners: Collection[int]) -> MemoryState:
        """Lock and checkpoint `pid`, which must be one of `owners` (the reservation's
        processes). Blocking. A failure leaves the process running as it was (unlocked)."""
        if pid <= 0 or pid not in owners:
            raise CheckpointRefused(
                f"pid {pid} is not the reservation's process ({sorted(owners) or 'none'})"
            )
        driver = self.driver()
        if driver is None:
            return MemoryState(False, f"memory resident: {self._unsupported}")
        try:
            driver.lock(pid, self.lock_timeout_ms)
        except CudaError as error:
            return MemoryState(False, f"memory resident: lock failed ({error})")
        try:
            driver.checkpoint(pid)
        except CudaError as error:
            with contextlib.suppress(CudaError):  # gone, or failed: reported as it is
                driver.unlock(pid)
            return MemoryState(False, f"memory resident: checkpoint failed ({error})")
        return MemoryState(True, "", pid)

    def restore(self, state: MemoryState) -> MemoryState:
        """Restore and unlock a released process. Blocking. Returns its state after: released
        False when it runs again; restore_failed with the reason when it stays suspended (no
        room on the GPU: tried again at the next resume; FAILED: it cannot run again)."""
        driver = self.driver()
        if not state.released or driver is None:
            return MemoryState(False)
        try:
            current = driver.state(state.pid)
            if current is ProcessState.CHECKPOINTED:
                driver.restore(state.pid)
                current = ProcessState.LOCKED
            if current is ProcessState.LOCKED:
                driver.unlock(state.pid)
            elif current is not ProcessState.RUNNING:
                return MemoryState(
                    True, f"restore failed: the process is {current.name}", state.pid, True
                )
        except CudaError as error:
            return MemoryState(True, f"restore failed: {error}", state.pid, True)
        return MemoryState(False)

    def restore_onto(self, state: MemoryState, gpu_pairs: Sequence[tuple[str, str]]) -> MemoryState:
        """Restore a released process onto other GPUs (pairs of UUIDs: checkpointed on,
        restore onto; the same chip type), leaving it LOCKED there: the target GPU's dispatcher
        unlocks it once its shim registered there (`unlock_moved`). Blocking. Returns released
        False on success; restore_failed with the reason when it stays checkpointed here (no
        room there, another chip type, a GPU the driver does not know)."""
        driver = self.driver()
        if not state.released or driver is None:
            return MemoryState(False, "not checkpointed: nothing to move", state.pid, True)
        try:
            driver.restore(state.pid, gpu_pairs)
        except CudaError as error:
            return MemoryState(True, f"move failed: {error}", state.pid, True)
        return MemoryState(False, "", state.pid)

    def unlock_moved(self, pid: int, owners: Collection[int]) -> None:
        """Unlock a process restored onto this GPU (LOCKED by the move), which must be one of
        `owners` (the processes registered for the reservation here). Blocking. Raises
        CheckpointRefused for another pid, CudaError when the driver refuses (not LOCKED)."""
        if pid <= 0 or pid not in owners:
            raise CheckpointRefused(
                f"pid {pid} is not the reservation's process ({sorted(owners) or 'none'})"
            )
        driver = self.driver()
        if driver is None:
            raise CheckpointRefused(f"no checkpoint API: {self._unsupported}")
        driver.unlock(pid)

    def alive(self, state: MemoryState) -> bool:
        """Whether the checkpointed process still exists for the driver."""
        driver = self.driver()
        if driver is None or not state.released:
            return True
        try:
            driver.state(state.pid)
        except CudaError:
            return False
        return True
