"""gRPC answers in tests: what a refused call said."""

from __future__ import annotations

from collections.abc import Awaitable

import grpc
import pytest


async def refusal(call: Awaitable[object]) -> tuple[grpc.StatusCode, str]:
    """The status code and details `call` fails with (the test fails if it succeeds)."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), caught.value.details() or ""
