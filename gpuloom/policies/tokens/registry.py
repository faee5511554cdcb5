"""Token policies by name: "spatiotemporal" (the default), "exclusive", "fifo"."""

from __future__ import annotations

from functools import partial

from gpuloom.policies.registry import Registry
from gpuloom.policies.tokens.model import TokenPolicy
from gpuloom.policies.tokens.one_at_a_time import OneAtATimePolicy
from gpuloom.policies.tokens.spatiotemporal import SpatioTemporalPolicy

DEFAULT_POLICY = "spatiotemporal"

POLICIES: Registry[TokenPolicy] = Registry(
    "token",
    {
        "spatiotemporal": SpatioTemporalPolicy,
        "exclusive": partial(OneAtATimePolicy, "exclusive", sliced=False),
        "fifo": partial(OneAtATimePolicy, "fifo", sliced=True),
    },
)


def get_policy(name: str) -> TokenPolicy:
    """A new policy called `name` (surrounding blanks ignored)."""
    return POLICIES.create(name)
