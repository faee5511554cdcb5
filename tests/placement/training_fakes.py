"""Stand-ins for the dispatcher side of Gandiva's live mechanisms: an in-memory
`TrainingControl` (SuspendClient / ResumeClient, MoveClient / UnlockMovedClient) for the core's
tests, and a dispatcher gRPC
server implementing just Reserve, Release, SuspendClient and ResumeClient for the tests that
run placement and `gpuloom run` end to end (the real dispatcher's side is issue 16's other
half)."""

from __future__ import annotations

import grpc

from gpuloom.domain.errors import FailedPrecondition, Unavailable
from gpuloom.v1 import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc


class FakeTrainingControl:
    """Suspensions per assignment id, and every call in order: (call, address, id)."""

    def __init__(self) -> None:
        self.suspended: set[str] = set()
        self.calls: list[tuple[str, str, str]] = []
        self.down: set[str] = set()
        self.move_failures: list[str] = []
        self.unregistered_unlocks = 0

    async def suspend(
        self, address: str, assignment_id: str, max_wait_ms: float, reason: str
    ) -> bool:
        if address in self.down:
            raise Unavailable(f"dispatcher {address} unreachable")
        self.calls.append(("suspend", address, assignment_id))
        self.suspended.add(assignment_id)
        return True

    async def resume(self, address: str, assignment_id: str) -> bool:
        if address in self.down:
            raise Unavailable(f"dispatcher {address} unreachable")
        self.calls.append(("resume", address, assignment_id))
        self.suspended.discard(assignment_id)
        return False

    async def move(
        self, address: str, assignment_id: str, target_gpu_uuid: str, socket_path: str, token: str
    ) -> str:
        """Moved unless `move_failures` holds a reason (taken, one per call); the moved
        process registers with the target after `unregistered_unlocks` refused unlocks."""
        if address in self.down:
            raise Unavailable(f"dispatcher {address} unreachable")
        self.calls.append(("move", address, assignment_id))
        if assignment_id not in self.suspended:
            raise FailedPrecondition(
                f"{assignment_id} is not suspended with its memory checkpointed"
            )
        if self.move_failures:
            return self.move_failures.pop(0)
        self.suspended.discard(assignment_id)  # it runs on the target once unlocked
        return ""

    async def unlock_moved(self, address: str, assignment_id: str) -> None:
        self.calls.append(("unlock_moved", address, assignment_id))
        if self.unregistered_unlocks > 0:
            self.unregistered_unlocks -= 1
            raise FailedPrecondition(f"no process registered for {assignment_id!r} yet")


class FakeDispatcherServicer(dispatcher_pb2_grpc.DispatcherServicer):
    """One GPU's dispatcher: reservations (environment GPULOOM_DISPATCHER names it) and
    suspensions. Every other RPC answers UNIMPLEMENTED (the generated base class)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.reservations: dict[str, dispatcher_pb2.ReserveRequest] = {}
        self.suspended: set[str] = set()

    async def Reserve(
        self, request: dispatcher_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> dispatcher_pb2.Assignment:
        self.reservations[request.assignment_id] = request
        return dispatcher_pb2.Assignment(
            assignment_id=request.assignment_id,
            client_name=request.client_name,
            environment={
                "GPULOOM_DISPATCHER": self.name,
                "GPULOOM_ASSIGNMENT_ID": request.assignment_id,
            },
        )

    async def Release(
        self, request: dispatcher_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> dispatcher_pb2.ReleaseResponse:
        released = self.reservations.pop(request.assignment_id, None) is not None
        self.suspended.discard(request.assignment_id)
        return dispatcher_pb2.ReleaseResponse(released=released)

    async def SuspendClient(
        self, request: dispatcher_pb2.SuspendClientRequest, context: grpc.aio.ServicerContext
    ) -> dispatcher_pb2.ClientStatus:
        return await self._set_suspended(request.assignment_id, True, context)

    async def ResumeClient(
        self, request: dispatcher_pb2.ResumeClientRequest, context: grpc.aio.ServicerContext
    ) -> dispatcher_pb2.ClientStatus:
        return await self._set_suspended(request.assignment_id, False, context)

    async def _set_suspended(
        self, assignment_id: str, suspended: bool, context: grpc.aio.ServicerContext
    ) -> dispatcher_pb2.ClientStatus:
        if assignment_id not in self.reservations:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such assignment")
        (self.suspended.add if suspended else self.suspended.discard)(assignment_id)
        return self._status(assignment_id)

    def _status(self, assignment_id: str) -> dispatcher_pb2.ClientStatus:
        return dispatcher_pb2.ClientStatus(
            assignment=dispatcher_pb2.Assignment(assignment_id=assignment_id),
            suspended=assignment_id in self.suspended,
        )


class FakeDispatcherServer:
    def __init__(self, name: str) -> None:
        self.servicer = FakeDispatcherServicer(name)
        self.server = grpc.aio.server()
        dispatcher_pb2_grpc.add_DispatcherServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(0)


def cycle(minibatch_s: float, minibatches: int = 10) -> common_pb2.TrainingCycle:
    return common_pb2.TrainingCycle(
        minibatch_s=minibatch_s, stable=True, samples=minibatches * 4, minibatches=minibatches
    )
