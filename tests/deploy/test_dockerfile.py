"""docker/Dockerfile: hadolint-clean, pinned base, non-root stages, installs from the lock files,
and a .dockerignore that lets in what the Dockerfile copies and nothing else."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from tests.deploy.conftest import ROOT, broken_copy, tool

DOCKERFILE = ROOT / "docker" / "Dockerfile"


def stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        start = re.match(r"FROM \S+ AS (\S+)$", line)
        if start:
            current = found.setdefault(start.group(1), [])
        if current is not None:
            current.append(line)
    return found


def test_hadolint_passes() -> None:
    result = tool("hadolint", "--no-color", DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("broken", "replacement"),
    [
        ("--no-install-recommends gcc", "gcc"),
        ("WORKDIR /src", "RUN cd /src"),
        ('ENTRYPOINT ["gpuloom"]', "ENTRYPOINT gpuloom"),
    ],
)
def test_hadolint_fails_on_a_broken_dockerfile(
    tmp_path: Path, broken: str, replacement: str
) -> None:
    copy = broken_copy(DOCKERFILE, tmp_path, broken, replacement)
    result = tool("hadolint", "--no-color", copy)
    assert result.returncode != 0, result.stdout


def test_the_base_image_is_pinned_to_an_exact_python_release() -> None:
    (default,) = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", default)
    froms = re.findall(r"^FROM (\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    assert set(froms) <= {"${PYTHON_IMAGE}", "service"}


def test_the_images_run_as_an_unprivileged_user() -> None:
    all_stages = stages()
    assert {"build", "service", "worker"} <= all_stages.keys()
    service_users = [i for i in all_stages["service"] if i.startswith("USER ")]
    assert service_users == ["USER 10001:10001"]
    # The worker starts from the service stage and never switches back to root.
    assert all_stages["worker"][0] == "FROM service AS worker"
    assert not [i for i in all_stages["worker"] if i.startswith("USER ")]


def test_packages_come_from_the_lock_files_with_hashes() -> None:
    build = " ".join(stages()["build"])
    assert "pip install --require-hashes --no-deps -r requirements.lock" in build
    assert "pip install --require-hashes --no-deps -r requirements-build.lock" in build
    assert "--no-build-isolation" in build  # the wheel builds with the locked tools only
    assert "pip install " not in " ".join(stages()["service"] + stages()["worker"])


def test_the_worker_ships_the_shim_and_the_service_the_fikit_core() -> None:
    service = " ".join(stages()["service"])
    worker = " ".join(stages()["worker"])
    assert "GPULOOM_FIKIT_LIB=/opt/gpuloom/lib/libglfikit.so" in service
    assert "COPY --from=build /opt/gpuloom/shim/build /opt/gpuloom/shim/build" in worker
    assert "GPULOOM_SHIM_PATH=/opt/gpuloom/shim/build/libgpuloom.so" in worker
    assert "/opt/gpuloom/shim" not in service


def _dockerignore_allows(path: str) -> bool:
    """Whether the build context keeps `path`, by .dockerignore's rules (the last match wins)."""
    allowed = True
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes) or (
            pattern.startswith("**/") and any(fnmatch.fnmatch(p, pattern[3:]) for p in parts)
        ):
            allowed = negate
    return allowed


def test_dockerignore_lets_in_every_copied_source_and_keeps_out_state() -> None:
    copied = []
    for instruction in stages()["build"] + stages()["service"] + stages()["worker"]:
        if instruction.startswith("COPY ") and "--from=" not in instruction:
            copied += instruction.split()[1:-1]
    assert "requirements.lock" in copied and "shim" in copied
    for source in copied:
        assert _dockerignore_allows(source), source
        assert (ROOT / source).exists(), source
    for kept_out in (
        ".venv/bin/python",
        ".gpuloom/placement.db",
        ".env",
        ".git/config",
        "shim/build/libgpuloom.so",
        "tests/conftest.py",
        "gpuloom/v1/placement_pb2.py",
        "services/__pycache__/x.pyc",
    ):
        assert not _dockerignore_allows(kept_out), kept_out
