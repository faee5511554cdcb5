"""Every GPULOOM_* variable compose.yaml, docker/Dockerfile and deploy/k8s hand a gpuloom process
is a setting that process reads (the settings classes ignore unknown names, so a misspelt one
would pass unnoticed), and the values they give load into those settings."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

from gpuloom.clients.shim_path import SHIM_PATH_ENV
from gpuloom.policies.fikit.core import LIBRARY_ENV
from gpuloom.services.common.settings import CommonSettings
from gpuloom.services.dispatcher.settings import DispatcherSettings
from gpuloom.services.k8s.settings import DevicePluginSettings, K8sSettings
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.services.profile_store.settings import ProfileStoreSettings
from gpuloom.services.profiler.settings import ProfilerSettings
from gpuloom.transport import TransportSettings
from tests.deploy.conftest import ROOT
from tests.deploy.test_k8s import env_of, workloads

SERVICE_SETTINGS: dict[str, tuple[type[BaseSettings], ...]] = {
    "profile-store": (ProfileStoreSettings,),
    "profiler": (ProfilerSettings,),
    "placement": (PlacementSettings,),
    "dispatcher": (DispatcherSettings,),
    "migrate": (ProfileStoreSettings, PlacementSettings),
    "k8s": (K8sSettings,),
    "device-plugin": (DevicePluginSettings,),
}
# Settings without a default, which a deployment sets per container.
REQUIRED = {"device-plugin": {"GPULOOM_DEVICE_PLUGIN_NODE": "node-a"}}
# Read by the CLI and libraries rather than a settings class.
OTHER_VARIABLES = {"GPULOOM_PLACEMENT_ADDRESS", SHIM_PATH_ENV, LIBRARY_ENV}


def variables(*classes: type[BaseSettings]) -> set[str]:
    """What a service reads: its own settings, every process's, and TLS and tokens (whose files
    the deployment provides, so their values are not loaded here)."""
    return {
        (cls.model_config.get("env_prefix", "") + name).upper()
        for cls in (CommonSettings, TransportSettings, *classes)
        for name in cls.model_fields
    }


def interpolate(value: str) -> str:
    """compose's ${VAR:-default} -> default, ${VAR:?error} -> a password; k8s' $(VAR) -> pw."""
    value = re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)
    value = re.sub(r"\$\{[A-Z0-9_]+:\?[^}]*\}", "pw", value)
    return re.sub(r"\$\([A-Z0-9_]+\)", "pw", value)


def check(where: str, role: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    classes = SERVICE_SETTINGS[role]
    known = variables(*classes) | OTHER_VARIABLES
    ours = {k: v for k, v in env.items() if k.startswith("GPULOOM_")}
    assert set(ours) - known == set(), where
    with monkeypatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("GPULOOM_")]:
            patch.delenv(name)
        for name, value in ours.items():
            patch.setenv(name, interpolate(value))
        for cls in (CommonSettings, *classes):
            cls()  # raises ValidationError naming the field if a value does not load


def role_of(command: list[str]) -> str:
    return command[1] if command[0] == "serve" else command[0]


def compose_services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]


def test_compose_gives_each_service_only_settings_it_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checked = 0
    for name, service in compose_services().items():
        command = service.get("command")
        if not command or role_of(command) not in SERVICE_SETTINGS:
            continue
        env = {k: str(v) for k, v in service.get("environment", {}).items()}
        check(f"compose {name}", role_of(command), env, monkeypatch)
        checked += 1
    assert checked == 4 + 8  # migrate, store, profiler, placement, 8 dispatchers


def test_k8s_gives_each_container_only_settings_it_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    placeholders = {
        "spec.nodeName": "node-a",
        "status.podIP": "10.1.2.3",
        "metadata.namespace": "gpuloom",
        "metadata.name": "gpuloom-k8s-5d8f7-abcde",
    }
    checked = 0
    for name, workload in workloads().items():
        pod = workload["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            args = container.get("args")
            if not args or role_of(args) not in SERVICE_SETTINGS:
                continue
            env = {
                k: placeholders[v["fieldRef"]["fieldPath"]]
                if isinstance(v, dict) and "fieldRef" in v
                else str(v)
                for k, v in env_of(container).items()
                if not (isinstance(v, dict) and "secretKeyRef" in v)
            }
            check(f"k8s {name}/{container['name']}", role_of(args), env, monkeypatch)
            checked += 1
    assert checked == 2 + 4 + 2  # two migrate init containers, four services, k8s, device plugin


def test_the_images_environment_is_read_by_every_service(monkeypatch: pytest.MonkeyPatch) -> None:
    dockerfile = re.sub(r"\\\n", " ", (ROOT / "docker" / "Dockerfile").read_text())
    env = dict(re.findall(r"\b(GPULOOM_[A-Z0-9_]+)=(\S+)", dockerfile))
    assert {"GPULOOM_BIND_HOST", "GPULOOM_DATA_DIR", LIBRARY_ENV, SHIM_PATH_ENV} <= env.keys()
    for role in SERVICE_SETTINGS:
        check(f"Dockerfile, {role}", role, {**env, **REQUIRED.get(role, {})}, monkeypatch)


def test_a_misspelt_variable_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AssertionError):
        check("x", "placement", {"GPULOOM_PLACEMENT_DEFALT_POLICY": "mra"}, monkeypatch)
    with pytest.raises(ValueError, match="default_policy"):
        check("x", "placement", {"GPULOOM_PLACEMENT_DEFAULT_POLICY": "nope"}, monkeypatch)
