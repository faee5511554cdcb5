"""Training-job schedulers by name: "fifo" (exclusive GPUs, arrival order), "gandiva"
("gandiva:HEIGHT": at most HEIGHT jobs time-sliced on one set of GPUs, default 8) and
"gandiva-gs" (gandiva with grow-shrink). Gandiva's rules of time are its arguments
(`GandivaKnobs`), given to `get_policy`."""

from __future__ import annotations

from gpuloom.policies.registry import Registry
from gpuloom.policies.training.fifo import FifoPolicy
from gpuloom.policies.training.gandiva import MAX_HEIGHT_LIMIT, GandivaKnobs, GandivaPolicy
from gpuloom.policies.training.model import TrainingPolicy


def _height(argument: str | None) -> int | None:
    if argument is None:
        return None
    try:
        height = int(argument)
    except ValueError:
        height = 0
    if not 1 <= height <= MAX_HEIGHT_LIMIT:
        raise ValueError(f"HEIGHT must be an integer from 1 to {MAX_HEIGHT_LIMIT}")
    return height


def _registry(knobs: GandivaKnobs) -> Registry[TrainingPolicy]:
    def gandiva(argument: str | None) -> TrainingPolicy:
        height = _height(argument)
        if height is None:
            return GandivaPolicy.with_knobs(knobs)
        return GandivaPolicy.with_knobs(knobs, max_height=height)

    return Registry(
        "training",
        {
            "fifo": FifoPolicy,
            "gandiva-gs": lambda: GandivaPolicy.with_knobs(knobs, grow_shrink=True),
        },
        with_argument={"gandiva": gandiva},
        arguments={"gandiva": "HEIGHT"},
    )


POLICIES: Registry[TrainingPolicy] = _registry(GandivaKnobs())


def get_policy(name: str, knobs: GandivaKnobs | None = None) -> TrainingPolicy:
    """A new training policy called `name` (one per run: a policy may learn as it goes);
    gandiva's with `knobs` (its defaults when None; fifo has none)."""
    return (POLICIES if knobs is None else _registry(knobs)).create(name)
