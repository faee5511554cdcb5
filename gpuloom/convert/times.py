"""Instants on the wire: `google.protobuf.Timestamp` (RFC 3339 in the JSON mapping, as grpcurl
and `gpuloom ... --json` print it), unix seconds (a float) in the domain types, 0 meaning
"never" (the field left unset). Microsecond precision: a message's time goes through a float
and back unchanged."""

from __future__ import annotations

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from gpuloom.domain.errors import InvalidArgument

MICROS = 1_000_000


def timestamp(unix_s: float) -> Timestamp | None:
    """The Timestamp of `unix_s`; None (leave the field unset) for 0."""
    if not unix_s:
        return None
    stamp = Timestamp()
    stamp.FromMicroseconds(round(unix_s * MICROS))
    return stamp


def unix_s(message: Message, field: str) -> float:
    """`message.field` in unix seconds; 0.0 when it is unset. InvalidArgument (naming the
    field) for a Timestamp out of its range: nanos outside 0..999,999,999, or seconds outside
    years 1..9999."""
    if not message.HasField(field):
        return 0.0
    stamp: Timestamp = getattr(message, field)
    try:
        return stamp.ToMicroseconds() / MICROS
    except ValueError:
        raise InvalidArgument(
            field, f"not a valid timestamp (seconds {stamp.seconds}, nanos {stamp.nanos})"
        ) from None
