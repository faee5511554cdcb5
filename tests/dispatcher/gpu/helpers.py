"""Helpers of the GPU backend tests."""

from __future__ import annotations


class SleepRecorder:
    """Stands in for time.sleep: records the durations asked for and returns at once."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
