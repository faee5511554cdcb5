"""Read-through caches for profile gets: Redis for real deployments, in-process for the embedded
default. Both keep entries ordered by profile version: an offer only replaces an older entry, so
a slow reader can never overwrite what a later write put there. A deletion is cached as a
versioned tombstone (payload None).

When Redis is unreachable the store keeps serving from the database: the cache reports misses,
logs the outage once, counts it, and retries after a pause. Writes made while it was unreachable
could leave stale entries behind, so the first successful contact afterwards flushes the cache.
A store just started cannot know what writes an earlier process made while Redis was unreachable
(a store that ran with Redis down, or pointed at a wrong address, then restarted): so its first
contact flushes the cache too. (With several store replicas sharing one Redis, a write one
replica could not invalidate stays visible to the others for at most the TTL.)
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import prometheus_client
import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from gpuloom.domain.profiles import ProfileId

log = structlog.get_logger("gpuloom.profile_store.cache")

CACHE_REQUESTS = prometheus_client.Counter(
    "gpuloom_profile_store_cache_requests_total",
    "Cache look-ups by result (hit, miss, degraded = served from the database, cache down)",
    ["result"],
)
CACHE_ERRORS = prometheus_client.Counter(
    "gpuloom_profile_store_cache_errors_total", "Failed cache commands (Redis unreachable or slow)"
)
CACHE_DEGRADED = prometheus_client.Gauge(
    "gpuloom_profile_store_cache_degraded", "1 while the cache is unreachable and bypassed"
)


@dataclass(frozen=True, slots=True)
class CacheEntry:
    version: int
    payload: bytes | None  # None: the profile was deleted at this version


class ProfileCache(Protocol):
    async def fetch(self, pid: ProfileId) -> CacheEntry | None:
        """The cached entry, or None on a miss (or when the cache is unavailable)."""

    async def offer(self, pid: ProfileId, version: int, payload: bytes | None) -> None:
        """Store the entry unless the cache already holds this version or a newer one."""

    async def close(self) -> None: ...


class InProcessCache:
    """A bounded LRU dictionary with a TTL; the embedded default's cache."""

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self._entries: OrderedDict[ProfileId, tuple[float, CacheEntry]] = OrderedDict()
        self._max_entries = max_entries
        self._ttl_s = ttl_s
        self._clock = clock

    async def fetch(self, pid: ProfileId) -> CacheEntry | None:
        item = self._entries.get(pid)
        if item is None or item[0] <= self._clock():
            CACHE_REQUESTS.labels("miss").inc()
            return None
        self._entries.move_to_end(pid)
        CACHE_REQUESTS.labels("hit").inc()
        return item[1]

    async def offer(self, pid: ProfileId, version: int, payload: bytes | None) -> None:
        item = self._entries.get(pid)
        if item is not None and item[1].version >= version and item[0] > self._clock():
            return
        self._entries[pid] = (self._clock() + self._ttl_s, CacheEntry(version, payload))
        self._entries.move_to_end(pid)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    async def close(self) -> None:
        self._entries.clear()


# Replace the entry only if it holds an older version (or none). KEYS[1]; ARGV: version,
# payload ("" for a tombstone), ttl seconds.
_OFFER_SCRIPT = """
local current = redis.call('HGET', KEYS[1], 'v')
if current and tonumber(current) >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'd', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""

T = TypeVar("T")


class _Bypassed(Exception):
    """Raised inside RedisCache while the cache is being skipped after a failure."""


class RedisCache:
    def __init__(
        self,
        url: str,
        ttl_s: int,
        timeout_s: float,
        retry_s: float,
        prefix: str = "gpuloom:profile-store:v1:",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        self._offer = self._redis.register_script(_OFFER_SCRIPT)
        self._ttl_s = ttl_s
        self._retry_s = retry_s
        self._prefix = prefix
        self._clock = clock
        self._down_since: float | None = None
        self._retry_at = 0.0
        # Set when a write could not reach the cache: it may hold a stale entry until flushed.
        # Set at start: writes of an earlier process may have missed it just the same.
        self._needs_flush = True
        self._flush_reason = "store started: writes of an earlier process may have missed it"

    def key(self, pid: ProfileId) -> str:
        # The key's length goes first so that ':' inside keys or models cannot make two ids alike.
        return f"{self._prefix}{pid.kind.value}:{len(pid.key)}:{pid.key}:{pid.gpu_model}"

    async def fetch(self, pid: ProfileId) -> CacheEntry | None:
        try:
            version, payload = await self._call(lambda: self._redis.hmget(self.key(pid), "v", "d"))
        except _Bypassed:
            CACHE_REQUESTS.labels("degraded").inc()
            return None
        if version is None:
            CACHE_REQUESTS.labels("miss").inc()
            return None
        CACHE_REQUESTS.labels("hit").inc()
        return CacheEntry(int(version), payload or None)

    async def offer(self, pid: ProfileId, version: int, payload: bytes | None) -> None:
        try:
            await self._call(
                lambda: self._offer(
                    keys=[self.key(pid)], args=[version, payload or b"", self._ttl_s]
                )
            )
        except _Bypassed:
            self._needs_flush = True
            self._flush_reason = "missed invalidations"

    async def ping(self) -> bool:
        try:
            await self._call(self._redis.ping)
        except _Bypassed:
            return False
        return True

    async def close(self) -> None:
        await self._redis.aclose()

    async def flush(self) -> int:
        """Remove every entry of this cache (only keys under its prefix); return how many."""
        removed = 0
        batch: list[bytes] = []
        async for key in self._redis.scan_iter(match=f"{self._prefix}*", count=500):
            batch.append(key)
            if len(batch) >= 500:
                removed += await self._redis.unlink(*batch)
                batch.clear()
        if batch:
            removed += await self._redis.unlink(*batch)
        return removed

    async def _call(self, command: Callable[[], Awaitable[T]]) -> T:
        now = self._clock()
        if self._down_since is not None and now < self._retry_at:
            raise _Bypassed
        try:
            if self._needs_flush:
                removed = await self.flush()
                self._needs_flush = False
                # At start a routine precaution; after missed writes, worth a look.
                routine = self._flush_reason.startswith("store started")
                (log.debug if routine else log.warning)(
                    "cache flushed", reason=self._flush_reason, entries=removed
                )
            result = await command()
        except (RedisError, OSError) as error:
            CACHE_ERRORS.inc()
            self._retry_at = now + self._retry_s
            if self._down_since is None:
                self._down_since = now
                CACHE_DEGRADED.set(1)
                log.error(
                    "cache unreachable; serving from the database",
                    error=f"{type(error).__name__}: {error}",
                    retry_in_s=self._retry_s,
                )
            raise _Bypassed from error
        if self._down_since is not None:
            log.warning("cache reachable again", outage_s=round(now - self._down_since, 3))
            self._down_since = None
            CACHE_DEGRADED.set(0)
        return result
