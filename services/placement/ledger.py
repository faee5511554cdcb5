"""The narrow interface through which MIG batches work on placement's live jobs.

`JobLedger` is all `MigBatches` may do with the jobs: read one, note a fresher pending reason,
record new revisions (written, then published to watchers), finish a few, and end one its run
reported over; under the ledger's lock, the one writer of fleet and database at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from gpuloom.domain.placement import JobState
from gpuloom.services.placement.domain import Job


class JobLedger(Protocol):
    @property
    def lock(self) -> asyncio.Lock:
        """Held while fleet, jobs or database change."""
        ...

    def now(self) -> float: ...

    def job(self, job_id: str) -> Job | None:
        """The live job (pending or holding capacity), None once it has finished."""
        ...

    def followed(self, job_id: str) -> bool:
        """Whether anyone follows the job (a WatchJob stream is open): its runner waits so."""
        ...

    def set_pending_reason(self, job_id: str, reason: str) -> None:
        """A pending job's fresher reason, kept in memory only (under the lock)."""
        ...

    async def record(self, jobs: Sequence[Job]) -> None:
        """Write new revisions of live jobs, then keep and publish them (under the lock)."""
        ...

    async def finish(self, jobs: Sequence[Job], state: JobState, message: str) -> None:
        """End these live jobs at once, written (under the lock)."""
        ...

    async def end_reported(self, job_id: str, state: JobState, message: str, exit_code: int) -> Job:
        """End a job its run reported over, with the next decision batch (not under the
        lock). Raises a DomainError when the job has ended meanwhile."""
        ...
