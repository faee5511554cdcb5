"""`gpuloom up` deployed with mutual TLS and tokens, as docs/security.md tells: the services
reach one another (dispatchers register with placement, placement reserves on them), and
submitters use the CLI and grpcurl with the documented settings and flags."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import free_port
from tests.plane import GPULOOM, clean_env, placement_in_banner, start_up, stop_up, up_env
from tests.security.conftest import first_output, make_deployment, submit_with_grpcurl


def test_a_secured_control_plane_serves_its_submitters(tmp_path: Path) -> None:
    deployment = make_deployment(tmp_path / "pki")
    env = up_env(
        GPULOOM_DATA_DIR=str(tmp_path / "state"),
        GPULOOM_METRICS_PORT=str(free_port()),
        GPULOOM_DISPATCHER_SIM_GPUS="A100-80GB",
        **deployment.environment(),
    )
    process = start_up(env)
    try:
        placement = placement_in_banner(process)

        def cli(who: str, *args: str) -> subprocess.CompletedProcess[str]:
            client = clean_env(
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
        shown = first_output(lambda: cli("alice", "gpus", "--json"), "a GPU", 20)
        assert len(shown.stdout.splitlines()) == 1 and "A100-80GB" in shown.stdout

        # grpcurl with the flags of docs/security.md: placement reserves on the dispatcher.
        files = deployment.client
        tls = (files.ca, files.cert, files.key)
        job = submit_with_grpcurl(placement, tls, deployment.tokens["alice"], "secured")
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
            env=clean_env(
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
        stop_up(process)
