"""Token scheduling for one GPU's dispatcher: Gemini-style time leases, FaST-GShare's
spatio-temporal multi-token policy, and the exclusive and FIFO baselines.

Pure code: the live dispatcher and the simulator drive `TokenScheduler` with an injected clock.
`get_policy(name)` finds a policy.
"""

from gpuloom.policies.registry import UnknownPolicyError
from gpuloom.policies.tokens.model import (
    EPSILON_S,
    ClientShare,
    ClientState,
    ClientView,
    Decision,
    Lease,
    SchedulerView,
    TokenConfig,
    TokenPolicy,
)
from gpuloom.policies.tokens.registry import DEFAULT_POLICY, POLICIES, get_policy
from gpuloom.policies.tokens.scheduler import (
    ClientSnapshot,
    SchedulerSnapshot,
    StandingTerms,
    TokenScheduler,
)

__all__ = [
    "DEFAULT_POLICY",
    "EPSILON_S",
    "POLICIES",
    "ClientShare",
    "ClientSnapshot",
    "ClientState",
    "ClientView",
    "Decision",
    "Lease",
    "SchedulerSnapshot",
    "SchedulerView",
    "StandingTerms",
    "TokenConfig",
    "TokenPolicy",
    "TokenScheduler",
    "UnknownPolicyError",
    "get_policy",
]
