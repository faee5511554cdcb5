"""Bytes that are no valid request are answered INVALID_ARGUMENT by every service (they used to
be UNKNOWN "Unexpected DecodeError", or INTERNAL on a client stream)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.control_plane import control_plane

# A field 1 of wire type "length-delimited" claiming more bytes than follow; then a text field
# (GetJobRequest.job_id, ...) holding invalid UTF-8.
TRUNCATED = b"\x0a\xff\x01abc"
NOT_UTF8 = b"\x0a\x02\xff\xfe"

UNARY_RPCS = {
    "gpuloom.v1.ProfileStore": "GetKernelProfile",
    "gpuloom.v1.Profiler": "GetSession",
    "gpuloom.v1.Placement": "GetJob",
    "gpuloom.v1.Dispatcher": "Release",
}


@pytest.fixture
async def addresses() -> AsyncIterator[dict[str, str]]:
    data_dir = Path(tempfile.mkdtemp(prefix="gl-", dir="/tmp"))
    try:
        async with control_plane(data_dir) as running:
            yield running
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def _identity(data: bytes) -> bytes:
    return data


async def test_undecodable_bytes_are_invalid_argument_on_every_service(
    addresses: dict[str, str],
) -> None:
    for service, method in UNARY_RPCS.items():
        async with grpc.aio.insecure_channel(addresses[service]) as channel:
            call = channel.unary_unary(
                f"/{service}/{method}",
                request_serializer=_identity,
                response_deserializer=_identity,
            )
            for garbage in (TRUNCATED, NOT_UTF8):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await call(garbage, timeout=10)
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
                    service,
                    raised.value.details(),
                )
                assert raised.value.details().startswith("request:")


async def test_undecodable_bytes_in_a_client_stream_are_invalid_argument(
    addresses: dict[str, str],
) -> None:
    async with grpc.aio.insecure_channel(addresses["gpuloom.v1.Profiler"]) as channel:
        call = channel.stream_unary(
            "/gpuloom.v1.Profiler/UploadMeasurements",
            request_serializer=_identity,
            response_deserializer=_identity,
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call(iter([TRUNCATED]), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
