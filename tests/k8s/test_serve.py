"""`gpuloom serve k8s` and `gpuloom serve device-plugin` as processes: bad settings stop them in
one line naming the variable; `gpuloom serve k8s` against a stand-in API server and a real
placement announces its endpoint, answers its health check and stops on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from gpuloom.services.placement.app import PlacementApp
from gpuloom.services.placement.settings import PlacementSettings
from tests.conftest import free_port
from tests.k8s.standins import ApiServer

GPULOOM = str(Path(sys.executable).parent / "gpuloom")


def environment(tmp_path: Path, **values: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GPULOOM_") and not k.startswith("KUBERNETES_")
    }
    # The placement these processes call serves open, so they are told so, as a deployment
    # without credentials must be (GPULOOM_INSECURE).
    env.update(
        GPULOOM_DATA_DIR=str(tmp_path), GPULOOM_METRICS_PORT="0", GPULOOM_INSECURE="true", **values
    )
    return env


@pytest.mark.parametrize(
    ("service", "values", "says"),
    [
        ("device-plugin", {}, "GPULOOM_DEVICE_PLUGIN_NODE"),
        (
            "device-plugin",
            {"GPULOOM_DEVICE_PLUGIN_NODE": "n", "GPULOOM_DEVICE_PLUGIN_SHIM_HOST_PATH": "lib.so"},
            "GPULOOM_DEVICE_PLUGIN_SHIM_HOST_PATH",
        ),
        ("k8s", {"GPULOOM_K8S_PRIORITY_CLASSES": "high=12"}, "GPULOOM_K8S_PRIORITY_CLASSES"),
        ("k8s", {"GPULOOM_K8S_TLS_CERT_FILE": "x.crt"}, "GPULOOM_K8S_TLS_KEY_FILE"),
        (
            "k8s",
            {"GPULOOM_K8S_EXTENDER_CLIENT_CA_FILE": "ca.crt"},
            "GPULOOM_K8S_EXTENDER_CLIENT_CA_FILE needs TLS",
        ),
        ("k8s", {}, "GPULOOM_K8S_API_SERVER: no API server: not in a cluster"),
    ],
)
def test_bad_settings_stop_it_in_one_line_naming_the_variable(
    tmp_path: Path, service: str, values: dict[str, str], says: str
) -> None:
    result = subprocess.run(
        [GPULOOM, "serve", service],
        env=environment(tmp_path, **values),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    assert says in line, line
    assert "Traceback" not in result.stderr


async def test_gpuloom_serve_k8s_runs_against_an_api_server_and_placement(tmp_path: Path) -> None:
    placement = await PlacementApp.start(PlacementSettings(port=0), "127.0.0.1", tmp_path)
    api = ApiServer({"t0k3n-0123456789": "system:serviceaccount:gpuloom:gpuloom-k8s"})
    api.start()
    (tmp_path / "token").write_text("t0k3n-0123456789\n")
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        GPULOOM,
        "serve",
        "k8s",
        env=environment(
            tmp_path,
            GPULOOM_K8S_PORT=str(port),
            GPULOOM_K8S_PLACEMENT_ADDRESS=f"127.0.0.1:{placement.port}",
            GPULOOM_K8S_API_SERVER=api.url,
            GPULOOM_K8S_API_TOKEN_FILE=str(tmp_path / "token"),
        ),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        lines = [(await asyncio.wait_for(process.stdout.readline(), 30)).decode() for _ in range(2)]
        assert lines[1].split()[-1] == f"127.0.0.1:{port}", lines
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            assert json.loads(answer.read()) == {"status": "ok"}
        # Its first reconcile listed the Pods of its scheduler, with its own token.
        assert (
            "system:serviceaccount:gpuloom:gpuloom-k8s",
            "GET",
            "/api/v1/pods?fieldSelector=spec.schedulerName%3Dgpuloom",
        ) in api.requests
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        api.stop()
        await placement.stop(0)


def test_serve_lists_the_kubernetes_components() -> None:
    result = subprocess.run(
        [GPULOOM, "serve", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    assert "k8s" in result.stdout and "device-plugin" in result.stdout
