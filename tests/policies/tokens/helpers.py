"""Shared by the token scheduler tests: small constructors and a lease ledger."""

from __future__ import annotations

from gpuloom.policies.tokens import ClientShare, Decision, Lease, TokenConfig, TokenScheduler


def share(client_id: str, sm: int = 100, request: float = 0.2, limit: float | None = None):
    return ClientShare.of(client_id, sm, request, request if limit is None else limit)


def scheduler(
    policy: str = "spatiotemporal", *shares: ClientShare, now: float = 0.0, **config: float
) -> TokenScheduler:
    s = TokenScheduler(policy, TokenConfig(**config), now)
    for sh in shares:
        s.add_client(sh, now)
    return s


def only(leases: tuple[Lease, ...]) -> Lease:
    assert len(leases) == 1, leases
    return leases[0]


def holders(decisions: list[Decision]) -> dict[str, Lease]:
    """The leases open after these decisions, replayed in order."""
    open_: dict[str, Lease] = {}
    for d in decisions:
        for lease in d.ended:
            assert open_.pop(lease.client_id) == lease
        for lease in d.granted:
            assert lease.client_id not in open_
            open_[lease.client_id] = lease
    return open_
