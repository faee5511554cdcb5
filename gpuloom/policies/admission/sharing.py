"""No admission: every host launches freely into the one device queue (NVIDIA's default time
sharing). The simulator's `sharing` baseline."""

from __future__ import annotations

from collections.abc import Sequence

from gpuloom.policies.admission.model import Kernel, TaskShare


class SharingAdmission:
    name = "sharing"
    delayed_grants = False

    def add_task(self, task: int, share: TaskShare, now_ns: int) -> None:
        share.validate()

    def launch(self, task: int, kernel: Kernel, now_ns: int) -> bool:
        return True

    def completed(self, task: int, device_ns: int, now_ns: int) -> None:
        return None

    def idle(self, task: int, now_ns: int) -> None:
        return None

    def decide(self, now_ns: int) -> tuple[Sequence[int], int | None]:
        return (), None

    def counters(self) -> dict[str, int]:
        return {}
