"""FIKIT alone (priority across levels, kernel by kernel; quotas and SM partitions ignored):
each launch is a request to the native decision core (`gpuloom.policies.fikit`), each kernel
end a completion; grants and the wake time come from its decide. The `fikit` baseline."""

from __future__ import annotations

from collections.abc import Sequence

from gpuloom.policies.admission.model import Kernel, TaskShare
from gpuloom.policies.fikit.core import UNKNOWN, FikitConfig, FikitCore


def _known(value: int | None) -> int:
    return UNKNOWN if value is None else value


class FikitAdmission:
    name = "fikit"
    delayed_grants = True  # a granted filler wakes, then launches (the live futex wake)

    def __init__(self, config: FikitConfig | None = None) -> None:
        self.core = FikitCore(config)
        self._waiting: set[int] = set()

    def add_task(self, task: int, share: TaskShare, now_ns: int) -> None:
        share.validate()
        if not self.core.add_task(task, share.priority, now_ns):
            raise ValueError(f"the FIKIT core refused task {task}")

    def launch(self, task: int, kernel: Kernel, now_ns: int) -> bool:
        verdict = self.core.request(
            task, _known(kernel.duration_ns), _known(kernel.gap_after_ns), now_ns
        )
        if verdict == 1:
            return True
        if verdict < 0:
            raise ValueError(f"the FIKIT core refused a request of task {task}")
        self._waiting.add(task)
        return False

    def completed(self, task: int, device_ns: int, now_ns: int) -> None:
        self.core.completed(task, 1, now_ns)

    def idle(self, task: int, now_ns: int) -> None:
        return None

    def decide(self, now_ns: int) -> tuple[Sequence[int], int | None]:
        grants: list[int] = []
        while True:
            granted, wake = self.core.decide(now_ns)
            for task in granted:
                if task in self._waiting:
                    self._waiting.discard(task)
                    grants.append(task)
            if wake is None or wake > now_ns:
                return grants, wake

    def counters(self) -> dict[str, int]:
        counters = self.core.counters()
        return {name: getattr(counters, name) for name in counters.__slots__}
