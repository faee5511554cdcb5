"""gRPC server factory: every gpuloom server gets reflection, the standard health service, the
callers' check of auth.py (TLS and bearer tokens, as GPULOOM_TLS_* and GPULOOM_AUTH_* say) and
the request check of validation.py (INVALID_ARGUMENT for undecodable bytes and NUL bytes)."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import signal
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gpuloom.services.common.auth import ServerSecurity
from gpuloom.services.common.ports import PortInUse
from gpuloom.services.common.validation import RequestValidator

log = structlog.get_logger("gpuloom.server")

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ServiceRegistration:
    """A servicer and how to add it: `full_name` is e.g. "gpuloom.v1.ProfileStore"."""

    full_name: str
    add_to_server: Callable[[grpc.aio.Server], None]


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: tuple[str, ...]

    async def stop(self, grace_s: float = 5.0) -> None:
        """Report NOT_SERVING, then let in-flight calls finish for up to `grace_s` seconds."""
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)


def _port_free(host: str, port: int) -> bool:
    """Whether `port` can be bound: asked before grpc binds, whose refusal also writes a
    multi-line native log to stderr."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return True  # let grpc say what is wrong with the host
    family, kind, _, _, address = infos[0]
    with socket.socket(family, kind) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return False
    return True


async def start_server(
    services: Sequence[ServiceRegistration],
    host: str,
    port: int,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> RunningServer:
    """Bind and start an asyncio gRPC server; port 0 picks a free port (see RunningServer.port).
    TLS and tokens come from the environment (SettingsError naming the variable if wrong)."""
    security = ServerSecurity.from_environment()
    server = grpc.aio.server(
        # The caller first: a call without a valid token is refused before its bytes are read.
        interceptors=[security.authenticator, RequestValidator()],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    for service in services:
        service.add_to_server(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(s.full_name for s in services)
    reflection.enable_server_reflection(
        (*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    if port and not _port_free(host, port):
        raise PortInUse(host, port)
    try:
        if security.credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", security.credentials)
    except RuntimeError:  # how grpc says the port is taken
        bound = 0
    if bound == 0:
        raise PortInUse(host, port)
    await server.start()
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "grpc server listening",
        address=f"{host}:{bound}",
        services=list(names),
        tls=security.credentials is not None,
        client_certificates=security.credentials is not None and security.client_auth,
        tokens=security.authenticator.takes_tokens,
    )
    if security.open:
        log.warning(
            "gRPC WITHOUT AUTHENTICATION: anyone who reaches this address may call every RPC "
            "(set GPULOOM_AUTH_TOKENS_FILE and GPULOOM_TLS_*; see docs/security.md)",
            address=f"{host}:{bound}",
        )
    elif security.credentials is None and not is_loopback(host):
        log.warning(
            "bearer tokens WITHOUT TLS: they cross the network in plaintext "
            "(set GPULOOM_TLS_*; see docs/security.md)",
            address=f"{host}:{bound}",
        )
    return RunningServer(server, health_servicer, bound, names)


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


async def wait_for_shutdown_signal() -> signal.Signals:
    """Block until SIGINT or SIGTERM arrives; return which one."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[signal.Signals] = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda s=sig: received.done() or received.set_result(s))
    try:
        return await received
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
