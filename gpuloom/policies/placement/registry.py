"""Placement policies by name: "mra" (the default), "binpack", "spread", "time-share",
"gap-aware"."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from gpuloom.policies.placement.binpack import BinPackPolicy, SpreadPolicy
from gpuloom.policies.placement.gap_aware import GapAwarePolicy
from gpuloom.policies.placement.model import PlacementPolicy
from gpuloom.policies.placement.mra import MraPolicy
from gpuloom.policies.placement.timeshare import TimeSharePolicy

DEFAULT_POLICY = "mra"


class UnknownPlacementPolicyError(ValueError):
    """No placement policy has that name."""


POLICIES: Mapping[str, Callable[[], PlacementPolicy]] = MappingProxyType(
    {
        "mra": MraPolicy,
        "binpack": BinPackPolicy,
        "spread": SpreadPolicy,
        "time-share": TimeSharePolicy,
        "gap-aware": GapAwarePolicy,
    }
)


def get_policy(name: str) -> PlacementPolicy:
    """A new policy called `name` (surrounding blanks ignored). "gap-aware" starts without
    profiles: give them with its set_profile."""
    make = POLICIES.get(name.strip()) if isinstance(name, str) else None
    if make is None:
        known = ", ".join(sorted(POLICIES))
        raise UnknownPlacementPolicyError(f"unknown placement policy {name!r}; known: {known}")
    return make()
