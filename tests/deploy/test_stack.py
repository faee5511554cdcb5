"""`docker compose up`, run for real: the stack of compose.yaml with compose.simulated.yaml (four
dispatchers, one simulated GPU each) built and started on a Docker Engine, then checked from
the host as a user would, with the credentials the stack made (copied out of its `credentials`
volume as docs/deploy.md says): every service healthy, calls without them refused, the GPUs
listed once each, a job run through the shim, the example container, `gpuloom top`; then
restarted three ways (the whole stack stopped and started, taken down and up again, one
dispatcher container restarted), with every assigned job still assigned on its GPU, every
reservation where placement says, and the shims of running jobs connected again; finally no
traceback in any service's log.

The engine: tests/deploy/stack/engine.sh (installs and starts one where none runs, as root); the
base images: tests/deploy/stack/base-images.sh (official ones where a registry answers, else
fixtures made here). In CI (CI=true) a missing engine fails the run and says why; elsewhere the
module is skipped with the reason when no engine answers. docs/deploy.md has the timings.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuloom.clients.placement import PlacementClient
from gpuloom.domain.errors import DomainError
from gpuloom.domain.placement import JobKind, JobSpec, JobState, JobView
from gpuloom.domain.shares import share_of
from tests.deploy.conftest import ROOT

STACK = ROOT / "tests" / "deploy" / "stack"
GPULOOM = str(Path(sys.executable).parent / "gpuloom")
IN_CI = os.environ.get("CI", "").lower() == "true"
GPUS = 4  # dispatcher-gpu0 .. gpu3
COMPOSE = ["docker", "compose", "-f", "compose.yaml", "-f", "compose.simulated.yaml"]
LONG_RUNNING = {"postgres", "redis", "profile-store", "profiler", "placement"} | {
    f"dispatcher-gpu{n}" for n in range(GPUS)
}
ONE_SHOT = {"credentials", "migrate", "socket-dirs"}
GIB = 1 << 30

pytestmark = pytest.mark.timeout(1800)  # the first build of the images takes minutes


@dataclass
class Stack:
    project: str
    env: dict[str, str]  # docker compose's environment (the .env of this stack)
    socket_dir: Path
    publish_host: str
    credentials: Path  # the admin's client files, copied out of the stack (docs/deploy.md)
    timings: dict[str, float] = field(default_factory=dict)
    since: float = 0.0  # when the last `up` began (time.time())

    @property
    def placement(self) -> str:
        return f"{self.publish_host}:50051"

    def compose(self, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*COMPOSE, "-p", self.project, *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def must(self, *args: str, timeout_s: float = 600) -> str:
        result = self.compose(*args, timeout_s=timeout_s)
        assert result.returncode == 0, f"docker compose {' '.join(args)}:\n{result.stderr[-3000:]}"
        return result.stdout

    def up(self, what: str) -> None:
        """`up -d --wait` (timed as `what`), then wait until every GPU's dispatcher has been
        heard from since."""
        began, self.since = time.monotonic(), time.time()
        self.must("up", "-d", "--wait")
        self.timings[what] = time.monotonic() - began
        if not self.credentials.exists():  # the first up made them
            self.copy_credentials()
        deadline = time.monotonic() + 120
        while len(self.registered()) < GPUS:
            assert time.monotonic() < deadline, f"GPUs heard from: {self.registered()}"
            time.sleep(1)

    # Clients on the host go through these two: they find the stack's credentials as a user's
    # do, in the directory GPULOOM_CREDENTIALS_DIR names (its client.env: TLS and the token).
    def placement_client(self, timeout_s: float = 30.0) -> PlacementClient:
        return PlacementClient(self.placement, timeout_s=timeout_s)

    def client_env(self, credentials: Path | None = None) -> dict[str, str]:
        """The environment of the CLI on the host: where placement is published, and the
        credentials directory (the stack's, unless another is given)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOOM_")}
        env["GPULOOM_PLACEMENT_ADDRESS"] = self.placement
        env["GPULOOM_CREDENTIALS_DIR"] = str(credentials or self.credentials)
        return env

    def copy_credentials(self) -> None:
        """What docs/deploy.md tells a user to do once: the client files out of the volume."""
        shutil.rmtree(self.credentials, ignore_errors=True)
        self.must("cp", "credentials:/etc/gpuloom/credentials/.", str(self.credentials))
        self.credentials.chmod(0o700)
        for path in self.credentials.iterdir():
            path.chmod(0o600)

    def gpuloom(
        self, *args: str, timeout_s: float = 120, credentials: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [GPULOOM, *args],
            cwd=ROOT,
            env=self.client_env(credentials),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def registered(self) -> list[str]:
        """The UUIDs of the GPUs whose dispatchers placement heard from since the last `up`."""
        try:
            with self.placement_client(timeout_s=5) as client:
                return [
                    g.gpu.gpu_uuid
                    for g in client.gpus()
                    if g.last_heartbeat >= self.since and not g.lost
                ]
        except DomainError:  # placement not answering yet
            return []

    def reserved(self, gpu_uuid: str) -> dict[str, dict]:
        """Assignment id -> the client status its dispatcher reports, for one GPU."""
        shown = self.gpuloom("dispatcher", "status", "--gpu", gpu_uuid, "--json")
        assert shown.returncode == 0, shown.stderr
        status = json.loads(shown.stdout)
        return {c["assignment"]["assignment_id"]: c for c in status.get("clients", [])}


def _run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def _engine() -> None:
    """An engine with compose v2, or skip (outside CI) / fail (in CI) saying why."""
    answers = shutil.which("docker") is not None and (_run(["docker", "info"], 30).returncode == 0)
    if not answers and not IN_CI:
        pytest.skip(
            "no Docker Engine answers `docker info`; CI (CI=true) installs and starts one with "
            "tests/deploy/stack/engine.sh, which you may run yourself (as root)"
        )
    prepared = _run(["bash", str(STACK / "engine.sh")], 900)
    if prepared.returncode != 0:
        pytest.fail(f"no Docker Engine for the compose test: {prepared.stderr.strip()}")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    _engine()
    began = time.monotonic()
    images = _run(["bash", str(STACK / "base-images.sh")], 1800)
    assert images.returncode == 0, images.stderr[-3000:]
    base_s = time.monotonic() - began
    tag = f"{os.getpid() % 100_000}"
    socket_dir = Path(f"/tmp/gl-stack-{tag}")  # short: Unix socket paths have 108 bytes
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULOOM_", "COMPOSE_"))}
    env.update(
        line.split("=", 1) for line in images.stdout.splitlines() if line.startswith("GPULOOM_")
    )
    publish_host = f"127.0.{os.getpid() % 250 + 1}.1"  # its own loopback address: no port clash
    env.update(
        DOCKER_BUILDKIT="0",  # the classic builder: no buildx here
        COMPOSE_PROFILES=",".join(f"gpu{n}" for n in range(1, GPUS)),
        GPULOOM_POSTGRES_PASSWORD="stacktest0123456789",
        GPULOOM_SOCKET_DIR=str(socket_dir),
        GPULOOM_PUBLISH_HOST=publish_host,
        GPULOOM_NODE_NAME="stack-host",
    )
    credentials = Path(f"/tmp/gl-stack-{tag}-credentials")
    built = Stack(f"gpuloom-stack-{tag}", env, socket_dir, publish_host, credentials)
    built.timings["base images"] = base_s
    # The in-process clients of this module find the stack's credentials as the CLI does.
    outer = os.environ.get("GPULOOM_CREDENTIALS_DIR")
    os.environ["GPULOOM_CREDENTIALS_DIR"] = str(credentials)
    try:
        began = time.monotonic()
        built.must("build", timeout_s=1800)  # as docs/deploy.md: `up --build`, timed apart
        built.timings["build"] = time.monotonic() - began
        built.up("up")
        yield built
    finally:
        if outer is None:
            os.environ.pop("GPULOOM_CREDENTIALS_DIR", None)
        else:
            os.environ["GPULOOM_CREDENTIALS_DIR"] = outer
        shutil.rmtree(credentials, ignore_errors=True)
        down = built.compose("down", "--volumes", "--remove-orphans", timeout_s=300)
        if down.returncode != 0:
            sys.stderr.write(f"docker compose down failed: {down.stderr[-2000:]}\n")
        shutil.rmtree(socket_dir, ignore_errors=True)


def services(stack: Stack) -> dict[str, dict]:
    """Service -> its container as `docker compose ps -a --format json` shows it."""
    out = stack.must("ps", "-a", "--format", "json")
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    if len(rows) == 1 and isinstance(rows[0], list):  # older compose: one JSON array
        rows = rows[0]
    return {row["Service"]: row for row in rows}


def test_every_long_running_service_is_healthy_and_the_one_shot_jobs_exited_0(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    with capsys.disabled():
        timings = ", ".join(f"{k} {v:.0f} s" for k, v in stack.timings.items())
        sys.stderr.write(f"\ncompose stack timings: {timings}\n")
    shown = services(stack)
    assert set(shown) == LONG_RUNNING | ONE_SHOT
    for name in LONG_RUNNING:
        assert shown[name]["State"] == "running" and shown[name]["Health"] == "healthy", shown[name]
    for name in ONE_SHOT:
        assert shown[name]["State"] == "exited" and shown[name]["ExitCode"] == 0, shown[name]


def test_gpuloom_gpus_shows_every_simulated_gpu_once(stack: Stack) -> None:
    listed = stack.gpuloom("gpus", "--json")
    assert listed.returncode == 0, listed.stderr
    uuids = [json.loads(line)["gpu"]["ref"]["gpu_uuid"] for line in listed.stdout.splitlines()]
    assert len(uuids) == GPUS and len(set(uuids)) == GPUS, uuids
    assert all(u.startswith("SIM-A100-80GB-0-") for u in uuids), uuids


def test_a_caller_without_the_stacks_credentials_is_refused(stack: Stack, tmp_path: Path) -> None:
    """Without the client files (no TLS certificate, no token) placement answers nothing: the
    published ports serve mutual TLS. With them the same call answers."""
    stranger = tmp_path / "stranger"
    stranger.mkdir(mode=0o700)
    refused = stack.gpuloom("jobs", credentials=stranger, timeout_s=60)
    assert refused.returncode != 0, refused.stdout
    assert stack.gpuloom("jobs").returncode == 0


def test_gpuloom_run_from_the_host_runs_to_the_end(stack: Stack) -> None:
    ran = stack.gpuloom(
        "run", "--sm", "24", "--quota", "40", "--memory-gib", "4", "--",
        sys.executable, "examples/serve.py",
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "served 20 requests on a 24% SM share" in ran.stdout, ran.stdout
    assert "failures 0" in ran.stdout


def test_the_example_service_runs(stack: Stack) -> None:
    began = time.monotonic()
    ran = stack.compose("--profile", "example", "run", "--rm", "example", timeout_s=1200)
    stack.timings["example (worker build + run)"] = time.monotonic() - began
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    assert "served 20 requests on a 24% SM share" in ran.stdout, ran.stdout[-2000:]


def test_gpuloom_top_once_answers(stack: Stack) -> None:
    top = stack.gpuloom("top", "--once")
    assert top.returncode == 0, top.stderr
    assert f"{GPUS} GPUs" in top.stdout and "errors resolving" not in top.stdout + top.stderr
    assert top.stdout.count("SIM-A100-80GB-0-") == GPUS, top.stdout


def _spec(n: int) -> JobSpec:
    return JobSpec(
        name=f"held-{n}",
        kind=JobKind.INFERENCE,
        share=share_of(50, 50.0, 50.0, memory_bytes=2 * GIB),  # four to a GPU at most
        mps=True,
    )


def _assigned(stack: Stack) -> dict[str, JobView]:
    with stack.placement_client() as client:
        return {j.job_id: j for j in client.list(states=[JobState.ASSIGNED])}


def _check_held_as_before(stack: Stack, before: dict[str, JobView]) -> None:
    """Every job assigned before is assigned now on the same GPU; none is LOST; each GPU's
    dispatcher holds exactly the reservations of the jobs placement has on it."""
    with stack.placement_client() as client:
        lost = list(client.list(states=[JobState.LOST]))
    assert lost == [], [(j.job_id, j.message) for j in lost]
    now = _assigned(stack)
    for job_id, job in before.items():
        assert job_id in now, f"{job_id} is no longer assigned"
        assert job.assignment is not None and now[job_id].assignment is not None
        assert now[job_id].assignment.gpu_uuid == job.assignment.gpu_uuid, job_id
    for gpu_uuid in stack.registered():
        placed = {
            j.assignment.assignment_id
            for j in now.values()
            if j.assignment is not None and j.assignment.gpu_uuid == gpu_uuid
        }
        assert set(stack.reserved(gpu_uuid)) == placed, gpu_uuid


@pytest.fixture(scope="module")
def held(stack: Stack) -> dict[str, JobView]:
    """Six jobs holding shares (no process: their reservations alone), on two GPUs or more."""
    with stack.placement_client() as client:
        jobs = [client.submit(_spec(n)) for n in range(6)]
    assert all(j.state is JobState.ASSIGNED for j in jobs), [j.pending_reason for j in jobs]
    assert len({j.assignment.gpu_uuid for j in jobs if j.assignment}) > 1
    return {j.job_id: j for j in jobs}


def test_stop_and_up_keeps_every_assigned_job_on_its_gpu(
    stack: Stack, held: dict[str, JobView]
) -> None:
    before = _assigned(stack)
    assert held.keys() <= before.keys()
    stack.must("stop")
    stack.up("warm up after stop")
    _check_held_as_before(stack, before)


def test_down_and_up_keeps_every_assigned_job_on_its_gpu(
    stack: Stack, held: dict[str, JobView]
) -> None:
    before = _assigned(stack)
    assert held.keys() <= before.keys()
    stack.must("down")  # containers and network go; the volumes stay
    stack.up("warm up after down")
    _check_held_as_before(stack, before)


def test_a_restarted_dispatcher_gets_its_reservations_and_shims_back(stack: Stack) -> None:
    """A job runs under the shim on the host while its GPU's dispatcher container restarts:
    the reservation is there again, its process connected again, and the job runs to the end."""
    job = subprocess.Popen(
        [GPULOOM, "run", "--sm", "24", "--quota", "40", "--memory-gib", "4", "--",
         sys.executable, "examples/serve.py"],
        cwd=ROOT,
        env={**stack.client_env(), "SERVE_REQUESTS": "6000"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert job.stderr is not None
        line = job.stderr.readline()  # "gpuloom run: job J assigned on GPU G on node N: ..."
        assert " assigned on GPU " in line, line
        gpu_uuid = line.split(" assigned on GPU ")[1].split()[0]
        job_id = line.split("job ")[1].split()[0]
        deadline = time.monotonic() + 60
        while not any(c.get("connected") for c in stack.reserved(gpu_uuid).values()):
            assert time.monotonic() < deadline, "the job's shim never connected"
            time.sleep(0.5)
        slot = next(
            name
            for name in LONG_RUNNING
            if name.startswith("dispatcher")
            and gpu_uuid in stack.must("logs", "--no-log-prefix", name)
        )
        began = time.monotonic()
        stack.must("restart", slot)
        stack.since = time.time()
        with stack.placement_client() as placement:
            assignment = placement.get(job_id).assignment
        assert assignment is not None and assignment.gpu_uuid == gpu_uuid
        deadline = time.monotonic() + 120
        while True:
            reserved = stack.reserved(gpu_uuid) if gpu_uuid in stack.registered() else {}
            client = reserved.get(assignment.assignment_id)
            if client is not None and client.get("connected"):
                break
            assert time.monotonic() < deadline, f"not back after the restart: {reserved}"
            time.sleep(0.5)
        stack.timings["dispatcher restart to shim connected"] = time.monotonic() - began
        out, err = job.communicate(timeout=300)
        assert job.returncode == 0, out + err
        assert "served 6000 requests" in out and "failures 0" in out, out
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_no_service_log_holds_a_traceback(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    logs = stack.must("logs", "--no-color")
    assert "Traceback" not in logs, logs[logs.index("Traceback") - 2000 :][:6000]
    with capsys.disabled():
        timings = ", ".join(f"{k} {v:.0f} s" for k, v in stack.timings.items())
        sys.stderr.write(f"\ncompose stack timings: {timings}\n")
