"""Token sharing on the live dispatcher (simulated GPU, real socket, Python reference client):
saturating clients get their time quotas, and idle time goes to those with room under their
limits."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gpuloom.clients.shim import ShimClient
from tests.dispatcher.conftest import LiveDispatcher

WINDOW_S = 0.5
WINDOWS = 10
# Leases of 25-50 ms: a Python client needs a few hundred microseconds to wake up for a lease,
# and that handover time is lost to everyone; with 10 ms leases it alone would cost ~4%.
TOKENS = {"window_ms": WINDOW_S * 1e3, "lease_initial_ms": 25.0, "lease_max_ms": 50.0}


def _saturate(shim: ShimClient, start: float, stop: float, held: list[tuple[float, float]]) -> None:
    """Always have work: hold every lease to its end, report the time held as GPU time."""
    while time.monotonic() < stop:
        lease = shim.acquire(timeout_s=2)
        began = time.monotonic()
        time.sleep(lease.remaining_s())
        ended = time.monotonic()
        shim.record_usage(ended - began, burst_s=ended - began)
        held.append((began, ended))


def _share(held: list[tuple[float, float]], start: float, stop: float) -> float:
    inside = sum(max(0.0, min(e, stop) - max(b, start)) for b, e in held)
    return inside / (stop - start)


async def _run(live: LiveDispatcher, quotas: list[tuple[float, float]], active: list[bool]):
    tokens = [
        (await live.reserve(sm=100, request=r * 100, limit=lim * 100)).assignment_token
        for r, lim in quotas
    ]
    shims = [ShimClient.connect(live.socket_path, t) for t in tokens]
    # One warm-up window, then ten measured ones.
    start = time.monotonic() + WINDOW_S
    stop = start + WINDOWS * WINDOW_S
    held: list[list[tuple[float, float]]] = [[] for _ in shims]
    threads = [
        threading.Thread(target=_saturate, args=(shim, start, stop, held[i]))
        for i, shim in enumerate(shims)
        if active[i]
    ]
    try:
        for thread in threads:
            thread.start()
        await asyncio.to_thread(lambda: [t.join(timeout=30) for t in threads])
    finally:
        for shim in shims:
            shim.close()
    return [_share(h, start, stop) for h in held]


@pytest.mark.parametrize("live", [TOKENS], indirect=True)
async def test_saturating_clients_get_their_requests_within_two_points(
    live: LiveDispatcher,
) -> None:
    requests = [0.2, 0.3, 0.5]
    shares = await _run(live, [(r, r) for r in requests], [True, True, True])
    for share, request in zip(shares, requests, strict=True):
        assert share == pytest.approx(request, abs=0.02), shares


@pytest.mark.parametrize("live", [TOKENS], indirect=True)
async def test_idle_time_is_absorbed_up_to_the_limits(live: LiveDispatcher) -> None:
    # The 0.5 client is idle: the others may run past their requests, up to 0.4 and 0.6.
    shares = await _run(live, [(0.2, 0.4), (0.3, 0.6), (0.5, 0.5)], [True, True, False])
    assert shares[2] == 0
    assert shares[0] == pytest.approx(0.4, abs=0.02), shares
    assert shares[1] == pytest.approx(0.6, abs=0.02), shares
