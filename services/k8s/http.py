"""A small HTTP/1.1 server for JSON webhooks: the API server calls the admission webhook and
kube-scheduler calls the extender this way (POST, a JSON body, a JSON answer), over TLS when a
certificate is configured (the API server calls webhooks over HTTPS only).

Each route is a coroutine taking the decoded body and answering (status, JSON). Bodies are
bounded, connections are kept alive, a malformed request gets 400 with a one-line reason and
never reaches a route, and a route that raises answers 500 without taking the server down."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import Awaitable, Callable, Collection, Mapping
from http import HTTPStatus
from typing import Any

import structlog

log = structlog.get_logger("gpuloom.k8s")

Route = Callable[[Any], Awaitable[tuple[int, object]]]
MAX_BODY_BYTES = 64 << 20  # an ExtenderArgs with whole Node objects of a large cluster
MAX_HEADER_BYTES = 64 << 10
IDLE_TIMEOUT_S = 120.0
READ_TIMEOUT_S = 30.0


NOT_READY = {"error": "not ready: another replica leads (leader election)", "status": "waiting"}


class BadRequest(Exception):
    pass


class JsonServer:
    def __init__(
        self,
        routes: Mapping[str, Route],
        health: Callable[[], bool] = lambda: True,
        certified: Collection[str] = (),
        ready: Callable[[], bool] = lambda: True,
    ) -> None:
        """`routes`: POST path -> handler. GET /healthz answers 200 while `health()` holds;
        GET /readyz and the routes answer 503 while `ready()` does not (a replica that does
        not lead).
        `certified`: the paths only a caller with a client certificate the TLS context
        verified may call (`server_tls(..., client_ca_file)`); others get 403."""
        self._routes = dict(routes)
        self._health = health
        self._certified = frozenset(certified)
        self._ready = ready
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        self._server = await asyncio.start_server(
            self._serve, host, port, ssl=tls, limit=MAX_HEADER_BYTES
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A verified client certificate (the context lets callers without one in: the API
        # server calls webhooks without one); its absence bars the certified paths only.
        certified = bool(writer.get_extra_info("peercert"))
        try:
            while True:
                try:
                    request = await asyncio.wait_for(_read_request(reader), IDLE_TIMEOUT_S)
                except BadRequest as error:
                    await _answer(writer, 400, {"error": str(error)}, close=True)
                    return
                if request is None:
                    return
                method, path, body, keep_alive = request
                status, payload = await self._route(method, path, body, certified)
                await _answer(writer, status, payload, close=not keep_alive)
                if not keep_alive:
                    return
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            return
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _route(
        self, method: str, path: str, body: bytes, certified: bool
    ) -> tuple[int, object]:
        path = path.split("?", 1)[0]
        if method == "GET" and path == "/healthz":
            return (200, {"status": "ok"}) if self._health() else (503, {"status": "unhealthy"})
        if method == "GET" and path == "/readyz":
            return (200, {"status": "ready"}) if self._ready() else (503, NOT_READY)
        route = self._routes.get(path)
        if route is None:
            return 404, {"error": f"no route {path!r}"}
        if path in self._certified and not certified:
            return 403, {
                "error": f"{path} needs a client certificate of the deployment's CA "
                "(kube-scheduler's extender tlsConfig: certFile, keyFile)"
            }
        if method != "POST":
            return 405, {"error": f"{path} takes POST"}
        if not self._ready():
            return 503, NOT_READY
        try:
            document = json.loads(body)
        except ValueError as error:
            return 400, {"error": f"the body is not JSON: {error}"}
        try:
            return await route(document)
        except Exception:
            log.exception("a webhook route failed", path=path)
            return 500, {"error": "internal error (logged)"}


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes, bool] | None:
    """(method, path, body, keep-alive) of the next request; None at a clean end."""
    try:
        line = await reader.readline()
    except (asyncio.LimitOverrunError, ValueError):
        raise BadRequest("request line too long") from None
    if not line:
        return None
    parts = line.decode("latin-1").rstrip("\r\n").split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest("malformed request line")
    method, path, version = parts
    headers: dict[str, str] = {}
    size = 0
    while True:
        try:
            raw = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
        except (asyncio.LimitOverrunError, ValueError):
            raise BadRequest("header line too long") from None
        size += len(raw)
        if size > MAX_HEADER_BYTES:
            raise BadRequest("headers too large")
        text = raw.decode("latin-1").rstrip("\r\n")
        if not text:
            break
        name, sep, value = text.partition(":")
        if not sep:
            raise BadRequest("malformed header")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise BadRequest("chunked bodies are not taken: send Content-Length")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise BadRequest("bad Content-Length") from None
    if not 0 <= length <= MAX_BODY_BYTES:
        raise BadRequest(f"a body of {length} bytes (at most {MAX_BODY_BYTES})")
    body = await asyncio.wait_for(reader.readexactly(length), READ_TIMEOUT_S) if length else b""
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
    return method, path, body, keep_alive


async def _answer(writer: asyncio.StreamWriter, status: int, payload: object, close: bool) -> None:
    body = json.dumps(payload).encode()
    reason = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: {'close' if close else 'keep-alive'}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()


def server_tls(cert_file: str, key_file: str, client_ca_file: str = "") -> ssl.SSLContext:
    """A server context with this certificate and key (TLS 1.2 or newer). With
    `client_ca_file`, a client may present a certificate, which must then be that CA's (a
    caller presenting another is refused at the handshake); JsonServer's `certified` paths
    require one."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        context.verify_mode = ssl.CERT_OPTIONAL
        context.load_verify_locations(cafile=client_ca_file)
    return context
