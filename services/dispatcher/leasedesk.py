"""The lease desk of one GPU: a native thread (shim/src/leasedesk.c) that renews token leases.

A SHARE shim posts its lease request in its region and rings the GPU's doorbell; the desk
renews the lease from the standing terms the token policy gave that process (`set_terms`), or
forwards the request to the channel thread. Either way the event is journaled and taken here
(`take`), so the token scheduler's books follow. This module is the thin ctypes binding plus
the two eventfds: the doorbell the shims ring, and the notification the channel thread polls.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import functools
import math
import os
from dataclasses import dataclass

from gpuloom.services.dispatcher.native import counters_struct, native_library, read_counters

MAX_SLOTS = 256
FOREVER = (1 << 64) - 1
INVALID_FLAG = 0x80000000
_TAKE_BATCH = 512


class DeskEventKind(enum.IntEnum):
    RENEWED = 1
    FORWARDED = 2


class _Terms(ctypes.Structure):
    _fields_ = [
        ("lease_ns", ctypes.c_uint64),
        ("budget_ns", ctypes.c_uint64),
        ("min_lease_ns", ctypes.c_uint64),
        ("limit_ns", ctypes.c_uint64),
        ("window_ns", ctypes.c_uint64),
        ("window_end_ns", ctypes.c_uint64),
    ]


class _Event(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("slot", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("seq", ctypes.c_uint32),
        ("report_lease", ctypes.c_uint64),
        ("gpu_ns", ctypes.c_uint64),
        ("burst_ns", ctypes.c_uint64),
        ("allocated_bytes", ctypes.c_uint64),
        ("posted_ns", ctypes.c_uint64),
        ("at_ns", ctypes.c_uint64),
        ("lease_id", ctypes.c_uint64),
        ("until_ns", ctypes.c_uint64),
        ("charge_ns", ctypes.c_int64),
    ]


@dataclass(frozen=True, slots=True)
class DeskStats:
    rounds: int
    requests: int
    renewed: int
    forwarded: int
    invalid_writes: int
    throttled: int
    slots: int
    pending: int


@dataclass(frozen=True, slots=True)
class DeskEvent:
    """A lease the desk granted (RENEWED) or a request it left to Python (FORWARDED)."""

    kind: DeskEventKind
    slot: int
    report: tuple[int, int, int, bool] | None  # lease id, GPU ns, burst ns, release
    allocated_bytes: int  # device memory the process holds, with a report
    invalid: bool  # the request words failed validation
    posted_ns: int
    at_ns: int
    lease_id: int
    until_ns: int


class DeskFull(Exception):
    """All MAX_SLOTS slots of this GPU's lease desk are taken."""


_Stats = counters_struct(DeskStats, u32=("slots", "pending"))


@functools.cache
def _library() -> ctypes.CDLL:
    lib = native_library()
    lib.gl_desk_start.restype = ctypes.c_void_p
    lib.gl_desk_start.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.gl_desk_stop.restype = None
    lib.gl_desk_stop.argtypes = [ctypes.c_void_p]
    lib.gl_desk_add.restype = ctypes.c_int
    lib.gl_desk_add.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.gl_desk_remove.restype = None
    lib.gl_desk_remove.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.gl_desk_set_terms.restype = ctypes.c_int
    lib.gl_desk_set_terms.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.gl_desk_revoke_all.restype = None
    lib.gl_desk_revoke_all.argtypes = [ctypes.c_void_p]
    lib.gl_desk_take.restype = ctypes.c_uint32
    lib.gl_desk_take.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32]
    lib.gl_desk_get_stats.restype = None
    lib.gl_desk_get_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Stats)]
    return lib


def _ns(seconds: float) -> int:
    """Seconds (monotonic clock) as the desk's ns; infinity is FOREVER."""
    if math.isinf(seconds):
        return FOREVER
    return min(max(int(seconds * 1e9), 0), FOREVER - 1)


class LeaseDesk:
    """Owns the native thread and its two eventfds; safe to call from any thread."""

    def __init__(self) -> None:
        self._lib = _library()
        self.doorbell_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.notify_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        handle = self._lib.gl_desk_start(self.doorbell_fd, self.notify_fd)
        if not handle:
            error = ctypes.get_errno()
            os.close(self.doorbell_fd)
            os.close(self.notify_fd)
            raise OSError(error, f"cannot start the lease desk: {os.strerror(error)}")
        self._handle: int | None = handle
        self._events = (_Event * _TAKE_BATCH)()

    def add(self, region_fd: int) -> int:
        """Register a process's region; returns its slot. Raises DeskFull."""
        ctypes.set_errno(0)
        slot = self._lib.gl_desk_add(self._require(), region_fd)
        if slot < 0:
            error = ctypes.get_errno()
            if error == errno.ENOSPC:
                raise DeskFull(f"the lease desk serves at most {MAX_SLOTS} processes per GPU")
            raise OSError(error, f"cannot add to the lease desk: {os.strerror(error)}")
        return slot

    def remove(self, slot: int) -> None:
        self._lib.gl_desk_remove(self._require(), slot)

    def set_terms(
        self,
        slot: int,
        lease_s: float,
        budget_s: float,
        min_lease_s: float,
        limit_s: float,
        window_s: float,
        window_end_s: float,
    ) -> None:
        """Standing terms for a process (seconds; window_end_s on the monotonic clock). The
        budget is taken as computed from the events taken so far."""
        terms = _Terms(
            _ns(lease_s), min(_ns(budget_s), _ns(limit_s)) if budget_s != math.inf else FOREVER,
            _ns(min_lease_s), _ns(limit_s), _ns(window_s), _ns(window_end_s),
        )  # fmt: skip
        self._call_terms(slot, ctypes.byref(terms))

    def _call_terms(self, slot: int, terms: object) -> None:
        ctypes.set_errno(0)
        if self._lib.gl_desk_set_terms(self._require(), slot, terms) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot set lease terms: {os.strerror(error)}")

    def revoke_all(self) -> None:
        """When this returns, the desk writes no lease word until new terms are given."""
        self._lib.gl_desk_revoke_all(self._require())

    def take(self) -> list[DeskEvent]:
        """Every journaled event, oldest first."""
        handle, buffer = self._require(), self._events
        events: list[DeskEvent] = []
        while True:
            n = self._lib.gl_desk_take(handle, buffer, _TAKE_BATCH)
            for raw in buffer[:n]:
                report = None
                if raw.flags & 1:
                    report = (raw.report_lease, raw.gpu_ns, raw.burst_ns, bool(raw.flags & 2))
                events.append(
                    DeskEvent(
                        DeskEventKind(raw.kind),
                        raw.slot,
                        report,
                        raw.allocated_bytes,
                        bool(raw.flags & INVALID_FLAG),
                        raw.posted_ns,
                        raw.at_ns,
                        raw.lease_id,
                        raw.until_ns,
                    )
                )
            if n < _TAKE_BATCH:
                return events

    def clear_notification(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.notify_fd)

    def stats(self) -> DeskStats:
        raw = _Stats()
        self._lib.gl_desk_get_stats(self._require(), ctypes.byref(raw))
        return read_counters(DeskStats, raw)

    def stop(self) -> None:
        if self._handle is None:
            return
        self._lib.gl_desk_stop(self._handle)
        self._handle = None
        os.close(self.doorbell_fd)
        os.close(self.notify_fd)

    def _require(self) -> int:
        if self._handle is None:
            raise RuntimeError("the lease desk is stopped")
        return self._handle
