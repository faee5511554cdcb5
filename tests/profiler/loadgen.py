"""A load generator for sweep tests: "requests" of 2 ms GPU work, each needing a lease from the
dispatcher through the Python reference shim client; prints the sweep's JSON report."""

from __future__ import annotations

import json
import os
import sys
import time

from gpuloom.clients.shim import ShimClient

REQUEST_S = 0.002


def main() -> None:
    seconds = float(sys.argv[1])
    shim = ShimClient.connect(
        os.environ["GPULOOM_DISPATCHER_SOCKET"], os.environ["GPULOOM_ASSIGNMENT_TOKEN"]
    )
    latencies = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        arrived = time.monotonic()
        lease = shim.acquire(timeout_s=5)
        if lease.remaining_s() < REQUEST_S:  # not enough left: wait for the next lease
            time.sleep(lease.remaining_s())
            continue
        time.sleep(REQUEST_S)
        shim.record_usage(REQUEST_S)
        latencies.append((time.monotonic() - arrived) * 1e3)
    shim.close()
    latencies.sort()
    report = {
        "requests_per_s": len(latencies) / seconds,
        "p50_latency_ms": latencies[len(latencies) // 2],
        "p99_latency_ms": latencies[int(len(latencies) * 0.99)],
    }
    print("warming up")  # noise a real load generator may print: ignored
    print(json.dumps(report))


if __name__ == "__main__":
    main()
