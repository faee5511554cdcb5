"""A CLOCK_MONOTONIC timerfd for the channel thread's epoll loop.

epoll's own timeout has millisecond resolution (Python rounds it up), which would end every
lease up to a millisecond late and hand that time to nobody. A timerfd armed at the absolute
deadline wakes the loop within microseconds. (os.timerfd_create arrives only in Python 3.13,
hence ctypes.)
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class DeadlineTimer:
    """One-shot timer at an absolute time.monotonic() deadline; its fd becomes readable then."""

    def __init__(self) -> None:
        fd = _libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            error = ctypes.get_errno()
            raise OSError(error, f"timerfd_create: {os.strerror(error)}")
        self.fd: int = fd
        self._armed: float | None = None

    def arm(self, deadline: float | None) -> None:
        """Fire at `deadline` or earlier (None: whenever convenient). The timer is moved only
        when the deadline comes sooner: leases keep pushing the next deadline later, and an
        early wake-up (the loop finds nothing due and re-arms) is cheaper than a system call
        per lease."""
        armed = self._armed
        if deadline is None or (armed is not None and armed <= deadline):
            return
        self._armed = deadline
        # A zero it_value disarms the timer; a deadline at or before zero must still fire.
        fraction, whole = math.modf(max(deadline, 1e-9))
        spec = _Itimerspec(it_value=_Timespec(int(whole), max(1, int(fraction * 1e9))))
        if _libc.timerfd_settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"timerfd_settime: {os.strerror(error)}")

    def clear(self) -> None:
        """Consume an expiry (call when the fd was readable)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)
        self._armed = None

    def close(self) -> None:
        os.close(self.fd)
