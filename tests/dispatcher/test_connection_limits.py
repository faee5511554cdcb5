"""One local user cannot lock the shim socket: a cap per peer uid, unregistered connections
dropped fast, the last connections kept for users holding a reservation (issue 19, item 2);
nor fill the disk: refusals logged at a bounded rate per user, and counted (issue 34)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import time

import pytest
from structlog.testing import capture_logs

from gpuloom.services.dispatcher import metrics
from gpuloom.services.dispatcher.refusal_log import BURST, PER_S
from gpuloom.shimwire import encode_frame
from gpuloom.v1 import shim_pb2
from tests.dispatcher.conftest import LiveDispatcher


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.settimeout(3.0)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the dispatcher hangs up (after what it may say why) within the socket timeout."""
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def _refused(gpu: str, reason: str) -> float:
    return metrics.CONNECTIONS_REFUSED.labels(gpu, reason)._value.get()


def _limits(live: LiveDispatcher, **limits: object) -> None:
    channel = live.dispatcher.channel
    channel._limits = dataclasses.replace(channel._limits, **limits)  # type: ignore[arg-type]


@pytest.fixture
def gpu(live: LiveDispatcher) -> str:
    return str(live.dispatcher.core.gpu.index)


async def test_one_user_gets_at_most_its_share_of_connections(
    live: LiveDispatcher, gpu: str
) -> None:
    _limits(live, max_connections_per_uid=3, reserved_connections=0, register_timeout_s=30.0)
    before = _refused(gpu, "per-uid limit")
    held = [_connect(live.socket_path) for _ in range(3)]
    await asyncio.sleep(0.1)
    extra = _connect(live.socket_path)  # accepted by the kernel, closed by the dispatcher
    assert await asyncio.to_thread(_closed_by_server, extra)
    assert _refused(gpu, "per-uid limit") == before + 1
    # A closed one frees its place.
    held.pop().close()
    await asyncio.sleep(0.1)
    again = _connect(live.socket_path)
    again.settimeout(0.3)
    with pytest.raises(TimeoutError):
        again.recv(1)  # kept open: waiting for its registration
    for sock in [*held, extra, again]:
        sock.close()


async def test_an_unregistered_connection_is_dropped_within_the_timeout(
    live: LiveDispatcher,
) -> None:
    _limits(live, register_timeout_s=0.2)
    sock = _connect(live.socket_path)
    started = time.monotonic()
    assert await asyncio.to_thread(_closed_by_server, sock)
    # The timeout plus one housekeeping round (every 0.5 s).
    assert time.monotonic() - started < 0.2 + 0.5 + 0.3
    sock.close()


async def test_the_last_connections_are_kept_for_reservation_holders(
    live: LiveDispatcher, gpu: str
) -> None:
    _limits(
        live,
        max_connections=3,
        reserved_connections=2,
        max_connections_per_uid=100,
        register_timeout_s=30.0,
    )
    before = _refused(gpu, "kept for reservation holders")
    first = _connect(live.socket_path)
    await asyncio.sleep(0.1)
    # This test's uid holds no reservation bound to a process: beyond 3 - 2, no more.
    second = _connect(live.socket_path)
    assert await asyncio.to_thread(_closed_by_server, second)
    assert _refused(gpu, "kept for reservation holders") == before + 1
    first.close()
    second.close()


def _closed_total(gpu: str) -> float:
    return sum(
        sample.value
        for metric in metrics.CONNECTIONS_CLOSED.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels["gpu"] == gpu
    )


def _unlogged(gpu: str) -> float:
    return metrics.REFUSALS_UNLOGGED.labels(gpu)._value.get()


async def test_one_user_refused_in_a_loop_is_logged_at_a_bounded_rate_and_counted(
    live: LiveDispatcher, gpu: str
) -> None:
    """A user reconnecting in a loop with an unknown token (issue 34: 195,850 warnings in
    11 s) gets at most the burst of refusal lines, then one per refill; every refusal is still
    counted."""
    register = encode_frame(
        shim_pb2.ShimMessage(
            register=shim_pb2.Register(protocol_version=1, assignment_token="u" * 40)
        ).SerializeToString()
    )
    attempts = 300

    def hammer() -> None:
        for _ in range(attempts):
            sock = _connect(live.socket_path)
            sock.sendall(register)
            assert _closed_by_server(sock)
            sock.close()

    closed_before, unlogged_before = _closed_total(gpu), _unlogged(gpu)
    started = time.monotonic()
    with capture_logs() as logs:
        await asyncio.to_thread(hammer)
        await asyncio.sleep(0.2)
    took = time.monotonic() - started
    refused = [entry for entry in logs if entry["event"] == "shim refused"]
    assert all(entry["log_level"] == "warning" and entry["uid"] == os.getuid() for entry in refused)
    assert all(entry["reason"] == "unknown assignment token" for entry in refused)
    # The burst, and one more line per 1 / PER_S seconds the loop took.
    assert 1 <= len(refused) <= BURST + 1 + int(took * PER_S), (len(refused), took)
    assert _closed_total(gpu) - closed_before == attempts
    assert _unlogged(gpu) - unlogged_before == attempts - len(refused)
