"""Secure by default (issue 34, gpuloom/credentials.py, services/common/secure_start.py): the
credentials directory `gpuloom credentials init` makes (private, made once, kept), the client
settings every command reads from it, `gpuloom serve` refusing to start open unless told to,
and a plane deployed with the directory on a non-loopback address: mutual TLS and tokens
between its services, and for the CLI and grpcurl with the documented flags."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from gpuloom.credentials import client_defaults, ensure
from gpuloom.transport import load_settings, open_channel
from gpuloom.v1 import placement_pb2 as pb
from gpuloom.v1 import placement_pb2_grpc
from tests.conftest import free_port
from tests.plane import GPULOOM, clean_env, placement_in_banner, start_up, stop_up, up_env
from tests.security.conftest import first_output, submit_with_grpcurl


def gpuloom(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPULOOM, *args], env=env, capture_output=True, text=True, timeout=120)


def test_init_makes_a_private_directory_once_and_keeps_it(tmp_path: Path) -> None:
    where = tmp_path / "creds"
    made = gpuloom("credentials", "init", "--dir", str(where), "--name", "gpu-host.example")
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    files = {p.name: p.read_bytes() for p in where.iterdir() if p.name != ".lock"}
    assert all(stat.S_IMODE((where / n).stat().st_mode) == 0o600 for n in files)
    cert = x509.load_pem_x509_certificate(files["placement.crt"])
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"placement", "localhost", "gpuloom", "gpu-host.example"} <= set(
        names.get_values_for_type(x509.DNSName)
    )
    admin = x509.load_pem_x509_certificate(files["admin.crt"])
    with pytest.raises(x509.ExtensionNotFound):  # a client's certificate names no server
        admin.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    table = files["tokens"].decode()
    assert f"admin admin {files['admin.token'].decode().strip()}" in table
    assert f"service services {files['service.token'].decode().strip()}" in table

    # Again: nothing is replaced. A certificate removed is made again (a new key) and signed
    # by the same CA.
    (where / "profiler.crt").unlink()
    again = gpuloom("credentials", "init", "--dir", str(where))
    assert again.returncode == 0, again.stderr
    for name, content in files.items():
        if name not in ("profiler.crt", "profiler.key"):
            assert (where / name).read_bytes() == content, name
    renewed = x509.load_pem_x509_certificate((where / "profiler.crt").read_bytes())
    renewed.verify_directly_issued_by(x509.load_pem_x509_certificate(files["ca.crt"]))

    # Tokens for people: a new name gets a file of its own; a taken or bad one is refused.
    added = gpuloom("credentials", "add", "alice", "--dir", str(where))
    assert added.returncode == 0 and "submitter alice" in added.stdout
    alice = (where / "alice.token").read_text().strip()
    assert f"submitter alice {alice}" in (where / "tokens").read_text()
    for name, needle in (("alice", "already has a token"), ("admin", "not admin"), ("a b", "name")):
        refused = gpuloom("credentials", "add", name, "--dir", str(where))
        assert refused.returncode == 1 and needle in refused.stderr, refused.stderr
    shown = gpuloom("credentials", "token", "--dir", str(where))
    assert shown.stdout.strip() == files["admin.token"].decode().strip()
    bad = gpuloom("credentials", "init", "--dir", str(tmp_path / "x"), "--name", "not a host")
    assert bad.returncode == 1 and "is not a host name or an IP address" in bad.stderr


def test_clients_take_the_directorys_settings_unless_the_environment_sets_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    where = tmp_path / "creds"
    ensure(where)
    for name in list(os.environ):
        if name.startswith(("GPULOOM_TLS_", "GPULOOM_AUTH_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("GPULOOM_CREDENTIALS_DIR", str(where))
    found = load_settings()
    assert found.tls_ca_file == str(where / "ca.crt") and found.tls_server_name == "gpuloom"
    assert found.tls_cert_file == str(where / "admin.crt")
    assert found.token() == (where / "admin.token").read_text().strip()
    assert client_defaults(where)["GPULOOM_AUTH_TOKEN_FILE"] == str(where / "admin.token")
    # The environment's own choice wins, group by group; set empty, it means none.
    monkeypatch.setenv("GPULOOM_AUTH_TOKEN", "x" * 20)
    monkeypatch.setenv("GPULOOM_TLS_CA_FILE", "")
    chosen = load_settings()
    assert chosen.token() == "x" * 20 and not chosen.tls and chosen.tls_cert_file == ""


def test_serve_refuses_to_start_without_credentials_unless_told_to_serve_open(
    tmp_path: Path,
) -> None:
    env = clean_env(
        GPULOOM_DATA_DIR=str(tmp_path / "state"),
        GPULOOM_CREDENTIALS_DIR=str(tmp_path / "none"),
        GPULOOM_PROFILE_STORE_PORT="0",
        GPULOOM_METRICS_PORT="0",
    )
    refused = gpuloom("serve", "profile-store", env=env)
    assert refused.returncode == 1
    assert f"no credentials in {tmp_path / 'none'}" in refused.stderr
    assert "`gpuloom credentials init`" in refused.stderr and "GPULOOM_INSECURE" in refused.stderr
    assert not (tmp_path / "none").exists()  # serve makes none

    env["GPULOOM_INSECURE"] = "true"
    process = subprocess.Popen(
        [GPULOOM, "serve", "profile-store"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert "gpuloom is running" in process.stdout.readline()
    finally:
        process.terminate()
        _, log = process.communicate(timeout=30)
    assert "OPEN PLANE: GPULOOM_INSECURE is set" in log
    assert "gRPC WITHOUT AUTHENTICATION" in log


def test_a_plane_on_a_network_address_serves_mutual_tls_and_tokens(tmp_path: Path) -> None:
    where = tmp_path / "creds"
    assert gpuloom("credentials", "init", "--dir", str(where)).returncode == 0
    env = up_env(
        GPULOOM_DATA_DIR=str(tmp_path / "state"),
        GPULOOM_CREDENTIALS_DIR=str(where),
        GPULOOM_BIND_HOST="0.0.0.0",
        GPULOOM_METRICS_PORT=str(free_port()),
        GPULOOM_DISPATCHER_SIM_GPUS="A100-80GB",
    )
    process = start_up(env)
    try:
        port = placement_in_banner(process).split(":")[-1]  # it binds 0.0.0.0
        placement = f"127.0.0.1:{port}"
        client = clean_env(GPULOOM_CREDENTIALS_DIR=str(where), GPULOOM_PLACEMENT_ADDRESS=placement)

        # The dispatcher registered over mutual TLS with the services' token; the CLI finds
        # the directory's client settings (TLS, the admin's certificate and token).
        shown = first_output(lambda: gpuloom("gpus", "--json", env=client), "a GPU", 30)
        assert "A100-80GB" in shown.stdout

        # grpcurl with the documented flags.
        token = (where / "admin.token").read_text().strip()
        tls = (where / "ca.crt", where / "admin.crt", where / "admin.key")
        submitted = submit_with_grpcurl(placement, tls, token, "tls", server_name="gpuloom")
        assert submitted["state"] == "JOB_STATE_ASSIGNED"

        # Without the directory: plaintext is no use, nor TLS without a client certificate.
        for settings_env in (
            {"GPULOOM_TLS_CA_FILE": "", "GPULOOM_AUTH_TOKEN": token},
            {"GPULOOM_TLS_CA_FILE": str(where / "ca.crt"), "GPULOOM_TLS_SERVER_NAME": "gpuloom"},
        ):
            with pytest.MonkeyPatch.context() as patch:
                for name in list(os.environ):
                    if name.startswith(("GPULOOM_TLS_", "GPULOOM_AUTH_")):
                        patch.delenv(name)
                for name, value in settings_env.items():
                    patch.setenv(name, value)
                with open_channel(placement) as channel, pytest.raises(grpc.RpcError) as failed:
                    placement_pb2_grpc.PlacementStub(channel).ListGpus(
                        pb.ListGpusRequest(), timeout=10
                    )
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    finally:
        stop_up(process)
