"""MIG planners by name: "far", "far-paper", "fixpart-best", "fixpart:4,2,1", "miso"."""

from __future__ import annotations

from gpuloom.policies.mig.far import FarOptions, FarPlanner
from gpuloom.policies.mig.fixpart import FixPartPlanner, parse_sizes
from gpuloom.policies.mig.fixpart_best import FixPartBestPlanner
from gpuloom.policies.mig.miso import MisoPlanner
from gpuloom.policies.mig.plan import MigPlanner
from gpuloom.policies.registry import Registry


def _fixpart(argument: str | None) -> MigPlanner:
    if not argument:
        raise ValueError("fixpart needs instance sizes, e.g. fixpart:4,2,1")
    return FixPartPlanner(parse_sizes(argument))


PLANNERS: Registry[MigPlanner] = Registry(
    "MIG",
    {
        "far": FarPlanner,
        "far-paper": lambda: FarPlanner(FarOptions.paper(), name="far-paper"),
        "fixpart-best": FixPartBestPlanner,
        "miso": MisoPlanner,
    },
    with_argument={"fixpart": _fixpart},
    arguments={"fixpart": "SIZES"},
)


def get_planner(spec: str) -> MigPlanner:
    """The planner for "name" or "name:argument"."""
    return PLANNERS.create(spec)
