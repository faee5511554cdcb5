"""`gpuloom profile open|sessions|session|cancel` against a live profiler (and its store)."""

from __future__ import annotations

import asyncio
import json
import re

from click.testing import CliRunner, Result

from gpuloom.clients.cli import cli
from gpuloom.services.profiler.app import ProfilerApp
from gpuloom.v1 import profiler_pb2, profiler_pb2_grpc
from tests.conftest import free_port
from tests.placement.test_client_cli import SERVICE_LOG


async def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    # The profiler serves on this event loop, so the blocking CLI runs in a worker thread.
    runner = CliRunner(env=env)
    return await asyncio.to_thread(runner.invoke, cli, list(args), prog_name="gpuloom")


def printed(result: Result) -> str:
    """stdout without the service's log lines (it logs on this process's stdout)."""
    lines = result.stdout.splitlines(keepends=True)
    return "".join(line for line in lines if not SERVICE_LOG.match(line))


async def test_open_list_show_and_cancel_a_session(
    profiler_app: ProfilerApp, profiler: profiler_pb2_grpc.ProfilerStub
) -> None:
    where = f"127.0.0.1:{profiler_app.port}"
    opened = await invoke("profile", "open", "resnet50-train", "A100-80GB", "--runs", "12",
                          "--profiler", where, "--json")  # fmt: skip
    assert opened.exit_code == 0, opened.output
    session = json.loads(printed(opened))
    assert session["state"] == "SESSION_STATE_OPEN" and session["runs"] == 12
    session_id = session["session_id"]

    twice = await invoke("profile", "open", "resnet50-train", "A100-80GB", "--profiler", where)
    assert twice.exit_code == 1
    (line,) = twice.stderr.splitlines()
    assert line.startswith("Error: ") and line.endswith(f"(profiler at {where})")

    # The group's --profiler serves every command.
    listed = await invoke("--profiler", where, "profile", "sessions")
    assert listed.exit_code == 0, listed.output
    lines = printed(listed).splitlines()
    assert lines[0].split()[:3] == ["ID", "TASK", "KEY"]
    row = next(line for line in lines if line.startswith(session_id))
    assert re.search(r"resnet50-train\s+A100-80GB\s+open\s+0/12\s+0\s+\d{4}-\d\d-\d\dT", row), row

    shown = await invoke("profile", "session", session_id, "--profiler", where)
    assert shown.exit_code == 0, shown.output
    assert printed(shown).startswith(
        f"session {session_id} open: task 'resnet50-train' on 'A100-80GB', 0 of 12 runs"
    )

    cancelled = await invoke("profile", "cancel", session_id, "--profiler", where)
    assert cancelled.exit_code == 0, cancelled.output
    assert printed(cancelled).startswith(f"session {session_id} cancelled:")
    stored = await profiler.GetSession(profiler_pb2.GetSessionRequest(session_id=session_id))
    assert stored.state == profiler_pb2.SESSION_STATE_CANCELLED

    only_open = await invoke(
        "profile", "sessions", "--state", "open", "--profiler", where, "--json"
    )
    assert only_open.exit_code == 0 and printed(only_open) == ""


async def test_session_errors_are_one_line(profiler_app: ProfilerApp) -> None:
    where = f"127.0.0.1:{profiler_app.port}"
    unknown = await invoke("profile", "session", "s-nobody", "--profiler", where)
    assert unknown.exit_code == 1 and "s-nobody" in unknown.stderr
    few = await invoke("profile", "open", "t", "A100-80GB", "--runs", "3", "--profiler", where)
    assert few.exit_code == 2
    (line,) = few.stderr.splitlines()
    assert line.startswith("Error: gpuloom profile open: Invalid value for '--runs'")
    dead = f"127.0.0.1:{free_port()}"
    down = await invoke("profile", "sessions", env={"GPULOOM_PROFILER_ADDRESS": dead})
    assert down.exit_code == 1
    (line,) = down.stderr.splitlines()
    assert line.startswith(
        f"Error: cannot reach profiler at {dead} (set with --profiler or GPULOOM_PROFILER_ADDRESS)"
    )
