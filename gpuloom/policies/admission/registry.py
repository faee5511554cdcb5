"""Kernel-admission policies by name. `composed` is the default (the dispatcher's and the
simulator's); `fikit`, `token`, `fifo` and `sharing` are the baselines it is measured against
(the simulator's `exclusive`, each task alone, is a run, not a policy)."""

from __future__ import annotations

from gpuloom.policies.admission.composed import ComposedAdmission
from gpuloom.policies.admission.fikit_only import FikitAdmission
from gpuloom.policies.admission.model import KernelAdmission
from gpuloom.policies.admission.sharing import SharingAdmission
from gpuloom.policies.admission.tokens_only import TokenAdmission
from gpuloom.policies.fikit.core import FikitConfig
from gpuloom.policies.harvest import create_harvest_policy
from gpuloom.policies.registry import Registry
from gpuloom.policies.tokens import TokenConfig

DEFAULT_ADMISSION = "composed"


def make_admission(
    name: str,
    fikit: FikitConfig | None = None,
    tokens: TokenConfig | None = None,
    token_policy: str = "spatiotemporal",
    harvest: str = "spatial",
) -> KernelAdmission:
    """A new policy called `name` with these knobs (each policy takes the ones it uses)."""
    factories = {
        "composed": lambda: ComposedAdmission(
            fikit, tokens, token_policy, harvest=create_harvest_policy(harvest)
        ),
        "fikit": lambda: FikitAdmission(fikit),
        "token": lambda: TokenAdmission(token_policy, tokens, "held", "token"),
        "fifo": lambda: TokenAdmission("fifo", tokens, "held", "fifo"),
        "sharing": SharingAdmission,
    }
    return Registry("admission", factories).create(name)


ADMISSION_POLICIES = ("composed", "fikit", "token", "fifo", "sharing")
