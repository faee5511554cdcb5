"""Container healthcheck of a gpuloom service: ask the standard gRPC health service.

    python healthcheck.py ADDRESS [SERVICE]

Exits 0 when ADDRESS (host:port) answers SERVING for SERVICE (default: the whole server);
otherwise 1, with one line on stderr saying what answered (or did not); 2 for a bad call.
Every gpuloom server registers grpc.health.v1.Health (services/common/server.py), and answers it
without a token. A service that serves TLS is asked over TLS, as the service itself calls: with
GPULOOM_TLS_CA_FILE (and GPULOOM_TLS_CERT_FILE / _KEY_FILE, its own certificate, for mutual
TLS; GPULOOM_TLS_SERVER_NAME, the name to check) from the container's environment.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def check(address: str, service: str = "", timeout_s: float = TIMEOUT_S) -> str | None:
    """None when `address` serves `service`, else why not (one line)."""
    try:
        with _channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
    except grpc.RpcError as error:
        return f"{address}: {error.code().name}: {error.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return f"{address}: {service or 'server'} is {status}"
    return None


def _channel(address: str) -> grpc.Channel:
    ca = os.environ.get("GPULOOM_TLS_CA_FILE", "")
    if not ca:
        return grpc.insecure_channel(address)

    def read(variable: str) -> bytes | None:
        path = os.environ.get(variable, "")
        if not path:
            return None
        with open(path, "rb") as file:
            return file.read()

    credentials = grpc.ssl_channel_credentials(
        read("GPULOOM_TLS_CA_FILE"), read("GPULOOM_TLS_KEY_FILE"), read("GPULOOM_TLS_CERT_FILE")
    )
    name = os.environ.get("GPULOOM_TLS_SERVER_NAME", "")
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(address, credentials, options=options)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or not argv[1] or argv[1].startswith("-"):
        sys.stderr.write("usage: healthcheck.py HOST:PORT [SERVICE]\n")
        return 2
    try:
        problem = check(argv[1], argv[2] if len(argv) == 3 else "")
    except OSError as error:  # a TLS file that cannot be read
        problem = f"{argv[1]}: {error}"
    if problem is not None:
        sys.stderr.write(problem + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
