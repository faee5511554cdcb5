"""A saturating client process for the fairness tests: it always has work, holds every lease
to its end, reports the time held as GPU time, and prints the intervals it held (JSON).

    python saturate.py SOCKET TOKEN STOP_MONOTONIC_S
"""

from __future__ import annotations

import json
import sys
import time

from gpuloom.clients.shim import ShimClient


def main() -> None:
    socket_path, token, stop = sys.argv[1], sys.argv[2], float(sys.argv[3])
    held = []
    with ShimClient.connect(socket_path, token) as shim:
        while time.monotonic() < stop:
            lease = shim.acquire(timeout_s=5)
            began = time.monotonic()
            time.sleep(lease.remaining_s())
            ended = time.monotonic()
            shim.record_usage(ended - began, burst_s=ended - began)
            held.append((began, ended))
    print(json.dumps(held))


if __name__ == "__main__":
    main()
