"""The shim channel's wire format, shared by the dispatcher and the Python reference client.

Two parts, both specified in protos/gpuloom/v1/shim.proto (the C shim follows the same text):
- frames: a 4-byte little-endian length, then one serialized message;
- the admission region: 4 KiB of shared memory per client. The lease words are written by
  the dispatcher and read by the shim on every launch (a waiting shim sleeps on the epoch word
  with FUTEX_WAIT); the FIKIT words are split into a part the dispatcher's arbiter writes and
  a part the shim writes (docs/fikit.md); the suspension word and the memory sample ring serve
  training introspection and suspend/resume (docs/training.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import enum
import mmap
import os
import struct
import time

FRAME_HEADER = struct.Struct("<I")
DEFAULT_MAX_FRAME_BYTES = 1 << 20
PROTOCOL_VERSION = 1


class FrameError(Exception):
    """The peer broke the framing rules; the connection must be closed."""


def encode_frame(payload: bytes) -> bytes:
    return FRAME_HEADER.pack(len(payload)) + payload


def store_word(buffer: mmap.mmap | bytearray, offset: int, value: int, size: int = 8) -> None:
    """One aligned store of a `size`-byte word, as the C shim's __atomic_store_n: a reader on
    another thread sees the old value or the new one. (struct.pack_into zeroes the bytes first
    and then writes them one by one, so a concurrent reader can see a zero or half a word.)"""
    word = (ctypes.c_uint64 if size == 8 else ctypes.c_uint32).from_buffer(buffer, offset)
    word.value = value
    del word


class FrameReader:
    """Splits a byte stream into frame payloads, refusing empty and oversized frames."""

    __slots__ = ("_buffer", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self.max_frame_bytes = max_frame_bytes

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return every frame now complete (raises FrameError on a bad one)."""
        buffer = self._buffer
        buffer += data
        frames = []
        start = 0
        while len(buffer) - start >= FRAME_HEADER.size:
            (length,) = FRAME_HEADER.unpack_from(buffer, start)
            if length == 0 or length > self.max_frame_bytes:
                raise FrameError(f"frame length {length} outside 1..{self.max_frame_bytes} bytes")
            end = start + FRAME_HEADER.size + length
            if len(buffer) < end:
                break
            frames.append(bytes(buffer[start + FRAME_HEADER.size : end]))
            start = end
        if start:
            del buffer[:start]
        return frames


# ---- the admission region ----

REGION_MAGIC = 0x4D534C47  # "GLSM" little-endian
REGION_VERSION = 6
REGION_BYTES = 4096
REGION_SAMPLES = 224  # entries of the memory sample ring
OPEN_ENDED_NS = (1 << 64) - 1

