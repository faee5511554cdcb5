"""Refusals on the shim socket, logged at a bounded rate per local user (peer uid), so that one
user reconnecting in a loop with a bad token cannot fill the disk with warnings: a token bucket
per uid (BURST lines at once, then one every 1 / PER_S seconds); a refusal past it is counted,
not logged, and the next line logged for that user says how many were left out. Every refusal
is counted in the metrics either way. Pure: the caller passes the clock."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BURST = 5
PER_S = 0.2  # one line every 5 s per user after the burst
MAX_USERS = 4096  # users remembered (the least recently refused are forgotten first)


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float
    left_out: int = 0


class RefusalLog:
    def __init__(
        self, burst: int = BURST, per_s: float = PER_S, max_users: int = MAX_USERS
    ) -> None:
        self._burst = burst
        self._per_s = per_s
        self._max_users = max_users
        self._buckets: OrderedDict[int, _Bucket] = OrderedDict()

    def admit(self, uid: int, now: float) -> int | None:
        """Whether a refusal of `uid` at `now` may be logged: if so, how many of its refusals
        were left out since its last logged one (to say with it); None: leave this one out."""
        bucket = self._buckets.pop(uid, None)
        if bucket is None:
            bucket = _Bucket(float(self._burst), now)
        bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.at) * self._per_s)
        bucket.at = now
        self._buckets[uid] = bucket  # the most recently refused last
        while len(self._buckets) > self._max_users:
            self._buckets.popitem(last=False)
        if bucket.tokens < 1.0:
            bucket.left_out += 1
            return None
        bucket.tokens -= 1.0
        left_out, bucket.left_out = bucket.left_out, 0
        return left_out
