"""Where kernel measurement batches from shims go.

Forwarding them to the profiler service is not built yet (the profiler issue builds it): until
then the dispatcher keeps the latest records per assignment in a bounded buffer, so nothing a
shim sends is refused, and it says so in its log the first time.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import structlog

from gpuloom.v1 import shim_pb2

log = structlog.get_logger("gpuloom.dispatcher.measurements")


class MeasurementBuffer:
    def __init__(self, max_records_per_assignment: int = 100_000) -> None:
        self._max = max_records_per_assignment
        self._lock = threading.Lock()
        self._records: dict[str, collections.deque[shim_pb2.KernelRecord]] = {}
        self._warned = False

    def __call__(self, assignment_id: str, records: Sequence[shim_pb2.KernelRecord]) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "no profiler configured: measurement batches are buffered, not forwarded",
                assignment=assignment_id,
            )
        with self._lock:
            buffer = self._records.setdefault(assignment_id, collections.deque(maxlen=self._max))
            buffer.extend(records)

    def take(self, assignment_id: str) -> list[shim_pb2.KernelRecord]:
        with self._lock:
            return list(self._records.pop(assignment_id, ()))
