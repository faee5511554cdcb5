"""Time leases alone (quotas and SM partitions; priority ignored): a host launches only while
it holds a lease of the token scheduler; kernels already queued run on after the lease ends.
The `token` (FaST-GShare's spatio-temporal policy with Gemini's leases) and `fifo` baselines."""

from __future__ import annotations

from collections.abc import Sequence

from gpuloom.policies.admission.leases import Charge, Leases
from gpuloom.policies.admission.model import Kernel, TaskShare
from gpuloom.policies.tokens import TokenConfig


class TokenAdmission:
    delayed_grants = False

    def __init__(
        self,
        policy: str = "spatiotemporal",
        config: TokenConfig | None = None,
        charge: Charge = "held",
        name: str = "token",
    ) -> None:
        self.name = name
        self.leases = Leases(policy, config or TokenConfig(), charge)

    def add_task(self, task: int, share: TaskShare, now_ns: int) -> None:
        share.validate()
        self.leases.add(task, share.sm_percent, share.quota_request, share.quota_limit, now_ns)

    def launch(self, task: int, kernel: Kernel, now_ns: int) -> bool:
        return self.leases.want(task, now_ns)

    def completed(self, task: int, device_ns: int, now_ns: int) -> None:
        self.leases.completed(task, device_ns)

    def idle(self, task: int, now_ns: int) -> None:
        self.leases.idle(task, now_ns)

    def decide(self, now_ns: int) -> tuple[Sequence[int], int | None]:
        self.leases.advance(now_ns)
        return list(self.leases.take_granted()), self.leases.wake(now_ns)

    def counters(self) -> dict[str, int]:
        return {}
