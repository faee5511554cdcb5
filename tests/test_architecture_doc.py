"""What docs/architecture.md claims about the package, against the package:

- its layer table has a row for every package and module of the gpuloom/ folder and names every
  service of the services/ folder (a new one gets its row, with what it may import);
- every policy family (a package under gpuloom/policies/) finds its policies by name through a
  `Registry` of gpuloom/policies/registry.py, as "Where new things go" says.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ROOT / "gpuloom" / "policies"
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


def builds_a_registry(family: str) -> bool:
    """Whether some module of gpuloom/policies/<family>/ makes a `Registry(...)` (at import time
    or, for a family whose policies take knobs, inside the function that makes one)."""
    for path in sorted((POLICIES / family).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name == "Registry":
                    return True
    return False


FAMILIES = sorted(
    p.name
    for p in POLICIES.iterdir()
    if (p / "__init__.py").is_file() and p.name not in NOT_FAMILIES
)


def test_the_exceptions_are_packages_of_the_policies() -> None:
    assert all((POLICIES / name / "__init__.py").is_file() for name in NOT_FAMILIES)
    assert len(FAMILIES) >= 6  # placement, fleet, tokens, mig, training, profiling at least


@pytest.mark.parametrize("family", FAMILIES)
def test_every_policy_family_finds_its_policies_through_a_registry(family: str) -> None:
    assert builds_a_registry(family), (
        f"gpuloom/policies/{family}/ finds its policies by name without a Registry "
        "(gpuloom/policies/registry.py)"
    )


def walk_section() -> str:
    text = ARCHITECTURE.read_text()
    start = text.index("## One request, from SubmitJob")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_each_walk_counts_the_shapes_it_lists() -> None:
    """A walk's heading says "N shapes"; its numbered list ends at N (the lists of the shim's
    half go on from the reservation's count)."""
    walks = re.findall(
        r"\*\*(Priority|Time quota|Memory cap)\*\*:[^\n]*?(\d+) shapes", walk_section()
    )
    assert len(walks) == 6, walks  # three to the reservation, three from it on
    blocks = re.split(r"\n\*\*(?:Priority|Time quota|Memory cap)\*\*:", walk_section())[1:]
    for (name, count), block in zip(walks, blocks, strict=True):
        numbers = [int(n) for n in re.findall(r"^(\d+)\. ", block, re.MULTILINE)]
        assert numbers and numbers[-1] == int(count), (name, count, numbers)
        # Issue 39's target: at most 5 shapes from SubmitJob to the shim for each value.
        assert int(count) <= 5, (name, count)


def test_the_walk_names_only_code_that_exists() -> None:
    """Every identifier the walk puts in backticks (a function, a type, a field: `a.b_c`,
    `gl_fk_add_task`, `Share.priority`) is found in the sources, so a rename breaks the walk."""
    sources = "\n".join(
        path.read_text(errors="replace")
        for folder in ("gpuloom", "services", "clients", "shim/src", "protos")
        for path in (ROOT / folder).rglob("*")
        if path.suffix in (".py", ".c", ".h", ".proto") and "v1" not in path.parts
    )
    names = set()
    for quoted in re.findall(r"`([^`]+)`", walk_section()):
        for token in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", quoted.split(":")[-1]):
            if "_" in token.strip("_") or re.fullmatch(r"[A-Z][a-z]+[A-Z]\w*", token):
                names.add(token)
    missing = sorted(name for name in names if not re.search(rf"\b{name}\b", sources))
    assert names and not missing, missing
