"""Token sharing on the live dispatcher (simulated GPU, real socket, Python reference client):
saturating clients get their time quotas, and idle time goes to those with room under their
limits."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

from gpuloom.v1 import dispatcher_pb2
from tests.dispatcher.conftest import LiveDispatcher

WINDOW_S = 0.5
WINDOWS = 10
# Leases of 25-50 ms: a Python client needs from a few hundred microseconds to milliseconds (on
# a loaded machine) to wake up for a lease, and that time is lost; with 10 ms leases ~4%.
SATURATE = str(Path(__file__).with_name("saturate.py"))
TOKENS = {
    "window_ms": WINDOW_S * 1e3,
    "policy_args": "tokens.lease_initial_s=0.025,tokens.lease_max_s=0.05",
}


def _share(held: list[tuple[float, float]], start: float, stop: float) -> float:
    inside = sum(max(0.0, min(e, stop) - max(b, start)) for b, e in held)
    return inside / (stop - start)


async def _run(live: LiveDispatcher, quotas: list[tuple[float, float]], active: list[bool]):
    """Each client is its own process, as GPU jobs are (no shared interpreter lock)."""
    tokens = [
        (await live.reserve(sm=100, request=r * 100, limit=lim * 100)).assignment_token
        for r, lim in quotas
    ]
    # Two warm-up windows (processes start, leases adapt), then ten measured ones, aligned with
    # the dispatcher's own windows (a lease granted near a window's end runs into the next).
    status = await live.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
    window_start = time.monotonic() - status.window_elapsed_ms / 1e3
    start = window_start + 3 * WINDOW_S
    stop = start + WINDOWS * WINDOW_S
    processes = {
        i: await asyncio.create_subprocess_exec(
            sys.executable,
            SATURATE,
            live.socket_path,
            token,
            repr(stop),
            stdout=asyncio.subprocess.PIPE,
        )
        for i, token in enumerate(tokens)
        if active[i]
    }
    held: list[list[tuple[float, float]]] = [[] for _ in tokens]
    for i, process in processes.items():
        out, _ = await asyncio.wait_for(process.communicate(), timeout=60)
        assert process.returncode == 0
        held[i] = [tuple(pair) for pair in json.loads(out)]
    return [_share(h, start, stop) for h in held]


@pytest.mark.parametrize("live", [TOKENS], indirect=True)
async def test_saturating_clients_get_their_requests_and_never_two_points_more(
    live: LiveDispatcher,
) -> None:
    requests = [0.2, 0.3, 0.5]
    shares = await _run(live, [(r, r) for r in requests], [True, True, True])
    for share, request in zip(shares, requests, strict=True):
        # Never more than two points past its request; below it, one point more is allowed
        # for the client's own wake-ups: on this 2-vCPU VM, on a slow day, a client that got
        # its leases in time once lost 2.1 points waking for them (0.279 of 0.3).
        assert request - 0.03 <= share <= request + 0.02, shares


@pytest.mark.parametrize("live", [TOKENS], indirect=True)
async def test_idle_time_is_absorbed_up_to_the_limits(live: LiveDispatcher) -> None:
    # The 0.5 client is idle: the others run past their requests (0.2, 0.3) up to their
    # limits (0.35, 0.45), and no further, though the GPU still has idle time left.
    terms = [(0.2, 0.35), (0.3, 0.45), (0.5, 0.5)]
    shares = await _run(live, terms, [True, True, False])
    assert shares[2] == 0
    for share, (request, limit) in zip(shares[:2], terms[:2], strict=True):
        # Never past the limit; well past the request (on a loaded machine a client may fall
        # a little short of its limit: its own process does not always get the CPU in time).
        assert request + (limit - request) / 2 <= share <= limit + 0.02, shares
