"""Placement policies by name: "mra", "binpack", "spread", "time-share", "gap-aware", and the
trace simulator's fleet policies placing live jobs through one adapter (fleet_model.py):
"random", "bestfit", "dotprod", "gpupacking", "gpuclustering", "fgd", "fgd-pack", "fgd-fates"
and "best" (our strongest, an alias, and the default for jobs that name no policy)."""

from __future__ import annotations

from functools import partial

from gpuloom.policies.fleet.registry import POLICIES as FLEET_POLICIES
from gpuloom.policies.placement.binpack import BinPackPolicy
from gpuloom.policies.placement.fleet import PlacementPolicy
from gpuloom.policies.placement.fleet_model import FleetModelPolicy
from gpuloom.policies.placement.gap_aware import GapAwarePolicy
from gpuloom.policies.placement.mra import MraPolicy
from gpuloom.policies.placement.spread import SpreadPolicy
from gpuloom.policies.placement.timeshare import TimeSharePolicy
from gpuloom.policies.registry import Registry

DEFAULT_POLICY = "best"

POLICIES: Registry[PlacementPolicy] = Registry(
    "placement",
    {
        "mra": MraPolicy,
        "binpack": BinPackPolicy,
        "spread": SpreadPolicy,
        "time-share": TimeSharePolicy,
        "gap-aware": GapAwarePolicy,
        **{name: partial(FleetModelPolicy, name) for name in FLEET_POLICIES},
    },
)
# The policies that place only with the fleet model's view (whole GPUs and shares as milli).
FLEET_MODEL_POLICIES = frozenset(FLEET_POLICIES)


def get_policy(name: str) -> PlacementPolicy:
    """A new policy called `name` (surrounding blanks ignored)."""
    return POLICIES.create(name)
