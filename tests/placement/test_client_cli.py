"""The placement client and the job commands of the CLI against a live placement service with
real dispatchers on simulated GPUs."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from google.protobuf import json_format

from gpuloom.clients.cli import cli
from gpuloom.clients.placement import (
    JobFileError,
    JobNotAssigned,
    PlacementClient,
    WaitTimedOut,
    load_job_file,
    spec_from_document,
)
from gpuloom.clients.times import duration, rfc3339
from gpuloom.convert.placement import job_from_pb
from gpuloom.convert.times import unix_s
from gpuloom.domain.placement import JobState
from gpuloom.domain.shares import DEFAULT_PRIORITY
from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.v1 import common_pb2
from gpuloom.v1 import placement_pb2 as pb
from tests.placement.conftest import GIB, Live, eventually, mps_spec, register_all, submit

YAML_JOB = """\
# a shared inference job
name: resnet-serve
kind: inference
task_key: resnet50
priority: 2
policy: mra
resources:
  memory_gib: 8
  mps: {sm_percent: 30, quota_request_percent: 40, quota_limit_percent: 60}
slo: {p99_latency_ms: 25, target_requests_per_s: 300}
"""
JSON_JOB = {
    "name": "trainer",
    "kind": "training",
    "request_id": "train-1",
    "resources": {"memory_bytes": 16 * GIB, "whole_gpus": 1},
}


def address(live: Live) -> str:
    return f"--placement=127.0.0.1:{live.app.port}"


# CliRunner swaps sys.stdout for the whole process, so the service's log lines (printed on
# this event loop while a command runs) land in its output too: they are left out here.
SERVICE_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[")


def stdout_lines(result: Result) -> list[str]:
    return [line for line in result.stdout.splitlines() if not SERVICE_LOG.match(line)]


def output_lines(result: Result) -> list[str]:
    """stdout and stderr, without the service's log lines."""
    return [line for line in result.output.splitlines() if not SERVICE_LOG.match(line)]


def stdout_of(result: Result) -> str:
    return "\n".join(stdout_lines(result))


async def invoke(*args: str) -> Result:
    # Placement serves on this event loop, so the blocking CLI runs in a worker thread.
    return await asyncio.to_thread(CliRunner().invoke, cli, list(args))


async def all_jobs(live: Live) -> list[pb.Job]:
    return list((await live.stub.ListJobs(pb.ListJobsRequest())).jobs)


async def get_job(live: Live, job_id: str) -> pb.Job:
    return await live.stub.GetJob(pb.GetJobRequest(job_id=job_id))


# ---- submit ----


async def test_submit_a_yaml_and_a_json_job_file(
    placement: Live, dispatchers: DispatcherApp, tmp_path: Path
) -> None:
    await register_all(placement.stub, dispatchers)
    yaml_file = tmp_path / "serve.yaml"
    yaml_file.write_text(YAML_JOB)
    shared = await invoke("submit", str(yaml_file), address(placement))
    assert shared.exit_code == 0, shared.output
    job_id = stdout_of(shared).split()[1]
    assert "assigned on GPU SIM-" in shared.output
    assert "SM 30%, quota 40% (limit 60%), memory 8.00 GiB" in shared.output

    job = await get_job(placement, job_id)
    assert job.state == pb.JOB_STATE_ASSIGNED
    assert (job.spec.name, job.spec.kind, job.spec.task_key) == (
        "resnet-serve",
        pb.JOB_KIND_INFERENCE,
        "resnet50",
    )
    assert job.spec.priority.level == 2 and job.policy == "mra"
    assert job.spec.resources.memory_bytes == 8 * GIB
    mps = job.spec.resources.mps
    assert (mps.sm_percent, mps.quota.request_percent, mps.quota.limit_percent) == (30, 40, 60)
    assert (job.spec.slo.p99_latency_ms, job.spec.slo.target_requests_per_s) == (25, 300)

    json_file = tmp_path / "train.json"
    json_file.write_text(json.dumps(JSON_JOB))
    whole = await invoke("submit", str(json_file), address(placement), "--json")
    assert whole.exit_code == 0, whole.output
    document = json.loads(stdout_of(whole))
    assert document["state"] == "JOB_STATE_ASSIGNED"
    assert document["request_id"] == "train-1"
    assert document["spec"]["resources"] == {"memory_bytes": str(16 * GIB), "whole_gpus": 1}
    assert document["spec"]["priority"] == {"level": 5}  # the default of job files
    # The file's request_id makes submitting it again idempotent.
    again = await invoke("submit", str(json_file), address(placement), "--json")
    assert json.loads(stdout_of(again))["job_id"] == document["job_id"]
    assert len(await all_jobs(placement)) == 2


