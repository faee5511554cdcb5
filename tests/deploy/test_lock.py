"""requirements.lock / requirements-build.lock: every dependency of pyproject.toml pinned with
hashes at a version its specifier allows, so the images install exactly what was locked.
After a dependency change, `scripts/lock` regenerates them (and this fails until then)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.conftest import ROOT

RUNTIME_LOCK = ROOT / "requirements.lock"
BUILD_LOCK = ROOT / "requirements-build.lock"


def pins(lock: Path) -> dict[str, tuple[str, list[str]]]:
    """Package -> (version, hashes) of a pip-compile --generate-hashes file."""
    found: dict[str, tuple[str, list[str]]] = {}
    entries = re.split(r"\n(?=[A-Za-z0-9])", lock.read_text())
    for entry in entries:
        head = re.match(r"([A-Za-z0-9._-]+)==(\S+)", entry)
        if head is None:
            continue
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", entry)
        found[canonicalize_name(head.group(1))] = (head.group(2), hashes)
    return found


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def check_locked(requirements: list[str], lock: Path) -> None:
    locked = pins(lock)
    assert locked, lock.name
    for text in requirements:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{name} is not in {lock.name}: run scripts/lock"
        version, _ = locked[name]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"{lock.name} pins {name}=={version}, pyproject.toml asks {requirement.specifier}: "
            "run scripts/lock"
        )
    for name, (version, hashes) in locked.items():
        assert hashes, f"{name}=={version} in {lock.name} has no hash"


def test_the_runtime_lock_pins_every_dependency() -> None:
    check_locked(pyproject()["project"]["dependencies"], RUNTIME_LOCK)


def test_the_build_lock_pins_what_building_the_wheel_needs() -> None:
    check_locked(pyproject()["build-system"]["requires"], BUILD_LOCK)


def test_the_locks_agree_on_what_both_hold() -> None:
    # The stubs are generated with the build lock's protobuf tools and run on the runtime's.
    runtime, build = pins(RUNTIME_LOCK), pins(BUILD_LOCK)
    for name in runtime.keys() & build.keys():
        assert runtime[name][0] == build[name][0], name


def test_a_stale_or_unhashed_lock_is_caught(tmp_path: Path) -> None:
    lock = RUNTIME_LOCK.read_text()
    version = pins(RUNTIME_LOCK)["grpcio"][0]
    stale = tmp_path / "stale.lock"
    stale.write_text(lock.replace(f"grpcio=={version}", "grpcio==1.0.0", 1))
    with pytest.raises(AssertionError, match=r"grpcio==1\.0\.0"):
        check_locked(["grpcio>=1.66,<2"], stale)
    missing = tmp_path / "missing.lock"
    missing.write_text(lock.replace(f"grpcio=={version}", "grpcyo==1.0.0", 1))
    with pytest.raises(AssertionError, match="grpcio is not in"):
        check_locked(["grpcio>=1.66,<2"], missing)
    unhashed = tmp_path / "unhashed.lock"
    unhashed.write_text(re.sub(r"--hash=sha256:[0-9a-f]{64}", "", lock))
    with pytest.raises(AssertionError, match="has no hash"):
        check_locked([], unhashed)
