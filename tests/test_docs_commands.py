"""Every command in README.md and docs/*.md runs as written, against a real `gpuloom up` (the
embedded plane on simulated GPUs), or is in SKIPS with the reason it cannot run here.

A command is a line of a ```sh (or unmarked) block that starts like one (`.venv/bin/...`,
`gpuloom`, `grpcurl`, `scripts/...`, `docker`, `kubectl`, `VAR=... command`, ...; in a block of
`$ ` prompts only the prompted lines), with the lines that continue it (a trailing backslash
or an open quote). The commands of a document run in its order, in one shell each, from the
checkout's root, one document after another on a shared plane, so that what one command
makes (a reservation, a profile) is there for the next, as for a reader following along.
What changes between the docs and here:

- the plane runs on free ports: `localhost:50051`/`50052`/`50053`/`5006N` become its
  placement, profile store, profiler and dispatcher N, and GPULOOM_*_ADDRESS say the same for
  commands that name no address (what `scripts/up`'s defaults give a reader);
- a usage synopsis's optional `[...]` parts are left out (with `[--json]`, the command runs a
  second time with `--json` and its output must parse as JSON);
- a document that starts its own plane (`GPULOOM_...=... scripts/up`) gets one started with
  those settings (docs/mig.md: a GPU in MIG mode);
- a stream (SERVER_STREAMS) runs for a few seconds and is then stopped: it must still be
  running, not have failed;
- examples/serve.py serves a handful of requests (SERVE_REQUESTS), not its default 20.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuloom.clients.cli import cli
from tests.plane import Plane, running_plane

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
DEFAULT_SIM_GPUS = "4xA100-80GB"  # scripts/up's fleet (docs/configuration.md)

FENCE = re.compile(r"^```(\w*)\s*$")
COMMAND_START = re.compile(
    r"^(\.venv/bin/\w|gpuloom |grpcurl |scripts/[A-Za-z_]|docker |kubectl |cp |export |for "
    r"|[A-Z][A-Z0-9_]*=)"
)
ASSIGNMENT = re.compile(r"^[A-Z][A-Z0-9_]*=\S*(\s+#.*)?$")
PLANE_SETUP = re.compile(r"^((?:GPULOOM_[A-Z0-9_]+=\S+\s+)+)scripts/up\s*$")


@dataclass(frozen=True)
class Skip:
    doc: str
    pattern: str  # re.search on the command as written
    why: str


# Every command that does not run here, and why. Each entry must match a command (no stale
# entries), and the list stays short: a command that can run, runs.
SKIPS = (
    Skip("README.md", r"^scripts/up\b", "runs until Ctrl-C on fixed ports; the plane here is "
         "its `gpuloom up` on free ports (tests/test_up.py tests `gpuloom up`)"),
    Skip("README.md", r"^scripts/test\b", "the whole test suite, this test among it"),
    Skip("README.md", r"^scripts/fuzz\b", "minutes of fuzzing; tests/test_fuzz_script.py runs "
         "a short one"),
    Skip("README.md", r"^scripts/demo\b", "tests/test_demo.py runs it to the end"),
    Skip("benchmarks.md", r"scripts/bench_placement", "a benchmark of minutes; its figures are "
         "in the doc"),
    Skip("benchmarks.md", r"scripts/bench_training", "960 simulations, minutes, over the traces "
         "in ../shared/traces; its figures are in the doc (tests/test_bench_training.py runs a "
         "small one)"),
    Skip("benchmarks.md", r"^[TD]=\.\./shared/traces/|\$[TD]/", "a benchmark of minutes over the "
         "traces in ../shared/traces, outside the checkout; its figures are in the doc"),
    Skip("deploy.md", r"^(docker|cp \.env\.example|kubectl)\b", "needs a Docker Engine or a "
         "Kubernetes cluster; tests/deploy/test_stack.py runs the compose stack, tests/deploy "
         "validates the manifests"),
    Skip("deploy.md", r"credentials init --dir deploy/k8s", "writes a deployment's secrets into "
         "the checkout; tests/security/test_credentials.py runs `credentials init`"),
    Skip("dispatcher.md", r"dispatcher ((evict|suspend|resume) ASSIGNMENT|mig on\|off|status "
         r"--gpu UUID)", "a synopsis with placeholders; tests/test_cli_dispatcher.py runs status, "
         "evict, suspend, resume and mig on|off, docs/mig.md has `mig on|off` as commands"),
    Skip("mig.md", r"gpuloom mig (plan|synth) --gpu \{", "a synopsis with placeholders; "
         "tests/policies/mig/test_mig_cli.py runs both"),
    Skip("profile-store.md", r"alembic .* revision", "writes a new migration into the checkout"),
    Skip("profile-store.md", r"gpuloom serve profile-store$", "a server until Ctrl-C, on the "
         "fixed port 50052 (tests/profile_store start the service on free ports)"),
    Skip("profiler.md", r"gpuloom profile (session|cancel) SESSION", "a synopsis with a "
         "placeholder; tests/profiler/test_cli_sessions.py runs both"),
    Skip("profiler.md", r"loadgen\.py", "loadgen.py stands for the reader's load generator "
         "(and the grid is 35 runs); tests/profiler/test_sweep.py sweeps with one"),
    Skip("security.md", r"^(export GPULOOM_|gpuloom jobs$|grpcurl -cacert)", "needs TLS "
         "certificates and a secured plane at placement.example; tests/security/ runs the same "
         "flags against one"),
    Skip("training.md", r"--trace FILE", "a synopsis with placeholders; tests/sim/"
         "test_sim_training.py runs the command"),
)  # fmt: skip
# Server streams: they run until Ctrl-C.
SERVER_STREAMS = (r"gpuloom\.v1\.Dispatcher/WatchEvents",)
STREAM_FOR_S = 3.0


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str  # as written, its lines joined by newlines

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _complete(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on
        return False
    return not text.rstrip().endswith("\\")


def commands_of(doc: Path) -> list[Command]:
    lines = doc.read_text().splitlines()
    found: list[Command] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if FENCE.match(lines[j]))
        if fence.group(1) in ("sh", ""):
            found += _block_commands(doc.name, lines, i + 1, end)
        i = end + 1
    return found


def _block_commands(doc: str, lines: list[str], start: int, end: int) -> list[Command]:
    prompted = any(line.startswith("$ ") for line in lines[start:end])
    found: list[Command] = []
    i = start
    while i < end:
        line = lines[i]
        if prompted:
            line = line[2:] if line.startswith("$ ") else ""
        gpuloom = re.match(r"^(?:\.venv/bin/)?gpuloom (\S+)", line)
        if not COMMAND_START.match(line) or (gpuloom and gpuloom.group(1) not in cli.commands):
            i += 1  # not a command (`gpuloom is running ...`: what `gpuloom up` prints)
            continue
        first, text = i, line
        while not _complete(text) and i + 1 < end:
            i += 1
            text += "\n" + lines[i]
        found.append(Command(doc, first + 1, text))
        i += 1
    # A block of settings only (NAME=value lines, as in an env file) holds no command.
    if all(ASSIGNMENT.match(c.text) for c in found):
        return []
    return found


def all_commands() -> list[Command]:
    return [command for doc in DOCS for command in commands_of(doc)]


def skip_of(command: Command) -> Skip | None:
    return next(
        (s for s in SKIPS if s.doc == command.doc and re.search(s.pattern, command.text)), None
    )


def test_the_extraction_finds_the_commands_and_every_skip_is_used() -> None:
    commands = all_commands()
    texts = [c.text for c in commands]
    # Spot checks: a multi-line grpcurl request joined, a prompted line, a synopsis.
    assert any(t.startswith("grpcurl -plaintext -H") and '"resnet-1"' in t for t in texts)
    assert ".venv/bin/gpuloom top --once" in texts
    assert not any(t.startswith("gpuloom top  ") for t in texts)  # output, not a command
    assert not any(t.startswith("gpuloom is running") for t in texts)
    assert not any(t.startswith("GPULOOM_TLS_CERT_FILE=") for t in texts)  # a settings list
    unused = [s for s in SKIPS if not any(skip_of(c) is s for c in commands)]
    assert unused == []
    run = [c for c in commands if skip_of(c) is None]
    assert len(run) >= 30 and len(run) > 2 * len(SKIPS)


# ---- running them ----


def _for_plane(text: str, plane: Plane) -> str:
    """The command with the docs' fixed addresses replaced by the plane's."""
    ports = {"50051": plane.placement, "50052": plane.store, "50053": plane.profiler}
    ports |= {str(50060 + n): address for n, address in enumerate(plane.dispatchers)}
    text = re.sub(r"\blocalhost:(5\d{4})\b", lambda m: ports.get(m.group(1), m.group(0)), text)
    return re.sub(r"(?<![\w/])\.venv/bin/", f"{BIN}/", text)


def _variants(text: str) -> list[tuple[str, bool]]:
    """(command, prints JSON): a synopsis without its optional parts, and with `--json` when
    that is one of them."""
    if text.startswith("grpcurl") or "[" not in text:
        return [(text, False)]
    code, _, _comment = text.partition("  #")
    bare = re.sub(r"\s*\[[^\]]*\]", "", code).rstrip()
    with_json = [(f"{bare} --json", True)] if re.search(r"\[--json\]", code) else []
    return [(bare, False), *with_json]


def _run(text: str, env: dict[str, str]) -> tuple[bool, str, str]:
    """(ran well, stdout, what to show if not): exit status 0; a stream still running when
    stopped."""
    stream = any(re.search(p, text) for p in SERVER_STREAMS)
    process = subprocess.Popen(
        ["bash", "-c", text],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=STREAM_FOR_S if stream else 120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT if stream else signal.SIGKILL)
        try:
            out, err = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a stream that shrugged off SIGINT
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
        return stream, out, f"{out}{err}\n(still running after the time allowed)"
    ok = process.returncode == 0 and not stream
    return ok, out, f"{out}{err}\n(exit status {process.returncode})"


def _json_error(out: str) -> str:
    """'' if `out` is one JSON document, or one per line; else what is wrong."""
    try:
        json.loads(out)
        return ""
    except json.JSONDecodeError:
        pass
    for line in filter(None, out.splitlines()):
        try:
            json.loads(line)
        except json.JSONDecodeError as error:
            return f"not JSON: {error}: {line[:200]}"
    return "" if out.strip() else "nothing printed"


def _env(plane: Plane) -> dict[str, str]:
    return {
        **plane.env,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "SERVE_REQUESTS": "3",
        "COLUMNS": "200",
    }


def _gpu_count(sim_gpus: str) -> int:
    return sum(int(p.split("x", 1)[0]) if re.match(r"\d+x", p) else 1 for p in sim_gpus.split(","))


@pytest.fixture(scope="module")
def plane_for(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Plane]]:
    """A plane for the `scripts/up` settings a doc starts it with ('': scripts/up's defaults),
    started on first use and shared by the docs that use the same."""
    with contextlib.ExitStack() as stack:
        started: dict[str, Plane] = {}

        def get(settings: str) -> Plane:
            if settings not in started:
                env = dict(part.split("=", 1) for part in settings.split())
                sim = env.pop("GPULOOM_DISPATCHER_SIM_GPUS", DEFAULT_SIM_GPUS)
                assert not env, f"settings this test cannot start a plane with: {env}"
                state = tmp_path_factory.mktemp("plane")
                started[settings] = stack.enter_context(running_plane(state, sim, _gpu_count(sim)))
            return started[settings]

        yield get


def _docs_with_commands_to_run() -> list[str]:
    return sorted({c.doc for c in all_commands() if skip_of(c) is None})


@pytest.mark.parametrize("doc", _docs_with_commands_to_run())
def test_every_command_of_the_doc_runs_as_written(
    doc: str, plane_for: Callable[[str], Plane]
) -> None:
    setting = ""
    failures: list[str] = []
    ran = 0
    for command in (c for c in all_commands() if c.doc == doc):
        setup = PLANE_SETUP.match(command.text)
        if setup:  # `GPULOOM_X=... scripts/up`: the commands after it use such a plane
            setting = setup.group(1).strip()
            continue
        if skip_of(command) is not None:
            continue
        plane = plane_for(setting)
        for text, prints_json in _variants(_for_plane(command.text, plane)):
            ok, out, shown = _run(text, _env(plane))
            ran += 1
            if ok and prints_json and _json_error(out):
                ok, shown = False, f"{shown}\n({_json_error(out)})"
            if not ok:
                failures.append(f"{command}\n  ran: {text}\n  got: {shown.strip()[-1500:]}")
    assert ran > 0
    assert failures == [], "\n\n".join(failures)
