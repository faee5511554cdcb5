"""A job's share to and from the messages that carry it.

common.proto's SpatioTemporalShare is the SM percent and time quota (`share_to_pb`,
`share_from_pb`); a reservation's messages (the dispatcher's ReserveRequest and Assignment,
placement's DispatcherReservation) carry a whole `Share` in three fields of their own:
`priority`, `memory_cap_bytes` and `share` (`reservation_share_fields`, `reservation_share`).
Protobuf's unset fields (no priority, a quota limit of 0) are read as "not given", and
gpuloom.domain.shares.share_of fills them in."""

from __future__ import annotations

from typing import Any

from gpuloom.domain.shares import Share, SpatioTemporalShare, TimeQuota, share_of
from gpuloom.v1 import common_pb2, dispatcher_pb2, placement_pb2

ReservationMessage = (
    dispatcher_pb2.ReserveRequest | dispatcher_pb2.Assignment | placement_pb2.DispatcherReservation
)


def share_to_pb(share: SpatioTemporalShare | Share) -> common_pb2.SpatioTemporalShare:
    """The SM percent and time quota of a share."""
    return common_pb2.SpatioTemporalShare(
        sm_percent=share.sm_percent,
        quota=common_pb2.TimeQuota(
            request_percent=share.quota.request_percent, limit_percent=share.quota.limit_percent
        ),
    )


def share_from_pb(msg: common_pb2.SpatioTemporalShare) -> SpatioTemporalShare:
    """As sent, unvalidated: the caller validates, naming its own field."""
    return SpatioTemporalShare(
        msg.sm_percent, TimeQuota(msg.quota.request_percent, msg.quota.limit_percent)
    )


def priority_from_pb(msg: Any) -> int | None:
    """The level of a message's `priority` field; None when it is unset (the default's)."""
    return msg.priority.level if msg.HasField("priority") else None


def reservation_share_fields(share: Share) -> dict[str, Any]:
    """A reservation message's fields for `share`: `Message(**reservation_share_fields(s))`."""
    return {
        "priority": common_pb2.Priority(level=share.priority),
        "memory_cap_bytes": share.memory_bytes,
        "share": share_to_pb(share),
    }


def reservation_share(msg: ReservationMessage) -> Share:
    """The share a reservation message carries, its unset fields defaulted, unvalidated."""
    quota = msg.share.quota
    return share_of(
        msg.share.sm_percent,
        quota.request_percent,
        quota.limit_percent or None,
        msg.memory_cap_bytes,
        priority_from_pb(msg),
    )
