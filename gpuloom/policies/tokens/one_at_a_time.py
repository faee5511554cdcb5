"""One client at a time, longest-waiting first, quotas and SM partitions ignored: the
"exclusive" and "fifo" baselines, which differ only in how long a lease lasts.

- exclusive (`sliced=False`): an open-ended lease, kept until the client releases it or is
  removed, as with a GPU assigned to one job;
- fifo (`sliced=True`): a lease of `fifo_slice_s`; when it ends the client must ask again and
  so goes to the back of the line, which is round robin among busy clients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpuloom.policies.tokens.model import ClientView, SchedulerView


@dataclass(frozen=True, slots=True)
class OneAtATimePolicy:
    name: str
    sliced: bool

    def order(self, view: SchedulerView) -> list[ClientView]:
        return list(view.waiting)

    def select(self, view: SchedulerView) -> Sequence[tuple[str, float]]:
        if view.holders:
            return ()
        for client in view.waiting:
            lease_s = view.config.fifo_slice_s if self.sliced else math.inf
            return ((client.client_id, lease_s),)
        return ()
