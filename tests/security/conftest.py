"""A deployment with mutual TLS and bearer tokens, set in the environment as an operator would:
a CA, the services' certificate, a client certificate, and a tokens file."""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gpuloom.transport import TransportSettings, open_aio_channel
from tests.polling import holds_within
from tests.profile_store.test_grpcurl import grpcurl_binary
from tests.security.pki import Authority, Files, write

ROLES = {"admin": "admin", "alice": "submitter", "bob": "submitter", "placement": "service"}


@dataclass
class Deployment:
    directory: Path
    authority: Authority
    server: Files  # the services' certificate (server and client)
    client: Files  # a submitter's client certificate
    tokens_file: Path
    tokens: dict[str, str]  # name -> token

    def settings(self, name: str | None, **changes: object) -> TransportSettings:
        """A client's settings: TLS with the client certificate and `name`'s token (None:
        no token); the environment is not read."""
        values: dict[str, object] = {
            "tls_ca_file": str(self.client.ca),
            "tls_cert_file": str(self.client.cert),
            "tls_key_file": str(self.client.key),
            "auth_token": self.tokens[name] if name else "",
        }
        values.update(changes)
        return TransportSettings.model_construct(**values)

    def channel(self, address: str, name: str | None, **changes: object) -> grpc.aio.Channel:
        return open_aio_channel(address, settings=self.settings(name, **changes))

    def environment(self) -> dict[str, str]:
        """What the services are started with."""
        return {
            "GPULOOM_TLS_CERT_FILE": str(self.server.cert),
            "GPULOOM_TLS_KEY_FILE": str(self.server.key),
            "GPULOOM_TLS_CA_FILE": str(self.server.ca),
            "GPULOOM_AUTH_TOKENS_FILE": str(self.tokens_file),
            "GPULOOM_AUTH_TOKEN": self.tokens["placement"],
        }

    def write_tokens(self) -> None:
        lines = ["# role name token"]
        lines += [f"{ROLES.get(name, 'submitter')} {name} {t}" for name, t in self.tokens.items()]
        self.tokens_file.write_text("\n".join(lines) + "\n")
        self.tokens_file.chmod(0o600)


def make_deployment(directory: Path) -> Deployment:
    authority = Authority.create()
    deployment = Deployment(
        directory,
        authority,
        write(directory, "service", authority, "gpuloom-service"),
        write(directory, "client", authority, "alice-laptop"),
        directory / "tokens",
        {name: secrets.token_urlsafe(24) for name in ROLES},
    )
    deployment.write_tokens()
    return deployment


@pytest.fixture
def deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Deployment:
    """The deployment's settings in the environment of this test process."""
    made = make_deployment(tmp_path / "pki")
    for name, value in made.environment().items():
        monkeypatch.setenv(name, value)
    return made


def first_output(
    run: Callable[[], subprocess.CompletedProcess[str]], what: str, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """Run a command (each run must succeed) until it prints something, as a CLI listing does
    once the plane has what it lists; fail naming `what` after `timeout_s`."""
    runs: list[subprocess.CompletedProcess[str]] = []

    def printed() -> bool:
        runs.append(run())
        assert runs[-1].returncode == 0, runs[-1].stderr
        return bool(runs[-1].stdout)

    assert holds_within(printed, timeout_s, pause_s=0.2), f"nothing listed: no {what}"
    return runs[-1]


def submit_with_grpcurl(
    placement: str,
    tls: tuple[Path, Path, Path],
    token: str,
    name: str,
    server_name: str | None = None,
) -> dict[str, object]:
    """SubmitJob of a one-GPU batch job `name` with grpcurl and the flags of docs/security.md
    (`tls`: the CA, the client certificate and its key); the job as grpcurl prints it."""
    ca, cert, key = tls
    body = {
        "request_id": f"{name}-1",
        "spec": {
            "name": name,
            "kind": "JOB_KIND_BATCH",
            "resources": {"memory_bytes": "1073741824", "whole_gpus": 1},
        },
    }
    flags = ["-cacert", str(ca), "-cert", str(cert), "-key", str(key)]
    if server_name is not None:
        flags += ["-servername", server_name]
    submitted = subprocess.run(
        [grpcurl_binary(), *flags, "-H", f"authorization: Bearer {token}", "-d",
         json.dumps(body), placement, "gpuloom.v1.Placement/SubmitJob"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    return json.loads(submitted.stdout)
