"""Training-job schedulers by name: "fifo" (exclusive GPUs, arrival order), "gandiva"
("gandiva:HEIGHT": at most HEIGHT jobs time-sliced on one set of GPUs, default 8) and
"gandiva-gs" (gandiva with grow-shrink)."""

from __future__ import annotations

from gpuloom.policies.registry import Registry
from gpuloom.policies.training.fifo import FifoPolicy
from gpuloom.policies.training.gandiva import MAX_HEIGHT_LIMIT, GandivaPolicy
from gpuloom.policies.training.model import TrainingPolicy


def _gandiva(argument: str | None) -> TrainingPolicy:
    if argument is None:
        return GandivaPolicy()
    try:
        height = int(argument)
    except ValueError:
        height = 0
    if not 1 <= height <= MAX_HEIGHT_LIMIT:
        raise ValueError(f"HEIGHT must be an integer from 1 to {MAX_HEIGHT_LIMIT}")
    return GandivaPolicy(height)


POLICIES: Registry[TrainingPolicy] = Registry(
    "training",
    {"fifo": FifoPolicy, "gandiva-gs": lambda: GandivaPolicy(grow_shrink=True)},
    with_argument={"gandiva": _gandiva},
    arguments={"gandiva": "HEIGHT"},
)


def get_policy(name: str) -> TrainingPolicy:
    """A new training policy called `name` (one per run: a policy may learn as it goes)."""
    return POLICIES.create(name)
