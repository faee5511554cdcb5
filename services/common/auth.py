"""Who may call a gpuloom service: the server side of gpuloom/transport.py, installed on every
server by `start_server`.

- **TLS** (`GPULOOM_TLS_CERT_FILE`, `_KEY_FILE`, `_CA_FILE`): the server presents its
  certificate and, with `GPULOOM_TLS_CLIENT_AUTH` (the default), requires a client certificate
  signed by the CA (mutual TLS). The three files are read again when one of them changes
  (checked at each new connection), so a renewed certificate needs no restart.
- **Bearer tokens** (`GPULOOM_AUTH_TOKENS_FILE`): every call must carry
  `authorization: Bearer TOKEN` with a token of the table, else UNAUTHENTICATED. A `submitter`
  token may call only the submitters' RPCs of placement (PERMISSION_DENIED for the others);
  `admin` and `service` tokens may call every RPC. The caller is known to the servicer through
  `current_caller()`; placement shows and ends a submitter's own jobs only, and tells a job's
  assignment token to its submitter only. The table is read again when the file changes.
- **Anonymous reads** (`GPULOOM_AUTH_ANONYMOUS_READS`, the embedded plane on 127.0.0.1): a
  call without a token may still make the RPCs of READ_RPCS, which change nothing and tell no
  token; everything else needs one.

Health and reflection stay open (they tell nothing secret; grpcurl needs reflection). With
neither tokens nor client certificates the server is open to whoever reaches it, and says so
in a warning at start-up: `gpuloom up` and `gpuloom serve` run so only when told to
(GPULOOM_INSECURE, docs/security.md).
"""

from __future__ import annotations

import contextvars
import enum
import hashlib
import inspect
import os
import re
import ssl
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from gpuloom.services.common.metrics import RPC_TOTAL
from gpuloom.services.common.settings import SettingsError
from gpuloom.transport import (
    AUTHORIZATION,
    TransportConfigError,
    TransportSettings,
    check_token_text,
    load_settings,
    read_bytes,
)

log = structlog.get_logger("gpuloom.auth")

OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)
# What a submitter token may call: its jobs, and the fleet they run on.
SUBMITTER_RPCS = frozenset(
    f"/gpuloom.v1.Placement/{name}"
    for name in (
        "SubmitJob",
        "GetJob",
        "ListJobs",
        "CancelJob",
        "WatchJob",
        "ReportJobDone",
        "ReportCheckpoint",
        "ListGpus",
    )
)
# What a call without a token may make where anonymous reads are on: these change nothing and
# tell no token (GetJob tells a job's token to its submitter only, and an anonymous caller
# submitted nothing). Anything not listed needs a token, a new RPC included.
READ_RPCS = frozenset(
    f"/gpuloom.v1.{service}/{name}"
    for service, names in (
        ("Placement", ("GetJob", "ListJobs", "WatchJob", "ListGpus")),
        ("Dispatcher", ("GetGpuStatus", "ListClients", "WatchEvents", "ListModels")),
        (
            "ProfileStore",
            (
                "GetKernelProfile",
                "GetThroughputProfile",
                "GetMigProfile",
                "GetJobProfile",
                "ListProfiles",
            ),
        ),
        ("Profiler", ("GetSession", "ListSessions", "AnalyzeMemory")),
    )
    for name in names
)
NAME = re.compile(r"[A-Za-z0-9._@-]{1,128}")
MIN_TOKEN_CHARS = 16
RELOAD_CHECK_S = 1.0


class Role(enum.StrEnum):
    ADMIN = "admin"  # every RPC, every job
    SUBMITTER = "submitter"  # placement's job RPCs, its own jobs only
    SERVICE = "service"  # every RPC: the services' calls to one another
    ANONYMOUS = "anonymous"  # no token, where anonymous reads are on: READ_RPCS only


@dataclass(frozen=True, slots=True)
class Caller:
    name: str
    role: Role

    @property
    def sees_every_job(self) -> bool:
        return self.role is not Role.SUBMITTER


ANONYMOUS = Caller("", Role.ANONYMOUS)


_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar(
    "gpuloom_caller", default=None
)


def current_caller() -> Caller | None:
    """The authenticated caller of the RPC being served; None when the server takes no tokens."""
    return _CALLER.get()


def _digest(token: str) -> bytes:
    # Looked up by digest: the comparison never runs over the secret itself.
    return hashlib.sha256(token.encode()).digest()


