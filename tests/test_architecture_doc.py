"""What docs/architecture.md claims about the package, against the package:

- its layer table has a row for every package and module of the gpuloom/ folder and names every
  service of the services/ folder (a new one gets its row, with what it may import);
- every policy family (a package under gpuloom/policies/) finds its policies by name through a
  `Registry` of gpuloom/policies/registry.py, as "Where new things go" says.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import gpuloom.policies
from gpuloom.policies.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# Packages of gpuloom/policies/ that are not a family of policies found by name, and why.
NOT_FAMILIES = {
    "fikit": "the binding of the one FIKIT decision core (shim/src/fikit.c), no alternatives",
}


def layer_table_modules() -> set[str]:
    """The backticked names in the first cell of each row of the layer table (the table whose
    header is `| module | may import | never imports |`)."""
    lines = ARCHITECTURE.read_text().splitlines()
    start = lines.index("| module | may import | never imports |")
    names: set[str] = set()
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        names |= set(re.findall(r"`([A-Za-z0-9_.]+)`", line.split("|")[1]))
    return names


def parts_of(folder: Path) -> list[str]:
    """The packages and modules directly in `folder` (not __init__.py)."""
    found = [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()]
    found += [p.stem for p in folder.glob("*.py") if p.name != "__init__.py"]
    return sorted(found)


def test_the_layer_table_is_found() -> None:
    names = layer_table_modules()
    assert {"gpuloom.domain", "gpuloom.policies", "gpuloom.services.X"} <= names


@pytest.mark.parametrize("part", parts_of(ROOT / "gpuloom"))
def test_every_part_of_the_gpuloom_folder_has_a_row(part: str) -> None:
    assert f"gpuloom.{part}" in layer_table_modules(), f"no row for gpuloom.{part}"


@pytest.mark.parametrize("part", parts_of(ROOT / "services"))
def test_every_service_is_named_in_the_layer_table(part: str) -> None:
    names = layer_table_modules()
    assert f"gpuloom.services.{part}" in names or part in names, f"services/{part} unnamed"


def registries_of(family: str) -> list[Registry]:
    """The module-level Registry objects of every module of gpuloom.policies.<family>."""
    package = importlib.import_module(f"gpuloom.policies.{family}")
    modules = [package]
    for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        modules.append(importlib.import_module(info.name))
    return [value for m in modules for value in vars(m).values() if isinstance(value, Registry)]


FAMILIES = [
    info.name
    for info in pkgutil.iter_modules(gpuloom.policies.__path__)
    if info.ispkg and info.name not in NOT_FAMILIES
]


def test_the_exceptions_are_packages_of_the_policies() -> None:
    packages = {info.name for info in pkgutil.iter_modules(gpuloom.policies.__path__)}
    assert set(NOT_FAMILIES) <= packages
    assert len(FAMILIES) >= 6  # placement, fleet, tokens, mig, training, profiling at least


@pytest.mark.parametrize("family", FAMILIES)
def test_every_policy_family_has_a_registry(family: str) -> None:
    registries = registries_of(family)
    assert registries, f"gpuloom/policies/{family}/ finds its policies by name without a Registry"
    assert all(len(r) >= 1 for r in registries)
