"""Domain forms of the resource shapes in common.proto, with their validation and defaults.

Every service that takes a job's resources (dispatcher, placement) validates them here, so the
rules are written once: SM percent 1..100, 0 < quota request <= quota limit <= 100, priority
0..9 (0 highest), MIG sizes 1/2/3/4/7 slices. `Share` is what a job asks of each GPU it runs
on, in one form from the client to the dispatcher's reservation; `share_of` is the one place
its defaults are applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuloom.domain.errors import InvalidArgument

MIG_SLICE_SIZES = (1, 2, 3, 4, 7)
LOWEST_PRIORITY = 9


@dataclass(frozen=True, slots=True)
class TimeQuota:
    """Shares of the dispatcher's scheduling window, in percent."""

    request_percent: float
    limit_percent: float

    def validate(self, field: str) -> None:
        for name, value in (
            ("request_percent", self.request_percent),
            ("limit_percent", self.limit_percent),
        ):
            if not (math.isfinite(value) and 0 < value <= 100):
                raise InvalidArgument(f"{field}.{name}", f"must be in (0, 100], got {value}")
        if self.request_percent > self.limit_percent:
            raise InvalidArgument(
                f"{field}.request_percent",
                f"must not exceed limit_percent ({self.request_percent} > {self.limit_percent})",
            )


@dataclass(frozen=True, slots=True)
class SpatioTemporalShare:
    """An MPS SM partition plus a time quota (FaST-GShare)."""

    sm_percent: int
    quota: TimeQuota

    def validate(self, field: str) -> None:
        if not 1 <= self.sm_percent <= 100:
            raise InvalidArgument(
                f"{field}.sm_percent", f"must be within 1..100, got {self.sm_percent}"
            )
        self.quota.validate(f"{field}.quota")


# What a request that names no priority gets, everywhere (placement's SubmitJob, the
# dispatcher's Reserve, the CLI, job files): the middle, so that an unmarked job does not go
# ahead of the ones marked important.
DEFAULT_PRIORITY = 5
WHOLE_QUOTA = TimeQuota(100.0, 100.0)


@dataclass(frozen=True, slots=True)
class Share:
    """What a job holds of one GPU and how it ranks there: an SM percent and a time quota
    (100 and 100 % for a whole GPU), a GPU memory cap (0: all of the GPU's memory) and a
    priority (0 highest). The one form of a job's resources from the client (the CLI, a job
    file, the client library) through placement to the dispatcher's reservation; made by
    `share_of` wherever something was left unsaid."""

    sm_percent: int
    quota: TimeQuota
    memory_bytes: int
    priority: int

    @property
    def partition(self) -> SpatioTemporalShare:
        """Its SM percent and time quota: common.proto's SpatioTemporalShare."""
        return SpatioTemporalShare(self.sm_percent, self.quota)

    @property
    def whole(self) -> bool:
        """All of the GPU's SMs and time window (the memory cap aside)."""
        return self.sm_percent == 100 and self.quota == WHOLE_QUOTA


def share_of(
    sm_percent: int | None = None,
    quota_request_percent: float | None = None,
    quota_limit_percent: float | None = None,
    memory_bytes: int = 0,
    priority: int | None = None,
) -> Share:
    """A share from what was asked, each default applied here and nowhere else: SM percent and
    quota request 100 (the whole GPU) where not given, the quota limit the request where not
    given (no more than it is guaranteed), the priority DEFAULT_PRIORITY where not given.
    Unvalidated: the caller validates, naming its own fields."""
    request = 100.0 if quota_request_percent is None else quota_request_percent
    return Share(
        sm_percent=100 if sm_percent is None else sm_percent,
        quota=TimeQuota(request, request if quota_limit_percent is None else quota_limit_percent),
        memory_bytes=memory_bytes,
        priority=DEFAULT_PRIORITY if priority is None else priority,
    )


def validate_priority(field: str, level: int) -> None:
    if not 0 <= level <= LOWEST_PRIORITY:
        raise InvalidArgument(
            field, f"must be within 0..{LOWEST_PRIORITY} (0 is highest), got {level}"
        )


def validate_mig_slices(field: str, slices: int) -> None:
    if slices not in MIG_SLICE_SIZES:
        sizes = ", ".join(map(str, MIG_SLICE_SIZES))
        raise InvalidArgument(field, f"must be one of {sizes} slices, got {slices}")
