"""The admission engine of one GPU: one native thread (shim/src/engine.c) that admits the work of
every shim on that GPU, with one state, one mutex and one doorbell.

Each round does both halves of admission (docs/dispatcher.md, "The admission engine"):

- leases: a shim posts its lease request in its region and rings the doorbell; the engine
  renews the lease from the standing terms the token policy gave that process (`set_terms`),
  or forwards the request to the channel thread. Either way the event is journaled and taken
  here (`take`), so the token scheduler's books follow. Under policy composed these are the
  leases within a priority level; under a token policy, the only admission.
- kernels: the processes added as FIKIT tasks (`add_task`: a region, a priority and a kernel
  table) are admitted kernel by kernel by the FIKIT decision core, across priority levels.
  Under a token policy no process is, and this half stays inert. Where the GPU runs MPS
  (`harvest` given at start), a filler's request queued behind a running holder kernel is also
  put to the spatial rule (shim/src/spatial.c, the C twin of gpuloom.policies.harvest): one it
  admits goes at once, beside the holder's kernel (`harvested`).

The per-kernel and per-lease paths, shim posts in shared memory -> engine -> grants, never
enter Python. This module is the thin ctypes binding plus the two eventfds: the doorbell every
shim of this GPU receives at registration, and the notification the channel thread polls.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import functools
import math
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
from gpuloom.policies.harvest import Candidate, HarvestConfig, Running
from gpuloom.services.dispatcher.native import counters_struct, native_library, read_counters

MAX_LEASE_SLOTS = 256
FOREVER = (1 << 64) - 1
INVALID_FLAG = 0x80000000
_TAKE_BATCH = 512


@dataclass(frozen=True, slots=True)
class ArbiterStats:
    """The FIKIT half's counters."""

    rounds: int
    requests: int
    grants: int
    unknown_kernels: int
    invalid_writes: int
    role_races: int
    arms: int
    fired: int
    late_releases: int
    harvested: int
    tasks: int
    waiting: int


@dataclass(frozen=True, slots=True)
class DeskStats:
    """The lease half's counters (it was the lease desk's own thread once: the name stays)."""

    rounds: int
    requests: int
    renewed: int
    forwarded: int
    invalid_writes: int
    throttled: int
    slots: int
    pending: int


# A kernel's bound class as spatial.h numbers it (the profile store's KernelBound too).
BOUNDS = {"unknown": 0, "compute": 1, "memory": 2}
# The most SMs the engine's spatial rule takes a GPU to have (GL_SP_MAX_SMS).
MAX_SMS = 4096


@dataclass(frozen=True, slots=True)
class KernelTiming:
    """One kernel of a task's profile, as the engine predicts it."""

    kernel_id: int
    duration_ns: int
    gap_after_ns: int | None  # None: the profile has no gap for it
    sm_usage: int = 0  # SMs its launch shape occupies (0: unknown, taken as all of them)
    bound: str = "unknown"  # compute, memory or unknown: what limits it
    samples: int = 1  # its launches in the profile's measured runs (the harvest gauge's weight)

    def __post_init__(self) -> None:
        if self.bound not in BOUNDS:
            raise ValueError(f"bound must be one of {sorted(BOUNDS)}, got {self.bound!r}")
        if not 0 <= self.sm_usage <= 0xFFFFFFFF:
            raise ValueError(f"sm_usage must be a u32, got {self.sm_usage}")


class DeskEventKind(enum.IntEnum):
    RENEWED = 1
    FORWARDED = 2


@dataclass(frozen=True, slots=True)
class DeskEvent:
    """A lease the engine granted (RENEWED) or a request it left to Python (FORWARDED)."""

    kind: DeskEventKind
    slot: int
    report: tuple[int, int, int, bool] | None  # lease id, GPU ns, burst ns, release
    allocated_bytes: int  # device memory the process holds, with a report
    invalid: bool  # the request words failed validation
    posted_ns: int
    at_ns: int
    lease_id: int
    until_ns: int


class ArbiterFull(Exception):
    """All MAX_TASKS FIKIT slots of this GPU's engine are taken."""


class DeskFull(Exception):
    """All MAX_LEASE_SLOTS lease slots of this GPU's engine are taken."""


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


class _KernelTable(ctypes.Structure):
    _fields_ = [
        ("ids", ctypes.POINTER(ctypes.c_uint64)),
        ("durations_ns", ctypes.POINTER(ctypes.c_uint64)),
        ("gaps_ns", ctypes.POINTER(ctypes.c_uint64)),
        ("sm_usage", ctypes.POINTER(ctypes.c_uint32)),
        ("bounds", ctypes.POINTER(ctypes.c_uint32)),
        ("count", ctypes.c_uint32),
    ]