_OFF_MAGIC, _OFF_VERSION, _OFF_EPOCH, _OFF_STATE = 0, 4, 8, 12
_OFF_ADMIT_UNTIL, _OFF_LEASE_ID = 16, 24
# 32..47: unused (zero): the memory cap, priority and mode come on the Registered frame.
# Written by the dispatcher: the suspension's deadline (CLOCK_MONOTONIC ns, renewed while it
# lasts; 0 = not suspended) and the memory sample period (us; 0 = the shim samples nothing).
_OFF_SUSPEND_UNTIL, _OFF_SAMPLE_PERIOD = 48, 56
# FIKIT words: the arbiter writes these ...
OFF_FK_GRANT, OFF_FK_ROLE, OFF_FK_NOTIFY, OFF_FK_BEAT = 64, 68, 72, 80
# Mode FIKIT under policy composed: 1 = the leases of its priority level bound it too (written
# by the dispatcher before the shim sees the region).
OFF_FK_LEASED = 76
# The dispatcher's heartbeat (CLOCK_MONOTONIC ns, every mode; written by its native thread every
# BEAT_PERIOD_NS; 0: it gives none): a shim that asks for nothing takes a beat older than its
# bound (GPULOOM_SHIM_WAIT_MS, at least BEAT_MIN_PERIODS periods) for a lost dispatcher.
OFF_BEAT, BEAT_PERIOD_NS, BEAT_MIN_PERIODS = 88, 25_000_000, 4
# ... and the shim these (own cache line).
OFF_FK_REQ_SEQ, OFF_FK_DONE, OFF_FK_KERNEL, OFF_FK_POST_NS, OFF_FK_WAITING = 128, 132, 136, 144, 152
# Lease request words, written by a SHARE shim for the dispatcher's lease desk (own cache line).
OFF_LR_SEQ, OFF_LR_FLAGS, OFF_LR_LEASE, OFF_LR_GPU_NS = 192, 196, 200, 208
OFF_LR_BURST_NS, OFF_LR_POST_NS, OFF_LR_ALLOCATED = 216, 224, 232
# The one-wake-up path (docs/fikit.md): the arbiter writes the arm words (own cache line) ...
OFF_FK_ARM, OFF_FK_ARM_KERNELS, OFF_FK_ARMED = 256, 264, 296
OFF_FK_ARM_BOARD, OFF_FK_ARM_WAIT = 304, 308
# ... a filler its release (own cache line).
OFF_FK_RELEASED, OFF_FK_RELEASED_KERNEL = 320, 328
# ... and which request the filler's arm is for (the arbiter).
# The holder's window-opening kernels; OPENERS_ALL = 1: no others (the rest post without a ring).
OFF_FK_OPENERS, OFF_FK_OPENERS_ALL = 336, 368
OFF_FK_ARMED_SEQ, OFF_FK_ARMED_KERNELS = 384, 392
ARM_KERNELS = 4  # kernel IDs an arm names
# The training loop's period seen in the kernel stream (the shim's kperiod.c): kernels per
# iteration (u32, 0: none seen), the host gap before its boundary (u32 us), its mean duration
# and its latest boundary (u64 ns each).
OFF_KP_PERIOD, OFF_KP_GAP_US, OFF_KP_PERIOD_NS, OFF_KP_BOUNDARY_NS = 424, 428, 432, 440
# A priority board (one per priority per GPU), written by the holder shim of that priority.
BOARD_BYTES, BOARD_LAUNCH, BOARD_FIRED, BOARDS = 64, 0, 8, 10
# The memory sample ring, written by the shim in every mode: entries written so far (u32), then
# REGION_SAMPLES entries of (u64 CLOCK_MONOTONIC ns, u64 allocated bytes).
OFF_MS_HEAD, OFF_MS_RING = 448, 512
_SAMPLE = struct.Struct("<QQ")


@dataclasses.dataclass(frozen=True, slots=True)
class KernelPeriod:
    """A training loop's period seen in its kernel stream (the shim's kperiod.c)."""

    kernels: int  # launches per iteration
    period_ns: int  # the iteration's mean duration
    boundary_ns: int  # when its latest boundary launch was (CLOCK_MONOTONIC)
    gap_ns: int  # the host gap before each boundary launch

    def next_gap(self, now_ns: int) -> tuple[int, int]:
        """The next host gap before a boundary launch that has not begun by `now_ns`:
        (start, boundary), CLOCK_MONOTONIC ns."""
        boundary = self.boundary_ns + self.period_ns
        if boundary - self.gap_ns <= now_ns:
            behind = (now_ns - (boundary - self.gap_ns)) // self.period_ns + 1
            boundary += behind * self.period_ns
        return boundary - self.gap_ns, boundary


class AdmissionState(enum.IntEnum):
    """Mirrors gpuloom.v1.AdmissionState (kept here so domain code needs no protobuf import)."""

    WAITING = 1
    LEASED = 2
    OPEN = 3
    EVICTED = 4


class ShimMode(enum.IntEnum):
    """Mirrors gpuloom.v1.ShimMode."""

    SHARE = 1
    MEASURE = 2
    OFF = 3
    FIKIT = 4


