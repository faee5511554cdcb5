"""The default deployment, as a fresh clone starts it (`gpuloom up`, nothing configured), tried
the way an attacker on the same host would (issue 34):

- a process of another local user (uid `nobody`, through `setpriv`) can make the dispatcher run
  nothing (a MIG batch as older clients sent it, with a command per task), change nothing
  (SetMigMode, Reserve, EvictClient, SubmitJob, CancelJob, PutKernelProfile: UNAUTHENTICATED),
  and learn no assignment token (GetJob and ListJobs answer without it);
- a submitter's token may not touch a dispatcher (PERMISSION_DENIED) nor see another's job;
- an assignment token reaches only the job's submitter: not an admin who sees the job, not an
  anonymous reader, and it is in no log line;
- the credentials were made on the first start (0600 files in a 0700 directory) and the CLI
  finds them without flags.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpuloom.transport import TransportSettings, open_channel
from gpuloom.v1 import dispatcher_pb2, dispatcher_pb2_grpc, placement_pb2_grpc
from gpuloom.v1 import placement_pb2 as pb
from tests.plane import GPULOOM, Plane, running_plane

PYTHON = sys.executable
ROOT = Path(__file__).resolve().parents[2]

# Run as uid nobody: every call another local user can make, and what it got.
AS_NOBODY = r"""
import json, sys
import grpc
from gpuloom.v1 import dispatcher_pb2 as d, placement_pb2 as p, profile_store_pb2 as s
from gpuloom.v1 import dispatcher_pb2_grpc, placement_pb2_grpc, profile_store_pb2_grpc

dispatcher, placement, store, job_id, witness = sys.argv[1:6]
got = {}

def call(name, function):
    try:
        answer = function()
        got[name] = ["OK", answer]
    except grpc.RpcError as error:
        got[name] = [error.code().name, error.details()]

def run_mig_batch(channel):
    # A batch as older clients sent it: the task carries its command (MigTaskSpec field 3).
    spec = d.MigTaskSpec(name="pwn", seconds_by_size={1: 0.1}).SerializeToString()
    for arg in ("sh", "-c", f"id > {witness}"):
        spec += b"\x1a" + bytes([len(arg)]) + arg.encode()
    batch = b"\x0a" + bytes([len(spec)]) + spec
    first = b"\x0a" + bytes([len(batch)]) + batch
    stream = channel.stream_stream(
        "/gpuloom.v1.Dispatcher/RunMigBatch",
        request_serializer=lambda b: b, response_deserializer=d.MigRunUpdate.FromString,
    )(iter([first]), timeout=10)
    return [u.WhichOneof("update") for u in stream]

with grpc.insecure_channel(dispatcher) as channel:
    stub = dispatcher_pb2_grpc.DispatcherStub(channel)
    call("RunMigBatch", lambda: run_mig_batch(channel))
    call("SetMigMode", lambda: str(stub.SetMigMode(d.SetMigModeRequest(enabled=False))))
    call("Reserve", lambda: stub.Reserve(d.ReserveRequest(
        assignment_id="nobody-1", memory_cap_bytes=1 << 30,
        share={"sm_percent": 50, "quota": {"request_percent": 10, "limit_percent": 10}},
    )).assignment_token)
    call("EvictClient", lambda: str(stub.EvictClient(d.EvictClientRequest(assignment_id=job_id))))
    call("GetGpuStatus", lambda: stub.GetGpuStatus(d.GetGpuStatusRequest()).gpu.mig_enabled)
with grpc.insecure_channel(placement) as channel:
    stub = placement_pb2_grpc.PlacementStub(channel)
    call("CancelJob", lambda: p.JobState.Name(
        stub.CancelJob(p.CancelJobRequest(job_id=job_id)).state))
    call("SubmitJob", lambda: stub.SubmitJob(p.SubmitJobRequest(spec=p.JobSpec(
        name="mine", kind=p.JOB_KIND_BATCH,
        resources={"memory_bytes": 1 << 30, "whole_gpus": 1}))).job_id)
    call("GetJob", lambda: dict(stub.GetJob(p.GetJobRequest(job_id=job_id)).assignment.environment))
    call("ListJobs", lambda: [dict(j.assignment.environment)
                              for j in stub.ListJobs(p.ListJobsRequest()).jobs])