def parse_tokens(text: str, source: str) -> dict[bytes, Caller]:
    """The table of a tokens file: one `ROLE NAME TOKEN` a line, `#` comments. ValueError
    naming the file and line for anything else."""
    table: dict[bytes, Caller] = {}
    roles: dict[str, Role] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}"
        fields = line.split()
        if len(fields) != 3:
            raise ValueError(f"{where}: expected ROLE NAME TOKEN, got {len(fields)} fields")
        role_text, name, token = fields
        try:
            role = Role(role_text)
        except ValueError:
            known = ", ".join(r.value for r in Role)
            raise ValueError(f"{where}: unknown role {role_text[:40]!r} (known: {known})") from None
        if role is Role.ANONYMOUS:
            raise ValueError(f"{where}: anonymous is no token's role")
        if not NAME.fullmatch(name):
            raise ValueError(f"{where}: the name must match [A-Za-z0-9._@-]{{1,128}}")
        try:
            check_token_text(token)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"{where}: a token has at least {MIN_TOKEN_CHARS} characters")
        if roles.setdefault(name, role) is not role:
            raise ValueError(f"{where}: {name!r} has another role on an earlier line")
        digest = _digest(token)
        if digest in table:
            raise ValueError(f"{where}: this token is on an earlier line too")
        table[digest] = Caller(name, role)
    return table


def _stamp(paths: tuple[str, ...]) -> tuple[tuple[int, int, int], ...] | None:
    try:
        return tuple(
            (s.st_mtime_ns, s.st_size, s.st_ino) for s in (os.stat(path) for path in paths)
        )
    except OSError:
        return None


def _warn_if_shared(path: str, variable: str) -> None:
    # Group access is how Kubernetes hands a Secret to a pod's user (fsGroup); world access is
    # a mistake.
    mode = os.stat(path).st_mode
    if mode & stat.S_IRWXO:
        log.warning(
            "secret file readable by every user; chmod 600 it",
            variable=variable,
            path=path,
            mode=oct(stat.S_IMODE(mode)),
        )


class TokenTable:
    """The tokens file, read again (at most once a second) when it changes. A changed file
    that does not parse is logged and the table before it kept."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._stamp = _stamp((path,))
        try:
            self._table = parse_tokens(read_bytes(path).decode("utf-8", "replace"), path)
        except (OSError, ValueError) as error:
            raise SettingsError(f"GPULOOM_AUTH_TOKENS_FILE: {error}") from None
        if not self._table:
            raise SettingsError(f"GPULOOM_AUTH_TOKENS_FILE: {path} holds no token")
        _warn_if_shared(path, "GPULOOM_AUTH_TOKENS_FILE")
        self._checked = clock()

    def lookup(self, token: str) -> Caller | None:
        self._reload_if_changed()
        return self._table.get(_digest(token))

    def _reload_if_changed(self) -> None:
        now = self._clock()
        if now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        stamp = _stamp((self.path,))
        if stamp is None or stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            table = parse_tokens(read_bytes(self.path).decode("utf-8", "replace"), self.path)
        except (OSError, ValueError) as error:
            log.error("tokens file not reloaded; keeping the previous tokens", error=str(error))
            return
        self._table = table
        log.info("tokens file reloaded", path=self.path, tokens=len(table))


class CertificateFiles:
    """The server's certificate chain, key and CA, read again when one of the files changes:
    grpc asks `fetch` at each new connection's handshake."""

    def __init__(self, cert: str, key: str, ca: str) -> None:
        self._paths = (cert, key, ca)
        self._stamp = _stamp(self._paths)
        try:
            self.initial = self._configuration()
        except (OSError, ssl.SSLError) as error:
            raise SettingsError(
                f"GPULOOM_TLS_CERT_FILE/GPULOOM_TLS_KEY_FILE: not a certificate and its key: "
                f"{error}"
            ) from None
        _warn_if_shared(key, "GPULOOM_TLS_KEY_FILE")

    def _configuration(self) -> Any:
        cert, key, ca = self._paths
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)  # the pair matches
        return grpc.ssl_server_certificate_configuration(
            [(read_bytes(key), read_bytes(cert))], root_certificates=read_bytes(ca)
        )

    def fetch(self) -> Any:
        """A new configuration if a file changed since the last one; None: keep it."""
        stamp = _stamp(self._paths)
        if stamp is None or stamp == self._stamp:
            return None
        try:
            configuration = self._configuration()
        except (OSError, ssl.SSLError) as error:
            # Half-written (a new certificate, the old key): the next handshake looks again.
            log.error("TLS files not reloaded; keeping the previous ones", error=str(error))
            return None
        if _stamp(self._paths) != stamp:
            return None  # changed while being read: take it at the next handshake
        self._stamp = stamp
        log.info("TLS certificate reloaded", cert=self._paths[0])
        return configuration


class Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Authenticator(grpc.aio.ServerInterceptor):
    """Every call but health and reflection must carry a known bearer token (with
    `anonymous_reads`, the READ_RPCS may come without one); a submitter's only on
    SUBMITTER_RPCS. Without a table (`tokens` None), every call passes, callerless."""

    def __init__(self, tokens: TokenTable | None, anonymous_reads: bool = False) -> None:
        self._tokens = tokens
        self._anonymous_reads = anonymous_reads

    @property
    def takes_tokens(self) -> bool:
        return self._tokens is not None

    def authenticate(self, method: str, metadata: Any) -> Caller:
        assert self._tokens is not None
        headers = [value for key, value in (metadata or ()) if key == AUTHORIZATION]
        if not headers:
            if self._anonymous_reads and method in READ_RPCS:
                return ANONYMOUS
            needs = (
                f"{method.strip('/')} changes state or tells a token, so it needs one; "
                if self._anonymous_reads
                else ""
            )
            raise Refusal(
                grpc.StatusCode.UNAUTHENTICATED,
                f"missing bearer token: {needs}send the header 'authorization: Bearer TOKEN' "
                "(gpuloom clients find it in the credentials directory, or GPULOOM_AUTH_TOKEN / "
                "GPULOOM_AUTH_TOKEN_FILE; docs/security.md)",
            )
        scheme, _, token = str(headers[0]).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Refusal(
                grpc.StatusCode.UNAUTHENTICATED,
                "malformed authorization header: expected 'Bearer TOKEN'",
            )
        caller = self._tokens.lookup(token.strip())
        if caller is None:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token")
        if caller.role is Role.SUBMITTER and method not in SUBMITTER_RPCS:
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method.strip('/')} needs an admin or service token; {caller.name!r} holds "
                "a submitter token",
            )
        return caller

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or self._tokens is None:
            return handler
        if method.strip("/").rpartition("/")[0] in OPEN_SERVICES:
            return handler
        try:
            caller: Caller | Refusal = self.authenticate(
                method, handler_call_details.invocation_metadata
            )
        except Refusal as refusal:
            caller = refusal
        return _wrapped(handler, caller, method)


async def _enter(context: grpc.aio.ServicerContext, caller: Caller | Refusal, method: str) -> None:
    """Refuse the call, or make its caller known to the servicer."""
    if isinstance(caller, Refusal):
        service, _, name = method.strip("/").rpartition("/")
        RPC_TOTAL.labels(service, name, caller.code.name).inc()
        log.info("request refused", rpc=method, code=caller.code.name, error=caller.message)
        await context.abort(caller.code, caller.message)
    else:
        _CALLER.set(caller)


def _wrapped(handler: grpc.RpcMethodHandler, caller: Caller | Refusal, method: str) -> Any:
    kind, make = next(
        (behavior, factory)
        for behavior, factory in (
            (handler.unary_unary, grpc.unary_unary_rpc_method_handler),
            (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
            (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
            (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
        )
        if behavior is not None
    )
    if inspect.isasyncgenfunction(kind):

        async def streamed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _enter(context, caller, method)
            async for answer in kind(request, context):
                yield answer

        behavior: Any = streamed
    else:

        async def answered(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _enter(context, caller, method)
            return await kind(request, context)

        behavior = answered
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


@dataclass
class ServerSecurity:
    """What `start_server` installs: the authenticator, and TLS credentials (None: plaintext)."""

    authenticator: Authenticator
    credentials: grpc.ServerCredentials | None
    client_auth: bool

    @property
    def open(self) -> bool:
        """Whether anyone who reaches the port may call every RPC."""
        return not self.authenticator.takes_tokens and not (self.credentials and self.client_auth)

    @classmethod
    def from_environment(cls) -> ServerSecurity:
        try:
            settings = load_settings()
        except TransportConfigError as error:
            raise SettingsError(str(error)) from None
        return cls.from_settings(settings)

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> ServerSecurity:
        tokens = TokenTable(settings.auth_tokens_file) if settings.auth_tokens_file else None
        credentials = None
        if settings.tls_cert_file:
            files = CertificateFiles(
                settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file
            )
            credentials = grpc.dynamic_ssl_server_credentials(
                files.initial, files.fetch, require_client_authentication=settings.tls_client_auth
            )
        return cls(
            Authenticator(tokens, settings.auth_anonymous_reads),
            credentials,
            settings.tls_client_auth,
        )
