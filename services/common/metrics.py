"""Prometheus metrics shared by every service, and the endpoint that serves them."""

from __future__ import annotations

import errno

import prometheus_client
import structlog

from gpuloom.services.common.ports import PortInUse

RPC_TOTAL = prometheus_client.Counter(
    "gpuloom_rpc_total",
    "gRPC requests handled, by final status code",
    ["service", "method", "code"],
)
RPC_LATENCY = prometheus_client.Histogram(
    "gpuloom_rpc_latency_seconds",
    "Time spent handling a gRPC request",
    ["service", "method"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
)

log = structlog.get_logger("gpuloom.metrics")


def start_metrics_endpoint(host: str, port: int) -> int | None:
    """Serve /metrics over HTTP in a background thread; port 0 disables it. Returns the port."""
    if port == 0:
        return None
    try:
        server, _thread = prometheus_client.start_http_server(port, addr=host)
    except OSError as error:
        if error.errno != errno.EADDRINUSE:
            raise
        raise PortInUse(host, port) from None
    bound = server.server_port
    log.info("metrics endpoint listening", url=f"http://{host}:{bound}/metrics")
    return bound