class FikitPost(enum.IntEnum):
    """What a FIKIT shim's latest post is: a holder's launch (untracked: taken as done at once;
    tracked: its completion will be reported) or a filler's request for a grant."""

    LAUNCHED = 0
    REQUEST = 1
    TRACKED = 2


class LeaseRequestFlag(enum.IntFlag):
    """What a lease request posted for the lease desk carries: a usage report (the LR_LEASE..
    words are set), and whether that lease is released."""

    REPORT = 1
    RELEASE = 2


class FikitRole(enum.IntEnum):
    """What the arbiter tells a FIKIT shim: launch at once, or request and wait for a grant."""

    NONE = 0
    HOLDER = 1
    FILL = 2


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_FUTEX = 202 if os.uname().machine == "x86_64" else 98  # x86_64; aarch64 uses 98
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the u32 at `address` equals `expected`, at most `timeout_s` (spurious wake-ups
    and EAGAIN are normal: callers re-check what they wait for)."""
    timeout = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _libc.syscall(
        _SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, expected, ctypes.byref(timeout)
    )


def futex_wake(address: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 0x7FFFFFFF, None)


class AdmissionRegion:
    """One client's admission region over a shared mapping (see shim.proto for the layout).

    Only the dispatcher writes (the `publish_*` methods); aligned 4- and 8-byte fields are read
    and written with single loads and stores, and the epoch is bumped last so a woken waiter
    sees the new lease.
    """

    def __init__(self, mapping: mmap.mmap) -> None:
        if len(mapping) < REGION_BYTES:
            raise ValueError(f"admission region needs {REGION_BYTES} bytes, got {len(mapping)}")
        self._mapping = mapping
        self._epoch = ctypes.c_uint32.from_buffer(mapping, _OFF_EPOCH)
        self._state = ctypes.c_uint32.from_buffer(mapping, _OFF_STATE)
        self._admit_until = ctypes.c_uint64.from_buffer(mapping, _OFF_ADMIT_UNTIL)
        self._lease_id = ctypes.c_uint64.from_buffer(mapping, _OFF_LEASE_ID)
        self._suspend_until = ctypes.c_uint64.from_buffer(mapping, _OFF_SUSPEND_UNTIL)
        self._epoch_address = ctypes.addressof(self._epoch)
        self.sample_cursor: int | None = None  # the dispatcher's reading position in the ring
        self.last_sample: tuple[int, int] | None = None  # the latest entry it read

    # -- creating and opening --

    @classmethod
    def create(cls, name: str, sample_period_us: int = 0) -> tuple[AdmissionRegion, int]:
        """A fresh region in a memfd; returns the region and the fd to pass to the client."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, REGION_BYTES)
            mapping = mmap.mmap(fd, REGION_BYTES)
        except BaseException:
            os.close(fd)
            raise
        struct.pack_into("<II", mapping, _OFF_MAGIC, REGION_MAGIC, REGION_VERSION)
        struct.pack_into("<I", mapping, _OFF_SAMPLE_PERIOD, sample_period_us)
        region = cls(mapping)
        region._state.value = AdmissionState.WAITING
        return region, fd

    @classmethod
    def open(cls, fd: int) -> AdmissionRegion:
        """Map a region received from the dispatcher (client side); checks magic and version."""
        size = os.fstat(fd).st_size
        if size < REGION_BYTES:
            raise ValueError(f"admission region is {size} bytes, expected {REGION_BYTES}")
        mapping = mmap.mmap(fd, REGION_BYTES, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        magic, version = struct.unpack_from("<II", mapping, _OFF_MAGIC)
        if magic != REGION_MAGIC or version != REGION_VERSION:
            mapping.close()
            raise ValueError(f"not a gpuloom admission region (magic {magic:#x} v{version})")
        return cls(mapping)

    @property
    def mapping(self) -> mmap.mmap:
        return self._mapping

    def close(self) -> None:
        # The ctypes views pin the buffer; drop them before closing the mapping.
        del self._epoch, self._state, self._admit_until, self._lease_id, self._suspend_until
        self._mapping.close()

    # -- reading (shim side, and tests) --

    @property
    def epoch(self) -> int:
        return self._epoch.value

    @property
    def state(self) -> AdmissionState:
        return AdmissionState(self._state.value)

    @property
    def fikit_leased(self) -> bool:
        """Mode FIKIT under policy composed: its level's leases bound it too."""
        return struct.unpack_from("<I", self._mapping, OFF_FK_LEASED)[0] == 1

    @property
    def fikit_seq(self) -> int:
        """Mode FIKIT: the shim's sequence word, one more at each launch or kernel request
        (whatever its role; wraps at 2**32): its launch counter for the harvest gauge. Written
        by the shim, so only as trustworthy as it (the gauge bounds what it takes)."""
        return struct.unpack_from("<I", self._mapping, OFF_FK_REQ_SEQ)[0]

    @property
    def admit_until_ns(self) -> int:
        return self._admit_until.value

    @property
    def lease_id(self) -> int:
        return self._lease_id.value

    @property
    def suspended_until_ns(self) -> int:
        return self._suspend_until.value

    def admitted(self, now_ns: int | None = None) -> bool:
        """The launch-path check: one load and a clock read."""
        return (time.monotonic_ns() if now_ns is None else now_ns) < self._admit_until.value

    def wait_for_change(self, seen_epoch: int, timeout_s: float) -> None:
        futex_wait(self._epoch_address, seen_epoch, timeout_s)

    # -- writing (dispatcher side) --

    def _publish(
        self, state: AdmissionState, admit_until_ns: int, lease_id: int, wake: bool
    ) -> None:
        self._lease_id.value = lease_id
        self._admit_until.value = admit_until_ns
        self._state.value = state
        self._epoch.value = (self._epoch.value + 1) & 0xFFFFFFFF
        if wake:
            futex_wake(self._epoch_address)

    def publish_lease(self, lease_id: int, until_ns: int) -> None:
        self._publish(AdmissionState.LEASED, until_ns, lease_id, wake=True)

    def publish_leased(self) -> None:
        """Mode FIKIT under policy composed: the shim asks its level for a lease before the
        arbiter (set before the region is passed)."""
        struct.pack_into("<I", self._mapping, OFF_FK_LEASED, 1)

    def publish_open(self) -> None:
        self._publish(AdmissionState.OPEN, OPEN_ENDED_NS, 0, wake=True)

    def publish_waiting(self) -> None:
        # A revocation: nobody sleeps waiting for one, so no wake-up system call.
        self._publish(AdmissionState.WAITING, 0, 0, wake=False)

    def publish_evicted(self) -> None:
        self._publish(AdmissionState.EVICTED, 0, 0, wake=True)

    def publish_suspended(self, until_ns: int) -> None:
        """Suspend: no lease, and the shim waits (unbounded) while `until_ns` is renewed."""
        self._suspend_until.value = until_ns
        self._publish(AdmissionState.WAITING, 0, 0, wake=True)

    def renew_suspension(self, until_ns: int) -> None:
        self._suspend_until.value = until_ns

    def publish_resumed(self, open_ended: bool) -> None:
        """Lift a suspension; `open_ended`: admitted until further notice again (modes without
        leases), else the shim asks for a lease as usual."""
        self._suspend_until.value = 0
        if open_ended:
            self.publish_open()
        else:
            self._publish(AdmissionState.WAITING, 0, 0, wake=True)

    def read_kernel_period(self) -> KernelPeriod | None:
        """The training loop's period the shim found in its kernel stream, or None (none seen,
        or values that make no sense: the shim's words are validated here)."""
        (kernels, gap_us) = struct.unpack_from("<II", self._mapping, OFF_KP_PERIOD)
        (period_ns, boundary_ns) = struct.unpack_from("<QQ", self._mapping, OFF_KP_PERIOD_NS)
        gap_ns = gap_us * 1000
        if kernels == 0 or not 0 < period_ns <= 3600 * 10**9 or not 0 < gap_ns < period_ns:
            return None
        return KernelPeriod(kernels, period_ns, boundary_ns, gap_ns)

    def read_samples(self) -> tuple[list[tuple[int, int]], int]:
        """The memory samples written since the last call (the latest entry of the last call
        again: the shim may have updated its bytes since), oldest first, and how many were
        overwritten unread. Values are as found: the caller validates them."""
        return read_sample_ring(self._mapping, self)


def read_sample_ring(
    mapping: mmap.mmap | bytearray, cursor_holder: AdmissionRegion | SampleCursor
) -> tuple[list[tuple[int, int]], int]:
    """Reads the ring of `mapping` from `cursor_holder.sample_cursor` (None: from the oldest
    entry still there) up to its head, and moves the cursor."""
    (head,) = struct.unpack_from("<I", mapping, OFF_MS_HEAD)
    cursor = cursor_holder.sample_cursor
    start = max(head - REGION_SAMPLES, 0) if cursor is None else cursor
    ahead = (head - start) & 0xFFFFFFFF
    lost = 0
    if ahead > REGION_SAMPLES:  # the shim lapped the reader (or the head is garbage)
        lost = ahead - REGION_SAMPLES if ahead < 1 << 31 else 0
        start = (head - REGION_SAMPLES) & 0xFFFFFFFF if ahead < 1 << 31 else head
        ahead = (head - start) & 0xFFFFFFFF
    # The entry before the new ones again: its bytes may have been updated since.
    again = cursor is not None and start != 0 and ahead < REGION_SAMPLES
    first = (start - 1) & 0xFFFFFFFF if again else start
    count = (head - first) & 0xFFFFFFFF
    samples = []
    for i in range(count):
        index = (first + i) & 0xFFFFFFFF
        samples.append(_SAMPLE.unpack_from(mapping, OFF_MS_RING + 16 * (index % REGION_SAMPLES)))
    cursor_holder.sample_cursor = head
    return samples, lost


class SampleCursor:
    """A reading position in a sample ring (tests, and readers of a mapping of their own)."""

    def __init__(self) -> None:
        self.sample_cursor: int | None = None


class SamplePort:
    """The shim's side of the memory sample ring (the Python reference of mem_sample in
    shim/src/memcap.c): a new entry when the latest is at least `period_ns` old, else the
    latest entry's bytes are overwritten."""

    def __init__(self, mapping: mmap.mmap | bytearray, period_ns: int) -> None:
        self._mapping = mapping
        self._period_ns = period_ns
        self.count = 0
        self._started = 0

    def sample(self, allocated: int, now_ns: int | None = None) -> None:
        now = time.monotonic_ns() if now_ns is None else now_ns
        if self.count and now - self._started < self._period_ns:
            offset = OFF_MS_RING + 16 * ((self.count - 1) % REGION_SAMPLES)
            struct.pack_into("<Q", self._mapping, offset + 8, allocated)
            return
        offset = OFF_MS_RING + 16 * (self.count % REGION_SAMPLES)
        _SAMPLE.pack_into(self._mapping, offset, now, allocated)
        self.count = (self.count + 1) & 0xFFFFFFFF
        struct.pack_into("<I", self._mapping, OFF_MS_HEAD, self.count)
        self._started = now


class FikitPort:
    """The shim's side of a region's FIKIT words (the Python reference of shim/src/fikit_gate.c).

    A holder posts a launch and goes; a filler posts a request, rings the doorbell and waits
    until the arbiter writes the request's sequence number into the grant word. With `boards`
    (the priority boards of the Registered frame, 0..own priority, the own one last and
    writable), a holder's launch of an armed kernel fires the arm into its board, and a filler
    armed with that nonce goes without waiting for the arbiter.
    """

    def __init__(
        self, mapping: mmap.mmap, doorbell_fd: int, boards: list[mmap.mmap] | None = None
    ) -> None:
        self._mapping = mapping
        self._doorbell = doorbell_fd
        self._grant = ctypes.c_uint32.from_buffer(mapping, OFF_FK_GRANT)
        self._grant_address = ctypes.addressof(self._grant)
        self.seq = struct.unpack_from("<I", mapping, OFF_FK_REQ_SEQ)[0]
        self._boards = boards or []
        self._fired = 0
        self._released = 0
        self._stale = 0  # an arm fired before the request was posted
        self.early_releases = 0  # requests that went by the holder's fire, before a grant

    def _u32(self, offset: int) -> int:
        return struct.unpack_from("<I", self._mapping, offset)[0]

    def _u64(self, offset: int) -> int:
        return struct.unpack_from("<Q", self._mapping, offset)[0]

    @property
    def role(self) -> FikitRole:
        return FikitRole(self._u32(OFF_FK_ROLE))

    @property
    def notify(self) -> bool:
        return self._u32(OFF_FK_NOTIFY) == 1

    @property
    def granted(self) -> int:
        return self._grant.value

    @property
    def heartbeat_ns(self) -> int:
        return struct.unpack_from("<Q", self._mapping, OFF_FK_BEAT)[0]

    @property
    def arm(self) -> tuple[int, list[int]]:
        """(nonce, kernel IDs) of the arm a holder's launch may fire; nonce 0: none."""
        kernels = struct.unpack_from(f"<{ARM_KERNELS}Q", self._mapping, OFF_FK_ARM_KERNELS)
        return self._u64(OFF_FK_ARM), [k for k in kernels if k]

    @property
    def openers(self) -> list[int] | None:
        """The holder's window-opening kernel IDs as the arbiter published them, or None when
        it did not list them all (then every launch must ring)."""
        if self._u32(OFF_FK_OPENERS_ALL) != 1:
            return None
        kernels = struct.unpack_from(f"<{ARM_KERNELS}Q", self._mapping, OFF_FK_OPENERS)
        return [k for k in kernels if k]

    def opens_window(self, kernel_id: int) -> bool:
        """Whether a holder's launch of `kernel_id` needs the doorbell (the C shim's rule)."""
        openers = self.openers
        return openers is None or kernel_id == 0 or kernel_id in openers

    @property
    def armed(self) -> tuple[int, int]:
        """(nonce, board) of the arm that releases a filler's queued request; nonce 0: none."""
        return self._u64(OFF_FK_ARMED), self._u32(OFF_FK_ARM_BOARD)

    def ring(self) -> None:
        os.eventfd_write(self._doorbell, 1)

    def post(self, kernel_id: int, kind: FikitPost, now_ns: int | None = None) -> int:
        """Post a launch (holder) or a request (filler); returns its sequence number. The
        sequence number is stored last, so the arbiter never sees it before the rest. A
        holder's launch then fires its arm when it names this kernel."""
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        posted = time.monotonic_ns() if now_ns is None else now_ns
        if kind is FikitPost.REQUEST:
            # An arm given ahead already fired does not release this request; read before the
            # post, as the C shim does: a fire after the post releases it.
            stale, index = self.armed
            if (
                stale
                and index < len(self._boards) - 1
                and struct.unpack_from("<Q", self._boards[index], BOARD_FIRED)[0] == stale
            ):
                self._stale = stale
        store_word(self._mapping, OFF_FK_KERNEL, kernel_id)
        store_word(self._mapping, OFF_FK_POST_NS, posted)
        store_word(self._mapping, OFF_FK_WAITING, int(kind), 4)
        store_word(self._mapping, OFF_FK_REQ_SEQ, self.seq, 4)
        if kind is not FikitPost.REQUEST:
            self._fire(kernel_id)
        self.ring()
        return self.seq

    def _fire(self, kernel_id: int) -> None:
        nonce, kernels = self.arm
        if not self._boards or not nonce or nonce == self._fired or kernel_id not in kernels:
            return
        if self._u64(OFF_FK_ARM) != nonce:
            return
        self._fired = nonce
        board = self._boards[-1]
        struct.pack_into("<Q", board, BOARD_FIRED, nonce)
        launch = ctypes.c_uint32.from_buffer(board, BOARD_LAUNCH)
        launch.value = (launch.value + 1) & 0xFFFFFFFF
        futex_wake(ctypes.addressof(launch))
        del launch

    def _released_by_board(self, seq: int, kernel_id: int) -> bool:
        nonce, index = self.armed
        if not nonce or nonce in (self._released, self._stale) or index >= len(self._boards) - 1:
            return False
        kernels = struct.unpack_from(f"<{ARM_KERNELS}Q", self._mapping, OFF_FK_ARMED_KERNELS)
        if self._u32(OFF_FK_ARMED_SEQ) != seq or (any(kernels) and kernel_id not in kernels):
            return False  # another request's arm, or one for a kernel this is not
        if struct.unpack_from("<Q", self._boards[index], BOARD_FIRED)[0] != nonce:
            return False
        self._released = nonce
        struct.pack_into("<Q", self._mapping, OFF_FK_RELEASED_KERNEL, kernel_id)
        struct.pack_into("<Q", self._mapping, OFF_FK_RELEASED, nonce)
        self.early_releases += 1
        return True

    def wait_grant(self, seq: int, timeout_s: float) -> bool:
        """Sleep until request `seq` is granted, or its arm fired; False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        kernel_id = self._u64(OFF_FK_KERNEL)
        # The board first: a fire the arbiter already settled (and granted) still counts as
        # the release it was.
        while not self._released_by_board(seq, kernel_id):
            if (granted := self._grant.value) == seq:
                # Granted: the post is no longer a waiting request. (Released by the board it
                # stays one: the arbiter may not have read it yet.)
                struct.pack_into("<I", self._mapping, OFF_FK_WAITING, FikitPost.LAUNCHED)
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # The board is polled at this step (the C shim sleeps on it with futex_waitv).
            futex_wait(
                self._grant_address, granted, min(left, 0.005 if not self._boards else 0.0005)
            )
        return True

    def report_done(self, seq: int) -> None:
        """Granted kernels up to `seq` completed."""
        struct.pack_into("<I", self._mapping, OFF_FK_DONE, seq)
        self.ring()

    def close(self) -> None:
        del self._grant


class DeskPort:
    """The shim's side of a region's lease request words (the Python reference of
    gl_post_lease_request in shim/src/wire.c): post a request, with the usage report of the
    lease that ended, and ring the GPU's doorbell; the lease arrives in the lease words."""

    def __init__(self, mapping: mmap.mmap, doorbell_fd: int) -> None:
        self._mapping = mapping
        self._doorbell = doorbell_fd

    def post(
        self,
        report_lease_id: int = 0,
        gpu_time_ns: int = 0,
        longest_burst_ns: int = 0,
        release: bool = False,
        flags: int | None = None,
        allocated_bytes: int = 0,
    ) -> int:
        """Post a request (a report when `report_lease_id` is set); returns its sequence
        number. `flags` overrides the flags word (tests write garbage with it)."""
        if flags is None:
            flags = 0
            if report_lease_id:
                flags = LeaseRequestFlag.REPORT | (LeaseRequestFlag.RELEASE if release else 0)
        # Word by word in gl_post_lease_request's order, the sequence number last.
        for offset, value in (
            (OFF_LR_LEASE, report_lease_id), (OFF_LR_GPU_NS, gpu_time_ns),
            (OFF_LR_BURST_NS, longest_burst_ns), (OFF_LR_ALLOCATED, allocated_bytes),
        ):  # fmt: skip
            store_word(self._mapping, offset, value)
        store_word(self._mapping, OFF_LR_FLAGS, int(flags), 4)
        store_word(self._mapping, OFF_LR_POST_NS, time.monotonic_ns())
        seq = (struct.unpack_from("<I", self._mapping, OFF_LR_SEQ)[0] + 1) & 0xFFFFFFFF
        store_word(self._mapping, OFF_LR_SEQ, seq, 4)
        os.eventfd_write(self._doorbell, 1)
        return seq

    def close(self) -> None:
        os.close(self._doorbell)
