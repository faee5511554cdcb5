"""FaST-GShare's multi-token scheduler (Gu et al., section 3.3.2), with Gemini's lease lengths.

Filtering: a waiting client with no quota left this window (Q_remain = Q_limit - Q_used <= 0)
is blocked. The rest are served by missing quota (Q_miss = Q_request - Q_used), largest first,
while the SM percent they hold together stays within the global limit; the first one that does
not fit stops the walk (head of line), so a client with a large partition is not starved by a
stream of small ones. Clients already past their request (Q_miss <= 0) but under their limit
sort behind everyone else and run only on SMs the others leave free: the elastic share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heapify, heappop

from gpuloom.policies.tokens.model import EPSILON_S, ClientView, SchedulerView


def _ready(view: SchedulerView) -> list[tuple[float, float, str, ClientView]]:
    # Decorated tuples compare in C: (-missing, request time, id); ids are unique, so the
    # client objects themselves are never compared.
    return [
        (c.used_s - c.request_s, c.requested_at, c.client_id, c)
        for c in view.waiting
        if c.limit_s - c.used_s > EPSILON_S
    ]


@dataclass(frozen=True, slots=True)
class SpatioTemporalPolicy:
    name: str = "spatiotemporal"

    def order(self, view: SchedulerView) -> list[ClientView]:
        ready = _ready(view)
        ready.sort()
        return [entry[-1] for entry in ready]

    def select(self, view: SchedulerView) -> Sequence[tuple[str, float]]:
        free = view.config.sm_global_limit - view.running_sm
        if free <= 0:
            return ()
        ready = _ready(view)
        heapify(ready)
        grants: list[tuple[str, float]] = []
        while ready:
            client = ready[0][-1]
            if client.sm_percent > free:
                break
            heappop(ready)
            free -= client.sm_percent
            remaining = client.limit_s - client.used_s
            q = client.q_s
            grants.append((client.client_id, q if q < remaining else remaining))
        return grants
