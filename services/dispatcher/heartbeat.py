"""The dispatcher's heartbeat into the regions of the processes it serves: a native thread of its
own (shim/src/heartbeat.c) writes the time into each region every 25 ms, so that a shim that
asks for nothing (admitted until further notice, a FIKIT holder) still learns, within its
bound (GPULOOM_SHIM_WAIT_MS), that its dispatcher is hung or gone. Native, so that no pause of
this process's Python can stop it while the process lives. This module is its ctypes binding."""

from __future__ import annotations

import ctypes
import functools
import os

import structlog

from gpuloom.policies.fikit.core import FikitLibraryMissingError
from gpuloom.services.dispatcher.native import native_library
from gpuloom.shimwire import BEAT_PERIOD_NS

log = structlog.get_logger("gpuloom.dispatcher.heartbeat")


@functools.cache
def _library() -> ctypes.CDLL:
    lib = native_library()
    lib.gl_heart_start.restype = ctypes.c_void_p
    lib.gl_heart_start.argtypes = [ctypes.c_uint64]
    lib.gl_heart_add.restype = ctypes.c_int
    lib.gl_heart_add.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.gl_heart_remove.restype = None
    lib.gl_heart_remove.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.gl_heart_stop.restype = None
    lib.gl_heart_stop.argtypes = [ctypes.c_void_p]
    return lib


class Heartbeat:
    def __init__(self, handle: int) -> None:
        self._handle: int | None = handle

    @classmethod
    def start(cls, gpu: str) -> Heartbeat | None:
        """The heartbeat's thread, or None (logged) without the native library: its shims
        then see no heartbeat (0) and are not judged by one."""
        try:
            lib = _library()
        except FikitLibraryMissingError as error:
            log.warning("no heartbeat for the shims", gpu=gpu, error=str(error))
            return None
        handle = lib.gl_heart_start(BEAT_PERIOD_NS)
        if not handle:
            log.warning(
                "no heartbeat for the shims", gpu=gpu, error=os.strerror(ctypes.get_errno())
            )
            return None
        return cls(handle)

    def add(self, region_fd: int) -> int:
        """Beat into the region of `region_fd` from now on; its slot. OSError when full."""
        slot = _library().gl_heart_add(self._handle, region_fd)
        if slot < 0:
            error = ctypes.get_errno()
            raise OSError(error, f"heartbeat: {os.strerror(error)}")
        return int(slot)

    def remove(self, slot: int) -> None:
        """No beat into that region any more (before it is unmapped)."""
        if self._handle is not None:
            _library().gl_heart_remove(self._handle, slot)

    def stop(self) -> None:
        if self._handle is not None:
            _library().gl_heart_stop(self._handle)
            self._handle = None
