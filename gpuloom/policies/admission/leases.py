"""Time leases for a set of tasks from one token scheduler (`gpuloom.policies.tokens`), kept
the way a shim keeps them: a task that wants to launch and holds no lease asks for one; a lease
that ends while its task still has work is asked for again; a lease granted to a task that has
gone idle is handed back unused. Shared by the token baseline and the composed policy.

Charging (`charge`): "held" reports a lease's time held (the whole lease when it expires, the
time until release when the task goes idle); "device" reports the device time of the task's
kernels that completed since its last report, which is what a shim measures (docs/fikit.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from gpuloom.policies.tokens import ClientShare, Decision, TokenConfig, TokenScheduler

NS = 1_000_000_000
Charge = Literal["held", "device"]


@dataclass(slots=True)
class _State:
    lease_id: int | None = None
    granted_at: float = 0.0
    asked: bool = False  # a request is with the scheduler
    busy: bool = False  # has work (since launch, until idle)
    wanting: bool = False  # a launch waits for a lease
    device_ns: int = 0  # device time of completed kernels
    charged_ns: int = 0  # of which reported


class Leases:
    def __init__(self, policy: str, config: TokenConfig, charge: Charge) -> None:
        self.scheduler = TokenScheduler(policy, config, 0.0)
        self.charge = charge
        self._tasks: dict[int, _State] = {}
        self.granted: list[int] = []  # tasks whose wanted lease came, in grant order

    def add(self, task: int, sm_percent: int, request: float, limit: float, now_ns: int) -> None:
        share = ClientShare.of(str(task), sm_percent, request, limit)
        self.scheduler.add_client(share, now_ns / NS)
        self._tasks[task] = _State()

    def holds(self, task: int) -> bool:
        return self._tasks[task].lease_id is not None

    def want(self, task: int, now_ns: int) -> bool:
        """The task wants to launch: True if it holds a lease (maybe just granted)."""
        state = self._tasks[task]
        state.busy = True
        if state.lease_id is not None:
            return True
        state.wanting = True
        if not state.asked:
            state.asked = True
            self._apply(self.scheduler.request(str(task), now_ns / NS), now_ns)
        if state.lease_id is not None:
            self.granted.remove(task)
            return True
        return False

    def completed(self, task: int, device_ns: int) -> None:
        self._tasks[task].device_ns += device_ns

    def idle(self, task: int, now_ns: int) -> None:
        state = self._tasks[task]
        state.busy = False
        if state.lease_id is None:
            return
        lease, state.lease_id = state.lease_id, None
        used = self._used(state, now_ns, None)
        self._apply(self.scheduler.release(str(task), lease, used, None, now_ns / NS), now_ns)

    def advance(self, now_ns: int) -> None:
        deadline = self.scheduler.next_deadline()
        if deadline is None:
            return
        seconds = now_ns / NS
        # A timer is rounded up to whole ns: never advance to before the deadline it is for.
        if deadline <= (now_ns + 1) / NS:
            seconds = max(seconds, min(deadline, (now_ns + 1) / NS))
        self._apply(self.scheduler.advance(seconds), now_ns)

    def wake(self, now_ns: int) -> int | None:
        deadline = self.scheduler.next_deadline()
        return None if deadline is None else max(now_ns, math.ceil(deadline * NS))

    def _used(self, state: _State, now_ns: int, length_s: float | None) -> float:
        if self.charge == "device":
            used, state.charged_ns = state.device_ns - state.charged_ns, state.device_ns
            return used / NS
        if length_s is not None:
            return length_s
        return max(0.0, now_ns / NS - state.granted_at)

    def _apply(self, decision: Decision, now_ns: int) -> None:
        pending: list[Decision] = [decision]
        while pending:
            d = pending.pop(0)
            for lease in d.ended:
                task = int(lease.client_id)
                state = self._tasks[task]
                if state.lease_id != lease.lease_id:
                    continue
                state.lease_id = None
                used = self._used(state, now_ns, lease.length_s)
                self.scheduler.report_usage(
                    lease.client_id, lease.lease_id, used, None, now_ns / NS
                )
                if state.busy:  # still has work: back in line
                    state.asked = True
                    pending.append(self.scheduler.request(lease.client_id, now_ns / NS))
            for lease in d.granted:
                task = int(lease.client_id)
                state = self._tasks[task]
                state.asked = False
                if not state.busy:
                    release = self.scheduler.release
                    pending.append(release(lease.client_id, lease.lease_id, 0.0, None, now_ns / NS))
                    continue
                state.lease_id = lease.lease_id
                state.granted_at = lease.granted_at
                if state.wanting:
                    state.wanting = False
                    self.granted.append(task)

    def take_granted(self) -> Iterable[int]:
        granted, self.granted = self.granted, []
        return granted
