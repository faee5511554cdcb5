"""The fleet at a glance, for `gpuloom top`: every GPU placement knows (ListGpus), with what its
dispatcher says of it (GetGpuStatus), and the live jobs by state (ListJobs).

One `FleetView` asks placement, then every dispatcher at once (a thread each, up to
MAX_PARALLEL), with a short timeout per dispatcher: a dispatcher that does not answer leaves its
GPU's `status` empty and says why in `error`, without holding up the rest. The dispatcher
connections are kept between snapshots (the live view asks every second)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from gpuloom.clients.blocking import ClosedOnExit
from gpuloom.clients.dispatcher import DispatcherClient
from gpuloom.clients.placement import PlacementClient
from gpuloom.clients.times import rfc3339
from gpuloom.convert.dispatcher import status_json
from gpuloom.convert.placement import gpu_entry_json
from gpuloom.domain.dispatcher import DispatcherStatus
from gpuloom.domain.errors import DomainError
from gpuloom.domain.placement import GpuEntry, JobState

LIVE_STATES = (JobState.PENDING, JobState.BINDING, JobState.ASSIGNED)
MAX_PARALLEL = 16
DISPATCHER_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class GpuTop:
    entry: GpuEntry  # what placement knows
    status: DispatcherStatus | None  # what its dispatcher says; None: see `error`
    error: str = ""


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    placement: str  # the address asked
    taken_at: float  # unix seconds
    jobs: dict[JobState, int]  # live jobs by state (LIVE_STATES, each present)
    gpus: tuple[GpuTop, ...]  # in ListGpus's order (node, UUID)

    def to_json(self) -> dict[str, Any]:
        """One object: the protos' JSON mapping for each GPU's entry and status."""
        return {
            "placement": self.placement,
            "taken_at": rfc3339(self.taken_at, millis=True),
            "jobs": {state.value: self.jobs[state] for state in LIVE_STATES},
            "gpus": [
                {
                    "entry": gpu_entry_json(gpu.entry),
                    "status": None if gpu.status is None else status_json(gpu.status),
                    "error": gpu.error,
                }
                for gpu in self.gpus
            ],
        }


class FleetView(ClosedOnExit):
    """Takes snapshots of the fleet through `placement`; close() closes the dispatcher clients
    it opened (not `placement`)."""

    def __init__(
        self,
        placement: PlacementClient,
        dispatcher_timeout_s: float = DISPATCHER_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._placement = placement
        self._timeout_s = dispatcher_timeout_s
        self._clock = clock
        self._dispatchers: dict[str, DispatcherClient] = {}
        self._pool = ThreadPoolExecutor(MAX_PARALLEL, thread_name_prefix="gpuloom-top")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self._dispatchers.values():
            client.close()
        self._dispatchers.clear()

    def snapshot(self) -> FleetSnapshot:
        """Raises the placement client's domain errors (Unavailable when it cannot be
        reached); a dispatcher's failure is only noted on its GPU."""
        taken_at = self._clock()
        entries = list(self._placement.gpus())
        counts = Counter(job.state for job in self._placement.list(LIVE_STATES, page_size=1000))
        gpus = tuple(self._pool.map(self._ask, entries))
        return FleetSnapshot(
            placement=self._placement.address,
            taken_at=taken_at,
            jobs={state: counts[state] for state in LIVE_STATES},
            gpus=gpus,
        )

    def _ask(self, entry: GpuEntry) -> GpuTop:
        address = entry.dispatcher_address
        if not address:
            return GpuTop(entry, None, "no dispatcher address registered")
        client = self._dispatchers.get(address)
        if client is None:
            client = self._dispatchers[address] = DispatcherClient(address, self._timeout_s)
        try:
            status = client.status()
        except DomainError as error:
            return GpuTop(entry, None, f"dispatcher at {address}: {one_line(error.message)}")
        if status.gpu.gpu_uuid != entry.gpu.gpu_uuid:
            return GpuTop(
                entry,
                None,
                f"dispatcher at {address} now serves GPU {status.gpu.gpu_uuid}, not this one",
            )
        return GpuTop(entry, status)


def one_line(text: str) -> str:
    return " ".join(text.split())


def mig_layout(entry: GpuEntry) -> str:
    """'off', 'on, no instances', or the instances as SIZEg@FIRST_SLICE, by first slice."""
    gpu = entry.gpu
    if not gpu.mig_enabled:
        return "off" if gpu.mig_capable else "-"
    instances = sorted(gpu.mig_instances, key=lambda i: i.first_slice)
    if not instances:
        return "on, no instances"
    return " ".join(f"{i.slices}g@{i.first_slice}" for i in instances)
