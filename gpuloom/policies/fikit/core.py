"""A thin ctypes binding of the FIKIT decision core (`shim/src/fikit.h`).

The simulator drives exactly the C code the dispatcher's arbiter runs; nothing of the policy
is re-implemented here. Times are integer nanoseconds; `UNKNOWN` marks a duration or gap the
task's profile does not know.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path

MAX_TASKS = 64
PRIORITIES = 10
UNKNOWN = (1 << 64) - 1

LIBRARY_ENV = "GPULOOM_FIKIT_LIB"
# Where `make -C shim` builds it in a checkout.
CHECKOUT_LIBRARY = Path(__file__).resolve().parents[3] / "shim" / "build" / "libglfikit.so"


class FikitLibraryMissingError(RuntimeError):
    """libglfikit.so is neither where GPULOOM_FIKIT_LIB says nor built in the checkout."""


@dataclass(frozen=True, slots=True)
class FikitConfig:
    gap_threshold_ns: int = 100_000
    idle_margin_ns: int = 200_000
    idle_backlog_ns: int = 0
    max_wait_ns: int = 0  # 0: never
    fill_guard_ns: int = 0  # a window fill must end this long before the window (gl_fk_config)

    def validate(self) -> None:
        """Raise ValueError naming the first field that is not a whole number of ns in
        0..2^62 (the C core keeps them as uint64, 2^64-1 meaning unknown)."""
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 62:
                raise ValueError(
                    f"{field.name} must be a whole number of ns in 0..2^62, got {value!r}"
                )


@dataclass(frozen=True, slots=True)
class FikitCounters:
    admitted_holder: int
    queued: int
    granted_window: int
    granted_idle: int
    granted_starved: int
    unknown_requests: int
    windows_opened: int
    windows_closed_early: int
    holder_switches: int
    overflowed: int
    rejected_calls: int
    launched_unadmitted: int
    granted_released: int


class FikitConfigStruct(ctypes.Structure):
    """gl_fk_config as C lays it out (the arbiter's binding passes it too)."""

    _fields_ = [(f.name, ctypes.c_uint64) for f in fields(FikitConfig)]


class FikitCountersStruct(ctypes.Structure):
    """gl_fk_counters as C lays it out (the arbiter's binding reads it too)."""

    _fields_ = [(f.name, ctypes.c_uint64) for f in fields(FikitCounters)]


def read_core_counters(raw: FikitCountersStruct) -> FikitCounters:
    return FikitCounters(*(getattr(raw, f.name) for f in fields(FikitCounters)))


def library_path(path: str | None = None) -> Path:
    """libglfikit.so: `path`, else $GPULOOM_FIKIT_LIB, else the checkout's build."""
    where = Path(path or os.environ.get(LIBRARY_ENV) or CHECKOUT_LIBRARY)
    if not where.is_file():
        raise FikitLibraryMissingError(
            f"the FIKIT core {where} is not built: run `make -C shim` (or set {LIBRARY_ENV})"
        )
    return where


@cache
def load_library(path: str | None = None) -> ctypes.CDLL:
    """Load libglfikit.so (see library_path) with the core's signatures."""
    lib = ctypes.CDLL(str(library_path(path)))
    u32, u64, core_p = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    signatures = {
        "gl_fk_default_config": (None, [ctypes.POINTER(FikitConfigStruct)]),
        "gl_fk_core_size": (ctypes.c_size_t, []),
        "gl_fk_init": (ctypes.c_int, [core_p, ctypes.POINTER(FikitConfigStruct)]),
        "gl_fk_add_task": (ctypes.c_int, [core_p, u32, u32, u64]),
        "gl_fk_remove_task": (None, [core_p, u32, u64]),
        "gl_fk_request": (ctypes.c_int, [core_p, u32, u64, u64, u64]),
        "gl_fk_launched": (ctypes.c_int, [core_p, u32, u64, u64, u64]),
        "gl_fk_completed": (None, [core_p, u32, u32, u64]),
        "gl_fk_decide": (
            ctypes.c_int,
            [core_p, u64, ctypes.POINTER(u32), ctypes.c_int, ctypes.POINTER(u64)],
        ),
        "gl_fk_next_fill": (
            ctypes.c_int,
            [core_p, ctypes.POINTER(u32), ctypes.POINTER(u64)],
        ),
        "gl_fk_next_asker": (ctypes.c_int, [core_p, ctypes.POINTER(u32)]),
        "gl_fk_release": (ctypes.c_int, [core_p, u32, u64]),
        "gl_fk_get_counters": (None, [core_p, ctypes.POINTER(FikitCountersStruct)]),
        "gl_fk_holder_priority": (ctypes.c_int, [core_p]),
        "gl_fk_window_end": (u64, [core_p]),
        "gl_fk_tail": (u64, [core_p]),
        "gl_fk_has_request": (ctypes.c_int, [core_p, u32]),
        "gl_fk_outstanding": (u32, [core_p, u32]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    return lib


def config_struct(config: FikitConfig) -> FikitConfigStruct:
    return FikitConfigStruct(*(getattr(config, f.name) for f in fields(FikitConfig)))


def default_config(library: str | None = None) -> FikitConfig:
    """The C core's own defaults."""
    raw = FikitConfigStruct()
    load_library(library).gl_fk_default_config(ctypes.byref(raw))
    return FikitConfig(*(getattr(raw, f.name) for f in fields(FikitConfig)))


class FikitCore:
    """One decision core in memory this object owns. Arguments pass to C unchecked except
    for what ctypes needs (values wrap to the C integer types); the core validates them."""

    def __init__(self, config: FikitConfig | None = None, library: str | None = None) -> None:
        self._lib = load_library(library)
        self._memory = ctypes.create_string_buffer(self._lib.gl_fk_core_size())
        self._core = ctypes.cast(self._memory, ctypes.c_void_p)
        config = config or FikitConfig()
        raw = config_struct(config)
        if self._lib.gl_fk_init(self._core, ctypes.byref(raw)) != 0:
            raise ValueError(f"the FIKIT core refused the configuration {config}")
        self.config = config
        self._out = (ctypes.c_uint32 * MAX_TASKS)()
        self._wake = ctypes.c_uint64()

    def add_task(self, task: int, priority: int, now_ns: int) -> bool:
        return self._lib.gl_fk_add_task(self._core, task, priority, now_ns) == 0

    def remove_task(self, task: int, now_ns: int) -> None:
        self._lib.gl_fk_remove_task(self._core, task, now_ns)

    def request(self, task: int, duration_ns: int, gap_after_ns: int, now_ns: int) -> int:
        """1: admitted now, 0: queued (wait for a grant from decide), -1: refused."""
        return self._lib.gl_fk_request(self._core, task, duration_ns, gap_after_ns, now_ns)

    def launched(self, task: int, duration_ns: int, gap_after_ns: int, now_ns: int) -> int:
        """A kernel the task launched without asking (a holder's, reported after the fact):
        1 admitted as the holder's, 0 counted as fill work (it is no longer a holder)."""
        return self._lib.gl_fk_launched(self._core, task, duration_ns, gap_after_ns, now_ns)

    def completed(self, task: int, count: int, now_ns: int) -> None:
        self._lib.gl_fk_completed(self._core, task, count, now_ns)

    def decide(self, now_ns: int, max_grants: int = MAX_TASKS) -> tuple[list[int], int | None]:
        """(granted task ids in grant order, the time to decide again with no new event or
        None)."""
        max_grants = max(0, min(max_grants, MAX_TASKS))
        n = self._lib.gl_fk_decide(
            self._core, now_ns, self._out, max_grants, ctypes.byref(self._wake)
        )
        wake = self._wake.value
        return list(self._out[:n]), (None if wake == UNKNOWN else wake)

    def next_fill(self) -> tuple[int, int] | None:
        """(task, least gap) of the request the holder's next window grants first, decided
        in advance (the one-wake-up path), or None."""
        task, gap = ctypes.c_uint32(), ctypes.c_uint64()
        if self._lib.gl_fk_next_fill(self._core, ctypes.byref(task), ctypes.byref(gap)) != 1:
            return None
        return task.value, gap.value

    def next_asker(self) -> int | None:
        """The task whose next request (not posted yet) the holder's next window grants first
        if its duration fits the gap, or None."""
        task = ctypes.c_uint32()
        if self._lib.gl_fk_next_asker(self._core, ctypes.byref(task)) != 1:
            return None
        return task.value

    def release(self, task: int, now_ns: int) -> bool:
        """The task's queued request already went: admit it as fill work now."""
        return self._lib.gl_fk_release(self._core, task, now_ns) == 0

    def counters(self) -> FikitCounters:
        raw = FikitCountersStruct()
        self._lib.gl_fk_get_counters(self._core, ctypes.byref(raw))
        return read_core_counters(raw)

    def holder_priority(self) -> int | None:
        priority = self._lib.gl_fk_holder_priority(self._core)
        return None if priority < 0 else priority

    def window_end(self) -> int | None:
        end = self._lib.gl_fk_window_end(self._core)
        return end or None

    def tail(self) -> int:
        return self._lib.gl_fk_tail(self._core)

    def has_request(self, task: int) -> bool:
        return self._lib.gl_fk_has_request(self._core, task) == 1

    def outstanding(self, task: int) -> int:
        return self._lib.gl_fk_outstanding(self._core, task)
