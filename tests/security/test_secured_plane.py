"""`gpuloom up` deployed with mutual TLS and tokens, as docs/security.md tells: the services
reach one another (dispatchers register with placement, placement reserves on them), and
submitters use the CLI and grpcurl with the documented settings and flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import free_port
from tests.profile_store.test_grpcurl import grpcurl_binary
from tests.security.conftest import make_deployment

GPULOOM = str(Path(sys.executable).parent / "gpuloom")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOOM_")}
    env.update(extra)
    return env


def test_a_secured_control_plane_serves_its_submitters(tmp_path: Path) -> None:
    deployment = make_deployment(tmp_path / "pki")
    env = _clean_env(
        GPULOOM_DATA_DIR=str(tmp_path / "state"),
        GPULOOM_METRICS_PORT=str(free_port()),
        GPULOOM_PROFILE_STORE_PORT="0",
        GPULOOM_PROFILER_PORT="0",
        GPULOOM_PLACEMENT_PORT="0",
        GPULOOM_DISPATCHER_PORT="0",
        GPULOOM_DISPATCHER_BACKEND="simulated",
        GPULOOM_DISPATCHER_SIM_GPUS="A100-80GB",
        **deployment.environment(),
    )
    process = subprocess.Popen(
        [GPULOOM, "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        banner = [process.stdout.readline() for _ in range(6)]
        placement = next(line for line in banner if "placement" in line).split()[-1]

        def cli(who: str, *args: str) -> subprocess.CompletedProcess[str]:
            client = _clean_env(
                GPULOOM_PLACEMENT_ADDRESS=placement,
                GPULOOM_TLS_CA_FILE=str(deployment.client.ca),
                GPULOOM_TLS_CERT_FILE=str(deployment.client.cert),
                GPULOOM_TLS_KEY_FILE=str(deployment.client.key),
                GPULOOM_AUTH_TOKEN=deployment.tokens[who],
            )
            return subprocess.run(
                [GPULOOM, *args], env=client, capture_output=True, text=True, timeout=60
            )

        # The dispatcher registered its GPU with placement over mutual TLS, with its token.
        deadline = time.monotonic() + 20
        while True:
            shown = cli("alice", "gpus", "--json")
            assert shown.returncode == 0, shown.stderr
            if shown.stdout or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(shown.stdout.splitlines()) == 1 and "A100-80GB" in shown.stdout

        # grpcurl with the flags of docs/security.md: placement reserves on the dispatcher.
        submitted = subprocess.run(
            [
                grpcurl_binary(),
                "-cacert",
                str(deployment.client.ca),
                "-cert",
                str(deployment.client.cert),
                "-key",
                str(deployment.client.key),
                "-H",
                f"authorization: Bearer {deployment.tokens['alice']}",
                "-d",
                json.dumps(
                    {
                        "request_id": "secured-1",
                        "spec": {
                            "name": "secured",
                            "kind": "JOB_KIND_BATCH",
                            "resources": {"memory_bytes": "1073741824", "whole_gpus": 1},
                        },
                    }
                ),
                placement,
                "gpuloom.v1.Placement/SubmitJob",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert submitted.returncode == 0, submitted.stderr
        job = json.loads(submitted.stdout)
        assert job["state"] == "JOB_STATE_ASSIGNED"

        mine = cli("alice", "job", job["job_id"], "--json")
        assert mine.returncode == 0, mine.stderr
        assert json.loads(mine.stdout)["state"] == "JOB_STATE_ASSIGNED"
        theirs = cli("bob", "job", job["job_id"])
        assert theirs.returncode == 1
        assert f"job {job['job_id']} belongs to another submitter" in theirs.stderr
        assert cli("bob", "jobs", "--json").stdout == ""
        everyone = cli("admin", "jobs", "--json").stdout.splitlines()
        assert [json.loads(line)["job_id"] for line in everyone] == [job["job_id"]]
        assert json.loads(everyone[0])["owner"] == "alice"

        # A client setting that is wrong is a usage error, named.
        bad = subprocess.run(
            [GPULOOM, "jobs"],
            env=_clean_env(
                GPULOOM_PLACEMENT_ADDRESS=placement,
                GPULOOM_AUTH_TOKEN_FILE=str(tmp_path / "missing-token"),
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 2
        assert "GPULOOM_AUTH_TOKEN_FILE: cannot read" in bad.stderr
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
