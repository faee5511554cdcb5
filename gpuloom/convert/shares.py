"""A job's share (MPS SM percent and time quota) to and from common.proto's
SpatioTemporalShare: the one form placement and the dispatchers both send."""

from __future__ import annotations

from gpuloom.domain.shares import SpatioTemporalShare, TimeQuota
from gpuloom.v1 import common_pb2


def share_to_pb(share: SpatioTemporalShare) -> common_pb2.SpatioTemporalShare:
    return common_pb2.SpatioTemporalShare(
        sm_percent=share.sm_percent,
        quota=common_pb2.TimeQuota(
            request_percent=share.quota.request_percent, limit_percent=share.quota.limit_percent
        ),
    )


def share_from_pb(msg: common_pb2.SpatioTemporalShare) -> SpatioTemporalShare:
    """As sent, unvalidated: the caller validates (naming its own field) and decides what an
    unset limit means."""
    return SpatioTemporalShare(
        msg.sm_percent, TimeQuota(msg.quota.request_percent, msg.quota.limit_percent)
    )
