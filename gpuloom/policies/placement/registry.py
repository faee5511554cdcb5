"""Placement policies by name: "mra" (the default), "binpack", "spread", "time-share",
"gap-aware"."""

from __future__ import annotations

from gpuloom.policies.placement.binpack import BinPackPolicy
from gpuloom.policies.placement.fleet import PlacementPolicy
from gpuloom.policies.placement.gap_aware import GapAwarePolicy
from gpuloom.policies.placement.mra import MraPolicy
from gpuloom.policies.placement.spread import SpreadPolicy
from gpuloom.policies.placement.timeshare import TimeSharePolicy
from gpuloom.policies.registry import Registry

DEFAULT_POLICY = "mra"

POLICIES: Registry[PlacementPolicy] = Registry(
    "placement",
    {
        "mra": MraPolicy,
        "binpack": BinPackPolicy,
        "spread": SpreadPolicy,
        "time-share": TimeSharePolicy,
        "gap-aware": GapAwarePolicy,
    },
)


def get_policy(name: str) -> PlacementPolicy:
    """A new policy called `name` (surrounding blanks ignored)."""
    return POLICIES.create(name)
