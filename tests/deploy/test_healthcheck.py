"""docker/healthcheck.py, the containers' healthcheck: exit 0 only for a SERVING server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from gpuloom.services.common.server import start_server
from tests.conftest import free_port
from tests.deploy.conftest import ROOT
from tests.security.pki import Authority, write

SCRIPT = ROOT / "docker" / "healthcheck.py"


async def probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # A child process, as the container runtime runs it; the server runs on this loop meanwhile.
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
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


async def test_a_service_serving_mutual_tls_is_probed_with_its_own_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in deploy/k8s: the probe runs in the service's container, with its TLS settings."""
    authority = Authority.create()
    files = write(tmp_path, "service", authority, "gpuloom-service")
    tls = {
        "GPULOOM_TLS_CERT_FILE": str(files.cert),
        "GPULOOM_TLS_KEY_FILE": str(files.key),
        "GPULOOM_TLS_CA_FILE": str(files.ca),
    }
    for name, value in tls.items():
        monkeypatch.setenv(name, value)
    running = await start_server([], "127.0.0.1", 0)
    address = f"127.0.0.1:{running.port}"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPULOOM_TLS_")}
    try:
        served = await probe(address, env={**clean, **tls})
        assert served.returncode == 0, served.stderr
        plaintext = await probe(address, env=clean)
        assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stderr
        missing = await probe(address, env={**clean, "GPULOOM_TLS_CA_FILE": str(tmp_path / "x")})
        assert missing.returncode == 1 and "No such file" in missing.stderr
    finally:
        await running.server.stop(0)
