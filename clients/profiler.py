"""A synchronous client for the profiler's measurement sessions (gpuloom.v1.Profiler): open,
look at, list and cancel them. Returns the domain's `SessionView` and raises the domain errors
of gpuloom/domain/errors.py, like the other clients."""

from __future__ import annotations

import os

from gpuloom.clients.blocking import BlockingClient
from gpuloom.convert.profiler import STATE_TO_PB, session_from_pb
from gpuloom.domain.profiler import SessionState, SessionView
from gpuloom.v1 import profiler_pb2 as pb
from gpuloom.v1 import profiler_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "localhost:50053"
ADDRESS_ENV = "GPULOOM_PROFILER_ADDRESS"


def default_address() -> str:
    return os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS)


class ProfilerClient(BlockingClient):
    """Blocking calls to the profiler at `address` (default: GPULOOM_PROFILER_ADDRESS, else
    localhost:50053). Use as a context manager, or call close()."""

    def __init__(self, address: str | None = None, timeout_s: float = 10.0) -> None:
        super().__init__(address or default_address(), pb_grpc.ProfilerStub, timeout_s)

    def open(self, task_key: str, gpu_model: str, runs: int = 0) -> SessionView:
        """A session measuring `runs` runs (0: the profiler's default, 20) of the task."""
        request = pb.OpenSessionRequest(task_key=task_key, gpu_model=gpu_model, runs=runs)
        return session_from_pb(self._call("OpenSession", request))

    def get(self, session_id: str) -> SessionView:
        return session_from_pb(
            self._call("GetSession", pb.GetSessionRequest(session_id=session_id))
        )

    def list(
        self, state: SessionState | None = None, task_key: str = "", gpu_model: str = ""
    ) -> list[SessionView]:
        request = pb.ListSessionsRequest(
            state=STATE_TO_PB[state] if state is not None else pb.SESSION_STATE_UNSPECIFIED,
            task_key=task_key,
            gpu_model=gpu_model,
        )
        return [session_from_pb(s) for s in self._call("ListSessions", request).sessions]

    def cancel(self, session_id: str) -> SessionView:
        request = pb.CancelSessionRequest(session_id=session_id)
        return session_from_pb(self._call("CancelSession", request))
