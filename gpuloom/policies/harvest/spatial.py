"""Spatial harvesting (Orion's rule, across processes under MPS): may a lower-priority kernel
run now, beside the kernel the holder has on the GPU, rather than wait for the holder's gaps?

Yes only if all of these hold (docs/harvest.md, "The rule"):

1. A higher-priority kernel is running (the holder's; with none, time admission decides).
2. SMs: the SMs the running kernels ask for plus the candidate's (its launch shape, capped by
   its MPS SM partition) stay within `sm_limit` of the GPU's SMs, so the holder's kernel keeps
   every SM it asked for.
3. Profiles: the candidate's bound class differs from every running higher-priority kernel's
   (compute beside memory); an unknown class passes only with `allow_unknown`. And the holder's
   predicted slowdown, `1 + (F - 1) * SMs the lower-priority kernels hold / SMs` with F the
   estimated interference factor of the pair of classes (`other_factor`, `unknown_factor`: the
   simulator's calibrated defaults), stays within `max_holder_slowdown`.
4. Time: the candidate, after the work queued ahead of it on its own stream, is predicted to
   end (its duration alone times `stretch`, for the slowdown beside the holder) before the
   holder is predicted to launch again (its running kernel's predicted end plus the gap after
   it), so it never sits on SMs the holder's next kernel wants. A kernel never measured has no
   prediction and waits.
5. Quota: the candidate's predicted duration fits what is left of its quota limit, if it has
   one.

Pure: dataclasses in, a bool out; the caller supplies `now` and the GPU's SMs. The default
admission policy (gpuloom.policies.admission.composed) asks it for a request it has queued
behind the holders.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gpuloom.policies.registry import Registry


@dataclass(frozen=True, slots=True)
class Running:
    """A kernel on the GPU now."""

    priority: int
    demand: int  # SMs it asked for
    profile: str  # compute, memory or unknown


@dataclass(frozen=True, slots=True)
class Candidate:
    """The lower-priority kernel that asks to run."""

    priority: int
    demand: int
    profile: str
    duration_ns: int | None  # predicted alone (None: never measured)
    queued_ns: int = 0  # predicted work ahead of it on its own stream
    quota_left_ns: int | None = None  # None: no quota limit


@dataclass(frozen=True, slots=True)
class HarvestConfig:
    sm_limit: float = 1.0  # share of the SMs the running kernels and the candidate may ask for
    allow_unknown: bool = True
    stretch: float = 1.3  # predicted slowdown of a harvested kernel beside the holder's
    max_holder_slowdown: float = 1.03  # of the holder's running kernel, predicted
    other_factor: float = 1.5  # estimated interference, compute beside memory
    unknown_factor: float = 2.0  # estimated interference, a class unknown

    def __post_init__(self) -> None:
        if not 0 < self.sm_limit <= 1:
            raise ValueError(f"sm_limit must be in (0, 1], got {self.sm_limit}")
        for name in ("stretch", "max_holder_slowdown", "other_factor", "unknown_factor"):
            value = getattr(self, name)
            if not 1 <= value <= 100:
                raise ValueError(f"{name} must be 1..100, got {value}")


class HarvestPolicy(Protocol):
    name: str

    def admit(
        self,
        now_ns: int,
        candidate: Candidate,
        running: Sequence[Running],
        holder_next_launch_ns: int | None,
        sms: int,
    ) -> bool: ...


class SpatialHarvest:
    """The rule above."""

    name = "spatial"

    def __init__(self, config: HarvestConfig | None = None) -> None:
        self.config = config or HarvestConfig()

    def admit(
        self,
        now_ns: int,
        candidate: Candidate,
        running: Sequence[Running],
        holder_next_launch_ns: int | None,
        sms: int,
    ) -> bool:
        c = self.config
        holders = [r for r in running if r.priority < candidate.priority]
        if not holders or holder_next_launch_ns is None or candidate.duration_ns is None:
            return False
        if sum(r.demand for r in running) + candidate.demand > c.sm_limit * sms:
            return False
        factor = 1.0
        for r in holders:
            if "unknown" in (r.profile, candidate.profile):
                if not c.allow_unknown:
                    return False
                factor = max(factor, c.unknown_factor)
            elif r.profile == candidate.profile:
                return False
            else:
                factor = max(factor, c.other_factor)
        beside = candidate.demand + sum(r.demand for r in running if r not in holders)
        if 1 + (factor - 1) * beside / sms > c.max_holder_slowdown:
            return False
        end = now_ns + candidate.queued_ns + candidate.duration_ns * c.stretch
        if end > holder_next_launch_ns:
            return False
        left = candidate.quota_left_ns
        return left is None or candidate.duration_ns <= left


class NoHarvest:
    """Lower-priority kernels run only where time admission lets them."""

    name = "off"

    def admit(
        self,
        now_ns: int,
        candidate: Candidate,
        running: Sequence[Running],
        holder_next_launch_ns: int | None,
        sms: int,
    ) -> bool:
        return False


HARVEST_POLICIES: Registry[HarvestPolicy] = Registry(
    "harvest", {"spatial": SpatialHarvest, "off": NoHarvest}
)


def create_harvest_policy(name: str, config: HarvestConfig | None = None) -> HarvestPolicy:
    policy = HARVEST_POLICIES.create(name)
    if config is not None and isinstance(policy, SpatialHarvest):
        policy.config = config
    return policy
