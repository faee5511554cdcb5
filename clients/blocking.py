"""What every blocking gpuloom client shares: one channel, a per-call timeout, and failed calls
turned back into the domain errors the service raised."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self

import grpc

from gpuloom.convert.status import error_from_rpc
from gpuloom.transport import open_channel


class ClosedOnExit(ABC):
    """A `with` block closes it: `close()` on the way out, whatever happened."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @abstractmethod
    def close(self) -> None: ...


class BlockingClient(ClosedOnExit):
    def __init__(
        self, address: str, make_stub: Callable[[grpc.Channel], Any], timeout_s: float
    ) -> None:
        self.address = address
        self._channel = open_channel(address)
        self._stub = make_stub(self._channel)
        self._timeout_s = timeout_s

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request: object, timeout_s: float | None = None) -> Any:
        """`timeout_s`: this call's deadline, when it may take longer than the client's."""
        try:
            return getattr(self._stub, method)(
                request, timeout=self._timeout_s if timeout_s is None else timeout_s
            )
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None
