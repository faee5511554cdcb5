"""Authenticated gRPC: mutual TLS and bearer tokens on every service (services/common/auth.py),
and placement's submitters seeing and ending only their own jobs."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpuloom.services.common.auth import Role, TokenTable, parse_tokens
from gpuloom.services.common.settings import SettingsError
from gpuloom.services.placement.app import PlacementApp
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.services.profile_store.settings import ProfileStoreSettings
from gpuloom.v1 import placement_pb2 as pb
from gpuloom.v1 import placement_pb2_grpc, profile_store_pb2, profile_store_pb2_grpc
from tests.conftest import free_port
from tests.placement.conftest import mps_spec
from tests.rpc import refusal
from tests.security.conftest import Deployment
from tests.security.pki import Authority, write

HOST = "127.0.0.1"


@pytest.fixture
async def placement(deployment: Deployment, tmp_path: Path) -> AsyncIterator[str]:
    settings = PlacementSettings(port=0, database_url=f"sqlite:///{tmp_path / 'placement.db'}")
    app = await PlacementApp.start(settings, HOST, tmp_path)
    yield f"{HOST}:{app.port}"
    await app.stop(0)


async def _submit(stub: placement_pb2_grpc.PlacementStub, request_id: str = "") -> pb.Job:
    return await stub.SubmitJob(
        pb.SubmitJobRequest(request_id=request_id or uuid.uuid4().hex, spec=mps_spec()),
        timeout=10,
    )


async def test_submitters_see_and_end_only_their_own_jobs(
    deployment: Deployment, placement: str
) -> None:
    async with (
        deployment.channel(placement, "alice") as a,
        deployment.channel(placement, "bob") as b,
        deployment.channel(placement, "admin") as root,
    ):
        alice = placement_pb2_grpc.PlacementStub(a)
        bob = placement_pb2_grpc.PlacementStub(b)
        admin = placement_pb2_grpc.PlacementStub(root)
        job = await _submit(alice, "alice-1")
        bobs = await _submit(bob)
        job_id = job.job_id

        for refused in (
            bob.GetJob(pb.GetJobRequest(job_id=job_id)),
            bob.CancelJob(pb.CancelJobRequest(job_id=job_id)),
            bob.ReportJobDone(pb.ReportJobDoneRequest(job_id=job_id, succeeded=True)),
        ):
            code, details = await refusal(refused)
            assert code is grpc.StatusCode.PERMISSION_DENIED
            assert job_id in details and "another submitter" in details
        code, details = await refusal(bob.WatchJob(pb.WatchJobRequest(job_id=job_id)).read())
        assert code is grpc.StatusCode.PERMISSION_DENIED and job_id in details
        # Bob cannot take Alice's job (and its token) by reusing her request id either.
        code, details = await refusal(_submit(bob, "alice-1"))
        assert code is grpc.StatusCode.PERMISSION_DENIED and "alice-1" in details

        # Nothing changed by the refused calls; each sees only its own jobs.
        again = await alice.GetJob(pb.GetJobRequest(job_id=job_id))
        assert again.state == job.state and again.revision == job.revision
        assert [j.job_id for j in (await bob.ListJobs(pb.ListJobsRequest())).jobs] == [bobs.job_id]
        assert [j.job_id for j in (await alice.ListJobs(pb.ListJobsRequest())).jobs] == [job_id]
        everyone = {j.job_id: j.owner for j in (await admin.ListJobs(pb.ListJobsRequest())).jobs}
        assert everyone == {job_id: "alice", bobs.job_id: "bob"}

        # The admin may end anyone's job; the owner its own.
        cancelled = await admin.CancelJob(pb.CancelJobRequest(job_id=job_id, reason="ops"))
        assert cancelled.state == pb.JOB_STATE_CANCELLED
        ended = await bob.CancelJob(pb.CancelJobRequest(job_id=bobs.job_id))
        assert ended.state == pb.JOB_STATE_CANCELLED


async def test_calls_without_a_valid_token_are_refused_saying_why(
    deployment: Deployment, placement: str
) -> None:
    request = pb.ListJobsRequest()
    async with deployment.channel(placement, None) as bare:
        code, details = await refusal(placement_pb2_grpc.PlacementStub(bare).ListJobs(request))
        assert code is grpc.StatusCode.UNAUTHENTICATED and "missing bearer token" in details
        # Health stays open (probes carry no token).
        health = await health_pb2_grpc.HealthStub(bare).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = placement_pb2_grpc.PlacementStub(bare)
        code, details = await refusal(
            stub.ListJobs(request, metadata=[("authorization", "Basic abc")])
        )
        assert code is grpc.StatusCode.UNAUTHENTICATED and "Bearer TOKEN" in details
    async with deployment.channel(placement, None, auth_token="x" * 32) as wrong:
        code, details = await refusal(placement_pb2_grpc.PlacementStub(wrong).ListJobs(request))
        assert code is grpc.StatusCode.UNAUTHENTICATED and details == "unknown bearer token"
    async with deployment.channel(placement, "alice") as a:
        register = placement_pb2_grpc.PlacementStub(a).RegisterGpu(pb.RegisterGpuRequest())
        code, details = await refusal(register)
        assert code is grpc.StatusCode.PERMISSION_DENIED
        assert "Placement/RegisterGpu" in details and "'alice' holds a submitter" in details


async def test_mutual_tls_refuses_callers_without_a_certificate_of_the_ca(
    deployment: Deployment, placement: str, tmp_path: Path
) -> None:
    stranger = write(tmp_path / "other", "stranger", Authority.create("other CA"), "stranger")
    request = pb.ListJobsRequest()
    for changes in (
        {"tls_cert_file": "", "tls_key_file": ""},  # no client certificate
        {"tls_cert_file": str(stranger.cert), "tls_key_file": str(stranger.key)},
        {"tls_ca_file": ""},  # plaintext
    ):
        async with deployment.channel(placement, "admin", **changes) as channel:
            stub = placement_pb2_grpc.PlacementStub(channel)
            code, _ = await refusal(stub.ListJobs(request, timeout=5))
            assert code is grpc.StatusCode.UNAVAILABLE, changes


async def test_certificates_and_tokens_are_read_again_when_their_files_change(
    deployment: Deployment, placement: str
) -> None:
    request = pb.ListJobsRequest()
    kept = {}
    for kind in ("cert", "key", "ca"):
        kept[kind] = deployment.directory / f"old-{kind}.pem"
        kept[kind].write_bytes(getattr(deployment.client, kind).read_bytes())
    old = {f"tls_{kind}_file": str(path) for kind, path in kept.items()}
    async with deployment.channel(placement, "admin", **old) as channel:
        await placement_pb2_grpc.PlacementStub(channel).ListJobs(request, timeout=5)

    # A new CA and certificates: new connections use them, without a restart.
    renewed = Authority.create("renewed CA")
    write(deployment.directory, "service", renewed, "gpuloom-service")
    write(deployment.directory, "client", renewed, "alice-laptop")
    async with deployment.channel(placement, "admin") as channel:
        await placement_pb2_grpc.PlacementStub(channel).ListJobs(request, timeout=5)
    async with deployment.channel(placement, "admin", **old) as stale:
        code, _ = await refusal(
            placement_pb2_grpc.PlacementStub(stale).ListJobs(request, timeout=5)
        )
        assert code is grpc.StatusCode.UNAVAILABLE  # the old CA no longer verifies the server

    # A token added to the file is taken within a second.
    deployment.tokens["carol"] = "carol-" + "c" * 24
    async with deployment.channel(placement, "carol") as c:
        stub = placement_pb2_grpc.PlacementStub(c)
        code, _ = await refusal(stub.ListJobs(request))
        assert code is grpc.StatusCode.UNAUTHENTICATED
        deployment.write_tokens()
        await asyncio.sleep(1.1)
        assert list((await stub.ListJobs(request)).jobs) == []


async def test_every_service_takes_the_same_security(
    deployment: Deployment, tmp_path: Path
) -> None:
    """The interceptor is installed by start_server: the profile store refuses as placement
    does, and answers a service token."""
    store = await ProfileStoreApp.start(
        ProfileStoreSettings(port=0, database_url=f"sqlite:///{tmp_path / 'p.db'}"), HOST, tmp_path
    )
    address = f"{HOST}:{store.port}"
    request = profile_store_pb2.ListProfilesRequest()
    try:
        async with deployment.channel(address, "alice") as a:
            stub = profile_store_pb2_grpc.ProfileStoreStub(a)
            code, details = await refusal(stub.ListProfiles(request))
            assert code is grpc.StatusCode.PERMISSION_DENIED and "ProfileStore" in details
        async with deployment.channel(address, "placement") as s:
            await profile_store_pb2_grpc.ProfileStoreStub(s).ListProfiles(request)
    finally:
        await store.stop(0)


async def test_an_open_server_says_so_loudly(tmp_path: Path) -> None:
    settings = ProfileStoreSettings(port=0, database_url=f"sqlite:///{tmp_path / 'p.db'}")
    with structlog.testing.capture_logs() as logs:
        store = await ProfileStoreApp.start(settings, HOST, tmp_path)
        await store.stop(0)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert any("WITHOUT AUTHENTICATION" in e["event"] for e in warnings), logs
    assert any(e.get("address") == f"{HOST}:{store.port}" for e in warnings)


def test_a_tokens_file_is_checked_line_by_line(tmp_path: Path) -> None:
    good = "admin root " + "r" * 20 + "\n# comment\n\nsubmitter alice " + "a" * 20
    table = parse_tokens(good, "tokens")
    assert sorted((c.name, c.role) for c in table.values()) == [
        ("alice", Role.SUBMITTER),
        ("root", Role.ADMIN),
    ]
    for text, problem in (
        ("admin root", "tokens:1: expected ROLE NAME TOKEN"),
        ("boss root " + "r" * 20, "tokens:1: unknown role 'boss'"),
        ("admin root short", "at least 16 characters"),
        ("admin r/t " + "r" * 20, "tokens:1: the name"),
        (f"admin a {'x' * 20}\nsubmitter b {'x' * 20}", "tokens:2: this token is on an earlier"),
        (f"admin a {'x' * 20}\nsubmitter a {'y' * 20}", "tokens:2: 'a' has another role"),
    ):
        with pytest.raises(ValueError, match=problem):
            parse_tokens(text, "tokens")
    empty = tmp_path / "empty"
    empty.write_text("# nobody yet\n")
    with pytest.raises(SettingsError, match=r"GPULOOM_AUTH_TOKENS_FILE: .* holds no token"):
        TokenTable(str(empty))


async def test_wrong_tls_settings_stop_a_service_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = ProfileStoreSettings(port=0, database_url=f"sqlite:///{tmp_path / 'p.db'}")
    files = write(tmp_path / "pki", "s", Authority.create(), "s")
    monkeypatch.setenv("GPULOOM_TLS_CERT_FILE", str(files.cert))
    with pytest.raises(SettingsError, match="GPULOOM_TLS_CERT_FILE and GPULOOM_TLS_KEY_FILE"):
        await ProfileStoreApp.start(settings, HOST, tmp_path)
    monkeypatch.setenv("GPULOOM_TLS_KEY_FILE", str(tmp_path / "missing.key"))
    with pytest.raises(SettingsError, match=r"GPULOOM_TLS_KEY_FILE: cannot read .*missing\.key"):
        await ProfileStoreApp.start(settings, HOST, tmp_path)
    monkeypatch.setenv("GPULOOM_TLS_KEY_FILE", str(files.ca))  # not the certificate's key
    monkeypatch.setenv("GPULOOM_TLS_CA_FILE", str(files.ca))
    with pytest.raises(SettingsError, match="not a certificate and its key"):
        await ProfileStoreApp.start(settings, HOST, tmp_path)


async def test_placement_without_client_certificates_still_asks_for_tokens(
    deployment: Deployment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPULOOM_TLS_CLIENT_AUTH=false: submitters need the CA and a token, no certificate."""
    monkeypatch.setenv("GPULOOM_TLS_CLIENT_AUTH", "false")
    settings = PlacementSettings(port=0, database_url=f"sqlite:///{tmp_path / 'placement.db'}")
    app = await PlacementApp.start(settings, HOST, tmp_path)
    address = f"{HOST}:{app.port}"
    no_certificate = {"tls_cert_file": "", "tls_key_file": ""}
    try:
        async with deployment.channel(address, "alice", **no_certificate) as a:
            stub = placement_pb2_grpc.PlacementStub(a)
            assert list((await stub.ListJobs(pb.ListJobsRequest())).jobs) == []
        async with deployment.channel(address, None, **no_certificate) as bare:
            stub = placement_pb2_grpc.PlacementStub(bare)
            code, _ = await refusal(stub.ListJobs(pb.ListJobsRequest()))
            assert code is grpc.StatusCode.UNAUTHENTICATED
        async with deployment.channel(address, "alice", tls_ca_file="") as plaintext:
            stub = placement_pb2_grpc.PlacementStub(plaintext)
            code, _ = await refusal(stub.ListJobs(pb.ListJobsRequest(), timeout=5))
            assert code is grpc.StatusCode.UNAVAILABLE  # TLS all the same
    finally:
        await app.stop(0)


