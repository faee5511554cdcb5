"""The decorators that frame every servicer method: log context, metrics, and domain errors
answered with the status code of gpuloom.convert.status."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog

from gpuloom.convert.status import status_for
from gpuloom.domain import errors
from gpuloom.services.common.metrics import RPC_LATENCY, RPC_TOTAL

Request = TypeVar("Request")
Response = TypeVar("Response")
Handler = Callable[[Any, Request, grpc.aio.ServicerContext], Awaitable[Response]]

log = structlog.get_logger("gpuloom.rpc")


@contextlib.asynccontextmanager
async def _handled(
    service: str, name: str, context: grpc.aio.ServicerContext
) -> AsyncIterator[None]:
    """The frame of every call: log context, metrics, and errors mapped to status codes."""
    started = time.perf_counter()
    code = grpc.StatusCode.OK
    with structlog.contextvars.bound_contextvars(rpc=f"{service}/{name}"):
        try:
            yield
        except errors.DomainError as error:
            code = status_for(error)
            if code is grpc.StatusCode.INTERNAL:
                log.error("unmapped domain error", error=str(error))
            else:
                log.info("request refused", code=code.name, error=error.message)
            await context.abort(code, error.message)
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception("unhandled error")
            await context.abort(code, f"internal error in {name}; see the service log")
        finally:
            RPC_TOTAL.labels(service, name, code.name).inc()
            RPC_LATENCY.labels(service, name).observe(time.perf_counter() - started)


def rpc(service: str) -> Callable[[Handler], Handler]:
    """Wrap an async unary (or client-streaming) servicer method: bind log context, count, time
    and map domain errors.

    Unexpected exceptions become INTERNAL with a generic message (the details go to the log), so
    a bug never leaks a traceback to the caller and never kills the server.
    """

    def decorate(method: Handler) -> Handler:
        name = method.__name__

        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with _handled(service, name, context):
                return await method(self, request, context)

        return wrapper

    return decorate


StreamHandler = Callable[[Any, Any, grpc.aio.ServicerContext], AsyncIterator[Any]]


def stream_rpc(service: str) -> Callable[[StreamHandler], StreamHandler]:
    """`rpc` for server-streaming methods (async generators): the same frame around the whole
    stream."""

    def decorate(method: StreamHandler) -> StreamHandler:
        name = method.__name__

        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with _handled(service, name, context):
                async for item in method(self, request, context):
                    yield item

        return wrapper

    return decorate
