"""Container healthcheck of a gpuloom service: ask the standard gRPC health service.

    python healthcheck.py ADDRESS [SERVICE]

Exits 0 when ADDRESS (host:port) answers SERVING for SERVICE (default: the whole server);
otherwise 1, with one line on stderr saying what answered (or did not); 2 for a bad call.
Every gpuloom server registers grpc.health.v1.Health (services/common/server.py).
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def check(address: str, service: str = "", timeout_s: float = TIMEOUT_S) -> str | None:
    """None when `address` serves `service`, else why not (one line)."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
    except grpc.RpcError as error:
        return f"{address}: {error.code().name}: {error.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return f"{address}: {service or 'server'} is {status}"
    return None


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or not argv[1] or argv[1].startswith("-"):
        sys.stderr.write("usage: healthcheck.py HOST:PORT [SERVICE]\n")
        return 2
    problem = check(argv[1], argv[2] if len(argv) == 3 else "")
    if problem is not None:
        sys.stderr.write(problem + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
