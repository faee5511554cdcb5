"""Fleet placement policies by name (the trace simulator's family): the FGD paper's baselines
"random", "bestfit", "dotprod", "gpupacking", "gpuclustering", "fgd", and ours, "fgd-pack" and
"fgd-fates"; "best" is our strongest (an alias)."""

from __future__ import annotations

from gpuloom.policies.fleet.bestfit import BestFitPolicy
from gpuloom.policies.fleet.dotprod import DotProductPolicy
from gpuloom.policies.fleet.fgd import FgdPolicy
from gpuloom.policies.fleet.fgd_fates import FgdFatesPolicy
from gpuloom.policies.fleet.fgd_pack import FgdPackPolicy
from gpuloom.policies.fleet.gpuclustering import GpuClusteringPolicy
from gpuloom.policies.fleet.gpupacking import GpuPackingPolicy
from gpuloom.policies.fleet.gpupacking_tiers import GpuPackingTiersPolicy
from gpuloom.policies.fleet.model import FleetPolicy
from gpuloom.policies.fleet.random_fit import RandomPolicy
from gpuloom.policies.registry import Registry

POLICIES: Registry[FleetPolicy] = Registry(
    "fleet placement",
    {
        "random": RandomPolicy,
        "bestfit": BestFitPolicy,
        "dotprod": DotProductPolicy,
        "gpupacking": GpuPackingPolicy,
        "gpupacking-tiers": GpuPackingTiersPolicy,
        "gpuclustering": GpuClusteringPolicy,
        "fgd": FgdPolicy,
        "fgd-pack": FgdPackPolicy,
        "fgd-fates": FgdFatesPolicy,
        "best": FgdFatesPolicy,
    },
)


def get_policy(name: str) -> FleetPolicy:
    """A new fleet policy called `name`."""
    return POLICIES.create(name)
