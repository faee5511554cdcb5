"""The shim channel of one GPU (docs/dispatcher.md, "The shim channel"): `server.py` (the
thread, epoll, frames, life cycle), `registration.py`, `suspension.py`, `engine.py` (leases and
the admission engine), `model.py` (limits, connections, constants)."""

from gpuloom.services.dispatcher.channel.model import (
    FIKIT_ARBITER_EVENTS,
    FIKIT_CORE_EVENTS,
    SAMPLE_POLL_S,
    SUSPEND_HOLD_S,
    SUSPEND_POLL_S,
    ChannelLimits,
    ConnectedProcess,
    ProtocolViolation,
)
from gpuloom.services.dispatcher.channel.server import ShimChannel

__all__ = [
    "FIKIT_ARBITER_EVENTS",
    "FIKIT_CORE_EVENTS",
    "SAMPLE_POLL_S",
    "SUSPEND_HOLD_S",
    "SUSPEND_POLL_S",
    "ChannelLimits",
    "ConnectedProcess",
    "ProtocolViolation",
    "ShimChannel",
]
