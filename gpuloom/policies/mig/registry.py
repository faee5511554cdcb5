"""MIG planners by name: "far", "far-paper", "fixpart-best", "fixpart:4,2,1", "miso"."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from gpuloom.policies.mig.far import FarOptions, FarPlanner
from gpuloom.policies.mig.fixpart import FixPartPlanner, parse_sizes
from gpuloom.policies.mig.fixpart_best import FixPartBestPlanner
from gpuloom.policies.mig.miso import MisoPlanner
from gpuloom.policies.mig.plan import MigPlanner


class UnknownPolicyError(ValueError):
    """No planner has that name, or its argument is malformed."""


def _no_argument(make: Callable[[], MigPlanner]) -> Callable[[str | None], MigPlanner]:
    def build(argument: str | None) -> MigPlanner:
        if argument is not None:
            raise UnknownPolicyError("this policy takes no ':' argument")
        return make()

    return build


def _fixpart(argument: str | None) -> MigPlanner:
    if not argument:
        raise UnknownPolicyError("fixpart needs instance sizes, e.g. fixpart:4,2,1")
    try:
        return FixPartPlanner(parse_sizes(argument))
    except ValueError as error:
        raise UnknownPolicyError(str(error)) from None


PLANNERS: Mapping[str, Callable[[str | None], MigPlanner]] = MappingProxyType(
    {
        "far": _no_argument(FarPlanner),
        "far-paper": _no_argument(lambda: FarPlanner(FarOptions.paper(), name="far-paper")),
        "fixpart": _fixpart,
        "fixpart-best": _no_argument(FixPartBestPlanner),
        "miso": _no_argument(MisoPlanner),
    }
)


def get_planner(spec: str) -> MigPlanner:
    """The planner for "name" or "name:argument"."""
    name, colon, argument = spec.strip().partition(":")
    build = PLANNERS.get(name)
    if build is None:
        known = ", ".join(sorted(PLANNERS))
        raise UnknownPolicyError(f"unknown MIG policy {spec!r}; known: {known} (fixpart:SIZES)")
    try:
        return build(argument if colon else None)
    except UnknownPolicyError as error:
        raise UnknownPolicyError(f"policy {spec!r}: {error}") from None
