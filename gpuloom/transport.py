"""How a gpuloom process calls a gRPC service: over TLS when GPULOOM_TLS_CA_FILE is set
(mutual TLS when it also holds a certificate), with the bearer token of GPULOOM_AUTH_TOKEN or
GPULOOM_AUTH_TOKEN_FILE in each call's `authorization` header. The services' outgoing channels
and the clients (CLI included) open their channels here, so both follow the same settings.
Where the environment sets neither the token nor TLS, the client settings of the credentials
directory (gpuloom/credentials.py, `client.env`) stand in, as kubectl reads its kubeconfig.

What a service accepts (its certificate, the table of tokens, who may call what) is the server
side, services/common/auth.py; docs/security.md tells how to deploy them together.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import grpc
from pydantic import ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuloom.credentials import client_defaults

AUTHORIZATION = "authorization"  # the metadata key of the bearer token (lower case in gRPC)
MAX_TOKEN_CHARS = 512
ChannelOptions = Sequence[tuple[str, Any]]


class TransportConfigError(ValueError):
    """A GPULOOM_TLS_* or GPULOOM_AUTH_* setting is wrong; the message names the variable."""


class TransportSettings(BaseSettings):
    """GPULOOM_TLS_* and GPULOOM_AUTH_*: read by every process, server and client alike."""

    model_config = SettingsConfigDict(env_prefix="GPULOOM_", extra="ignore")

    # This process's certificate chain and private key (PEM): a service's server certificate,
    # and the client certificate its outgoing calls present (mutual TLS).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # The CA bundle (PEM) that verifies the other side: servers verify client certificates
    # with it, clients verify servers. Setting it turns TLS on for outgoing calls.
    tls_ca_file: str = ""
    # Servers with a certificate: require and verify a client certificate (mutual TLS).
    tls_client_auth: bool = True
    # Outgoing calls: check the server's certificate for this name instead of the address's
    # host (e.g. when calling by IP a certificate that names hosts).
    tls_server_name: str = ""
    # The bearer token outgoing calls send (or the file holding it, first line).
    auth_token: str = ""
    auth_token_file: str = ""
    # Servers: the table of accepted tokens (ROLE NAME TOKEN per line); empty: no tokens.
    auth_tokens_file: str = ""
    # Servers with tokens: calls without one may still read (the RPCs that change nothing and
    # tell no token); the embedded plane on 127.0.0.1 serves so.
    auth_anonymous_reads: bool = False
    # `gpuloom up` / `gpuloom serve`: serve with no authentication at all (the explicit opt-out
    # of the credentials they otherwise make or require; docs/security.md).
    insecure: bool = False
    # Where the deployment's credentials are (gpuloom/credentials.py); empty: the default.
    credentials_dir: str = ""

    @field_validator(
        "tls_cert_file", "tls_key_file", "tls_ca_file", "auth_token_file", "auth_tokens_file"
    )
    @classmethod
    def _readable(cls, path: str) -> str:
        if path:
            try:
                with open(path, "rb"):
                    pass
            except OSError as error:
                raise ValueError(f"cannot read {path}: {error.strerror}") from None
        return path

    @field_validator("auth_token")
    @classmethod
    def _token_chars(cls, token: str) -> str:
        check_token_text(token)
        return token

    @model_validator(mode="after")
    def _consistent(self) -> TransportSettings:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("GPULOOM_TLS_CERT_FILE and GPULOOM_TLS_KEY_FILE go together")
        if self.tls_cert_file and not self.tls_ca_file:
            raise ValueError(
                "GPULOOM_TLS_CA_FILE is needed with GPULOOM_TLS_CERT_FILE (it verifies peers)"
            )
        if self.auth_token and self.auth_token_file:
            raise ValueError("set GPULOOM_AUTH_TOKEN or GPULOOM_AUTH_TOKEN_FILE, not both")
        return self

    @property
    def tls(self) -> bool:
        """Whether outgoing calls use TLS."""
        return bool(self.tls_ca_file)

    def token(self) -> str:
        """The bearer token outgoing calls send ("" for none)."""
        if not self.auth_token_file:
            return self.auth_token
        where = f"GPULOOM_AUTH_TOKEN_FILE ({self.auth_token_file})"
        try:
            with open(self.auth_token_file, encoding="utf-8", errors="replace") as file:
                token = file.readline().strip()
            if not token:
                raise ValueError("its first line is empty")
            check_token_text(token)
        except OSError as error:
            raise TransportConfigError(f"{where}: cannot read: {error.strerror}") from None
        except ValueError as error:
            raise TransportConfigError(f"{where}: {error}") from None
        return token


def check_token_text(token: str) -> None:
    """A token is printable ASCII without spaces (it travels in a header)."""
    if len(token) > MAX_TOKEN_CHARS:
        raise ValueError(f"a token has at most {MAX_TOKEN_CHARS} characters")
    if not all("!" <= c <= "~" for c in token):
        raise ValueError("a token is printable ASCII without spaces")


TOKEN_VARIABLES = ("GPULOOM_AUTH_TOKEN", "GPULOOM_AUTH_TOKEN_FILE")
TLS_VARIABLES = ("GPULOOM_TLS_CA_FILE", "GPULOOM_TLS_CERT_FILE", "GPULOOM_TLS_KEY_FILE")


def load_settings() -> TransportSettings:
    """The settings from the environment, with the credentials directory's client settings
    for the token where the environment sets no GPULOOM_AUTH_TOKEN(_FILE), and for TLS where
    it sets none of GPULOOM_TLS_CA_FILE, _CERT_FILE, _KEY_FILE (a variable set empty counts:
    `GPULOOM_TLS_CA_FILE=` calls without TLS); TransportConfigError naming each wrong
    variable."""
    defaults = client_defaults()
    chosen: dict[str, str] = {}
    for group, taken in (
        (TOKEN_VARIABLES, TOKEN_VARIABLES),
        (TLS_VARIABLES, (*TLS_VARIABLES, "GPULOOM_TLS_SERVER_NAME")),
    ):
        # A variable set, even empty, is the environment's choice (empty: none).
        if not any(variable in os.environ for variable in group):
            chosen.update({k: v for k, v in defaults.items() if k in taken and k not in os.environ})
    fields = {k.removeprefix("GPULOOM_").lower(): v for k, v in chosen.items()}
    try:
        return TransportSettings(**fields)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            where = "_".join(str(part) for part in item["loc"]).upper()
            message = item["msg"].removeprefix("Value error, ")
            problems.append(f"GPULOOM_{where}: {message}" if where else message)
        raise TransportConfigError("invalid configuration: " + "; ".join(problems)) from None


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def channel_credentials(settings: TransportSettings) -> grpc.ChannelCredentials:
    key = read_bytes(settings.tls_key_file) if settings.tls_key_file else None
    chain = read_bytes(settings.tls_cert_file) if settings.tls_cert_file else None
    return grpc.ssl_channel_credentials(read_bytes(settings.tls_ca_file), key, chain)


def _options(settings: TransportSettings, options: ChannelOptions) -> list[tuple[str, Any]]:
    result = list(options)
    if settings.tls and settings.tls_server_name:
        result.append(("grpc.ssl_target_name_override", settings.tls_server_name))
    return result


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


def _with_token(metadata: Any, token: str) -> list[tuple[str, str]]:
    return [*(metadata or ()), (AUTHORIZATION, f"Bearer {token}")]


class _SyncToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the bearer token to every call of a blocking channel."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details: Any) -> _Details:
        return _Details(
            details.method,
            details.timeout,
            _with_token(details.metadata, self._token),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Callable, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def _aio_details(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(
        details.method,
        details.timeout,
        _with_token(details.metadata, token),
        details.credentials,
        details.wait_for_ready,
    )


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(details, self._token), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(details, self._token), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_aio_details(details, self._token), requests)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_aio_details(details, self._token), requests)


def open_channel(
    address: str, options: ChannelOptions = (), settings: TransportSettings | None = None
) -> grpc.Channel:
    """A blocking channel to `address`, with TLS and the token as the settings (by default
    the environment's) say."""
    settings = settings or load_settings()
    opts = _options(settings, options)
    if settings.tls:
        channel = grpc.secure_channel(address, channel_credentials(settings), options=opts)
    else:
        channel = grpc.insecure_channel(address, options=opts)
    token = settings.token()
    return grpc.intercept_channel(channel, _SyncToken(token)) if token else channel


def open_aio_channel(
    address: str, options: ChannelOptions = (), settings: TransportSettings | None = None
) -> grpc.aio.Channel:
    """An asyncio channel to `address`, as `open_channel`. With TLS it watches this process's
    certificate files: after they change, calls go through a channel opened with the new ones
    (a service's channels live as long as the service; its certificates do not)."""
    settings = settings or load_settings()
    if settings.tls:
        return _ReloadingAioChannel(address, options, settings)  # type: ignore[return-value]
    return _open_aio(address, options, settings)


def _open_aio(
    address: str, options: ChannelOptions, settings: TransportSettings
) -> grpc.aio.Channel:
    opts = _options(settings, options)
    token = settings.token()
    interceptors: list[grpc.aio.ClientInterceptor] = (
        [
            _AioUnaryUnary(token),
            _AioUnaryStream(token),
            _AioStreamUnary(token),
            _AioStreamStream(token),
        ]
        if token
        else []
    )
    if settings.tls:
        return grpc.aio.secure_channel(
            address, channel_credentials(settings), options=opts, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)


# How often a reloading channel looks at its files, and how long a replaced channel has to
# finish the calls it carries.
_RELOAD_CHECK_S = 1.0
_REPLACED_GRACE_S = 30.0


def _files_stamp(settings: TransportSettings) -> tuple[tuple[str, int, int], ...]:
    stamp = []
    for path in (settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file):
        try:
            st = os.stat(path) if path else None
        except OSError:
            st = None
        stamp.append((path, st.st_mtime_ns if st else 0, st.st_size if st else -1))
    return tuple(stamp)


class _ReloadingAioChannel:
    """The asyncio channel interface over a channel that is opened again, at most once a
    second, when the certificate, key or CA file changed. A stub's method resolves the current
    channel at each call; calls in flight finish on the channel they started on. Files that do
    not load (a pair half written) keep the current channel until they do."""

    def __init__(self, address: str, options: ChannelOptions, settings: TransportSettings) -> None:
        self._address, self._options, self._settings = address, options, settings
        self._stamp = _files_stamp(settings)
        self._inner = _open_aio(address, options, settings)
        self._checked = time.monotonic()

    def current(self) -> grpc.aio.Channel:
        now = time.monotonic()
        if now - self._checked < _RELOAD_CHECK_S:
            return self._inner
        self._checked = now
        stamp = _files_stamp(self._settings)
        if stamp == self._stamp:
            return self._inner
        try:
            fresh = _open_aio(self._address, self._options, self._settings)
        except (OSError, ValueError, grpc.RpcError):
            return self._inner  # read again at the next check
        replaced, self._inner, self._stamp = self._inner, fresh, stamp
        asyncio.get_running_loop().create_task(replaced.close(_REPLACED_GRACE_S))
        return fresh

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Deferred(self, "unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Deferred(self, "unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Deferred(self, "stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Deferred(self, "stream_stream", method, args, kwargs)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self.current().wait_for_state_change(last_observed_state)

    async def close(self, grace: float | None = None) -> None:
        await self._inner.close(grace)

    async def __aenter__(self) -> _ReloadingAioChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class _Deferred:
    """A stub's multi-callable that takes the reloading channel's current channel per call."""

    __slots__ = ("_args", "_kind", "_kwargs", "_made", "_method", "_owner")

    def __init__(
        self, owner: _ReloadingAioChannel, kind: str, method: str, args: tuple, kwargs: dict
    ) -> None:
        self._owner, self._kind, self._method = owner, kind, method
        self._args, self._kwargs = args, kwargs
        self._made: tuple[grpc.aio.Channel, Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        channel = self._owner.current()
        made = self._made
        if made is None or made[0] is not channel:
            factory = getattr(channel, self._kind)
            made = self._made = (channel, factory(self._method, *self._args, **self._kwargs))
        return made[1](*args, **kwargs)
