"""What a placement policy may know besides the job and the fleet, offered to every policy
through one context (as the Kubernetes scheduler framework's plugins get `CycleState`).

The context only looks up data the caller has already loaded: policies stay pure, and the
service fetches profiles before it decides. `KernelProfiles` is the plain in-memory context the
service, the simulator and the tests fill.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from gpuloom.policies.placement.model import InvalidRequestError


@dataclass(frozen=True, slots=True)
class KernelTimes:
    """A task's kernel profile: the mean duration of each kernel of one run in launch order,
    and the mean idle gap after each (FIKIT's per-kernel-ID means); all in nanoseconds. A
    histogram works too: list each duration as often as it occurs."""

    task_key: str
    durations_ns: tuple[float, ...]
    gaps_ns: tuple[float, ...] = ()

    @property
    def run_ns(self) -> float:
        return math.fsum(self.durations_ns) + math.fsum(self.gaps_ns)

    def validate(self) -> None:
        """Raise InvalidRequestError unless the key is set and every time is finite, >= 0."""
        if not isinstance(self.task_key, str) or not self.task_key:
            raise InvalidRequestError(f"task_key must be a non-empty string: {self.task_key!r}")
        for name in ("durations_ns", "gaps_ns"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < math.inf
                for v in values
            ):
                raise InvalidRequestError(f"{name} must be a tuple of finite times >= 0")


class PlacementContext(Protocol):
    """Lookups every placement policy is offered; none does I/O."""

    def kernel_times(self, task_key: str) -> KernelTimes | None:
        """The task's kernel profile, None when it has none (or no task key)."""
        ...


class KernelProfiles:
    """A PlacementContext over kernel profiles held in memory, by task key (the latest set
    wins)."""

    def __init__(self, profiles: Iterable[KernelTimes] = ()) -> None:
        self._profiles: dict[str, KernelTimes] = {}
        for times in profiles:
            self.set_profile(times)

    @property
    def profiles(self) -> Mapping[str, KernelTimes]:
        return MappingProxyType(self._profiles)

    def set_profile(self, times: KernelTimes) -> None:
        times.validate()
        self._profiles[times.task_key] = times

    def forget_profile(self, task_key: str) -> None:
        self._profiles.pop(task_key, None)

    def kernel_times(self, task_key: str) -> KernelTimes | None:
        return self._profiles.get(task_key)


class _NoProfiles:
    """The context of a caller that has loaded nothing."""

    def kernel_times(self, task_key: str) -> KernelTimes | None:
        return None


NO_PROFILES: PlacementContext = _NoProfiles()
