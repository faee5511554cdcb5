"""Spatial harvesting: lower-priority kernels admitted beside the holder's under MPS
(docs/harvest.md). A pure policy: dataclasses in, a decision out."""

from gpuloom.policies.harvest.spatial import (
    HARVEST_POLICIES,
    Candidate,
    HarvestConfig,
    HarvestPolicy,
    Running,
    SpatialHarvest,
    create_harvest_policy,
)

__all__ = [
    "HARVEST_POLICIES",
    "Candidate",
    "HarvestConfig",
    "HarvestPolicy",
    "Running",
    "SpatialHarvest",
    "create_harvest_policy",
]
