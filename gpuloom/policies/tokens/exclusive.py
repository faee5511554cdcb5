"""Exclusive baseline: one client owns the GPU until it lets go.

Quotas and SM partitions are ignored. The client that has waited longest gets an open-ended
lease and keeps it until it releases it or is removed, as with a GPU assigned to one job.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpuloom.policies.tokens.model import ClientView, SchedulerView


@dataclass(frozen=True, slots=True)
class ExclusivePolicy:
    name: str = "exclusive"

    def order(self, view: SchedulerView) -> list[ClientView]:
        return list(view.waiting)

    def select(self, view: SchedulerView) -> Sequence[tuple[str, float]]:
        if view.holders:
            return ()
        for client in view.waiting:
            return ((client.client_id, math.inf),)
        return ()
