"""docker/healthcheck.py, the containers' healthcheck: exit 0 only for a SERVING server."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from grpc_health.v1 import health_pb2

from gpuloom.services.common.server import start_server
from tests.conftest import free_port
from tests.deploy.conftest import ROOT

SCRIPT = ROOT / "docker" / "healthcheck.py"


async def probe(*args: str) -> subprocess.CompletedProcess[str]:
    # A child process, as the container runtime runs it; the server runs on this loop meanwhile.
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


async def test_serving_not_serving_and_unreachable() -> None:
    running = await start_server([], "127.0.0.1", 0)
    address = f"127.0.0.1:{running.port}"
    try:
        serving = await probe(address)
        assert serving.returncode == 0, serving.stderr
        assert serving.stderr == ""
        await running.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        stopped = await probe(address)
        assert stopped.returncode == 1
        assert stopped.stderr.strip() == f"{address}: server is NOT_SERVING"
        unknown = await probe(address, "gpuloom.v1.Nothing")
        assert unknown.returncode == 1
        assert "NOT_FOUND" in unknown.stderr
    finally:
        await running.server.stop(0)
    closed = f"127.0.0.1:{free_port()}"
    unreachable = await probe(closed)
    assert unreachable.returncode == 1
    assert unreachable.stderr.startswith(f"{closed}: UNAVAILABLE")
    assert len(unreachable.stderr.strip().splitlines()) == 1  # one line, no traceback


async def test_a_bad_call_is_a_usage_error() -> None:
    for args in ((), ("a:1", "svc", "extra"), ("--help",)):
        result = await probe(*args)
        assert result.returncode == 2, args
        assert result.stderr.startswith("usage: healthcheck.py HOST:PORT [SERVICE]")
