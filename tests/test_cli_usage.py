"""Usage errors of every `gpuloom` command: one line `Error: gpuloom COMMAND: ...` naming the
flag, value, argument or command, exit status 2, no usage banner, nothing sent anywhere (the
placement address given is closed: a command that tried to reach it would exit 1)."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from gpuloom.clients.cli import cli

NOWHERE = "--placement=127.0.0.1:9"


@pytest.mark.parametrize(
    ("args", "command", "named"),
    [
        (["top", "--interval", "0.01", NOWHERE], "gpuloom top", "'--interval'"),
        (["top", "--bogus"], "gpuloom top", "'--bogus'"),
        (["jobs", "--state", "nope", NOWHERE], "gpuloom jobs", "'--state'"),
        (["jobs", "--limit", "0", NOWHERE], "gpuloom jobs", "'--limit'"),
        (["job", NOWHERE], "gpuloom job", "'JOB'"),
        (["run", "--sm", "200", NOWHERE, "--", "true"], "gpuloom run", "'--sm'"),
        (["run", "--priority", "x", NOWHERE, "--", "true"], "gpuloom run", "'--priority'"),
        (["run", "--sm", "20", NOWHERE, "--", "true"], "gpuloom run", "--memory-gib"),
        (["profile", "list", "--kind", "nope"], "gpuloom profile list", "'--kind'"),
        (["submit", "/nonexistent/job.yaml", NOWHERE], "gpuloom submit", "/nonexistent/job.yaml"),
        (["nope"], "gpuloom", "'nope'"),
    ],
)
def test_a_usage_error_is_one_line_naming_it(args: list[str], command: str, named: str) -> None:
    result = CliRunner().invoke(cli, args, prog_name="gpuloom")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"Error: {command}: ")
    assert named in lines[0]
    assert "Usage:" not in result.stderr


def test_a_group_without_a_command_still_shows_its_help() -> None:
    result = CliRunner().invoke(cli, ["mig"], prog_name="gpuloom")
    assert result.exit_code == 2
    assert "Usage: gpuloom mig" in result.output and "Commands:" in result.output


def closed(port: int) -> str:
    return f"127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("args", "env", "asked"),
    [
        # The group's option, for any command ...
        (["--placement", closed(9), "jobs"], {}, closed(9)),
        (["--placement", closed(9), "top", "--once"], {}, closed(9)),
        # ... over the variable ...
        (["--placement", closed(9), "gpus"], {"GPULOOM_PLACEMENT_ADDRESS": closed(8)}, closed(9)),
        (["gpus"], {"GPULOOM_PLACEMENT_ADDRESS": closed(8)}, closed(8)),
        # ... and the command's own option over both.
        (
            ["--placement", closed(9), "job", "j-1", "--placement", closed(7)],
            {"GPULOOM_PLACEMENT_ADDRESS": closed(8)},
            closed(7),
        ),
    ],
)
def test_where_placement_is_group_option_then_variable(
    args: list[str], env: dict[str, str], asked: str
) -> None:
    result = CliRunner(env=env).invoke(cli, args, prog_name="gpuloom")
    assert result.exit_code == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        f"Error: cannot reach placement at {asked} (set with --placement or "
        "GPULOOM_PLACEMENT_ADDRESS): "
    )


def test_where_the_profile_store_is() -> None:
    env = {"GPULOOM_PROFILE_STORE_ADDRESS": closed(8)}
    for args, asked in (
        (["--store", closed(9), "profile", "list"], closed(9)),
        (["profile", "list"], closed(8)),
        (["--store", closed(9), "profile", "list", "--store", closed(7)], closed(7)),
    ):
        result = CliRunner(env=env).invoke(cli, args, prog_name="gpuloom")
        assert result.exit_code == 1
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"Error: cannot reach profile store at {asked} (set with --store")


def test_profile_is_one_group_and_profiles_a_hidden_deprecated_alias() -> None:
    shown = CliRunner().invoke(cli, ["--help"], prog_name="gpuloom").output
    assert re.search(r"^\s+profile\s", shown, re.M) and not re.search(
        r"^\s+profiles\s", shown, re.M
    )
    commands = CliRunner().invoke(cli, ["profile", "--help"], prog_name="gpuloom").output
    for name in ("list", "show", "put", "delete", "open", "sessions", "session", "cancel"):
        assert re.search(rf"^\s+{name}\s", commands, re.M), name
    old = CliRunner(env={"GPULOOM_PROFILE_STORE_ADDRESS": closed(9)}).invoke(
        cli, ["profiles", "list"], prog_name="gpuloom"
    )
    assert old.exit_code == 1  # the same command: it tried the store
    assert "deprecated" in old.stderr and f"cannot reach profile store at {closed(9)}" in old.stderr


@pytest.mark.parametrize("command", ["up", "serve"])
def test_up_and_serve_help_point_to_the_settings(command: str) -> None:
    shown = CliRunner().invoke(cli, [command, "--help"], prog_name="gpuloom")
    assert shown.exit_code == 0
    assert "GPULOOM_" in shown.output and "docs/configuration.md" in shown.output
