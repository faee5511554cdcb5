"""The benchmark's `floor-desk` mode (scripts/bench_dispatcher_client.c --desk-alone): the lease
desk's own code in a bare C process answers every client's round trips, and bad arguments fail
instead of hanging."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

# The shim's wire code and the admission engine (its thread, both halves, the FIKIT core).
NATIVE_SOURCES = ("wire.c", "engine.c", "leasedesk.c", "arbiter.c", "fikit.c", "spatial.c")

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = tmp_path_factory.mktemp("bench") / "bench_dispatcher_client"
    subprocess.run(
        [
            "gcc", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'shim' / 'src'}",
            "-o", str(binary), str(ROOT / "scripts" / "bench_dispatcher_client.c"),
            *(str(ROOT / "shim" / "src" / name) for name in NATIVE_SOURCES),
            "-lpthread",
        ],
        check=True,
    )  # fmt: skip
    return binary


def test_the_desk_alone_answers_every_client(client: Path, tmp_path: Path) -> None:
    out = tmp_path / "latencies"
    # 3 clients, 0.5 s, 2 ms between round trips, no spinning
    subprocess.run(
        [str(client), "--desk-alone", "3", "0.5", "2000", "0", str(out)], check=True, timeout=30
    )
    latencies = np.fromfile(out, dtype=np.int64)
    # each client makes up to ~250 round trips; a desk that answered only some clients, or
    # only after the clients' 1 s futex timeout, would leave far fewer
    assert latencies.size >= 3 * 40
    assert (latencies > 0).all()
    assert np.median(latencies) < 100e6  # ns: answered, not timed out
    assert not list(tmp_path.glob("latencies.*"))  # the clients' parts were merged and removed


@pytest.mark.parametrize("clients", ["0", "257", "x"])
def test_a_bad_client_count_fails_at_once(client: Path, tmp_path: Path, clients: str) -> None:
    done = subprocess.run(
        [str(client), "--desk-alone", clients, "0.2", "1000", "0", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert done.returncode == 1
    assert "CLIENTS out of range" in done.stderr
