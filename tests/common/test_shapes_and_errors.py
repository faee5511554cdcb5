"""The shared resource shapes refuse what the contract forbids; the error table is complete."""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuloom.convert.status import STATUS_BY_ERROR, error_from_rpc, status_for
from gpuloom.domain import errors
from gpuloom.domain.shares import (
    SpatioTemporalShare,
    TimeQuota,
    validate_mig_slices,
    validate_priority,
)


@pytest.mark.parametrize(
    ("share", "field"),
    [
        (SpatioTemporalShare(0, TimeQuota(10, 20)), "share.sm_percent"),
        (SpatioTemporalShare(101, TimeQuota(10, 20)), "share.sm_percent"),
        (SpatioTemporalShare(50, TimeQuota(30, 20)), "share.quota.request_percent"),
        (SpatioTemporalShare(50, TimeQuota(0, 20)), "share.quota.request_percent"),
        (SpatioTemporalShare(50, TimeQuota(10, 120)), "share.quota.limit_percent"),
        (SpatioTemporalShare(50, TimeQuota(math.nan, 20)), "share.quota.request_percent"),
    ],
)
def test_bad_shares_name_the_field(share: SpatioTemporalShare, field: str) -> None:
    with pytest.raises(errors.InvalidArgument) as refused:
        share.validate("share")
    assert refused.value.field == field


@given(st.integers(1, 100), st.floats(0.01, 100), st.floats(0.01, 100))
def test_every_share_within_the_rules_is_accepted(sm: int, a: float, b: float) -> None:
    SpatioTemporalShare(sm, TimeQuota(min(a, b), max(a, b))).validate("share")


def test_priority_and_mig_sizes() -> None:
    for level in range(10):
        validate_priority("priority", level)
    with pytest.raises(errors.InvalidArgument, match="0 is highest"):
        validate_priority("priority", 10)
    with pytest.raises(errors.InvalidArgument, match="one of 1, 2, 3, 4, 7"):
        validate_mig_slices("mig.slices", 5)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize("error_type", sorted(STATUS_BY_ERROR, key=lambda t: t.__name__))
def test_error_table_round_trips(error_type: type[errors.DomainError]) -> None:
    error = (
        error_type("profile.key", "must not be empty")
        if error_type is errors.InvalidArgument
        else error_type("something went wrong")
    )
    back = error_from_rpc(FakeRpcError(status_for(error), error.message))
    assert type(back) is error_type and back.message == error.message


def test_an_unmapped_error_is_internal() -> None:
    class Surprise(errors.DomainError):
        pass

    assert status_for(Surprise("x")) is grpc.StatusCode.INTERNAL
    assert status_for(errors.NotFound("x")) is grpc.StatusCode.NOT_FOUND
