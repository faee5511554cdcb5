"""The default admission policy (`composed`) live: real processes under the C shim on the fake
driver, a real dispatcher with its default settings (the FIKIT arbiter between priority levels,
leases of each level's token scheduler within a level), kernel tables from a real profile
store.

On a loaded two-core machine absolute times move by tens of percent, so these tests assert
orderings and ratios with margin, alternating the runs they compare, and print the figures
(docs/benchmarks.md has the measured ones)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator

import pytest

from gpuloom.services.dispatcher.settings import DispatcherSettings
from tests.profile_store.conftest import store_app, stub  # noqa: F401  (fixtures)
from tests.shim.conftest import Runner
from tests.shim.test_fikit_live import (
    HIGH,
    LOW,
    Fikit,
    LiveWithProfiles,
    _infer,
    _jct_ms,
    _launches,
    _train,
    profiled,  # noqa: F401  (fixture)
)

DEFAULT_POLICY = DispatcherSettings.model_fields["policy"].default
ROUNDS = 5
QUOTA_KERNEL = "k_quota_1000us"  # the fake GPU runs it for the 1000 us its name says
# The dispatcher's own defaults for what decides admission (tests/dispatcher pins others).
DEFAULTS = {
    name: DispatcherSettings.model_fields[name].default
    for name in ("policy", "window_ms", "policy_args")
}


@pytest.fixture
async def composed(profiled: LiveWithProfiles) -> AsyncIterator[Fikit]:  # noqa: F811
    # The dispatcher's default policy, named as such (tests/dispatcher's settings pin the token
    # policy for the lease mechanics they test).
    assert DEFAULT_POLICY == "composed"
    async with profiled(
        policy=DEFAULT_POLICY,
        window_ms=1000.0,
        policy_args="tokens.lease_initial_s=0.02,tokens.lease_max_s=0.1",
    ) as live:
        yield live


@pytest.fixture
async def defaults(profiled: LiveWithProfiles) -> AsyncIterator[Fikit]:  # noqa: F811
    """A dispatcher with its default admission settings."""
    assert DEFAULTS["policy"] == "composed"
    async with profiled(**DEFAULTS) as live:
        yield live


async def _reserve(
    fikit: Fikit, task_key: str, priority: int, request: float, limit: float
) -> dict[str, str]:
    return fikit.env(await fikit.token(task_key, priority, request, limit))


async def test_priority_1_keeps_its_latency_beside_priority_8_by_default(
    defaults: Fikit, run: Runner
) -> None:
    composed = defaults
    alone, paired, sharing, trained = [], [], [], []
    for _ in range(ROUNDS):
        # Alternating: the inference alone (no shim), both with no shim, both under the
        # default policy (priority 1 and 8, each asking half the GPU, up to all of it).
        alone.append(_jct_ms(await run.run_async(*_infer(), preload=False, timeout=30))[0])
        training = asyncio.create_task(run.run_async(*_train(3.0), preload=False, timeout=30))
        await asyncio.sleep(0.3)
        shared = await run.run_async(*_infer(), preload=False, timeout=30)
        sharing_launches = _launches(await training)
        sharing.append(_jct_ms(shared)[0])
        high = await _reserve(composed, "infer", 1, 50, 100)
        low = await _reserve(composed, "train", 8, 50, 100)
        training = asyncio.create_task(
            run.run_async(*_train(3.0), env=low, preload=True, timeout=30)
        )
        await asyncio.sleep(0.3)
        admitted = await run.run_async(*_infer(), env=high, preload=True, timeout=30)
        paired.append(_jct_ms(admitted)[0])
        trained.append(_launches(await training) / max(sharing_launches, 1))
        channel = composed.live.dispatcher.channel
        snapshot = await asyncio.wrap_future(channel.submit(channel.scheduler_snapshot))
        # Each level leased its one process its time (the whole GPU, the quota asked).
        assert all(c.leases_granted > 0 for c in snapshot.clients.values()), snapshot
        await composed.release_all()
    median = {k: statistics.median(v) for k, v in (("alone", alone), ("paired", paired))}
    median["sharing"] = statistics.median(sharing)
    report = (
        f"inference mean ms (median of {ROUNDS}): alone {median['alone']:.3f}, "
        f"default policy {median['paired']:.3f} ({median['paired'] / median['alone']:.3f}x), "
        f"no admission {median['sharing']:.3f}; training work vs no admission "
        f"{statistics.median(trained):.3f}"
    )
    print(report)
    # Protected: near alone (a holder held back behind fill kernels shows as 2x and more; noise
    # on this machine reaches 1.4x), and the training still works. How near (the 1.05x
    # median) is scripts/bench_fikit's check and docs/benchmarks.md's figure, not asserted: at
    # load 5-7 on this 2-vCPU VM the median was 1.049-1.117x, and sharing without admission
    # 1.02-1.07x (the workload's kernels are short next to its host work), so neither that bound
    # nor the ordering against sharing holds run after run.
    assert median["paired"] <= 1.5 * median["alone"], report
    assert statistics.median(trained) > 0.1, report
    # Both roads were taken: leases of each level, and the arbiter between the levels.
    stats = composed.live.dispatcher.engine.fikit_stats()
    assert stats.requests > 0 and stats.grants > 0, stats


async def test_equal_priorities_share_by_their_quotas_live(composed: Fikit, run: Runner) -> None:
    # Two training loops at one priority, quotas 25% and 75% (limits the same): the leases of
    # their level bound each to its quota.
    small = await _reserve(composed, "train", 5, 25, 25)
    large = await _reserve(composed, "train2", 5, 75, 75)
    # Millisecond kernels, four queued before each sync: the two loops ask the GPU for more than
    # it has, so the leases decide the split. (With 150 us kernels and a sync after each, a
    # loop's host work between kernels is longer than its kernel on this VM, and neither loop
    # reaches the GPU its quota allows.)
    loop = ["module", ",".join([*HIGH, LOW, QUOTA_KERNEL]), "loop", "3.0", QUOTA_KERNEL, "4"]
    started = time.monotonic()
    first = asyncio.create_task(run.run_async(*loop, env=small, preload=True, timeout=30))
    second = asyncio.create_task(run.run_async(*loop, env=large, preload=True, timeout=30))
    await asyncio.sleep(2.0)
    # The dispatcher's books while both run: the GPU time each was charged (measured by the
    # shim with events around its bursts), by quota limit.
    channel = composed.live.dispatcher.channel
    snapshot = await asyncio.wrap_future(channel.submit(channel.scheduler_snapshot))
    elapsed = time.monotonic() - started
    charged = {c.share.share.quota.limit_percent: c.total_gpu_s for c in snapshot.clients.values()}
    a, b = _launches(await first), _launches(await second)
    print(
        f"launches at quota 25%: {a}, at 75%: {b} (ratio {b / max(a, 1):.2f}, quotas 3.0); "
        f"GPU s charged in the first {elapsed:.2f} s: {charged}"
    )
    assert set(charged) == {25.0, 75.0}, snapshot
    # The one with three times the quota is charged more and does more. Not 3x on a loaded
    # machine, where a loop's host falls behind its quota (charged 2.7x and launches 3.3x on an
    # idle two-core VM, 1.7-1.9x and 2.1-2.4x beside four CPU burners), while without the shim
    # the two loops share the GPU evenly (1,504 and 1,500 launches in 3 s, the GPU kept busy).
    assert charged[75.0] > 1.5 * charged[25.0], charged
    assert b > 1.6 * a, (a, b)
    assert a > 0
