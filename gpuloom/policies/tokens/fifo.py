"""FIFO time-slicing baseline: one client at a time, fixed slices, quotas ignored.

The client that has waited longest gets a lease of `fifo_slice_s`; when it ends the client
must ask again and so goes to the back of the line, which is round robin among busy clients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpuloom.policies.tokens.model import ClientView, SchedulerView


@dataclass(frozen=True, slots=True)
class FifoPolicy:
    name: str = "fifo"

    def order(self, view: SchedulerView) -> list[ClientView]:
        return list(view.waiting)

    def select(self, view: SchedulerView) -> Sequence[tuple[str, float]]:
        if view.holders:
            return ()
        for client in view.waiting:
            return ((client.client_id, view.config.fifo_slice_s),)
        return ()