async def test_tokens_on_a_plaintext_port_beyond_loopback_are_warned_about(
    deployment: Deployment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("GPULOOM_TLS_CERT_FILE", "GPULOOM_TLS_KEY_FILE", "GPULOOM_TLS_CA_FILE"):
        monkeypatch.delenv(name)
    settings = ProfileStoreSettings(port=0, database_url=f"sqlite:///{tmp_path / 'p.db'}")
    for host, warned in (("127.0.0.1", False), ("0.0.0.0", True)):
        with structlog.testing.capture_logs() as logs:
            store = await ProfileStoreApp.start(settings, host, tmp_path)
            await store.stop(0)
        said = [e["event"] for e in logs if e["log_level"] == "warning"]
        assert any("tokens WITHOUT TLS" in event for event in said) is warned, (host, said)
        assert not any("WITHOUT AUTHENTICATION" in event for event in said)


async def test_a_long_lived_channel_takes_renewed_certificates(
    deployment: Deployment, tmp_path: Path
) -> None:
    """A service's channels outlive its certificates: after a renewal (new CA, new server and
    client certificates) and a server restart, the same channel calls on with the new files."""
    port = free_port()
    settings = PlacementSettings(port=port, database_url=f"sqlite:///{tmp_path / 'p.db'}")
    app = await PlacementApp.start(settings, HOST, tmp_path)
    request = pb.ListJobsRequest()
    channel = deployment.channel(f"{HOST}:{port}", "admin")
    try:
        stub = placement_pb2_grpc.PlacementStub(channel)
        await stub.ListJobs(request, timeout=5)
        await app.stop(0)
        renewed = Authority.create("renewed CA")
        write(deployment.directory, "service", renewed, "gpuloom-service")
        write(deployment.directory, "client", renewed, "alice-laptop")
        app = await PlacementApp.start(settings, HOST, tmp_path)
        await asyncio.sleep(1.1)  # the channel looks at its files at most once a second
        assert list((await stub.ListJobs(request, timeout=5)).jobs) == []
    finally:
        await channel.close()
        await app.stop(0)
