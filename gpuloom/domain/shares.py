"""Domain forms of the resource shapes in common.proto, with their validation.

Every service that takes a job's resources (dispatcher, placement) validates them here, so the
rules are written once: SM percent 1..100, 0 < quota request <= quota limit <= 100, priority
0..9 (0 highest), MIG sizes 1/2/3/4/7 slices.
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


def validate_priority(field: str, level: int) -> None:
    if not 0 <= level <= LOWEST_PRIORITY:
        raise InvalidArgument(
            field, f"must be within 0..{LOWEST_PRIORITY} (0 is highest), got {level}"
        )


def validate_mig_slices(field: str, slices: int) -> None:
    if slices not in MIG_SLICE_SIZES:
        sizes = ", ".join(map(str, MIG_SLICE_SIZES))
        raise InvalidArgument(field, f"must be one of {sizes} slices, got {slices}")
