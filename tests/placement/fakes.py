"""An in-memory stand-in for the dispatchers placement binds on (the `Dispatchers` protocol):
it keeps each GPU's reservations, can be told to refuse, and checks that nothing is reserved
twice under different tokens."""

from __future__ import annotations

from collections import defaultdict

from gpuloom.services.common.errors import AlreadyExists, Unavailable
from gpuloom.services.placement.dispatchers import BindRequest


class FakeDispatchers:
    def __init__(self) -> None:
        self.held: dict[str, dict[str, BindRequest]] = defaultdict(dict)  # address -> id -> req
        self.down: set[str] = set()
        self.reserve_calls = 0

    async def reserve(self, address: str, request: BindRequest) -> dict[str, str]:
        self.reserve_calls += 1
        if address in self.down:
            raise Unavailable(f"dispatcher {address} unreachable")
        held = self.held[address]
        prior = held.get(request.assignment_id)
        if prior is not None and prior != request:
            raise AlreadyExists(f"assignment {request.assignment_id} exists with another request")
        held[request.assignment_id] = request
        return {"GPULOOM_ASSIGNMENT_ID": request.assignment_id, "GPULOOM_DISPATCHER": address}

    async def release(self, address: str, assignment_id: str) -> None:
        if address in self.down:
            raise Unavailable(f"dispatcher {address} unreachable")
        self.held[address].pop(assignment_id, None)

    async def close(self) -> None:
        pass

    def all_held(self) -> dict[str, str]:
        """assignment id -> dispatcher address, over every dispatcher."""
        return {aid: address for address, held in self.held.items() for aid in held}
