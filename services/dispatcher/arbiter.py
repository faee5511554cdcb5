"""The FIKIT arbiter of one GPU: a native thread (shim/src/arbiter.c) that admits kernels.

The dispatcher only adds and removes tasks (a region, a priority and a kernel table each); the
per-kernel path, shim posts in shared memory -> FIKIT decision core -> grants, never enters
Python. This module is the thin ctypes binding plus the doorbell (an eventfd every FIKIT shim
of this GPU receives at registration).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

from gpuloom.policies.fikit.core import (
    MAX_TASKS,
    PRIORITIES,
    UNKNOWN,
    FikitConfig,
    FikitConfigStruct,
    FikitCounters,
    FikitCountersStruct,
    config_struct,
    read_core_counters,
)
from gpuloom.services.dispatcher.native import counters_struct, native_library, read_counters


@dataclass(frozen=True, slots=True)
class ArbiterStats:
    rounds: int
    requests: int
    grants: int
    unknown_kernels: int
    invalid_writes: int
    role_races: int
    arms: int
    fired: int
    late_releases: int
    tasks: int
    waiting: int


@dataclass(frozen=True, slots=True)
class KernelTiming:
    """One kernel of a task's profile, as the arbiter predicts it."""

    kernel_id: int
    duration_ns: int
    gap_after_ns: int | None  # None: the profile has no gap for it


class ArbiterFull(Exception):
    """All GL_FK_MAX_TASKS slots of this GPU's arbiter are taken."""


_U64_ARRAY = ctypes.POINTER(ctypes.c_uint64)
_Stats = counters_struct(ArbiterStats, u32=("tasks", "waiting"))


@functools.cache
def _library() -> ctypes.CDLL:
    lib = native_library()
    lib.gl_arbiter_start.restype = ctypes.c_void_p
    lib.gl_arbiter_start.argtypes = [
        ctypes.POINTER(FikitConfigStruct),
        ctypes.c_int,
        ctypes.c_uint64,
    ]
    lib.gl_arbiter_stop.restype = None
    lib.gl_arbiter_stop.argtypes = [ctypes.c_void_p]
    lib.gl_arbiter_add_task.restype = ctypes.c_int
    lib.gl_arbiter_add_task.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_uint32,
        _U64_ARRAY,
        _U64_ARRAY,
        _U64_ARRAY,
        ctypes.c_uint32,
    ]
    lib.gl_arbiter_set_kernels.restype = ctypes.c_int
    lib.gl_arbiter_set_kernels.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        _U64_ARRAY,
        _U64_ARRAY,
        _U64_ARRAY,
        ctypes.c_uint32,
    ]
    lib.gl_arbiter_remove_task.restype = None
    lib.gl_arbiter_remove_task.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.gl_arbiter_board_fd.restype = ctypes.c_int
    lib.gl_arbiter_board_fd.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int]
    lib.gl_arbiter_set_suspended.restype = ctypes.c_int
    lib.gl_arbiter_set_suspended.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.gl_arbiter_get_stats.restype = None
    lib.gl_arbiter_get_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Stats)]
    lib.gl_arbiter_get_core_counters.restype = None
    lib.gl_arbiter_get_core_counters.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(FikitCountersStruct),
    ]
    return lib


class Arbiter:
    """Owns the native thread and the doorbell; safe to call from any thread."""

    def __init__(
        self,
        config: FikitConfig,
        beat_s: float = 0.02,
    ) -> None:
        """The thread publishes arms (the holder's launch releases the best waiting filler
        itself: one wake-up) and each task's window-opening kernels (a holder's other launches
        ring no doorbell); docs/fikit.md."""
        self._lib = _library()
        self.doorbell_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        handle = self._lib.gl_arbiter_start(
            ctypes.byref(config_struct(config)),
            self.doorbell_fd,
            int(beat_s * 1e9),
        )
        if not handle:
            error = ctypes.get_errno()
            os.close(self.doorbell_fd)
            raise OSError(error, f"cannot start the FIKIT arbiter: {os.strerror(error)}")
        self._handle: int | None = handle

    def add_task(self, region_fd: int, priority: int, kernels: Sequence[KernelTiming]) -> int:
        """Register a task; returns its slot. Raises ArbiterFull when no slot is free."""
        handle = self._require()
        ctypes.set_errno(0)
        slot = self._lib.gl_arbiter_add_task(handle, region_fd, priority, *_arrays(kernels))
        if slot < 0:
            error = ctypes.get_errno()
            if error == errno.ENOSPC:
                raise ArbiterFull(f"the FIKIT arbiter admits at most {MAX_TASKS} processes")
            raise OSError(error, f"cannot add a FIKIT task: {os.strerror(error)}")
        return slot

    def set_kernels(self, slot: int, kernels: Sequence[KernelTiming]) -> None:
        """Replace a task's kernel table (its profile arrived after it registered)."""
        ctypes.set_errno(0)
        if self._lib.gl_arbiter_set_kernels(self._require(), slot, *_arrays(kernels)) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot install a FIKIT kernel table: {os.strerror(error)}")

    def remove_task(self, slot: int) -> None:
        self._lib.gl_arbiter_remove_task(self._require(), slot)

    def set_suspended(self, slot: int, suspended: bool) -> None:
        """Take a task out of the decisions while the dispatcher has it suspended (the next
        priority then holds the GPU), or back in; a slot not in use is ignored."""
        self._lib.gl_arbiter_set_suspended(self._require(), slot, int(suspended))

    def board_fds(self, priority: int) -> list[int]:
        """The priority boards a process of `priority` gets on its Registered frame, after its
        region and the doorbell: the better priorities' read-only, then its own read-write
        (docs/fikit.md). The arbiter keeps these descriptors; the frame carries copies."""
        handle = self._require()
        if not 0 <= priority < PRIORITIES:
            raise ValueError(f"priority {priority} is outside 0..{PRIORITIES - 1}")
        return [
            self._lib.gl_arbiter_board_fd(handle, p, int(p == priority))
            for p in range(priority + 1)
        ]

    def stats(self) -> ArbiterStats:
        raw = _Stats()
        self._lib.gl_arbiter_get_stats(self._require(), ctypes.byref(raw))
        return read_counters(ArbiterStats, raw)

    def core_counters(self) -> FikitCounters:
        """The decision core's counters: windows opened and closed early, fills granted."""
        raw = FikitCountersStruct()
        self._lib.gl_arbiter_get_core_counters(self._require(), ctypes.byref(raw))
        return read_core_counters(raw)

    def stop(self) -> None:
        if self._handle is None:
            return
        self._lib.gl_arbiter_stop(self._handle)
        self._handle = None
        os.close(self.doorbell_fd)

    def _require(self) -> int:
        if self._handle is None:
            raise RuntimeError("the FIKIT arbiter is stopped")
        return self._handle


def _arrays(
    kernels: Sequence[KernelTiming],
) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array, int]:
    n = len(kernels)
    ids = (ctypes.c_uint64 * n)(*(k.kernel_id for k in kernels))
    durations = (ctypes.c_uint64 * n)(*(k.duration_ns for k in kernels))
    gaps = (ctypes.c_uint64 * n)(
        *(UNKNOWN if k.gap_after_ns is None else k.gap_after_ns for k in kernels)
    )
    return ids, durations, gaps, n
