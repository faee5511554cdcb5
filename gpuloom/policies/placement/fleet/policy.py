"""What a placement policy is to the fleet: `PlacementPolicy`, and `GangPolicy` for one that also
chooses the GPUs of a job on several."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from gpuloom.policies.placement.context import PlacementContext
from gpuloom.policies.placement.model import (
    JobRequest,
    Placement,
    Unplaceable,
)

if TYPE_CHECKING:
    from gpuloom.policies.placement.fleet.core import Fleet


class PlacementPolicy(Protocol):
    """Chooses a GPU and a rectangle for one job. The fleet holds the free space of every GPU
    (incrementally, shared by all policies), so a policy keeps no per-GPU state and needs no
    release hook; `Fleet.place` commits what it returns. A policy chooses only a GPU the job
    may use: schedulable (the indexes hold only those), of its models, with its memory free,
    and on a node that takes it (`Fleet.offers`); the commit refuses any other. Whatever else
    a policy may know (kernel profiles) comes through `context`, the same lookups offered to
    every policy."""

    @property
    def name(self) -> str: ...

    def place(
        self, job: JobRequest, fleet: Fleet, context: PlacementContext
    ) -> Placement | Unplaceable:
        """Decide only: nothing changes until the fleet commits the placement."""
        ...


class GangPolicy(PlacementPolicy, Protocol):
    """A policy that also chooses the GPUs of a job spanning several (`job.gpus > 1`): the
    placement names them all (`extra_gpu_ids`), whole GPUs of one node."""

    def place_gang(
        self, job: JobRequest, fleet: Fleet, context: PlacementContext
    ) -> Placement | Unplaceable: ...
