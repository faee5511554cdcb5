"""The reservations of one GPU: admission control, idempotency and persistence.

A reservation is what placement bought on this GPU for one process. The book refuses to
over-commit: the memory caps together fit in the GPU's memory and the guaranteed time quotas
(requests) together fit in the window. Reservations of one time-slice group (Gandiva: a
training job placed on a full GPU takes turns with the ones there, placement suspending and
resuming them) run one at a time, so the group takes one SM x quota rectangle, its largest
member's; each member's memory counts, unless the book takes memory in turns
(`memory_in_turns`: the dispatcher moves a suspended client's device memory to host memory
through the driver's checkpoint API), where a group holds its largest member's memory. It is
written to a JSON file on every change (atomic
rename), so a restarted dispatcher still knows every reservation and which process holds it.
The file holds every token, so it is 0600 in a 0700 directory.
Both the gRPC side and the shim channel thread use the book, hence the lock.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import structlog

from gpuloom import private_files
from gpuloom.domain.errors import (
    AlreadyExists,
    DomainError,
    FailedPrecondition,
    ResourceExhausted,
)
from gpuloom.domain.shares import Share, TimeQuota
from gpuloom.services.dispatcher.domain import (
    BoundProcess,
    Reservation,
    ReserveSpec,
    new_token,
)
from gpuloom.shimwire import ShimMode

log = structlog.get_logger("gpuloom.dispatcher.reservations")

FILE_VERSION = 1
MAX_RESERVATIONS = 1024
# Float sums of percentages: allow rounding noise, not real over-commitment.
_QUOTA_EPSILON = 1e-9
FULL_AREA = 100 * 100  # SM percent x quota percent of the whole GPU


class ReservationBook:
    def __init__(self, gpu_memory_bytes: int, path: Path | None) -> None:
        self._gpu_memory_bytes = gpu_memory_bytes
        self._path = path
        self._lock = threading.Lock()
        self._by_id: dict[str, Reservation] = {}
        self._by_token: dict[str, str] = {}
        # Device memory the GPU's model store holds (shared weights): charged once, here, and
        # not persisted (the store's process and its memory do not outlive the dispatcher).
        self._store_bytes = 0
        # A time-slice group's members take their memory in turns (set once the dispatcher
        # knows its driver checkpoints a suspended client's memory; docs/training.md).
        self.memory_in_turns = False
        if path is not None:
            private_files.private_directory(path.parent)
        if path is not None and path.exists():
            private_files.make_private(path)
            for reservation in _load(path):
                self._by_id[reservation.assignment_id] = reservation
                self._by_token[reservation.token] = reservation.assignment_id
            log.info("reservations restored", count=len(self._by_id), path=str(path))

    # -- queries --

    def all(self) -> list[Reservation]:
        with self._lock:
            return list(self._by_id.values())

    def get(self, assignment_id: str) -> Reservation | None:
        with self._lock:
            return self._by_id.get(assignment_id)

    def by_token(self, token: str) -> Reservation | None:
        with self._lock:
            assignment_id = self._by_token.get(token)
            return None if assignment_id is None else self._by_id[assignment_id]

    def memory_reserved_bytes(self) -> int:
        """The memory caps handed out plus what the model store holds."""
        with self._lock:
            return self._store_bytes + sum(self._memory_by_group_locked().values())

    def _memory_by_group_locked(self) -> dict[str, int]:
        """The memory each reservation (or time-slice group, taken in turns) holds."""
        held: dict[str, int] = {}
        for r in self._by_id.values():
            if self.memory_in_turns:
                held[r.group] = max(held.get(r.group, 0), r.memory_cap_bytes)
            else:
                held[r.assignment_id] = r.memory_cap_bytes
        return held

    def store_bytes(self) -> int:
        with self._lock:
            return self._store_bytes

    def quota_reserved_percent(self) -> float:
        """The guaranteed quotas (requests) of the SHARE reservations, each time-slice group
        counted once, at its largest member's (its members run one at a time)."""
        with self._lock:
            return sum(
                _by_group(self._by_id.values(), lambda r: r.share.quota.request_percent).values()
            )

    # -- changes --

    def reserve(self, spec: ReserveSpec) -> tuple[Reservation, bool]:
        """Admit `spec` (validated by the caller); returns (reservation, created)."""
        memory = spec.share.memory_bytes or self._gpu_memory_bytes
        with self._lock:
            existing = self._by_id.get(spec.assignment_id)
            if existing is not None:
                if existing.same_request(spec, memory):
                    return existing, False
                raise AlreadyExists(
                    f"assignment {spec.assignment_id!r} exists with a different request"
                )
            if spec.token and spec.token in self._by_token:
                raise AlreadyExists("assignment_token is already used by another assignment")
            if len(self._by_id) >= MAX_RESERVATIONS:
                raise ResourceExhausted(f"this GPU holds the maximum of {MAX_RESERVATIONS}")
            self._check_group_locked(spec)
            if memory > self._gpu_memory_bytes:
                raise ResourceExhausted(
                    f"memory_cap_bytes {memory} exceeds the GPU's {self._gpu_memory_bytes} bytes"
                )
            by_group = self._memory_by_group_locked()
            used_memory = self._store_bytes + sum(by_group.values())
            # Taken in turns, a member needs only what its group does not hold already.
            held = by_group.get(spec.time_slice_of, 0) if self.memory_in_turns else 0
            if used_memory - held + max(held, memory) > self._gpu_memory_bytes:
                in_group = (
                    f" beyond its time-slice group's {held} bytes (memory taken in turns)"
                    if held
                    else ""
                )
                raise ResourceExhausted(
                    f"not enough GPU memory: {self._gpu_memory_bytes - used_memory} bytes free, "
                    f"{memory} asked{in_group}"
                )
            if spec.mode is ShimMode.SHARE:
                # FaST-GShare's rectangle: each share takes SM % x quota % of the GPU, and
                # shares on disjoint SMs may run at the same time, so the areas must fit. A
                # time-slice group's members take turns: the group counts once, at its
                # largest member's area.
                areas = _by_group(self._by_id.values(), _area)
                used = sum(areas.values())
                asked = _area(spec)
                group = spec.time_slice_of or spec.assignment_id
                held = areas.get(group, 0.0)
                if used - held + max(held, asked) > FULL_AREA * (1 + _QUOTA_EPSILON):
                    in_group = (
                        f"; its time-slice group {group!r} holds {held / 100:.3g}% already"
                        if spec.time_slice_of
                        else ""
                    )
                    raise ResourceExhausted(
                        f"GPU over-committed: {100 - used / 100:.3g}% of its (SM x time quota) "
                        f"area is free, {asked / 100:.3g}% asked "
                        f"({spec.share.sm_percent}% SM x "
                        f"{spec.share.quota.request_percent:g}% quota){in_group}"
                    )
            reservation = Reservation(
                assignment_id=spec.assignment_id,
                client_name=spec.client_name,
                share=dataclasses.replace(spec.share, memory_bytes=memory),
                mode=spec.mode,
                token=spec.token or new_token(),
                reserved_at_unix_s=time.time(),
                task_key=spec.task_key,
                time_slice_of=spec.time_slice_of,
            )
            self._by_id[reservation.assignment_id] = reservation
            self._by_token[reservation.token] = reservation.assignment_id
            self._save_locked()
            return reservation, True

    def _check_group_locked(self, spec: ReserveSpec) -> None:
        """A member joins a group that is on this GPU; a reservation of its own may not take an
        id that is still the key of a group (its members' area would swallow its own)."""
        group = spec.time_slice_of
        if group and not any(r.group == group for r in self._by_id.values()):
            joined = self._by_id.get(group)
            where = (
                f"; it is a member of group {joined.group!r}, which is the one to name"
                if joined is not None
                else ""
            )
            raise FailedPrecondition(
                f"time_slice_of {group!r}: no time-slice group of that id on this GPU, "
                f"nothing to time-slice with{where}"
            )
        members = [r.assignment_id for r in self._by_id.values() if r.group == spec.assignment_id]
        if members:
            raise FailedPrecondition(
                f"assignment_id {spec.assignment_id!r} is the key of a time-slice group still "
                f"held by {', '.join(sorted(members))}; choose another id"
            )

    def charge_store(self, nbytes: int) -> None:
        """Charge the model store for `nbytes` of shared weights, if they fit beside the
        reservations (ResourceExhausted otherwise, nothing charged)."""
        with self._lock:
            used = self._store_bytes + sum(self._memory_by_group_locked().values())
            if used + nbytes > self._gpu_memory_bytes:
                raise ResourceExhausted(
                    f"not enough GPU memory for the model: {self._gpu_memory_bytes - used} "
                    f"bytes free, {nbytes} needed"
                )
            self._store_bytes += nbytes

    def uncharge_store(self, nbytes: int) -> None:
        with self._lock:
            self._store_bytes = max(0, self._store_bytes - nbytes)

    def release(self, assignment_id: str) -> Reservation | None:
        with self._lock:
            reservation = self._by_id.pop(assignment_id, None)
            if reservation is None:
                return None
            del self._by_token[reservation.token]
            self._save_locked()
            return reservation

    def bind(
        self,
        assignment_id: str,
        process: BoundProcess,
        alive: Callable[[BoundProcess], bool] = lambda _: True,
    ) -> Reservation:
        """Bind the token to its first process; the same process again is fine, any other is
        refused (FailedPrecondition), so one process cannot spend another's quota. Once the
        bound process has exited (`alive` says whether it still runs), a process of the same
        user may take the reservation over: the job started again where it was."""
        with self._lock:
            reservation = self._by_id.get(assignment_id)
            if reservation is None:
                raise FailedPrecondition("the assignment was released")
            if reservation.bound is not None:
                bound = reservation.bound
                if (bound.pid, bound.start_ticks) == (process.pid, process.start_ticks):
                    return reservation
                if bound.uid != process.uid or alive(bound):
                    raise FailedPrecondition(
                        f"assignment token already used by pid {bound.pid}; tokens are one-time"
                        " (after that process exits, only a process of the same user may take"
                        " it over)"
                    )
            reservation = dataclasses.replace(reservation, bound=process)
            self._by_id[assignment_id] = reservation
            self._save_locked()
            return reservation

    def _save_locked(self) -> None:
        if self._path is None:
            return
        document = {
            "version": FILE_VERSION,
            "reservations": [_to_json(r) for r in self._by_id.values()],
        }
        private_files.write_private(self._path, json.dumps(document))


