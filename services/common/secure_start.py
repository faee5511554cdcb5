"""How `gpuloom up` and `gpuloom serve` secure a process before any server starts: with the
operator's own files where GPULOOM_AUTH_TOKENS_FILE or GPULOOM_TLS_CERT_FILE say so; else with
the credentials directory (gpuloom/credentials.py), which `gpuloom up` makes on its first start
and `gpuloom serve` requires (compose's one-shot job and the Kubernetes Secret make it); open to
whoever reaches the ports only when GPULOOM_INSECURE says so, loudly.

From the directory, every server takes bearer tokens (its `tokens`) and every outgoing call
sends the services' token. A server bound to a loopback address serves in plaintext and lets
calls without a token read (GPULOOM_AUTH_ANONYMOUS_READS: the RPCs that change nothing and tell
no token); any other serves mutual TLS with its service's certificate, and outgoing calls
check the name every service certificate carries (`gpuloom`).
"""

from __future__ import annotations

import enum
import os

import structlog

from gpuloom.credentials import (
    KUBERNETES_COMPONENTS,
    SERVER_NAME,
    CredentialsError,
    default_directory,
    ensure,
    existing,
    kubernetes_complete,
)
from gpuloom.services.common.server import is_loopback
from gpuloom.services.common.settings import SettingsError
from gpuloom.transport import TransportConfigError, load_settings

log = structlog.get_logger("gpuloom.security")

EXPLICIT = ("GPULOOM_AUTH_TOKENS_FILE", "GPULOOM_TLS_CERT_FILE")


class Security(enum.StrEnum):
    CONFIGURED = "configured"  # the operator's own settings
    CREDENTIALS = "credentials"  # the credentials directory
    OPEN = "open"  # GPULOOM_INSECURE


def secure_process(services: tuple[str, ...], bind_host: str, embedded: bool) -> Security:
    """Set this process's GPULOOM_AUTH_* / GPULOOM_TLS_* for `services` bound to `bind_host`
    (`embedded`: `gpuloom up`, which makes the credentials directory if it is missing).
    SettingsError naming what to do when there is nothing to serve with."""
    env = os.environ
    if any(env.get(variable) for variable in EXPLICIT):
        return Security.CONFIGURED
    try:
        insecure = load_settings().insecure
    except TransportConfigError as error:
        raise SettingsError(str(error)) from None
    if insecure:
        log.warning(
            "OPEN PLANE: GPULOOM_INSECURE is set, so every port serves WITHOUT AUTHENTICATION: "
            "anyone who reaches it may cancel any job, reserve and evict on any GPU, and read "
            "every job's assignment token (docs/security.md)",
            services=list(services),
        )
        return Security.OPEN
    directory = default_directory()
    loopback = is_loopback(bind_host)
    try:
        credentials = (
            ensure(directory, client_tls=not loopback) if embedded else existing(directory)
        )
    except CredentialsError as error:
        raise SettingsError(f"GPULOOM_CREDENTIALS_DIR: {error}") from None
    if credentials is None:
        raise SettingsError(
            f"GPULOOM_CREDENTIALS_DIR: no credentials in {directory}: make them once with "
            "`gpuloom credentials init` (compose: the credentials job; Kubernetes: the "
            "gpuloom-credentials Secret), or give your own with GPULOOM_TLS_* and "
            "GPULOOM_AUTH_TOKENS_FILE; GPULOOM_INSECURE=true serves with no authentication at "
            "all (docs/security.md)"
        )
    # gpuloom's Kubernetes components call placement as the submitter `kubernetes`, with a
    # token and a certificate of their own (`init --kubernetes`), never the services' token.
    component = services[0] if len(services) == 1 and services[0] in KUBERNETES_COMPONENTS else ""
    if component and not kubernetes_complete(credentials):
        raise SettingsError(
            f"GPULOOM_CREDENTIALS_DIR: {directory} holds no {component}.token and certificate: "
            "gpuloom's Kubernetes components call placement as the submitter kubernetes, never "
            "with the services' token; make their files with `gpuloom credentials init "
            "--kubernetes`"
        )
    env["GPULOOM_CREDENTIALS_DIR"] = str(directory)
    env["GPULOOM_AUTH_TOKENS_FILE"] = str(credentials.tokens)
    env.pop("GPULOOM_AUTH_TOKEN", None)
    token = credentials.file(f"{component}.token") if component else credentials.service_token
    env["GPULOOM_AUTH_TOKEN_FILE"] = str(token)
    if loopback:
        env.setdefault("GPULOOM_AUTH_ANONYMOUS_READS", "true")
        for variable in ("GPULOOM_TLS_CA_FILE", "GPULOOM_TLS_KEY_FILE"):
            env[variable] = ""  # set, empty: no TLS, whatever the directory's client settings
    else:
        # One certificate per process: its service's (`gpuloom up` serves every service
        # under placement's; every service certificate names `gpuloom`, which clients check).
        cert, key = credentials.certificate(services[0] if len(services) == 1 else "placement")
        env["GPULOOM_TLS_CERT_FILE"] = str(cert)
        env["GPULOOM_TLS_KEY_FILE"] = str(key)
        env["GPULOOM_TLS_CA_FILE"] = str(credentials.ca)
        env.setdefault("GPULOOM_TLS_SERVER_NAME", SERVER_NAME)
    log.info(
        "serving with the credentials directory",
        directory=str(directory),
        tls=not loopback,
        anonymous_reads=loopback,
        admin_token=str(credentials.admin_token),
    )
    return Security.CREDENTIALS
