"""`gpuloom credentials init --kubernetes`: what deploy/k8s's Secret is made from. Besides the
services' files, the k8s process's certificate (server and client, naming its Service in the
namespace) and the device plugins' (client only), each with a token of its own, both tokens
the submitter `kubernetes`'s in the tokens file the services read; made once and kept; bad
input refused naming it, changing nothing."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from gpuloom.credentials import (
    KUBERNETES_SUBMITTER,
    CredentialsError,
    ensure,
    ensure_kubernetes,
)
from gpuloom.services.common.auth import Role, parse_tokens
from gpuloom.services.common.secure_start import Security, secure_process
from gpuloom.services.common.settings import SettingsError

GPULOOM = str(Path(sys.executable).parent / "gpuloom")
KUBERNETES_FILES = (
    "k8s.crt",
    "k8s.key",
    "k8s.token",
    "device-plugin.crt",
    "device-plugin.key",
    "device-plugin.token",
    "scheduler.crt",
    "scheduler.key",
)


def gpuloom(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPULOOM, *args], capture_output=True, text=True, timeout=120)


def usages(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_init_kubernetes_makes_the_components_identities_once(tmp_path: Path) -> None:
    where = tmp_path / "credentials"
    made = gpuloom("credentials", "init", "--dir", str(where), "--kubernetes", "--namespace", "gl")
    assert made.returncode == 0, made.stderr
    files = {p.name: p.read_bytes() for p in where.iterdir() if p.name != ".lock"}
    assert set(KUBERNETES_FILES) <= files.keys() and "ca.crt" in files and "tokens" in files
    assert all(stat.S_IMODE((where / name).stat().st_mode) == 0o600 for name in files)

    ca = x509.load_pem_x509_certificate(files["ca.crt"])
    k8s = x509.load_pem_x509_certificate(files["k8s.crt"])
    k8s.verify_directly_issued_by(ca)
    names = k8s.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    # The names the API server (webhook) and kube-scheduler (extender) call it by.
    assert {
        "gpuloom-k8s",
        "gpuloom-k8s.gl",
        "gpuloom-k8s.gl.svc",
        "gpuloom-k8s.gl.svc.cluster.local",
    } <= set(names.get_values_for_type(x509.DNSName))
    assert usages(k8s) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    plugin = x509.load_pem_x509_certificate(files["device-plugin.crt"])
    plugin.verify_directly_issued_by(ca)
    assert usages(plugin) == {ExtendedKeyUsageOID.CLIENT_AUTH}  # it serves nothing over TLS
    with pytest.raises(x509.ExtensionNotFound):
        plugin.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    scheduler = x509.load_pem_x509_certificate(files["scheduler.crt"])
    scheduler.verify_directly_issued_by(ca)
    assert usages(scheduler) == {ExtendedKeyUsageOID.CLIENT_AUTH}

    # Two tokens, one submitter; neither is the services' or the admin's.
    table = parse_tokens(files["tokens"].decode(), "tokens")
    k8s_token = files["k8s.token"].decode().strip()
    plugin_token = files["device-plugin.token"].decode().strip()
    assert k8s_token != plugin_token
    lines = [line for line in files["tokens"].decode().splitlines() if KUBERNETES_SUBMITTER in line]
    assert sorted(lines) == sorted(
        f"submitter {KUBERNETES_SUBMITTER} {t}" for t in (k8s_token, plugin_token)
    )
    callers = {caller for caller in table.values() if caller.name == KUBERNETES_SUBMITTER}
    assert {(c.name, c.role) for c in callers} == {(KUBERNETES_SUBMITTER, Role.SUBMITTER)}
    assert files["service.token"].decode().strip() not in (k8s_token, plugin_token)

    # Again: nothing replaced, no line added.
    again = gpuloom("credentials", "init", "--dir", str(where), "--kubernetes", "--namespace", "gl")
    assert again.returncode == 0, again.stderr
    for name, content in files.items():
        assert (where / name).read_bytes() == content, name
    # A revoked token (its line and its file deleted) is made anew; the other is kept.
    (where / "device-plugin.token").unlink()
    kept = [line for line in lines if plugin_token not in line]
    text = (where / "tokens").read_text()
    (where / "tokens").write_text(text.replace(f"submitter kubernetes {plugin_token}\n", ""))
    renewed = gpuloom(
        "credentials", "init", "--dir", str(where), "--kubernetes", "--namespace", "gl"
    )
    assert renewed.returncode == 0, renewed.stderr
    new_token = (where / "device-plugin.token").read_text().strip()
    assert new_token != plugin_token and plugin_token not in (where / "tokens").read_text()
    assert f"submitter kubernetes {new_token}" in (where / "tokens").read_text()
    assert all(line in (where / "tokens").read_text() for line in kept)

    shown = gpuloom("credentials", "show", "--dir", str(where))
    for name in (
        "k8s.crt",
        "device-plugin.crt",
        "scheduler.crt",
        "k8s.token",
        "device-plugin.token",
    ):
        assert any(name in line and "present" in line for line in shown.stdout.splitlines())
    assert k8s_token not in shown.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--kubernetes", "--namespace", "Not_A_Label"], "is not a DNS label"),
        (["--namespace", "gl"], "--namespace goes with --kubernetes"),
        (["--kubernetes", "--plaintext-clients"], "not with --plaintext-clients"),
    ],
)
def test_bad_init_options_are_refused_and_make_nothing(
    tmp_path: Path, args: list[str], says: str
) -> None:
    where = tmp_path / "credentials"
    refused = gpuloom("credentials", "init", "--dir", str(where), *args)
    assert refused.returncode == 1 and says in refused.stderr, refused.stderr
    assert not where.exists()


def test_what_would_break_the_kubernetes_identities_is_refused(tmp_path: Path) -> None:
    where = tmp_path / "credentials"
    ensure_kubernetes(where, "gpuloom")
    before = {p.name: p.read_bytes() for p in where.iterdir() if p.name != ".lock"}
    # Another namespace: the k8s certificate would not name the Service the API server calls.
    with pytest.raises(CredentialsError, match=r"does not name gpuloom-k8s\.other"):
        ensure_kubernetes(where, "other")
    # `add` cannot take the names whose files the directory writes for the components.
    for name in ("kubernetes", "k8s", "device-plugin"):
        added = gpuloom("credentials", "add", name, "--dir", str(where))
        assert added.returncode == 1 and "not admin" in added.stderr, added.stderr
    after = {p.name: p.read_bytes() for p in where.iterdir() if p.name != ".lock"}
    assert after == before

    # `kubernetes` given another role by hand: refused, naming the line to delete.
    tokens = where / "tokens"
    lines = tokens.read_text().replace("submitter kubernetes", "admin kubernetes")
    tokens.write_text(lines)
    with pytest.raises(CredentialsError, match="'kubernetes' has role admin"):
        ensure_kubernetes(where, "gpuloom")
    assert tokens.read_text() == lines


@pytest.mark.parametrize("component", ["k8s", "device-plugin"])
def test_gpuloom_serve_takes_a_components_own_files_from_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, component: str
) -> None:
    # `gpuloom serve k8s|device-plugin` with the credentials directory (no GPULOOM_TLS_* or
    # GPULOOM_AUTH_* of its own): the component's token and certificate, not the services'.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOOM_")}
    plain = tmp_path / "plain"
    ensure(plain)
    env["GPULOOM_CREDENTIALS_DIR"] = str(plain)
    monkeypatch.setattr(os, "environ", env)
    with pytest.raises(SettingsError, match=f"holds no {component}.token"):
        secure_process((component,), "10.0.0.1", embedded=False)
    made = ensure_kubernetes(tmp_path / "credentials")
    env["GPULOOM_CREDENTIALS_DIR"] = str(made.directory)
    assert secure_process((component,), "10.0.0.1", embedded=False) is Security.CREDENTIALS
    assert env["GPULOOM_AUTH_TOKEN_FILE"] == str(made.file(f"{component}.token"))
    assert env["GPULOOM_TLS_CERT_FILE"] == str(made.file(f"{component}.crt"))
    assert env["GPULOOM_TLS_KEY_FILE"] == str(made.file(f"{component}.key"))
    # Any other service keeps the services' token.
    for variable in [v for v in env if v.startswith(("GPULOOM_TLS_", "GPULOOM_AUTH_"))]:
        del env[variable]
    assert secure_process(("placement",), "10.0.0.1", embedded=False) is Security.CREDENTIALS
    assert env["GPULOOM_AUTH_TOKEN_FILE"] == str(made.service_token)
