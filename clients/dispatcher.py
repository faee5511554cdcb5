"""A synchronous client for one GPU's dispatcher (gpuloom.v1.Dispatcher): its status, and
releasing or evicting a reservation. Returns the domain's `DispatcherStatus` and raises the
domain errors of gpuloom/domain/errors.py, like the other clients."""

from __future__ import annotations

from gpuloom.clients.blocking import BlockingClient
from gpuloom.convert.dispatcher import status_from_pb, suspend_state_from_pb
from gpuloom.domain.dispatcher import DispatcherStatus, SuspendState
from gpuloom.v1 import dispatcher_pb2 as pb
from gpuloom.v1 import dispatcher_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "localhost:50060"


class DispatcherClient(BlockingClient):
    """Blocking calls to the dispatcher at `address`. Use as a context manager, or call close()."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout_s: float = 10.0) -> None:
        super().__init__(address, pb_grpc.DispatcherStub, timeout_s)

    def status(self) -> DispatcherStatus:
        return status_from_pb(self._call("GetGpuStatus", pb.GetGpuStatusRequest()))

    def release(self, assignment_id: str) -> bool:
        """Release a reservation; False when there was none (already released)."""
        answer = self._call("Release", pb.ReleaseRequest(assignment_id=assignment_id))
        return bool(answer.released)

    def set_mig_mode(self, enabled: bool) -> bool:
        """Turn the GPU's MIG mode on or off; whether it is on now."""
        answer = self._call("SetMigMode", pb.SetMigModeRequest(enabled=enabled))
        return bool(answer.mig_enabled)

    def suspend(
        self, assignment_id: str, max_wait_ms: float = 0.0, reason: str = ""
    ) -> SuspendState:
        """Suspend a client at its next low-memory point (NotFound: no such reservation)."""
        answer = self._call(
            "SuspendClient",
            pb.SuspendClientRequest(
                assignment_id=assignment_id, max_wait_ms=max_wait_ms, reason=reason
            ),
            timeout_s=self._timeout_s + max_wait_ms / 1e3,  # it may wait that long
        )
        return _suspend_state(answer)

    def resume(self, assignment_id: str) -> SuspendState:
        """Admit a suspended client's kernels again (NotFound: no such reservation)."""
        return _suspend_state(
            self._call("ResumeClient", pb.ResumeClientRequest(assignment_id=assignment_id))
        )

    def evict(self, assignment_id: str, reason: str = "") -> None:
        """Disconnect the process holding the reservation and release it (NotFound: none)."""
        self._call("EvictClient", pb.EvictClientRequest(assignment_id=assignment_id, reason=reason))


def _suspend_state(status: pb.ClientStatus) -> SuspendState:
    return suspend_state_from_pb(status)