def _area(share_holder: Reservation | ReserveSpec) -> float:
    """Its (SM percent x quota request percent) rectangle."""
    return share_holder.share.sm_percent * share_holder.share.quota.request_percent


def _by_group(
    reservations: Iterable[Reservation], measure: Callable[[Reservation], float]
) -> dict[str, float]:
    """Time-slice group -> the largest `measure` among its SHARE members (the others take no
    part of the GPU's rectangle)."""
    largest: dict[str, float] = {}
    for r in reservations:
        if r.mode is ShimMode.SHARE:
            largest[r.group] = max(largest.get(r.group, 0.0), measure(r))
    return largest


def _to_json(reservation: Reservation) -> dict[str, Any]:
    """The file's form of a reservation (FILE_VERSION 1): the share's memory cap and priority
    sit beside it, as in the Reserve request."""
    share = reservation.share
    bound = reservation.bound
    return {
        "assignment_id": reservation.assignment_id,
        "client_name": reservation.client_name,
        "priority": share.priority,
        "memory_cap_bytes": share.memory_bytes,
        "share": {
            "sm_percent": share.sm_percent,
            "quota": {
                "request_percent": share.quota.request_percent,
                "limit_percent": share.quota.limit_percent,
            },
        },
        "mode": reservation.mode.name,
        "token": reservation.token,
        "reserved_at_unix_s": reservation.reserved_at_unix_s,
        "bound": None if bound is None else dataclasses.asdict(bound),
        "task_key": reservation.task_key,
        "time_slice_of": reservation.time_slice_of,
    }


