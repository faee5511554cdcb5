"""The first check of every request of every service, before any servicer (or database) sees
it: the bytes must decode, and no text field anywhere in the message may hold a NUL byte
(PostgreSQL refuses those, and no name or reason needs one). Invalid UTF-8 in a text field
is refused by the protobuf decoder itself, so it is answered as a decode failure.

Both are answered INVALID_ARGUMENT by a server interceptor that `start_server` installs, so
a new service or RPC is covered without code of its own.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from gpuloom.domain.errors import InvalidArgument
from gpuloom.services.common.metrics import RPC_TOTAL

log = structlog.get_logger("gpuloom.rpc")

Deserializer = Callable[[bytes], Any]


def check_text_fields(message: Message, prefix: str = "") -> None:
    """Raise InvalidArgument naming the first text field (dotted path, `[i]` for a repeated
    element, `[key]` for a map entry) that holds a NUL byte, in nested and repeated messages
    too."""
    for field, value in message.ListFields():
        path = f"{prefix}{field.name}"
        if _is_map(field):
            value_field = field.message_type.fields_by_name["value"]
            for key, item in value.items():
                _check_scalar(field.message_type.fields_by_name["key"], key, f"{path}[{key!r}]")
                _check_value(value_field, item, f"{path}[{key!r}]")
        elif field.is_repeated:
            for index, item in enumerate(value):
                _check_value(field, item, f"{path}[{index}]")
        else:
            _check_value(field, value, path)


def _is_map(field: FieldDescriptor) -> bool:
    return (
        field.type == FieldDescriptor.TYPE_MESSAGE
        and field.is_repeated
        and field.message_type.GetOptions().map_entry
    )


def _check_value(field: FieldDescriptor, value: Any, path: str) -> None:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        check_text_fields(value, f"{path}.")
    else:
        _check_scalar(field, value, path)


def _check_scalar(field: FieldDescriptor, value: Any, path: str) -> None:
    if field.type == FieldDescriptor.TYPE_STRING and "\x00" in value:
        raise InvalidArgument(path, "must not contain a NUL byte")


def _decoded(deserializer: Deserializer | None, data: bytes) -> Any:
    """The request, decoded and checked; InvalidArgument for anything malformed."""
    if deserializer is None:
        return data
    try:
        request = deserializer(data)
    except Exception:
        # The decoder says nothing useful (nor which field); no detail is lost to the caller.
        raise InvalidArgument(
            "request", "cannot be decoded (malformed protobuf, or a text field not UTF-8)"
        ) from None
    # No zero byte anywhere in the encoding, no NUL in any text field: that skips the walk over
    # the fields (for a 100,000-record measurement batch, 0.5 s against 10 ms to decode).
    if isinstance(request, Message) and b"\x00" in data:
        check_text_fields(request)
    return request


class RequestValidator(grpc.aio.ServerInterceptor):
    """Decode requests itself (the handlers get raw bytes from grpc) so that a decode failure
    or a NUL byte is answered INVALID_ARGUMENT instead of UNKNOWN/INTERNAL, before the
    servicer runs."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method  # "/package.Service/Method"
        deserializer = handler.request_deserializer
        serializer = handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary_request(handler.unary_unary, deserializer, method),
                response_serializer=serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _unary_request_streamed(handler.unary_stream, deserializer, method),
                response_serializer=serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _request_stream(handler.stream_unary, deserializer, method),
                response_serializer=serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            _request_stream(handler.stream_stream, deserializer, method),
            response_serializer=serializer,
        )


async def _refuse(context: grpc.aio.ServicerContext, method: str, error: InvalidArgument) -> None:
    service, _, name = method.strip("/").rpartition("/")
    RPC_TOTAL.labels(service, name, grpc.StatusCode.INVALID_ARGUMENT.name).inc()
    log.info("request refused", rpc=method, code="INVALID_ARGUMENT", error=error.message)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error.message)


def _unary_request(behavior: Any, deserializer: Deserializer | None, method: str) -> Any:
    async def checked(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = _decoded(deserializer, data)
        except InvalidArgument as error:
            await _refuse(context, method, error)
        return await behavior(request, context)

    return checked


def _unary_request_streamed(behavior: Any, deserializer: Deserializer | None, method: str) -> Any:
    # A server-streaming behavior either yields its answers or writes them with
    # context.write; the wrapper must be of the same kind for grpc to drive it.
    if inspect.isasyncgenfunction(behavior):

        async def checked_stream(data: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                request = _decoded(deserializer, data)
            except InvalidArgument as error:
                await _refuse(context, method, error)
            async for answer in behavior(request, context):
                yield answer

        return checked_stream

    return _unary_request(behavior, deserializer, method)


def _request_stream(behavior: Any, deserializer: Deserializer | None, method: str) -> Any:
    """Client streams: each message is decoded and checked as the servicer reads it."""

    async def decoded(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for data in requests:
            try:
                yield _decoded(deserializer, data)
            except InvalidArgument as error:
                await _refuse(context, method, error)

    if inspect.isasyncgenfunction(behavior):

        async def checked_stream(requests: AsyncIterator[bytes], context: Any) -> Any:
            async for answer in behavior(decoded(requests, context), context):
                yield answer

        return checked_stream

    async def checked(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        return await behavior(decoded(requests, context), context)

    return checked