with grpc.insecure_channel(store) as channel:
    stub = profile_store_pb2_grpc.ProfileStoreStub(channel)
    call("PutKernelProfile", lambda: str(stub.PutKernelProfile(s.PutKernelProfileRequest())))
print(json.dumps(got))
"""


def as_nobody(script: str, *args: str) -> dict[str, list[object]]:
    """Run `script` as uid nobody (setpriv), from a directory it can read; its JSON answer."""
    folder = Path(tempfile.mkdtemp(prefix="gpuloom-nobody-"))
    try:
        folder.chmod(0o755)
        path = folder / "probe.py"
        path.write_text(script)
        path.chmod(0o644)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(folder),
            "XDG_CONFIG_HOME": str(folder),  # no credentials of its own
            "PYTHONPATH": str(ROOT),
        }
        nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
        result = subprocess.run(
            [*nobody, PYTHON, str(path), *args],
            env=env,
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Plane, Path, Path]]:
    """`gpuloom up` with nothing configured but its own credentials directory (so that this
    test knows where the first start makes it); its log kept."""
    state = tmp_path_factory.mktemp("default-plane")
    credentials = state / "credentials"
    log = state / "plane.log"
    # The state directory is the world-traversable kind a user's checkout is, so the shim
    # socket and the plane's ports are what another user reaches; the credentials are not.
    state.chmod(0o755)
    with running_plane(
        state / "data",
        "A100-80GB:mig,A100-80GB",
        2,
        extra_env={"GPULOOM_CREDENTIALS_DIR": str(credentials)},
        log=log,
    ) as plane:
        yield plane, credentials, log


def cli(plane: Plane, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(plane.env)
    if token is not None:
        env["GPULOOM_AUTH_TOKEN"] = token
    return subprocess.run([GPULOOM, *args], env=env, capture_output=True, text=True, timeout=120)


def submit_share(plane: Plane, name: str, token: str | None = None) -> dict[str, object]:
    """A job of a small MPS share submitted with the CLI (its own token found, or `token`)."""
    job_file = Path(tempfile.mkdtemp()) / "job.yaml"
    job_file.write_text(
        f"name: {name}\nkind: batch\nresources:\n  memory_gib: 1\n"
        "  mps: {sm_percent: 10, quota_request_percent: 10}\n"
    )
    shown = cli(plane, "submit", str(job_file), "--json", token=token)
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def test_the_first_start_made_private_credentials_the_cli_finds_without_flags(
    secured: tuple[Plane, Path, Path],
) -> None:
    plane, credentials, _ = secured
    assert stat.S_IMODE(credentials.stat().st_mode) == 0o700
    files = sorted(p.name for p in credentials.iterdir() if not p.name.startswith("."))
    for name in ("ca.crt", "ca.key", "tokens", "service.token", "admin.token", "client.env"):
        assert name in files
    for service in ("placement", "profile-store", "profiler", "dispatcher", "admin"):
        assert f"{service}.crt" in files and f"{service}.key" in files
    for name in files:
        assert stat.S_IMODE((credentials / name).stat().st_mode) == 0o600, name
    # No flag, no variable: the CLI takes the admin token from the directory and submits.
    job = submit_share(plane, "found-without-flags")
    assert job["state"] == "JOB_STATE_ASSIGNED" and job["owner"] == "admin"


def test_another_local_user_runs_nothing_changes_nothing_and_learns_no_token(
    secured: tuple[Plane, Path, Path],
) -> None:
    plane, _, _ = secured
    job = submit_share(plane, "the-admins")
    witness = Path(tempfile.mkdtemp(prefix="gpuloom-witness-")) / "pwned"
    witness.parent.chmod(0o777)  # whoever the dispatcher ran as could write it
    got = as_nobody(
        AS_NOBODY,
        plane.dispatchers[0],
        plane.placement,
        plane.store,
        str(job["job_id"]),
        str(witness),
    )
    for name in (
        "RunMigBatch",
        "SetMigMode",
        "Reserve",
        "EvictClient",
        "CancelJob",
        "SubmitJob",
        "PutKernelProfile",
    ):
        code, details = got[name]
        assert code == "UNAUTHENTICATED", (name, got[name])
        assert "missing bearer token" in str(details) and "needs one" in str(details)
    # Reads are answered, without any token.
    assert got["GetGpuStatus"] == ["OK", True]  # GPU 0 is still in MIG mode
    code, environment = got["GetJob"]
    assert code == "OK" and "GPULOOM_ASSIGNMENT_TOKEN" not in environment  # type: ignore[operator]
    assert "GPULOOM_ASSIGNMENT_ID" in environment  # type: ignore[operator]
    code, listed = got["ListJobs"]
    assert code == "OK" and all("GPULOOM_ASSIGNMENT_TOKEN" not in e for e in listed)  # type: ignore[union-attr]
    time.sleep(0.5)
    assert not witness.exists()
    shutil.rmtree(witness.parent, ignore_errors=True)
    # Nothing changed: the admin's job still holds its GPU.
    still = json.loads(cli(plane, "job", str(job["job_id"]), "--json").stdout)
    assert still["state"] == "JOB_STATE_ASSIGNED"


def test_a_submitter_may_not_touch_a_dispatcher_and_tokens_reach_only_their_submitter(
    secured: tuple[Plane, Path, Path],
) -> None:
    plane, credentials, log = secured
    added = cli(plane, "credentials", "add", "bob", "--dir", str(credentials))
    assert added.returncode == 0, added.stderr
    bob = (credentials / "bob.token").read_text().strip()
    admins = submit_share(plane, "admins-job")
    bob_settings = TransportSettings.model_construct(auth_token=bob)

    def known() -> bool:  # the services read the tokens file again within a second or two
        with open_channel(plane.placement, settings=bob_settings) as channel:
            try:
                placement_pb2_grpc.PlacementStub(channel).ListJobs(pb.ListJobsRequest(), timeout=10)
            except grpc.RpcError:
                return False
        return True

    deadline = time.monotonic() + 15
    while not known():
        assert time.monotonic() < deadline, "bob's token was never taken"
        time.sleep(0.2)
    with (
        open_channel(plane.dispatchers[1], settings=bob_settings) as channel,
        pytest.raises(grpc.RpcError) as refused,
    ):
        dispatcher_pb2_grpc.DispatcherStub(channel).SetMigMode(
            dispatcher_pb2.SetMigModeRequest(enabled=True), timeout=10
        )
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    assert "needs an admin or service token; 'bob' holds a submitter token" in (
        refused.value.details()  # type: ignore[attr-defined]
    )

    bobs = submit_share(plane, "bobs-job", token=bob)
    assert bobs["owner"] == "bob"
    with open_channel(plane.placement, settings=bob_settings) as channel:
        stub = placement_pb2_grpc.PlacementStub(channel)
        mine = stub.GetJob(pb.GetJobRequest(job_id=str(bobs["job_id"])), timeout=10)
        assert "GPULOOM_ASSIGNMENT_TOKEN" in mine.assignment.environment
        with pytest.raises(grpc.RpcError) as theirs:
            stub.GetJob(pb.GetJobRequest(job_id=str(admins["job_id"])), timeout=10)
        assert theirs.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    bobs_token = mine.assignment.environment["GPULOOM_ASSIGNMENT_TOKEN"]
    # The admin sees bob's job, but not its token.
    admin = (credentials / "admin.token").read_text().strip()
    admin_settings = TransportSettings.model_construct(auth_token=admin)
    with open_channel(plane.placement, settings=admin_settings) as channel:
        seen = placement_pb2_grpc.PlacementStub(channel).GetJob(
            pb.GetJobRequest(job_id=str(bobs["job_id"])), timeout=10
        )
    assert seen.owner == "bob" and "GPULOOM_ASSIGNMENT_TOKEN" not in seen.assignment.environment
    shown = json.loads(cli(plane, "job", str(bobs["job_id"]), "--json").stdout)
    assert "GPULOOM_ASSIGNMENT_TOKEN" not in shown["assignment"]["environment"]

    # No log line carries a token: bearer tokens, the services', assignment tokens.
    text = log.read_text()
    secrets = [bob, bobs_token, (credentials / "admin.token").read_text().strip()]
    secrets.append((credentials / "service.token").read_text().strip())
    assert text and not [s for s in secrets if s in text]