def _load(path: Path) -> list[Reservation]:
    """Read the reservations file; a damaged file stops the dispatcher instead of silently
    forgetting what placement paid for."""
    try:
        document = json.loads(path.read_text())
        if document.get("version") != FILE_VERSION:
            raise ValueError(f"unknown version {document.get('version')!r}")
        reservations = []
        for item in document["reservations"]:
            quota = item["share"]["quota"]
            spec = ReserveSpec(
                assignment_id=item["assignment_id"],
                client_name=item["client_name"],
                share=Share(
                    int(item["share"]["sm_percent"]),
                    TimeQuota(float(quota["request_percent"]), float(quota["limit_percent"])),
                    int(item["memory_cap_bytes"]),
                    int(item["priority"]),
                ),
                mode=ShimMode[item["mode"]],
                token=item["token"],
                task_key=item.get("task_key", ""),
                time_slice_of=item.get("time_slice_of", ""),
            )
            spec.validate()
            bound = item["bound"]
            reservations.append(
                Reservation(
                    assignment_id=spec.assignment_id,
                    client_name=spec.client_name,
                    share=spec.share,
                    mode=spec.mode,
                    token=spec.token,
                    reserved_at_unix_s=float(item["reserved_at_unix_s"]),
                    bound=None if bound is None else BoundProcess(**bound),
                    task_key=spec.task_key,
                    time_slice_of=spec.time_slice_of,
                )
            )
        return reservations
    except (OSError, ValueError, KeyError, TypeError, DomainError) as error:
        raise RuntimeError(f"cannot read the reservations file {path}: {error}") from None
