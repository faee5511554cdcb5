"""The reference docs against the code they describe:

- the tables of docs/configuration.md list exactly the variables of the settings classes (each
  field of a class is its prefix + the field name in capitals), no more, no fewer;
- every other GPULOOM_ variable docs/configuration.md names is one the code uses, and every
  GPULOOM_ variable the Python code names is in docs/configuration.md;
- every RPC of every service in protos/ is named in that service's doc.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from gpuloom.services.common.settings import CommonSettings
from gpuloom.services.dispatcher.settings import DispatcherSettings
from gpuloom.services.k8s.settings import DevicePluginSettings, K8sSettings
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.services.profile_store.settings import ProfileStoreSettings
from gpuloom.services.profiler.settings import ProfilerSettings
from gpuloom.transport import TransportSettings

ROOT = Path(__file__).resolve().parents[1]
CONFIGURATION = ROOT / "docs" / "configuration.md"
SETTINGS: tuple[type[BaseSettings], ...] = (
    CommonSettings,
    ProfileStoreSettings,
    ProfilerSettings,
    PlacementSettings,
    DispatcherSettings,
    K8sSettings,
    DevicePluginSettings,
    TransportSettings,
)
PYTHON_CODE = ("clients", "gpuloom", "services")
SOURCES = (*PYTHON_CODE, "shim/src", "shim/fake", "examples", "scripts")
# The service each doc describes (its RPCs must all be named there).
SERVICE_DOCS = {
    "Dispatcher": "docs/dispatcher.md",
    "Placement": "docs/placement.md",
    "ProfileStore": "docs/profile-store.md",
    "Profiler": "docs/profiler.md",
}
VARIABLE = re.compile(r"\bGPULOOM_[A-Z0-9_]*[A-Z0-9]\b")


def settings_variables() -> set[str]:
    found = set()
    for cls in SETTINGS:
        prefix = cls.model_config.get("env_prefix", "")
        assert prefix.startswith("GPULOOM_"), cls
        found |= {prefix + name.upper() for name in cls.model_fields}
    return found


def documented_table_variables() -> set[str]:
    """Each table row's first cell: full names (`GPULOOM_X`) or names under the section's
    prefix (`## placement (`GPULOOM_PLACEMENT_*`)`), several joined by ` / `."""
    found: set[str] = set()
    prefix = None
    for line in CONFIGURATION.read_text().splitlines():
        heading = re.match(r"^## .*\(`(GPULOOM_[A-Z0-9_]*)\*`\)", line)
        if heading:
            prefix = heading.group(1)
            continue
        if line.startswith("## "):
            prefix = None
            continue
        if prefix is None or not line.startswith("| `"):
            continue
        cell = line.split("|")[1]
        for name in re.findall(r"`([A-Z0-9_]+)`", cell):
            found.add(name if name.startswith("GPULOOM_") else prefix + name)
    return found


def source_text(folders: tuple[str, ...]) -> str:
    texts = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in ("", ".py", ".c", ".h", ".sh"):
                if "v1" in path.relative_to(ROOT).parts:  # generated stubs
                    continue
                try:
                    texts.append(path.read_text())
                except UnicodeDecodeError:
                    continue
    return "\n".join(texts)


def test_the_tables_list_exactly_the_settings() -> None:
    documented, settings = documented_table_variables(), settings_variables()
    assert settings - documented == set(), "settings missing in docs/configuration.md"
    assert documented - settings == set(), "docs/configuration.md lists unknown settings"


def test_every_other_variable_named_is_used_and_every_used_one_documented() -> None:
    named = set(VARIABLE.findall(CONFIGURATION.read_text()))
    settings = settings_variables()
    used_anywhere = set(VARIABLE.findall(source_text(SOURCES)))
    assert named - settings - used_anywhere == set(), "documented, but nothing uses them"
    python = source_text(PYTHON_CODE)
    # Whole names as string literals ("GPULOOM_X"; prefixes end in "_" and are not matched).
    used_in_python = set(re.findall(r"[\"'`](GPULOOM_[A-Z0-9_]*[A-Z0-9])[\"'`]", python))
    assert used_in_python - named - settings == set(), "used, but not in docs/configuration.md"


def rpcs() -> list[tuple[str, str]]:
    found = []
    for proto in sorted((ROOT / "protos" / "gpuloom" / "v1").glob("*.proto")):
        text = proto.read_text()
        for service, body in re.findall(r"^service (\w+) \{(.*?)^\}", text, re.M | re.S):
            found += [(service, rpc) for rpc in re.findall(r"^\s*rpc (\w+)\(", body, re.M)]
    return found


def test_the_protos_have_the_services_the_docs_describe() -> None:
    assert {service for service, _ in rpcs()} == set(SERVICE_DOCS)
    assert len(rpcs()) >= 30  # the parse found the RPCs, not nothing


@pytest.mark.parametrize(("service", "rpc"), rpcs())
def test_every_rpc_is_named_in_its_services_doc(service: str, rpc: str) -> None:
    doc = SERVICE_DOCS[service]
    assert re.search(rf"\b{rpc}\b", (ROOT / doc).read_text()), f"{rpc} not in {doc}"
