"""Placement of jobs on a fleet of shared GPUs: FaST-GShare's Maximal Rectangles algorithm
over each GPU's time-quota x SM rectangle, its auto-scaling heuristic, bin-packing, spreading
and time-sharing baselines, and a FIKIT gap-aware policy for low-priority jobs.

Pure code: the placement service and the simulator keep a `Fleet` (every GPU's allocations and
free rectangles, incrementally) and call `Fleet.place(job, policy, context)` and
`Fleet.release(id)` (and `Fleet.slice_into(job, gpu_id, group)` to time-slice a job with an
allocation already there); the context offers every policy the profiles the caller has loaded.
`get_policy(name)` finds a policy; `plan_scaling` is Algorithm 1.
"""

from gpuloom.policies.placement.autoscale import (
    Replica,
    ScalingPlan,
    ThroughputPoint,
    plan_scaling,
)
from gpuloom.policies.placement.binpack import BinPackPolicy
from gpuloom.policies.placement.context import (
    NO_PROFILES,
    KernelProfiles,
    KernelTimes,
    PlacementContext,
)
from gpuloom.policies.placement.fleet import (
    Fleet,
    GpuSlot,
    InvalidPlacementError,
    InvalidStateError,
    ModelIndex,
    PlacementPolicy,
)
from gpuloom.policies.placement.gap_aware import (
    MIN_GAP_NS,
    GapAwarePolicy,
    fill_rate,
    fillable_ns,
)
from gpuloom.policies.placement.model import (
    GRID_AREA,
    GRID_H,
    GRID_W,
    MIN_REPLICA_BYTES,
    QUOTA_STEPS_PER_PERCENT,
    Allocation,
    GpuState,
    InvalidRequestError,
    JobRequest,
    Placement,
    Rect,
    Unplaceable,
    quota_steps,
    replica_memory,
)
from gpuloom.policies.placement.mra import MraPolicy
from gpuloom.policies.placement.registry import DEFAULT_POLICY, POLICIES, get_policy
from gpuloom.policies.placement.spread import SpreadPolicy
from gpuloom.policies.placement.timeshare import TimeSharePolicy
from gpuloom.policies.registry import UnknownPolicyError

__all__ = [
    "DEFAULT_POLICY",
    "GRID_AREA",
    "GRID_H",
    "GRID_W",
    "MIN_GAP_NS",
    "MIN_REPLICA_BYTES",
    "NO_PROFILES",
    "POLICIES",
    "QUOTA_STEPS_PER_PERCENT",
    "Allocation",
    "BinPackPolicy",
    "Fleet",
    "GapAwarePolicy",
    "GpuSlot",
    "GpuState",
    "InvalidPlacementError",
    "InvalidRequestError",
    "InvalidStateError",
    "JobRequest",
    "KernelProfiles",
    "KernelTimes",
    "ModelIndex",
    "MraPolicy",
    "Placement",
    "PlacementContext",
    "PlacementPolicy",
    "Rect",
    "Replica",
    "ScalingPlan",
    "SpreadPolicy",
    "ThroughputPoint",
    "TimeSharePolicy",
    "UnknownPolicyError",
    "Unplaceable",
    "fill_rate",
    "fillable_ns",
    "get_policy",
    "plan_scaling",
    "quota_steps",
    "replica_memory",
]
