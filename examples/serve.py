"""A tiny inference-like workload for `gpuloom run` (README, docs/jobs.md):

    .venv/bin/gpuloom run --sm 24 --quota 40 --memory-gib 4 -- python examples/serve.py

It loads its "weights" (1 GiB of device memory, within the 4 GiB cap above), then serves
REQUESTS requests, each launching a few kernels and waiting for them, and prints the latencies.
The GPU work is done by the checkout's `shim/build/cudart_like` (built by `scripts/up` and
`scripts/test`), a small C program that calls the CUDA driver API as a CUDA application does,
so the launch shim `gpuloom run` preloads sees every launch and holds it to the job's share.
On a machine without a CUDA driver it runs on the fake libcuda the shim is tested with
(`shim/build/fake`), whose kernels take the time their names say.

Environment: SERVE_REQUESTS (default 20), SERVE_FAKE_DRIVER=1 to use the fake driver even
where a real one is installed.
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BUILD = Path(__file__).resolve().parents[1] / "shim" / "build"
PROGRAM = BUILD / "cudart_like"
# One request: a preprocessing, a GEMM and a softmax kernel, 0.2 to 0.5 ms each on the fake GPU.
KERNELS = ("k_preprocess_200us", "k_gemm_500us", "k_softmax_200us")
PAUSE_US = 2000  # between requests: the host waits for the next one
GAP_US = 50  # between a request's kernels: the host's own work
WEIGHTS_BYTES = 1 << 30  # device memory held for the whole run (`gpuloom top` shows it)


def driver_environment() -> dict[str, str]:
    """The environment of the GPU program: the fake driver first where no real one exists."""
    environment = dict(os.environ)
    if os.environ.get("SERVE_FAKE_DRIVER") == "1" or ctypes.util.find_library("cuda") is None:
        fake = BUILD / "fake"
        library_path = os.environ.get("LD_LIBRARY_PATH", "")
        environment["LD_LIBRARY_PATH"] = f"{fake}:{library_path}" if library_path else str(fake)
        # The fake GPU's engine lock and log; one per user unless the caller chose a place.
        environment.setdefault(
            "GPULOOM_FAKE_CUDA_DIR",
            str(Path(tempfile.gettempdir()) / f"gpuloom-fake-cuda-{os.getuid()}"),
        )
    return environment


def main() -> int:
    if not PROGRAM.is_file():
        sys.stderr.write(f"serve.py: {PROGRAM} is not built; run scripts/up or make -C shim\n")
        return 1
    requests = int(os.environ.get("SERVE_REQUESTS", "20"))
    command = [
        str(PROGRAM),
        "module",
        ",".join(KERNELS),
        "alloc",
        "alloc",
        str(WEIGHTS_BYTES),
        "infer",
        str(requests),
        str(PAUSE_US),
        str(GAP_US),
        ",".join(KERNELS),
    ]
    done = subprocess.run(command, env=driver_environment(), capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(f"serve.py: the GPU program failed ({done.returncode})\n")
        sys.stderr.write(done.stdout + done.stderr)
        return 1
    # cudart_like prints "infer requests=N failures=F mean_ms=M p50_ms=P p99_ms=Q".
    line = next(x for x in done.stdout.splitlines() if x.startswith("infer "))
    stats = dict(field.split("=", 1) for field in line.split()[1:])
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")
    sys.stdout.write(
        f"served {requests} requests on a {share}% SM share: mean {stats.get('mean_ms')} ms, "
        f"p99 {stats.get('p99_ms')} ms, failures {stats.get('failures', '0')}\n"
    )
    return 0 if stats.get("failures", "0") == "0" else 1


if __name__ == "__main__":
    sys.exit(main())
