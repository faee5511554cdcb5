"""The client side's settings (gpuloom/transport.py): each wrong one named, before any call."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuloom.transport import TransportConfigError, load_settings, open_channel
from tests.security.pki import Authority, write


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (
        "GPULOOM_TLS_CERT_FILE",
        "GPULOOM_TLS_KEY_FILE",
        "GPULOOM_TLS_CA_FILE",
        "GPULOOM_AUTH_TOKEN",
        "GPULOOM_AUTH_TOKEN_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_wrong_client_settings_are_named(clean: pytest.MonkeyPatch, tmp_path: Path) -> None:
    files = write(tmp_path, "c", Authority.create(), "c")
    token_file = tmp_path / "token"
    cases: list[tuple[dict[str, str], str]] = [
        ({"GPULOOM_TLS_CERT_FILE": str(files.cert)}, "GPULOOM_TLS_KEY_FILE go together"),
        (
            {"GPULOOM_TLS_CERT_FILE": str(files.cert), "GPULOOM_TLS_KEY_FILE": str(files.key)},
            "GPULOOM_TLS_CA_FILE is needed",
        ),
        ({"GPULOOM_TLS_CA_FILE": str(tmp_path / "none.crt")}, "GPULOOM_TLS_CA_FILE: cannot read"),
        ({"GPULOOM_AUTH_TOKEN": "two words"}, "GPULOOM_AUTH_TOKEN: a token is printable ASCII"),
        (
            {"GPULOOM_AUTH_TOKEN": "a" * 20, "GPULOOM_AUTH_TOKEN_FILE": str(files.ca)},
            "not both",
        ),
    ]
    for env, said in cases:
        for name in env:
            clean.setenv(name, env[name])
        with pytest.raises(TransportConfigError, match=said):
            open_channel("127.0.0.1:1")
        for name in env:
            clean.delenv(name)
    # A token file is read when a channel opens: empty or unreadable is named then.
    token_file.write_text("\n")
    clean.setenv("GPULOOM_AUTH_TOKEN_FILE", str(token_file))
    with pytest.raises(TransportConfigError, match="first line is empty"):
        open_channel("127.0.0.1:1")
    token_file.write_text("t" * 20 + "\nignored\n")
    assert load_settings().token() == "t" * 20
    clean.setenv("GPULOOM_AUTH_TOKEN_FILE", str(tmp_path))  # a folder: cannot be read as one
    with pytest.raises(TransportConfigError, match="GPULOOM_AUTH_TOKEN_FILE"):
        open_channel("127.0.0.1:1")
