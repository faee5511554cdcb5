"""A bounded fuzz of every RPC of every service, found through the generated descriptors (a new
RPC is covered without a new test): hypothesis-built requests (text with NULs and any unicode,
extreme and negative numbers, NaN and infinities, unknown enum values) and bytes that cannot
decode, sent to the whole control plane on the embedded default. No answer may be INTERNAL or
UNKNOWN, and the service must still be healthy afterwards.

Generated messages go to unary and client-streaming RPCs only: a server stream (WatchJob,
WatchEvents, RunMigBatch) may legitimately run until cancelled (RunMigBatch waits for its
runner to end each task it hands out). Those get the undecodable bytes only.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import os
import pkgutil
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuloom.v1
from tests.control_plane import control_plane

# Bounded for CI (about 15 s in all); scripts/fuzz runs it longer (GPULOOM_FUZZ_EXAMPLES=500).
EXAMPLES_PER_RPC = int(os.environ.get("GPULOOM_FUZZ_EXAMPLES", "12"))
MAX_DEPTH = 3
CALL_TIMEOUT_S = 10.0
# Any bytes, then a length-delimited field claiming far more than follows: never decodes.
UNDECODABLE_TAIL = b"\x0a\xff\xff\x03"


def _methods() -> list[MethodDescriptor]:
    found = []
    for module in pkgutil.iter_modules(gpuloom.v1.__path__):
        if module.name.endswith("_pb2"):
            descriptor = importlib.import_module(f"gpuloom.v1.{module.name}").DESCRIPTOR
            for service in descriptor.services_by_name.values():
                found.extend(service.methods)
    return found


METHODS = _methods()

TEXT = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=24),
    st.sampled_from(["", "\x00", "job-\x00", "é", "\U0001f600", "../../etc", "x" * 5000]),
)
_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [v for v in (low, high, -1, 0, 1, 100, 101) if low <= v <= high]
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        return TEXT
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_ENUM:
        # proto3 enums are open: values the service does not know must be refused, not crash.
        return _integers(-(2**31), 2**31 - 1)
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        width = 32 if kind == FieldDescriptor.TYPE_FLOAT else 64
        special = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, -1.0, 1e308, 5e-324])
        return st.one_of(special, st.floats(width=width))
    return _integers(*_INT_RANGES[kind])


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    return _scalar(field)


def messages(descriptor: Any, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type, each field absent or set to a hostile value."""
    message_class = GetMessageClass(descriptor)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE and depth >= MAX_DEPTH:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name
            strategy: st.SearchStrategy[Any] = st.dictionaries(
                _scalar(entry["key"]), _value(entry["value"], depth), max_size=3
            )
        elif field.is_repeated:
            strategy = st.lists(_value(field, depth), max_size=3)
        else:
            strategy = _value(field, depth)
        fields[field.name] = st.none() | strategy

    def build(values: dict[str, Any]) -> Message:
        message = message_class()
        for name, value in values.items():
            if value is None:
                continue
            field = descriptor.fields_by_name[name]
            target = getattr(message, name) if field.is_repeated else None
            if isinstance(value, dict):
                for key, item in value.items():
                    if isinstance(item, Message):
                        target[key].CopyFrom(item)
                    else:
                        target[key] = item
            elif isinstance(value, list):
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    for item in value:
                        target.add().CopyFrom(item)
                else:
                    target.extend(value)
            elif isinstance(value, Message):
                getattr(message, name).CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return st.fixed_dictionaries(fields).map(build)


class Running:
    """The control plane on its own event loop in a thread, so that hypothesis drives plain
    blocking calls."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._data_dir = Path(tempfile.mkdtemp(prefix="gl-fz-", dir="/tmp"))
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self.addresses: dict[str, str] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._run(),))

    async def _run(self) -> None:
        self._stop = asyncio.Event()
        try:
            async with control_plane(self._data_dir) as addresses:
                self.addresses = addresses
                self._started.set()
                await self._stop.wait()
        except BaseException as error:
            self._error = error
            self._started.set()

    def start(self) -> None:
        self._thread.start()
        self._started.wait(60)
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
        self._loop.close()
        shutil.rmtree(self._data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def channels() -> Iterator[dict[str, grpc.Channel]]:
    running = Running()
    running.start()
    opened = {name: grpc.insecure_channel(address) for name, address in running.addresses.items()}
    try:
        yield opened
    finally:
        for channel in opened.values():
            channel.close()
        running.close()


def _identity(data: bytes) -> bytes:
    return data


def _call(channel: grpc.Channel, method: MethodDescriptor, data: bytes) -> None:
    """Send one serialized request; a server stream is read to its first answer."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    kind = (method.client_streaming, method.server_streaming)
    options = {"request_serializer": _identity, "response_deserializer": _identity}
    try:
        if kind == (False, False):
            channel.unary_unary(path, **options)(data, timeout=CALL_TIMEOUT_S)
        elif kind == (True, False):
            channel.stream_unary(path, **options)(iter([data]), timeout=CALL_TIMEOUT_S)
        else:
            callable_ = channel.unary_stream if kind[0] is False else channel.stream_stream
            request = data if kind[0] is False else iter([data])
            stream = callable_(path, **options)(request, timeout=CALL_TIMEOUT_S)
            try:
                next(stream, None)
            finally:
                stream.cancel()
    except grpc.RpcError as error:
        code = error.code()  # type: ignore[attr-defined]
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
            f"{path}: {code.name}: {error.details()}"  # type: ignore[attr-defined]
        )


def _assert_healthy(channel: grpc.Channel, method: MethodDescriptor) -> None:
    answer = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=method.containing_service.full_name), timeout=5
    )
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES_PER_RPC,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
UNARY_REQUEST = [m for m in METHODS if not m.server_streaming]


def test_every_service_and_rpc_is_found() -> None:
    services = {m.containing_service.full_name for m in METHODS}
    assert services >= {
        "gpuloom.v1.ProfileStore",
        "gpuloom.v1.Profiler",
        "gpuloom.v1.Placement",
        "gpuloom.v1.Dispatcher",
    }
    assert len(METHODS) >= 30


@pytest.mark.parametrize("method", UNARY_REQUEST, ids=lambda m: m.full_name)
def test_generated_requests_are_answered_without_internal_errors(
    channels: dict[str, grpc.Channel], method: MethodDescriptor
) -> None:
    channel = channels[method.containing_service.full_name]

    @FUZZ_SETTINGS
    @given(request=messages(method.input_type))
    def fuzz(request: Message) -> None:
        _call(channel, method, request.SerializeToString())

    fuzz()
    _assert_healthy(channel, method)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.full_name)
def test_undecodable_bytes_are_answered_without_internal_errors(
    channels: dict[str, grpc.Channel], method: MethodDescriptor
) -> None:
    channel = channels[method.containing_service.full_name]

    @FUZZ_SETTINGS
    @given(prefix=st.binary(max_size=48))
    def fuzz(prefix: bytes) -> None:
        _call(channel, method, prefix + UNDECODABLE_TAIL)

    fuzz()
    _assert_healthy(channel, method)
