"""The shim channel's shared pieces: its limits, a connection, the constants and helpers its
parts use."""

from __future__ import annotations

import concurrent.futures
import math
import socket
import stat
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from gpuloom.policies.tokens.scheduler import (
    Lease,
)
from gpuloom.services.dispatcher.domain import (
    BoundProcess,
    Suspension,
)
from gpuloom.shimwire import (
    OPEN_ENDED_NS,
    AdmissionRegion,
    FrameReader,
    ShimMode,
)
from gpuloom.v1 import shim_pb2

log = structlog.get_logger("gpuloom.dispatcher.channel")

_PEERCRED = struct.Struct("3i")
_RECV_BYTES = 256 * 1024
# Usage numbers beyond this are garbage, not measurements (a lease lasts milliseconds).
_MAX_REPORTED_SECONDS = 3600.0
# How often the memory sample rings are read (a ring holds 224 entries: at the shortest sample
# period of 1 ms, 224 ms of allocations).
SAMPLE_POLL_S = 0.025
# While a suspension waits for its low point, the process's memory is looked at this often.
SUSPEND_POLL_S = 0.001
# FIKIT counters exported as gpuloom_dispatcher_fikit_events_total{event=...}: the engine's FIKIT
# half's own,
# then the decision core's (where the fill kernels went: windows or idle time).
FIKIT_ARBITER_EVENTS = (
    "requests",
    "grants",
    "unknown_kernels",
    "invalid_writes",
    "role_races",
    "arms",
    "fired",
    "late_releases",
    "harvested",
)
FIKIT_CORE_EVENTS = (
    "granted_window",
    "granted_idle",
    "granted_starved",
    "windows_opened",
    "windows_closed_early",
)
# A suspension word holds this long unless renewed (every housekeeping round, 0.5 s): a hung
# dispatcher frees its suspended processes after it.
SUSPEND_HOLD_S = 5.0


@dataclass(slots=True)
class _PendingSuspend:
    reason: str
    asked_at: float  # monotonic
    deadline: float  # monotonic
    threshold: int  # suspend once the process holds at most this many bytes
    future: concurrent.futures.Future[Suspension | None]


@dataclass(frozen=True, slots=True)
class ChannelLimits:
    max_frame_bytes: int = 1 << 20
    max_connections: int = 1024
    # One local user cannot take every connection: at most this many per peer uid ...
    max_connections_per_uid: int = 64
    # ... and the last ones go only to users whose processes hold a reservation here.
    reserved_connections: int = 64
    # A connection must register within this long, or it is closed (a shim registers at once).
    register_timeout_s: float = 1.0
    # A client that does not read its socket gets this much buffered before it is dropped.
    max_unsent_bytes: int = 256 * 1024
    max_records_per_batch: int = 100_000


@dataclass(frozen=True, slots=True)
class ConnectedProcess:
    """A registered process, as GetGpuStatus shows it."""

    pid: int
    asked_at: float | None  # monotonic time of the lease request it waits on; None: not waiting
    allocated_bytes: int  # device memory, as its shim's last usage report said


class ProtocolViolation(Exception):
    """The peer broke the shim protocol; its connection is closed, nobody else notices."""


MeasurementSink = Callable[[str, Sequence[shim_pb2.KernelRecord]], None]


class _Connection:
    __slots__ = (
        "allocated_bytes",
        "assignment_id",
        "beat_slot",
        "deadline",
        "fikit_slot",
        "lease_slot",
        "mode",
        "out",
        "peer",
        "reader",
        "region",
        "requested_at",
        "sock",
    )

    def __init__(self, sock: socket.socket, peer: tuple[int, int, int], reader: FrameReader):
        self.sock = sock
        self.peer = peer  # pid, uid, gid from SO_PEERCRED
        self.reader = reader
        self.out = bytearray()
        self.assignment_id: str | None = None
        self.mode: ShimMode | None = None  # set at registration
        self.region: AdmissionRegion | None = None
        self.deadline = 0.0
        self.requested_at: float | None = None
        self.fikit_slot: int | None = None  # the engine's FIKIT slot (mode FIKIT)
        # The engine's lease slot (mode SHARE, or FIKIT under policy composed).
        self.lease_slot: int | None = None
        self.beat_slot: int | None = None  # the heartbeat's slot (every mode)
        self.allocated_bytes = 0  # device memory, as the shim's last usage report said


def _suspend_deadline_ns() -> int:
    return time.monotonic_ns() + int(SUSPEND_HOLD_S * 1e9)


def _deadline_ns(lease: Lease) -> int:
    return OPEN_ENDED_NS if math.isinf(lease.expires_at) else int(lease.expires_at * 1e9)


def _still_runs(process: BoundProcess) -> bool:
    """Whether the process a token is bound to still runs (not a later one with its pid)."""
    return _process_start_ticks(process.pid) == process.start_ticks


def _process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat: when the process started, in clock ticks since boot."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as proc_stat:
            text = proc_stat.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; fields follow the last ')'.
    fields = text[text.rfind(b")") + 2 :].split()
    return int(fields[19])


def _remove_stale_socket(path: Path) -> None:
    """Remove a socket left by a dead dispatcher; refuse to touch anything else or a live one."""
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise OSError(f"{path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink()
        return
    except OSError as error:
        raise OSError(f"{path} exists and is not a usable socket: {error}") from None
    finally:
        probe.close()
    raise OSError(f"another dispatcher is listening on {path}")


_REASON_LABELS = ("peer closed", "goodbye", "evicted", "unknown assignment token", "frame")


def _reason_label(reason: str) -> str:
    """Bounded label values for the metric (reasons carry free text)."""
    for label in _REASON_LABELS:
        if reason.startswith(label):
            return label
    return "other"
