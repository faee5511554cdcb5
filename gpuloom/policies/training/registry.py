"""Training-job schedulers by name: "fifo" (exclusive GPUs, arrival order) and "gandiva"."""

from __future__ import annotations

from gpuloom.policies.registry import Registry
from gpuloom.policies.training.fifo import FifoPolicy
from gpuloom.policies.training.gandiva import GandivaPolicy
from gpuloom.policies.training.model import TrainingPolicy

POLICIES: Registry[TrainingPolicy] = Registry(
    "training", {"fifo": FifoPolicy, "gandiva": GandivaPolicy}
)


def get_policy(name: str) -> TrainingPolicy:
    """A new training policy called `name` (one per run: a policy may learn as it goes)."""
    return POLICIES.create(name)