BAD_FILES = [
    ("unknown.yaml", "name: a\nkind: batch\ncolour: red\n", ["'colour'", "unknown key"]),
    (
        "nested.yaml",
        "name: a\nkind: batch\nresources: {whole_gpus: 1, gpus: 2}\n",
        ["'resources.gpus'", "unknown key"],
    ),
    ("nokind.yaml", "name: a\nresources: {whole_gpus: 1}\n", ["'kind'", "required"]),
    ("badkind.json", '{"name": "a", "kind": "serving"}', ["'kind'", "inference, training"]),
    ("list.yaml", "- name: a\n- name: b\n", ["must hold a mapping", "got list"]),
    ("broken.json", '{"name": "a",', ["not valid JSON"]),
    (
        "priority.yaml",
        "name: a\nkind: batch\npriority: 12\nresources: {whole_gpus: 1}\n",
        ["'priority'", "0..9"],
    ),
    (
        "type.yaml",
        "name: a\nkind: batch\nresources: {memory_gib: lots, whole_gpus: 1}\n",
        ["'resources.memory_gib'", "must be a number"],
    ),
]


@pytest.mark.parametrize(("filename", "content", "expected"), BAD_FILES)
async def test_bad_job_files_exit_2_naming_the_file_and_key_and_submit_nothing(
    placement: Live,
    dispatchers: DispatcherApp,
    tmp_path: Path,
    filename: str,
    content: str,
    expected: list[str],
) -> None:
    await register_all(placement.stub, dispatchers)
    path = tmp_path / filename
    path.write_text(content)
    result = await invoke("submit", str(path), address(placement))
    assert result.exit_code == 2, result.output
    assert str(path) in result.output
    for text in expected:
        assert text in result.output
    assert await all_jobs(placement) == []


async def test_a_value_the_service_refuses_exits_1_with_one_line(
    placement: Live, dispatchers: DispatcherApp, tmp_path: Path
) -> None:
    await register_all(placement.stub, dispatchers)
    path = tmp_path / "sm0.yaml"
    path.write_text(
        "name: a\nkind: batch\nresources:\n  memory_gib: 4\n"
        "  mps: {sm_percent: 0, quota_request_percent: 50}\n"
    )
    result = await invoke("submit", str(path), address(placement))
    assert result.exit_code == 1, result.output
    assert output_lines(result) == [
        f"Error: {path}: key 'resources.mps.sm_percent': refused by placement: "
        "spec.resources.mps.sm_percent: must be within 1..100, got 0"
    ]
    assert await all_jobs(placement) == []


async def test_a_missing_file_and_an_unreachable_service_are_clear(
    placement: Live, tmp_path: Path
) -> None:
    missing = await invoke("submit", str(tmp_path / "nope.yaml"), address(placement))
    assert missing.exit_code == 2 and "nope.yaml" in missing.output
    assert "cannot read it" in missing.output
    path = tmp_path / "ok.yaml"
    path.write_text("name: a\nkind: batch\nresources: {whole_gpus: 1}\n")
    await placement.app.stop(0)
    dead = await invoke("submit", str(path), address(placement))
    assert dead.exit_code == 1 and "placement at 127.0.0.1" in dead.output


async def test_submit_wait_follows_a_pending_job_until_it_is_assigned(
    placement: Live, dispatchers: DispatcherApp, tmp_path: Path
) -> None:
    await register_all(placement.stub, dispatchers)
    big = [
        await submit(placement.stub, mps_spec(f"big{i}", 100, 100, memory_gib=70)) for i in range(4)
    ]
    path = tmp_path / "late.yaml"
    path.write_text("name: late\nkind: batch\nresources: {whole_gpus: 1}\n")
    waiting = asyncio.create_task(invoke("submit", str(path), address(placement), "--wait"))

    # Once the late job is pending, free a GPU for it.
    async def pending() -> list[pb.Job]:
        return [j for j in await all_jobs(placement) if j.spec.name == "late"]

    async with asyncio.timeout(10):
        while not await pending():
            await asyncio.sleep(0.02)
    await placement.stub.CancelJob(pb.CancelJobRequest(job_id=big[0].job_id))
    result = await waiting
    assert result.exit_code == 0, result.output
    assert "pending:" in result.stderr
    assert "assigned on GPU " + big[0].assignment.gpu.gpu_uuid in result.stdout


