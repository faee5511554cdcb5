"""Token policies by name: "spatiotemporal" (the default), "exclusive", "fifo"."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from gpuloom.policies.tokens.exclusive import ExclusivePolicy
from gpuloom.policies.tokens.fifo import FifoPolicy
from gpuloom.policies.tokens.model import TokenPolicy
from gpuloom.policies.tokens.spatiotemporal import SpatioTemporalPolicy

DEFAULT_POLICY = "spatiotemporal"


class UnknownTokenPolicyError(ValueError):
    """No token policy has that name."""


POLICIES: Mapping[str, Callable[[], TokenPolicy]] = MappingProxyType(
    {
        "spatiotemporal": SpatioTemporalPolicy,
        "exclusive": ExclusivePolicy,
        "fifo": FifoPolicy,
    }
)


def get_policy(name: str) -> TokenPolicy:
    """The policy called `name` (surrounding blanks ignored)."""
    make = POLICIES.get(name.strip()) if isinstance(name, str) else None
    if make is None:
        known = ", ".join(sorted(POLICIES))
        raise UnknownTokenPolicyError(f"unknown token policy {name!r}; known: {known}")
    return make()
