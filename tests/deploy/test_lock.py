"""requirements.lock / requirements-build.lock: every dependency of pyproject.toml pinned with
hashes at a version its specifier allows, so the images install exactly what was locked.
After a dependency change, `scripts/lock` regenerates them (and this fails until then)."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.markers import Marker
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


# Pythons pyproject.toml allows (>= 3.11), at the releases where dependencies' markers change:
# redis-py needs async-timeout below 3.11.3, and Debian bookworm's python3 is 3.11.2.
PYTHONS = ("3.11.0", "3.11.2", "3.11.3", "3.12.0", "3.13.0", "3.14.0")


def test_the_runtime_lock_holds_every_dependency_on_every_allowed_python() -> None:
    """The locked packages' own dependencies, as the releases installed here declare them
    (the lock's may differ by a patch release; the image build's `pip check` is the exact
    gate), evaluated for each allowed Python: each one is locked, with no marker that leaves
    it out there."""
    text = RUNTIME_LOCK.read_text()
    markers = {
        canonicalize_name(name): marker.strip()
        for name, marker in re.findall(r"^([A-Za-z0-9._-]+)==\S+(?: ;([^\\\n]*))?", text, re.M)
    }
    checked = 0
    for name in markers:
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # only needed on another Python than this one
        checked += 1
        for text_requirement in requires:
            requirement = Requirement(text_requirement)
            for python in PYTHONS:
                where = {"python_full_version": python, "python_version": python[:4], "extra": ""}
                if requirement.marker is not None and not requirement.marker.evaluate(where):
                    continue
                needed = canonicalize_name(requirement.name)
                assert needed in markers, (
                    f"{name} needs {needed} on Python {python}; not in requirements.lock: "
                    "run scripts/lock"
                )
                if markers[needed]:
                    assert Marker(markers[needed]).evaluate(where), (
                        f"{name} needs {needed} on Python {python}, which the lock's marker "
                        f"{markers[needed]!r} leaves out: run scripts/lock"
                    )
    assert checked >= len(markers) - 2, "the test venv lacks most locked packages"