# ---- jobs, job, cancel, watch, gpus ----


async def test_jobs_lists_filters_and_prints_json(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    shared = await submit(placement.stub, mps_spec("shared", 40, 30, task_key="t1"))
    whole_spec = pb.JobSpec(name="whole", kind=pb.JOB_KIND_BATCH, task_key="t2")
    whole_spec.resources.CopyFrom(common_pb2.Resources(whole_gpus=1))
    whole = await submit(placement.stub, whole_spec)

    listed = await invoke("jobs", address(placement), "--json")
    assert listed.exit_code == 0, listed.output
    documents = [json.loads(line) for line in stdout_lines(listed)]
    assert [d["job_id"] for d in documents] == [shared.job_id, whole.job_id]
    assert all(d["state"] == "JOB_STATE_ASSIGNED" for d in documents)

    table = await invoke("jobs", address(placement))
    lines = stdout_lines(table)
    assert lines[0].split()[:4] == ["ID", "NAME", "STATE", "PRIO"]
    row = next(line for line in lines if line.startswith(shared.job_id)).split()
    assert row[1:3] == ["shared", "assigned"]
    assert shared.assignment.gpu.gpu_uuid in row and "40" in row and "30.00" in row

    only = await invoke("jobs", address(placement), "--task-key", "t2", "--json")
    assert [json.loads(line)["job_id"] for line in stdout_lines(only)] == [whole.job_id]
    none = await invoke("jobs", address(placement), "--state", "pending")
    assert stdout_of(none).strip() == "no jobs match"


async def test_jobs_json_is_the_job_message_and_tables_have_colour_on_a_terminal_only(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    running = await submit(placement.stub, mps_spec("running"))
    waiting_spec = mps_spec("waiting")
    waiting_spec.resources.whole_gpus = 4  # all four GPUs of n1, one in use: it stays pending
    waiting = await submit(placement.stub, waiting_spec)

    # --json: each line parses back into the Job message the service returns (the protos'
    # JSON mapping, as grpcurl prints it).
    listed = await invoke("jobs", address(placement), "--json")
    parsed = [json_format.Parse(line, pb.Job()) for line in stdout_lines(listed)]
    assert parsed == await all_jobs(placement)
    # Times in RFC 3339; a job that never started has no started_at.
    documents = [json.loads(line) for line in stdout_lines(listed)]
    rfc3339_text = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z"
    assert all(re.fullmatch(rfc3339_text, d["submitted_at"]) for d in documents)
    assert re.fullmatch(rfc3339_text, documents[0]["started_at"])
    assert "started_at" not in documents[1]
    one = await invoke("job", running.job_id, address(placement), "--json")
    assert json_format.Parse(stdout_of(one), pb.Job()) == await get_job(placement, running.job_id)

    def rows(result: Result) -> list[str]:
        return [line for line in result.stdout.splitlines() if line.startswith("j-")]

    # Piped (CliRunner's stdout is no terminal): plain text, no escape codes.
    plain = await asyncio.to_thread(CliRunner().invoke, cli, ["jobs", address(placement)])
    assert len(rows(plain)) == 2 and not any("\x1b" in line for line in rows(plain))
    assert "\x1b" not in plain.stdout.splitlines()[0]  # the header neither
    # A terminal (rich takes FORCE_COLOR as one): the state in colour, green and yellow.
    coloured = await asyncio.to_thread(
        CliRunner().invoke, cli, ["jobs", address(placement)], env={"FORCE_COLOR": "1"}
    )
    assert coloured.exit_code == 0, coloured.output
    lines = rows(coloured)
    assert "\x1b[32massigned" in next(x for x in lines if x.startswith(running.job_id))
    assert "\x1b[33mpending" in next(x for x in lines if x.startswith(waiting.job_id))


async def test_jobs_and_job_say_when_a_job_was_submitted_started_and_how_long_it_ran(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    ran = await submit(placement.stub, mps_spec("ran"))
    assert unix_s(ran, "started_at") >= unix_s(ran, "submitted_at") > 0
    await asyncio.sleep(1.2)
    done = await placement.stub.ReportJobDone(
        pb.ReportJobDoneRequest(job_id=ran.job_id, succeeded=True, exit_code=0)
    )
    assert unix_s(done, "started_at") == unix_s(ran, "started_at")  # kept once it ended
    ran_for = unix_s(done, "updated_at") - unix_s(done, "started_at")
    assert ran_for >= 1.2
    await submit(placement.stub, mps_spec("holder"))
    waiting_spec = mps_spec("waiting")
    waiting_spec.resources.whole_gpus = 4  # all four GPUs of n1, one in use: it stays pending
    waiting = await submit(placement.stub, waiting_spec)
    assert waiting.state == pb.JOB_STATE_PENDING and not waiting.HasField("started_at")

    table = await invoke("jobs", address(placement))
    lines = stdout_lines(table)
    assert re.search(r"\bMEMORY\s+SUBMITTED\s+AGE\s+RUNTIME\b", lines[0])
    times = r"\s(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)\s+(\S+)\s+(\S+)"
    row = re.search(times, next(line for line in lines if line.startswith(ran.job_id)))
    assert row is not None
    submitted, age, runtime = row.groups()
    assert submitted == rfc3339(unix_s(ran, "submitted_at"))
    assert re.fullmatch(r"\d+s", age)  # seconds old
    assert runtime == duration(ran_for)  # from assigned to its end, not growing
    pending = re.search(times, next(line for line in lines if line.startswith(waiting.job_id)))
    assert pending is not None and pending.group(3) == "-"  # never ran

    shown = stdout_lines(await invoke("job", ran.job_id, address(placement)))
    assert f"started     {rfc3339(unix_s(ran, 'started_at'))}" in shown
    assert f"runtime     {duration(ran_for)}" in shown


async def test_job_shows_one_job_and_cancel_cancels_it(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    job = await submit(placement.stub, mps_spec("victim", 20, 20))

    shown = await invoke("job", job.job_id, address(placement))
    assert shown.exit_code == 0, shown.output
    assert f"GPULOOM_ASSIGNMENT_ID={job.job_id}" in shown.output
    assert "GPULOOM_ASSIGNMENT_TOKEN=(hidden)" in shown.output
    assert job.assignment.environment["GPULOOM_ASSIGNMENT_TOKEN"] not in shown.output

    cancelled = await invoke("cancel", job.job_id, "--reason", "not needed", address(placement))
    assert cancelled.exit_code == 0, cancelled.output
    assert f"job {job.job_id} cancelled" in cancelled.output
    after = await get_job(placement, job.job_id)
    assert after.state == pb.JOB_STATE_CANCELLED and "not needed" in after.message

    twice = await invoke("cancel", job.job_id, address(placement))
    assert twice.exit_code == 1 and "cancelled" in twice.output
    unknown = await invoke("job", "j-nobody", address(placement))
    assert unknown.exit_code == 1 and "j-nobody" in unknown.output


async def test_watch_prints_the_final_state_of_a_finished_job(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    job = await submit(placement.stub, mps_spec("done"))
    await placement.stub.ReportJobDone(
        pb.ReportJobDoneRequest(job_id=job.job_id, succeeded=True, exit_code=0, message="ok")
    )
    watched = await invoke("watch", job.job_id, address(placement))
    assert watched.exit_code == 0, watched.output
    lines = stdout_lines(watched)
    assert len(lines) == 1 and lines[0].endswith(f"job {job.job_id} succeeded (exit code 0): ok")

    as_json = await invoke("watch", job.job_id, address(placement), "--json")
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(stdout_of(as_json))["state"] == "JOB_STATE_SUCCEEDED"

    # A job that failed: the same line, and exit status 1 with the end on stderr.
    failed = await submit(placement.stub, mps_spec("crashed"))
    await placement.stub.ReportJobDone(
        pb.ReportJobDoneRequest(job_id=failed.job_id, succeeded=False, exit_code=3, message="oom")
    )
    watched = await invoke("watch", failed.job_id, address(placement))
    assert watched.exit_code == 1
    assert stdout_lines(watched)[-1].endswith(f"job {failed.job_id} failed (exit code 3): oom")
    assert watched.stderr.splitlines() == [f"Error: job {failed.job_id} ended failed: oom"]


async def test_watch_follows_a_job_through_its_changes(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    job = await submit(placement.stub, mps_spec("followed"))
    watching = asyncio.create_task(invoke("watch", job.job_id, address(placement)))
    await eventually(lambda: bool(placement.app.core.jobs._watchers.get(job.job_id)))
    await placement.stub.CancelJob(pb.CancelJobRequest(job_id=job.job_id, reason="bye"))
    watched = await watching
    assert watched.exit_code == 1, watched.output  # cancelled: not what the watcher hoped for
    lines = stdout_lines(watched)
    assert "assigned on GPU" in lines[0]
    assert lines[-1].endswith(f"job {job.job_id} cancelled: bye")
    assert f"Error: job {job.job_id} ended cancelled: bye" in watched.stderr


async def test_gpus_lists_the_four_simulated_gpus(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    job = await submit(placement.stub, mps_spec("one", 50, 50, memory_gib=8))
    listed = await invoke("gpus", address(placement), "--json")
    assert listed.exit_code == 0, listed.output
    entries = [json.loads(line) for line in stdout_lines(listed)]
    assert len(entries) == 4
    assert {e["gpu"]["model"] for e in entries} == {"A100-80GB"}
    holder = next(e for e in entries if e["gpu"]["ref"]["gpu_uuid"] == job.assignment.gpu.gpu_uuid)
    assert holder["jobs"] == 1 and holder["memory_reserved_bytes"] == str(8 * GIB)

    table = await invoke("gpus", address(placement), "--node", "n1")
    lines = stdout_lines(table)
    assert lines[0].split()[:3] == ["NODE", "UUID", "MODEL"]
    assert len(lines) == 2 + 4 and all("schedulable" in line for line in lines[2:])
    other = await invoke("gpus", address(placement), "--node", "n9")
    assert stdout_of(other).strip() == "no GPUs registered"


# ---- run ----

PRINT_ID_EXIT_3 = "import os, sys; print(os.environ['GPULOOM_ASSIGNMENT_ID']); sys.exit(3)"


async def test_run_runs_the_command_in_its_assignment_and_reports_its_exit_code(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    result = await invoke(
        "run", address(placement), "--no-shim", "--", sys.executable, "-c", PRINT_ID_EXIT_3
    )
    assert result.exit_code == 3, result.output
    (job,) = await all_jobs(placement)
    assert stdout_of(result).strip() == job.job_id
    assert job.state == pb.JOB_STATE_FAILED and job.exit_code == 3
    assert "exited with code 3" in job.message
    assert job.spec.resources.WhichOneof("share") == "whole_gpus"
    assert job.spec.kind == pb.JOB_KIND_BATCH
    # Its GPU was given back.
    await eventually(lambda: not any(d.core.book.all() for d in dispatchers.dispatchers))


async def test_run_with_a_share_passes_the_share_and_preloads_the_shim(
    placement: Live, dispatchers: DispatcherApp, tmp_path: Path
) -> None:
    await register_all(placement.stub, dispatchers)
    shim = tmp_path / "libfake.so"
    shim.write_bytes(b"")  # never loaded: the child is Python and reads its environment
    script = textwrap.dedent(
        """
        import os
        print(os.environ["LD_PRELOAD"])
        print(os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"])
        """
    )
    result = await asyncio.to_thread(
        CliRunner(env={"LD_PRELOAD": "/opt/other.so"}).invoke,
        cli,
        [
            "run",
            address(placement),
            "--sm",
            "25",
            "--quota",
            "40",
            "--memory-gib",
            "2",
            "--name",
            "shared-run",
            "--priority",
            "1",
            "--shim",
            str(shim),
            "--",
            sys.executable,
            "-c",
            script,
        ],
    )
    assert result.exit_code == 0, result.output
    assert stdout_lines(result) == [f"{shim}:/opt/other.so", "25"]
    (job,) = await all_jobs(placement)
    # Where it landed, before the command started.
    where = (
        f"gpuloom run: job {job.job_id} assigned on GPU {job.assignment.gpu.gpu_uuid} on node "
        f"{job.assignment.gpu.node}: SM 25%, quota 40%, memory 2.00 GiB"
    )
    assert where in result.stderr.splitlines()
    assert job.state == pb.JOB_STATE_SUCCEEDED and job.exit_code == 0
    assert (job.spec.name, job.spec.priority.level) == ("shared-run", 1)
    mps = job.spec.resources.mps
    assert (mps.sm_percent, mps.quota.request_percent) == (25, 40)
    assert job.spec.resources.memory_bytes == 2 * GIB


async def test_run_of_a_command_that_does_not_exist_exits_127_and_fails_the_job(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    result = await invoke("run", address(placement), "--no-shim", "--", "gpuloom-no-such-cmd")
    assert result.exit_code == 127, result.output
    assert "cannot start 'gpuloom-no-such-cmd'" in result.stderr
    (job,) = await all_jobs(placement)
    assert job.state == pb.JOB_STATE_FAILED and job.exit_code == 127
    assert "gpuloom-no-such-cmd" in job.message


async def test_run_stops_the_command_when_its_job_is_cancelled(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    sleeper = "import time; print('started', flush=True); time.sleep(60)"
    running = asyncio.create_task(
        invoke("run", address(placement), "--no-shim", "--", sys.executable, "-c", sleeper)
    )
    async with asyncio.timeout(10):
        while not (jobs := await all_jobs(placement)) or jobs[0].state != pb.JOB_STATE_ASSIGNED:
            await asyncio.sleep(0.02)
    await placement.stub.CancelJob(pb.CancelJobRequest(job_id=jobs[0].job_id, reason="stop"))
    result = await running
    assert result.exit_code == 128 + 15, result.output  # SIGTERM
    assert "was cancelled: stop" in result.stderr
    assert (await get_job(placement, jobs[0].job_id)).state == pb.JOB_STATE_CANCELLED


async def test_run_gives_up_after_its_timeout_and_cancels_the_job(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    for i in range(4):
        await submit(placement.stub, mps_spec(f"big{i}", 100, 100, memory_gib=70))
    result = await invoke("run", address(placement), "--no-shim", "--timeout", "0.5", "--", "true")
    assert result.exit_code == 1, result.output
    assert "pending:" in result.stderr and "not assigned within 0.5 s" in result.stderr
    late = [j for j in await all_jobs(placement) if j.spec.name == "true"]
    assert len(late) == 1 and late[0].state == pb.JOB_STATE_CANCELLED


async def test_run_refuses_inconsistent_options(placement: Live) -> None:
    for args, text in [
        (["--sm", "20"], "--memory-gib"),
        (["--whole-gpu", "--quota", "10", "--memory-gib", "1"], "--whole-gpu"),
        (["--quota-limit", "50"], "--quota-limit"),
        (["--sm", "0", "--memory-gib", "1"], "--sm"),
        (["--mig", "--sm", "20", "--memory-gib", "1"], "--mig excludes"),
        (["--mig", "--gpus", "2"], "--mig excludes"),
        (["--mig-size", "3"], "--mig-size goes with --mig"),
        (["--mig", "--mig-size", "8"], "--mig-size"),
    ]:
        result = await invoke("run", address(placement), *args, "--", "true")
        assert result.exit_code == 2 and text in result.output, (args, result.output)
    # A value only the service checks is a refusal: exit 1, one line, no usage banner.
    bad_policy = await invoke("run", address(placement), "--policy", "best-guess", "--", "true")
    assert bad_policy.exit_code == 1 and "Usage:" not in bad_policy.output
    lines = output_lines(bad_policy)
    assert len(lines) == 1 and lines[0].startswith("Error: --policy: refused by placement")
    assert "unknown placement policy 'best-guess'" in bad_policy.output
    # A MIG batch task, whose times come from a MIG profile: this placement has no profile
    # store, so it is refused before anything is submitted.
    mig = await invoke("run", address(placement), "--mig", "--task-key", "lud", "--", "true")
    assert mig.exit_code == 1 and "MIG batch tasks take their times from MIG profiles" in (
        mig.output
    )
    # A size placement cannot make is named by its option.
    size = await invoke(
        "run", address(placement), "--mig", "--mig-size", "5", "--task-key", "lud", "--", "true"
    )
    assert size.exit_code == 1 and "Usage:" not in size.output
    assert "--mig-size: refused by placement: spec.resources.mig.slices: must be one of" in (
        size.output
    )
    assert await all_jobs(placement) == []


async def test_run_and_job_files_name_the_shared_model_and_a_bad_name_is_refused(
    placement: Live, dispatchers: DispatcherApp, tmp_path: Path
) -> None:
    await register_all(placement.stub, dispatchers)
    bad = await invoke("run", address(placement), "--shared-model", "no spaces", "--", "true")
    assert bad.exit_code == 1 and "Usage:" not in bad.output
    lines = output_lines(bad)
    assert len(lines) == 1 and lines[0].startswith(
        "Error: --shared-model: refused by placement: spec.shared_model:"
    )
    assert await all_jobs(placement) == []
    ran = await invoke(
        "run",
        address(placement),
        "--no-shim",
        "--shared-model",
        "vit_huge",
        "--sm",
        "10",
        "--memory-gib",
        "2",
        "--",
        sys.executable,
        "-c",
        "pass",
    )
    assert ran.exit_code == 0, ran.output
    path = tmp_path / "replica.yaml"
    path.write_text(
        "name: r\nkind: inference\nshared_model: vit_huge\nresources:\n  memory_gib: 2\n"
        "  mps: {sm_percent: 10, quota_request_percent: 10}\n"
    )
    submitted = await invoke("submit", str(path), address(placement))
    assert submitted.exit_code == 0, submitted.output
    jobs = await all_jobs(placement)
    assert len(jobs) == 2 and all(j.spec.shared_model == "vit_huge" for j in jobs)
    # No store holds the model here: charged in full.
    assert all(j.assignment.memory_cap_bytes == 2 * GIB for j in jobs)


# ---- the client ----


async def test_client_waits_for_assignment_and_says_when_a_job_ends_instead(
    placement: Live, dispatchers: DispatcherApp
) -> None:
    await register_all(placement.stub, dispatchers)
    for i in range(4):
        await submit(placement.stub, mps_spec(f"big{i}", 100, 100, memory_gib=70))
    client = PlacementClient(f"127.0.0.1:{placement.app.port}")
    try:
        job = await asyncio.to_thread(
            client.submit, {"name": "w", "kind": "batch", "resources": {"whole_gpus": 1}}
        )
        assert job.state is JobState.PENDING
        with pytest.raises(WaitTimedOut) as timed_out:
            await asyncio.to_thread(client.wait_assigned, job.job_id, 0.2)
        assert timed_out.value.job.state is JobState.PENDING

        waiting = asyncio.create_task(asyncio.to_thread(client.wait_assigned, job.job_id))
        await placement.stub.CancelJob(pb.CancelJobRequest(job_id=job.job_id, reason="gone"))
        with pytest.raises(JobNotAssigned) as ended:
            await waiting
        assert ended.value.job.state is JobState.CANCELLED
        assert str(ended.value) == f"job {job.job_id} ended cancelled: gone"

        states = [j.state for j in await asyncio.to_thread(lambda: list(client.watch(job.job_id)))]
        assert states == [JobState.CANCELLED]
        pages = await asyncio.to_thread(lambda: list(client.list(page_size=2)))
        assert len(pages) == 5
        limited = await asyncio.to_thread(lambda: list(client.list(["assigned"], limit=3)))
        assert len(limited) == 3 and all(j.state is JobState.ASSIGNED for j in limited)
    finally:
        client.close()


def test_a_mig_batch_task_document_leaves_the_size_to_the_planner() -> None:
    spec = spec_from_document(
        {
            "name": "lud",
            "kind": "batch",
            "task_key": "rodinia-lud",
            "resources": {"mig": True},
            "command": ["./lud", "-s", "8192"],
        },
        "lud.yaml",
    )
    assert spec.resources.WhichOneof("share") == "mig"
    assert list(spec.command) == ["./lud", "-s", "8192"]


def test_job_documents_become_specs_with_defaults() -> None:
    spec = spec_from_document(
        {"name": "n", "kind": "batch", "resources": {"memory_bytes": 5, "whole_gpus": 1}}, "x"
    )
    assert spec.priority.level == 5 and spec.resources.memory_bytes == 5
    assert spec.resources.WhichOneof("share") == "whole_gpus"
    assert not spec.HasField("slo") or spec.slo.p99_latency_ms == 0


@pytest.mark.parametrize(
    ("document", "key", "problem"),
    [
        ({"kind": "batch"}, "name", "required"),
        ({"name": 3, "kind": "batch"}, "name", "must be a string"),
        ({"name": "n", "kind": "batch"}, "resources", "required"),
        (
            {"name": "n", "kind": "batch", "resources": {"memory_gib": 1, "memory_bytes": 1}},
            "resources.memory_gib",
            "not both",
        ),
        (
            {
                "name": "n",
                "kind": "batch",
                "resources": {"whole_gpus": 1, "mps": {"sm_percent": 1}},
            },
            "resources.mps",
            "give one of mps, whole_gpus and mig",
        ),
        (
            {"name": "n", "kind": "batch", "resources": {"mig": 5}, "command": ["true"]},
            "resources.mig",
            "must be true (the planner sizes it) or one of 1, 2, 3, 4, 7",
        ),
        (
            {"name": "n", "kind": "batch", "resources": {"mig": True}, "command": "true"},
            "command",
            "list of strings",
        ),
        (
            {"name": "n", "kind": "batch", "resources": {"mps": {"sm_percent": 10}}},
            "resources.mps.quota_request_percent",
            "required",
        ),
        (
            {"name": "n", "kind": "batch", "resources": {"whole_gpus": True}},
            "resources.whole_gpus",
            "whole number",
        ),
        (
            {"name": "n", "kind": "batch", "resources": {"whole_gpus": 1}, "slo": {"p50": 1}},
            "slo.p50",
            "unknown key",
        ),
        ({"name": "n", "kind": "batch", "resources": []}, "resources", "must be a mapping"),
    ],
)
def test_job_document_problems_name_the_source_and_key(
    document: dict, key: str, problem: str
) -> None:
    with pytest.raises(JobFileError) as caught:
        spec_from_document(document, "job.yaml")
    assert caught.value.key == key and caught.value.source == "job.yaml"
    assert str(caught.value).startswith(f"job.yaml: key {key!r}: ") and problem in str(caught.value)


def test_an_empty_job_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    with pytest.raises(JobFileError, match="empty document"):
        load_job_file(path)


def test_a_mig_task_shows_its_planned_instance() -> None:
    from gpuloom.clients.cli.jobs.common import summary

    job = pb.Job(job_id="j-1", state=pb.JOB_STATE_ASSIGNED)
    job.spec.resources.mig.SetInParent()
    job.assignment.gpu.gpu_uuid, job.assignment.gpu.node = "GPU-7", "n1"
    job.assignment.mig.CopyFrom(pb.MigSlot(size=3, first_slice=4))
    line = summary(job_from_pb(job))
    assert "GPU GPU-7 on node n1, MIG 3 slices at slice 4" in line
    assert "a MIG instance (sized by the batch planner)" in line


async def test_one_priority_default_for_the_service_the_cli_and_job_files(
    placement: Live, dispatchers: DispatcherApp, tmp_path: Path
) -> None:
    await register_all(placement.stub, dispatchers)
    unset = mps_spec("unset")
    unset.ClearField("priority")
    assert (await submit(placement.stub, unset)).spec.priority.level == DEFAULT_PRIORITY == 5
    highest = mps_spec("highest", priority=0)  # an explicit 0 stays the highest
    assert (await submit(placement.stub, highest)).spec.priority.level == 0

    path = tmp_path / "plain.yaml"
    path.write_text("name: plain\nkind: batch\nresources: {memory_gib: 1, whole_gpus: 1}\n")
    filed = await invoke("submit", str(path), address(placement), "--json")
    assert json.loads(stdout_of(filed))["spec"]["priority"] == {"level": DEFAULT_PRIORITY}
    ran = await invoke("run", address(placement), "--no-shim", "--name", "ran", "--", "true")
    assert ran.exit_code == 0, ran.output
    [job] = [j for j in await all_jobs(placement) if j.spec.name == "ran"]
    assert job.spec.priority.level == DEFAULT_PRIORITY
