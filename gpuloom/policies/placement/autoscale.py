"""FaST-GShare's heuristic auto-scaling (Gu et al., ICPP 2023, section 3.4.1, Algorithm 1).

A function's throughput profile gives requests/s for (SM %, quota %) configurations. The
gap between the target rate and what the replicas serve, dRPS = target - sum(T_i), decides:

- dRPS > 0, scale up: n = floor(dRPS / T_eff) replicas of the most efficient configuration
  p_eff (highest RPR), then, for the remainder r = dRPS - n * T_eff, one replica of the
  smallest configuration whose throughput covers r (p_ideal). The paper picks the p_ideal
  with the least excess throughput, argmin (T_p - r); the smallest resource is what the paper
  calls "the minimum but sufficient resources", and the two agree on profiles where more
  resource never serves less. Ties: least excess, then fewer SMs.
- dRPS < 0, scale down: replicas leave least efficient first (lowest RPR, then id) as long as
  the rest still serve the target; one too large to remove is skipped and the walk goes on
  (the paper's loop stops there and would spin). Capacity after the plan never drops below the
  target, a target of 0 removes every replica, and capacity after the plan grows with the target.

RPR (requests per resource) = T / (S * Q), with S the SM percent and Q the quota percent: the
resource is FaST-GShare's "secondCores" area of the configuration's rectangle, in percent x
percent (a whole GPU is 10,000). Pure and deterministic: the same input gives the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpuloom.policies.placement.model import InvalidRequestError, quota_steps

# A gap within this share of the rates is no gap: scaling up never adds a replica for a
# rounding error.
RELATIVE_TOLERANCE = 1e-9
# Removing a replica may leave this share of the capacity less than the target: float sums of
# the rates are off by about that much, and a zero target must remove every replica.
REMOVAL_TOLERANCE = 1e-12


def _check_config(what: str, sm: object, quota: object) -> None:
    if not isinstance(sm, int) or isinstance(sm, bool) or not 1 <= sm <= 100:
        raise InvalidRequestError(f"{what}: sm_percent must be an integer in 1..100, got {sm!r}")
    if isinstance(quota, bool) or not isinstance(quota, int | float) or not 0 < quota <= 100:
        raise InvalidRequestError(f"{what}: quota_percent must lie in (0, 100], got {quota!r}")


def _check_rate(what: str, rate: object) -> float:
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate < math.inf:
        raise InvalidRequestError(f"{what}: requests_per_s must be finite and >= 0, got {rate!r}")
    return float(rate)


@dataclass(frozen=True, slots=True)
class ThroughputPoint:
    """One profiled configuration (the profile store's ThroughputPoint)."""

    sm_percent: int
    quota_percent: float
    requests_per_s: float

    @property
    def resource(self) -> float:
        return self.sm_percent * self.quota_percent

    @property
    def rpr(self) -> float:
        return self.requests_per_s / self.resource

    def validate(self) -> None:
        what = f"point ({self.sm_percent}% SM, {self.quota_percent}% quota)"
        _check_config(what, self.sm_percent, self.quota_percent)
        _check_rate(what, self.requests_per_s)


@dataclass(frozen=True, slots=True)
class Replica:
    """A running replica; its throughput is the profile's at its configuration unless given."""

    replica_id: str
    sm_percent: int
    quota_percent: float
    requests_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class ScalingPlan:
    add: tuple[ThroughputPoint, ...]  # configurations of new replicas, p_eff ones first
    remove: tuple[str, ...]  # replica ids, least efficient first
    gap_rps: float  # dRPS: target minus what the replicas serve now
    capacity_rps: float  # what the replicas serve once the plan is carried out


def _rated(
    replicas: Iterable[Replica], table: dict[tuple[int, int], float]
) -> list[tuple[float, str, float]]:
    """(RPR, id, requests/s) per replica."""
    rated = []
    seen: set[str] = set()
    for replica in replicas:
        what = f"replica {replica.replica_id!r}"
        if not isinstance(replica.replica_id, str) or not replica.replica_id:
            raise InvalidRequestError(f"{what}: replica_id must be a non-empty string")
        if replica.replica_id in seen:
            raise InvalidRequestError(f"{what} appears twice")
        seen.add(replica.replica_id)
        _check_config(what, replica.sm_percent, replica.quota_percent)
        rate = replica.requests_per_s
        if rate is None:
            rate = table.get((replica.sm_percent, quota_steps(replica.quota_percent)))
            if rate is None:
                raise InvalidRequestError(
                    f"{what}: its configuration ({replica.sm_percent}% SM, "
                    f"{replica.quota_percent}% quota) is not in the profile; give its "
                    "requests_per_s"
                )
        rate = _check_rate(what, rate)
        rated.append(
            (rate / (replica.sm_percent * replica.quota_percent), replica.replica_id, rate)
        )
    return rated


def plan_scaling(
    profile: Sequence[ThroughputPoint], replicas: Sequence[Replica], target_rps: float
) -> ScalingPlan:
    """Algorithm 1 for one function: which configurations to add or replicas to remove so the
    replicas serve `target_rps`."""
    target = _check_rate("target", target_rps)
    for point in profile:
        point.validate()
    table = {(p.sm_percent, quota_steps(p.quota_percent)): p.requests_per_s for p in profile}
    rated = _rated(replicas, table)
    capacity = math.fsum(rate for _, _, rate in rated)
    gap = target - capacity
    tolerance = RELATIVE_TOLERANCE * max(1.0, target, capacity)
    if gap > tolerance:
        add = _scale_up(profile, gap, tolerance)
        return ScalingPlan(add, (), gap, capacity + math.fsum(p.requests_per_s for p in add))
    if gap < -tolerance:
        surplus = -gap
        slack = REMOVAL_TOLERANCE * max(1.0, capacity)
        remove: list[str] = []
        kept: list[float] = []
        for _, replica_id, rate in sorted(rated):
            if rate <= surplus + slack:
                remove.append(replica_id)
                surplus -= rate
            else:
                kept.append(rate)
        return ScalingPlan((), tuple(remove), gap, math.fsum(kept))
    return ScalingPlan((), (), gap, capacity)


def _scale_up(
    profile: Sequence[ThroughputPoint], gap: float, tolerance: float
) -> tuple[ThroughputPoint, ...]:
    serving = [p for p in profile if p.requests_per_s > 0]
    if not serving:
        raise InvalidRequestError("the profile has no configuration that serves requests")
    # Highest RPR; ties: more requests/s (fewer replicas), then fewer SMs, then less quota.
    efficient = min(
        serving, key=lambda p: (-p.rpr, -p.requests_per_s, p.sm_percent, p.quota_percent)
    )
    n = math.floor(gap / efficient.requests_per_s)
    rest = gap - n * efficient.requests_per_s
    if efficient.requests_per_s - rest <= tolerance:
        n, rest = n + 1, 0.0  # the remainder is p_eff's throughput but for rounding
    add = [efficient] * n
    if rest > tolerance:
        covering = [p for p in serving if p.requests_per_s >= rest - tolerance]
        ideal = min(
            covering,
            key=lambda p: (p.resource, p.requests_per_s, p.sm_percent, p.quota_percent),
        )
        add.append(ideal)
    return tuple(add)
