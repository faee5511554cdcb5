"""MIG planning: FAR (Villarrubia et al., JPDC 2025), its baselines, and the data they share.

Pure code: tasks and a GPU geometry (gpuloom.domain.mig_geometry) in, a Plan out.
`get_planner(name)` finds a policy.
"""

from gpuloom.policies.mig.lower_bound import area_lower_bound
from gpuloom.policies.mig.plan import (
    Assignment,
    InvalidPlanError,
    InvalidTaskError,
    MigPlanner,
    MigTask,
    Plan,
    PlanningError,
    Reconfiguration,
    verify_plan,
)
from gpuloom.policies.mig.registry import PLANNERS, get_planner
from gpuloom.policies.registry import UnknownPolicyError

__all__ = [
    "PLANNERS",
    "Assignment",
    "InvalidPlanError",
    "InvalidTaskError",
    "MigPlanner",
    "MigTask",
    "Plan",
    "PlanningError",
    "Reconfiguration",
    "UnknownPolicyError",
    "area_lower_bound",
    "get_planner",
    "verify_plan",
]
