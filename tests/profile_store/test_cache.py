"""The caches: version ordering, tombstones, TTL, and Redis outages (real Redis behind a proxy)."""

from __future__ import annotations

import time

import pytest

from gpuloom.domain import profiles as d
from gpuloom.services.profile_store.cache import (
    CACHE_REQUESTS,
    CacheEntry,
    InProcessCache,
    RedisCache,
)
from tests.conftest import TcpProxy, free_port

PID = d.ProfileId(d.ProfileKind.KERNEL, "task:a", "A100")


def _count(result: str) -> float:
    return CACHE_REQUESTS.labels(result)._value.get()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _check_version_ordering(cache) -> None:
    await cache.offer(PID, 2, b"two")
    await cache.offer(PID, 1, b"one")  # a slow reader's older copy must not win
    assert await cache.fetch(PID) == CacheEntry(2, b"two")
    await cache.offer(PID, 3, None)  # deletion tombstone
    assert await cache.fetch(PID) == CacheEntry(3, None)
    await cache.offer(PID, 2, b"two")
    assert await cache.fetch(PID) == CacheEntry(3, None)
    await cache.offer(PID, 4, b"four")  # re-created after the deletion
    assert await cache.fetch(PID) == CacheEntry(4, b"four")


async def test_in_process_cache_keeps_the_newest_version() -> None:
    await _check_version_ordering(InProcessCache(max_entries=10, ttl_s=60))


async def test_in_process_cache_expires_and_evicts() -> None:
    clock = FakeClock()
    cache = InProcessCache(max_entries=2, ttl_s=10, clock=clock)
    await cache.offer(PID, 1, b"x")
    clock.now += 11
    assert await cache.fetch(PID) is None
    other = [d.ProfileId(d.ProfileKind.MIG, f"k{i}", "A30") for i in range(3)]
    for i, pid in enumerate(other):
        await cache.offer(pid, 1, str(i).encode())
    assert await cache.fetch(other[0]) is None  # least recently used went first
    assert await cache.fetch(other[2]) == CacheEntry(1, b"2")


async def test_redis_cache_keeps_the_newest_version(redis_url: str, cache_prefix: str) -> None:
    cache = RedisCache(redis_url, ttl_s=60, timeout_s=1, retry_s=1, prefix=cache_prefix)
    try:
        await _check_version_ordering(cache)
        # Keys are unambiguous even when keys and models contain the separator.
        a = d.ProfileId(d.ProfileKind.MIG, "x:1", "y")
        b = d.ProfileId(d.ProfileKind.MIG, "x", "1:y")
        await cache.offer(a, 1, b"a")
        assert await cache.fetch(b) is None
    finally:
        await cache.flush()
        await cache.close()


async def test_redis_at_a_dead_port_degrades_quickly_without_errors(cache_prefix: str) -> None:
    cache = RedisCache(
        f"redis://127.0.0.1:{free_port()}/0",
        ttl_s=60,
        timeout_s=0.2,
        retry_s=30,
        prefix=cache_prefix,
    )
    degraded_before = _count("degraded")
    started = time.perf_counter()
    for _ in range(50):
        assert await cache.fetch(PID) is None
        await cache.offer(PID, 1, b"x")
    elapsed = time.perf_counter() - started
    # One connection attempt fails fast; the rest skip Redis until retry_s has passed.
    assert elapsed < 2.0
    assert _count("degraded") - degraded_before == 50
    await cache.close()


async def test_redis_stopped_mid_test_then_back_flushes_missed_invalidations(
    redis_proxy: TcpProxy, cache_prefix: str
) -> None:
    clock = FakeClock()
    cache = RedisCache(
        redis_proxy.url, ttl_s=60, timeout_s=0.5, retry_s=5, prefix=cache_prefix, clock=clock
    )
    try:
        await cache.offer(PID, 1, b"v1")
        assert await cache.fetch(PID) == CacheEntry(1, b"v1")

        await redis_proxy.stop()
        assert await cache.fetch(PID) is None  # served from the database instead
        await cache.offer(PID, 2, b"v2")  # this invalidation cannot reach Redis
        assert not await cache.ping()

        await redis_proxy.start()
        assert await cache.fetch(PID) is None  # still inside the retry pause
        clock.now += 6
        # Back: the entry written before the outage (v1) is stale and must be gone.
        assert await cache.fetch(PID) is None
        await cache.offer(PID, 2, b"v2")
        assert await cache.fetch(PID) == CacheEntry(2, b"v2")
    finally:
        await cache.flush()
        await cache.close()


@pytest.mark.parametrize("bad", ["http://localhost", "localhost:6379"])
def test_redis_url_setting_is_validated(bad: str) -> None:
    from pydantic import ValidationError

    from gpuloom.services.profile_store.settings import ProfileStoreSettings

    with pytest.raises(ValidationError, match="redis_url"):
        ProfileStoreSettings(redis_url=bad)