class _HarvestConfig(ctypes.Structure):
    """gl_sp_config."""

    _fields_ = [
        ("sm_limit", ctypes.c_double),
        ("stretch", ctypes.c_double),
        ("max_holder_slowdown", ctypes.c_double),
        ("other_factor", ctypes.c_double),
        ("unknown_factor", ctypes.c_double),
        ("allow_unknown", ctypes.c_uint32),
        ("sms", ctypes.c_uint32),
    ]


class _Running(ctypes.Structure):
    _fields_ = [
        ("priority", ctypes.c_uint32),
        ("demand", ctypes.c_uint32),
        ("bound", ctypes.c_uint32),
    ]


class _Candidate(ctypes.Structure):
    _fields_ = [
        ("priority", ctypes.c_uint32),
        ("demand", ctypes.c_uint32),
        ("bound", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("duration_ns", ctypes.c_uint64),
        ("queued_ns", ctypes.c_uint64),
        ("quota_left_ns", ctypes.c_uint64),
    ]


_ArbiterStats = counters_struct(ArbiterStats, u32=("tasks", "waiting"))
_DeskStats = counters_struct(DeskStats, u32=("slots", "pending"))


@functools.cache
def _library() -> ctypes.CDLL:
    lib = native_library()
    handle, slot = ctypes.c_void_p, ctypes.c_int
    kernels = [ctypes.POINTER(_KernelTable)]
    harvest = ctypes.POINTER(_HarvestConfig)
    signatures: dict[str, tuple[object, list[object]]] = {
        "gl_engine_start": (
            ctypes.c_void_p,
            [
                ctypes.POINTER(FikitConfigStruct),
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_uint64,
                harvest,
            ],
        ),
        "gl_engine_stop": (None, [handle]),
        "gl_engine_board_fd": (ctypes.c_int, [handle, ctypes.c_uint32, ctypes.c_int]),
        "gl_engine_add_task": (
            ctypes.c_int,
            [handle, ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32, *kernels],
        ),
        "gl_engine_set_kernels": (ctypes.c_int, [handle, slot, *kernels]),
        "gl_engine_remove_task": (None, [handle, slot]),
        "gl_engine_set_suspended": (ctypes.c_int, [handle, slot, ctypes.c_int]),
        "gl_engine_set_harvesting": (ctypes.c_int, [handle, ctypes.c_int]),
        "gl_engine_fikit_stats": (None, [handle, ctypes.POINTER(_ArbiterStats)]),
        "gl_engine_core_counters": (None, [handle, ctypes.POINTER(FikitCountersStruct)]),
        "gl_engine_lease_add": (ctypes.c_int, [handle, ctypes.c_int]),
        "gl_engine_lease_remove": (None, [handle, slot]),
        "gl_engine_set_terms": (ctypes.c_int, [handle, slot, ctypes.c_void_p]),
        "gl_engine_revoke_all": (None, [handle]),
        "gl_engine_take": (ctypes.c_uint32, [handle, ctypes.c_void_p, ctypes.c_uint32]),
        "gl_engine_lease_stats": (None, [handle, ctypes.POINTER(_DeskStats)]),
        "gl_sp_check_config": (ctypes.c_int, [harvest]),
        "gl_sp_admit": (
            ctypes.c_int,
            [
                harvest,
                ctypes.c_uint64,
                ctypes.POINTER(_Candidate),
                ctypes.POINTER(_Running),
                ctypes.c_uint32,
                ctypes.c_uint64,
            ],
        ),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    return lib


def _ns(seconds: float) -> int:
    """Seconds (monotonic clock) as the engine's ns; infinity is FOREVER."""
    if math.isinf(seconds):
        return FOREVER
    return min(max(int(seconds * 1e9), 0), FOREVER - 1)


class AdmissionEngine:
    """Owns the native thread and its two eventfds; safe to call from any thread."""

    def __init__(
        self,
        config: FikitConfig | None = None,
        beat_s: float = 0.02,
        harvest: HarvestConfig | None = None,
        sms: int = 0,
    ) -> None:
        """`config`: the FIKIT core's (its defaults when None: a token policy adds no task).
        The FIKIT half publishes arms (the holder's launch releases the best waiting filler
        itself: one wake-up) and each task's window-opening kernels (a holder's other launches
        ring no doorbell); docs/fikit.md. `beat_s`: the FIKIT regions' heartbeat cadence.
        `harvest`: only where the GPU runs MPS, the spatial rule's knobs, with `sms` the GPU's
        SMs (1..MAX_SMS); None (the default) never asks the rule."""
        self._lib = _library()
        harvest_struct = None if harvest is None else _harvest_struct(harvest, sms)
        self.doorbell_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.notify_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        handle = self._lib.gl_engine_start(
            ctypes.byref(config_struct(config or FikitConfig())),
            self.doorbell_fd,
            self.notify_fd,
            int(beat_s * 1e9),
            None if harvest_struct is None else ctypes.byref(harvest_struct),
        )
        if not handle:
            error = ctypes.get_errno()
            os.close(self.doorbell_fd)
            os.close(self.notify_fd)
            raise OSError(error, f"cannot start the admission engine: {os.strerror(error)}")
        self._handle: int | None = handle
        self._events = (_Event * _TAKE_BATCH)()

    # ---- kernels: the FIKIT half ----

    def add_task(
        self,
        region_fd: int,
        priority: int,
        kernels: Sequence[KernelTiming],
        sm_percent: int = 100,
    ) -> int:
        """Register a FIKIT task with its SM partition (under MPS the spatial rule caps its
        kernels' SMs at it); returns its slot. Raises ArbiterFull when no slot is free."""
        if isinstance(sm_percent, bool) or not isinstance(sm_percent, int):
            raise ValueError(f"sm_percent must be an integer 1..100, got {sm_percent!r}")
        if not 1 <= sm_percent <= 100:
            raise ValueError(f"sm_percent must be 1..100, got {sm_percent}")
        handle = self._require()
        ctypes.set_errno(0)
        table = _table(kernels)
        slot = self._lib.gl_engine_add_task(
            handle, region_fd, priority, sm_percent, ctypes.byref(table)
        )
        if slot < 0:
            error = ctypes.get_errno()
            if error == errno.ENOSPC:
                raise ArbiterFull(
                    f"the admission engine admits at most {MAX_TASKS} FIKIT processes"
                )
            raise OSError(error, f"cannot add a FIKIT task: {os.strerror(error)}")
        return slot

    def set_kernels(self, slot: int, kernels: Sequence[KernelTiming]) -> None:
        """Replace a task's kernel table (its profile arrived after it registered)."""
        ctypes.set_errno(0)
        table = _table(kernels)
        if self._lib.gl_engine_set_kernels(self._require(), slot, ctypes.byref(table)) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot install a FIKIT kernel table: {os.strerror(error)}")

    def remove_task(self, slot: int) -> None:
        self._lib.gl_engine_remove_task(self._require(), slot)

    def set_suspended(self, slot: int, suspended: bool) -> None:
        """Take a task out of the decisions while the dispatcher has it suspended (the next
        priority then holds the GPU), or back in; a slot not in use is ignored."""
        self._lib.gl_engine_set_suspended(self._require(), slot, int(suspended))

    def set_harvesting(self, on: bool) -> None:
        """Pause or resume asking the spatial rule (it follows the GPU's MPS daemon: a process
        reserved while it is down runs as a plain context). Raises ValueError to turn on an
        engine started without `harvest`."""
        if self._lib.gl_engine_set_harvesting(self._require(), int(on)) != 0:
            raise ValueError("the admission engine was started without spatial harvesting")

    def board_fds(self, priority: int) -> list[int]:
        """The priority boards a process of `priority` gets on its Registered frame, after its
        region and the doorbell: the better priorities' read-only, then its own read-write
        (docs/fikit.md). The engine keeps these descriptors; the frame carries copies."""
        handle = self._require()
        if not 0 <= priority < PRIORITIES:
            raise ValueError(f"priority {priority} is outside 0..{PRIORITIES - 1}")
        return [
            self._lib.gl_engine_board_fd(handle, p, int(p == priority)) for p in range(priority + 1)
        ]

    def fikit_stats(self) -> ArbiterStats:
        raw = _ArbiterStats()
        self._lib.gl_engine_fikit_stats(self._require(), ctypes.byref(raw))
        return read_counters(ArbiterStats, raw)

    def core_counters(self) -> FikitCounters:
        """The decision core's counters: windows opened and closed early, fills granted."""
        raw = FikitCountersStruct()
        self._lib.gl_engine_core_counters(self._require(), ctypes.byref(raw))
        return read_core_counters(raw)

    # ---- leases ----

    def add_leased(self, region_fd: int) -> int:
        """Register a process's region for leases; returns its lease slot. Raises DeskFull."""
        ctypes.set_errno(0)
        slot = self._lib.gl_engine_lease_add(self._require(), region_fd)
        if slot < 0:
            error = ctypes.get_errno()
            if error == errno.ENOSPC:
                raise DeskFull(
                    f"the admission engine leases to at most {MAX_LEASE_SLOTS} processes per GPU"
                )
            raise OSError(error, f"cannot add to the admission engine: {os.strerror(error)}")
        return slot

    def remove_leased(self, slot: int) -> None:
        self._lib.gl_engine_lease_remove(self._require(), slot)

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
        ctypes.set_errno(0)
        if self._lib.gl_engine_set_terms(self._require(), slot, ctypes.byref(terms)) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot set lease terms: {os.strerror(error)}")

    def revoke_all(self) -> None:
        """When this returns, the engine writes no lease word until new terms are given."""
        self._lib.gl_engine_revoke_all(self._require())

    def take(self) -> list[DeskEvent]:
        """Every journaled lease event, oldest first."""
        handle, buffer = self._require(), self._events
        events: list[DeskEvent] = []
        while True:
            n = self._lib.gl_engine_take(handle, buffer, _TAKE_BATCH)
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

    def lease_stats(self) -> DeskStats:
        raw = _DeskStats()
        self._lib.gl_engine_lease_stats(self._require(), ctypes.byref(raw))
        return read_counters(DeskStats, raw)

    # ---- life cycle ----

    def stop(self) -> None:
        if self._handle is None:
            return
        self._lib.gl_engine_stop(self._handle)
        self._handle = None
        os.close(self.doorbell_fd)
        os.close(self.notify_fd)

    def _require(self) -> int:
        if self._handle is None:
            raise RuntimeError("the admission engine is stopped")
        return self._handle


def _table(kernels: Sequence[KernelTiming]) -> _KernelTable:
    """The C view of a kernel table (ctypes keeps the arrays alive with the struct)."""
    n = len(kernels)
    ids = (ctypes.c_uint64 * n)(*(k.kernel_id for k in kernels))
    durations = (ctypes.c_uint64 * n)(*(k.duration_ns for k in kernels))
    gaps = (ctypes.c_uint64 * n)(
        *(UNKNOWN if k.gap_after_ns is None else k.gap_after_ns for k in kernels)
    )
    sm_usage = (ctypes.c_uint32 * n)(*(k.sm_usage for k in kernels))
    bounds = (ctypes.c_uint32 * n)(*(BOUNDS[k.bound] for k in kernels))
    return _KernelTable(ids, durations, gaps, sm_usage, bounds, n)


def _harvest_struct(config: HarvestConfig, sms: int) -> _HarvestConfig:
    if isinstance(sms, bool) or not isinstance(sms, int) or not 1 <= sms <= MAX_SMS:
        raise ValueError(
            f"the GPU's SM count must be 1..{MAX_SMS} for spatial harvesting, got {sms!r}"
        )
    raw = _HarvestConfig(
        config.sm_limit,
        config.stretch,
        config.max_holder_slowdown,
        config.other_factor,
        config.unknown_factor,
        int(config.allow_unknown),
        sms,
    )
    if _library().gl_sp_check_config(ctypes.byref(raw)) != 0:
        raise ValueError(f"the native spatial rule refuses {config!r} with {sms} SMs")
    return raw


def native_spatial_admit(
    config: HarvestConfig,
    sms: int,
    now_ns: int,
    candidate: Candidate,
    running: Sequence[Running],
    holder_next_launch_ns: int | None,
) -> bool:
    """The engine's C rule (gl_sp_admit), asked as SpatialHarvest.admit is: for the parity
    of the two."""
    raw = _harvest_struct(config, sms)
    cand = _Candidate(
        candidate.priority,
        candidate.demand,
        BOUNDS[candidate.profile],
        0,
        UNKNOWN if candidate.duration_ns is None else candidate.duration_ns,
        candidate.queued_ns,
        UNKNOWN if candidate.quota_left_ns is None else candidate.quota_left_ns,
    )
    kernels = (_Running * len(running))(
        *(_Running(r.priority, r.demand, BOUNDS[r.profile]) for r in running)
    )
    at = UNKNOWN if holder_next_launch_ns is None else holder_next_launch_ns
    verdict = _library().gl_sp_admit(
        ctypes.byref(raw), now_ns, ctypes.byref(cand), kernels, len(running), at
    )
    return verdict == 1
