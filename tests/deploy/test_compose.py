"""compose.yaml: valid by the compose specification, and shaped as docs/deploy.md says (one
dispatcher per GPU slot with its own device, socket directory and ports, healthchecks, restart
policies, the one-shot jobs first)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuloom.services.dispatcher.settings import COMPOSED_POLICY, DispatcherSettings
from tests.deploy.conftest import ROOT, broken_copy, tool

COMPOSE = ROOT / "compose.yaml"
ONE_SHOT = {"credentials", "migrate", "socket-dirs", "example"}
SLOTS = range(8)


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def environment(service: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in service.get("environment", {}).items()}


def test_compose_yaml_follows_the_compose_specification() -> None:
    result = tool("check-jsonschema", "--builtin-schema", "vendor.compose-spec", COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("broken", "replacement"),
    [
        ("    restart: unless-stopped\n", "    restart: unless-stopped\n    restrat: always\n"),
        ("      interval: 5s\n", "      interval: [5s]\n"),
        ("volumes:\n  pgdata:\n", "volumes: [pgdata]\n"),
    ],
)
def test_the_schema_check_fails_on_a_broken_file(
    tmp_path: Path, broken: str, replacement: str
) -> None:
    copy = broken_copy(COMPOSE, tmp_path, broken, replacement)
    result = tool("check-jsonschema", "--builtin-schema", "vendor.compose-spec", copy)
    assert result.returncode != 0, result.stdout


def test_every_long_running_service_has_a_healthcheck_and_restarts() -> None:
    for name, service in services().items():
        if name in ONE_SHOT:
            assert service["restart"] == "no", name
            assert service["healthcheck"] == {"disable": True}, name
            continue
        assert service["restart"] == "unless-stopped", name
        test = service["healthcheck"]["test"]
        assert test[0] in {"CMD", "CMD-SHELL"} and len(test) > 1, name


def test_gpuloom_services_probe_their_own_grpc_port() -> None:
    ports = {"profile-store": 50052, "profiler": 50053, "placement": 50051}
    ports.update({f"dispatcher-gpu{n}": 50060 for n in SLOTS})
    for name, port in ports.items():
        test = services()[name]["healthcheck"]["test"]
        assert test == ["CMD", "python", "/opt/gpuloom/bin/healthcheck.py", f"127.0.0.1:{port}"]


def test_the_healthcheck_script_is_in_the_image() -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "COPY docker/healthcheck.py /opt/gpuloom/bin/healthcheck.py" in dockerfile


def test_every_service_serves_with_the_credentials_the_one_shot_job_made() -> None:
    """The `credentials` job makes the directory in its volume (writable there only); every
    serving service starts after it, mounts the volume read-only and names its own certificate
    (a dispatcher: the dispatchers'), the CA, the tokens and the services' token."""
    all_services = services()
    job = all_services["credentials"]
    assert job["command"] == ["credentials", "init", "--dir", "/etc/gpuloom/credentials"]
    assert job["volumes"] == ["credentials:/etc/gpuloom/credentials"]
    assert "credentials" in compose()["volumes"]
    serving = ["profile-store", "profiler", "placement"] + [f"dispatcher-gpu{n}" for n in SLOTS]
    for name in serving:
        service = all_services[name]
        assert service["depends_on"]["credentials"] == {
            "condition": "service_completed_successfully"
        }, name
        assert "credentials:/etc/gpuloom/credentials:ro" in service["volumes"], name
        own = "dispatcher" if name.startswith("dispatcher") else name
        assert (
            environment(service).items()
            >= {
                "GPULOOM_TLS_CERT_FILE": f"/etc/gpuloom/credentials/{own}.crt",
                "GPULOOM_TLS_KEY_FILE": f"/etc/gpuloom/credentials/{own}.key",
                "GPULOOM_TLS_CA_FILE": "/etc/gpuloom/credentials/ca.crt",
                "GPULOOM_TLS_SERVER_NAME": "gpuloom",
                "GPULOOM_AUTH_TOKENS_FILE": "/etc/gpuloom/credentials/tokens",
                "GPULOOM_AUTH_TOKEN_FILE": "/etc/gpuloom/credentials/service.token",
            }.items()
        ), name
        assert "GPULOOM_INSECURE" not in environment(service), name
    example = all_services["example"]
    assert environment(example)["GPULOOM_CREDENTIALS_DIR"] == "/etc/gpuloom/credentials"
    assert "credentials:/etc/gpuloom/credentials:ro" in example["volumes"]
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "install -d -o gpuloom -g gpuloom -m 0700 /etc/gpuloom/credentials" in dockerfile


def test_the_dispatchers_run_the_dispatchers_default_policy() -> None:
    """compose is how most users run gpuloom: its dispatchers take the default admission policy
    (priority across levels, quotas within one), not a mode without priority."""
    for n in SLOTS:
        env = environment(services()[f"dispatcher-gpu{n}"])
        assert (
            env["GPULOOM_DISPATCHER_POLICY"] == f"${{GPULOOM_DISPATCHER_POLICY:-{COMPOSED_POLICY}}}"
        )
    assert DispatcherSettings.model_fields["policy"].default == COMPOSED_POLICY
    example = (ROOT / ".env.example").read_text()
    assert f"\nGPULOOM_DISPATCHER_POLICY={COMPOSED_POLICY}\n" in example


def test_services_with_a_database_start_after_the_migration_and_do_not_migrate() -> None:
    all_services = services()
    assert all_services["migrate"]["command"] == ["migrate"]
    assert all_services["migrate"]["depends_on"]["postgres"] == {"condition": "service_healthy"}
    for name in ("profile-store", "placement"):
        service = all_services[name]
        assert service["depends_on"]["migrate"] == {
            "condition": "service_completed_successfully"
        }, name
        variable = "PROFILE_STORE" if name == "profile-store" else "PLACEMENT"
        env = environment(service)
        assert env[f"GPULOOM_{variable}_AUTO_MIGRATE"] == "false"
        # The job migrates the very database the service uses.
        url = env[f"GPULOOM_{variable}_DATABASE_URL"]
        assert environment(all_services["migrate"])[f"GPULOOM_{variable}_DATABASE_URL"] == url


def test_one_dispatcher_per_gpu_slot_each_with_its_device_socket_dir_and_ports() -> None:
    all_services = services()
    dispatchers = sorted(n for n in all_services if n.startswith("dispatcher"))
    assert dispatchers == [f"dispatcher-gpu{n}" for n in SLOTS]
    published: set[str] = set()
    for n in SLOTS:
        name = f"dispatcher-gpu{n}"
        service = all_services[name]
        assert service["command"] == ["serve", "dispatcher"]
        assert service.get("profiles", []) == ([] if n == 0 else [f"gpu{n}"])
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia"
        assert device["device_ids"] == [f"${{GPULOOM_GPU{n}:-{n}}}"]
        assert "count" not in device
        env = environment(service)
        assert env["GPULOOM_DISPATCHER_GPUS"] == "0"  # the one GPU its container sees
        assert env["GPULOOM_DISPATCHER_BACKEND"] == "nvml"
        assert env["GPULOOM_DISPATCHER_PLACEMENT_ADDRESS"] == "placement:50051"
        # It registers with its container's IP (reachable from the host and the stack's
        # network), not its container name (which resolves only inside the network).
        assert "GPULOOM_DISPATCHER_ADVERTISE_HOST" not in env
        assert service["entrypoint"][:2] == ["/bin/sh", "-c"]
        assert 'GPULOOM_DISPATCHER_ADVERTISE_HOST="$${address%% *}"' in service["entrypoint"][2]
        assert "$$(hostname -i)" in service["entrypoint"][2]
        # The socket directory: a host path bound at the same path, one per slot; the MPS
        # pipe directory inside it, so jobs on the host and in containers reach both.
        socket_dir = env["GPULOOM_DISPATCHER_SOCKET_DIR"]
        assert socket_dir == f"${{GPULOOM_SOCKET_DIR:-/run/gpuloom}}/gpu-{n}"
        assert f"{socket_dir}:{socket_dir}" in service["volumes"]
        assert env["GPULOOM_DISPATCHER_MPS_DIR"] == f"{socket_dir}/mps"
        # The dispatcher owns its GPU's MPS daemon: `compute` mounts nvidia-cuda-mps-control,
        # and the jobs (MPS clients) share the host's IPC namespace with its MPS server.
        assert device["capabilities"] == ["gpu", "compute", "utility"]
        assert service["ipc"] == "host"
        assert f"dispatcher-gpu{n}-state:/var/lib/gpuloom" in service["volumes"]
        assert service["pid"] == "host"  # SO_PEERCRED pids of jobs anywhere on the host
        assert service["depends_on"]["socket-dirs"] == {
            "condition": "service_completed_successfully"
        }
        for mapping in service["ports"]:
            host_port = mapping.split(":")[-2]
            assert host_port not in published, mapping
            published.add(host_port)
        assert f"${{GPULOOM_PUBLISH_HOST:-127.0.0.1}}:{50060 + n}:50060" in service["ports"]


def test_socket_dirs_makes_every_slot_directory() -> None:
    service = services()["socket-dirs"]
    script = service["command"][0]
    made = re.search(r"for n in ([\d ]+);", script)
    assert made is not None
    assert [int(n) for n in made.group(1).split()] == list(SLOTS)
    assert "-o 10001 -g 10001" in script  # the image's user (docker/Dockerfile)


def test_published_ports_are_distinct_and_on_the_publish_host() -> None:
    seen: dict[str, str] = {}
    for name, service in services().items():
        for mapping in service.get("ports", []):
            assert mapping.startswith("${GPULOOM_PUBLISH_HOST:-127.0.0.1}:"), (name, mapping)
            host_port = mapping.split(":")[-2]
            assert host_port not in seen, (name, seen.get(host_port))
            seen[host_port] = name


def test_third_party_images_are_pinned_to_an_exact_version() -> None:
    build_args = services()["migrate"]["build"]["args"]
    images = {
        "GPULOOM_POSTGRES_IMAGE": services()["postgres"]["image"],
        "GPULOOM_REDIS_IMAGE": services()["redis"]["image"],
        "GPULOOM_PYTHON_IMAGE": build_args["PYTHON_IMAGE"],
    }
    defaults = {}
    for variable, image in images.items():
        # Another registry's copy may be named (an air-gapped host's mirror); the default is
        # an exact version.
        default = re.fullmatch(rf"\$\{{{variable}:-(\S+)\}}", image)
        assert default is not None, image
        defaults[variable] = default.group(1)
        assert re.fullmatch(
            r"[a-z]+:\d+\.\d+(\.\d+)?-([a-z]+-)?[a-z]+(@sha256:[0-9a-f]{64})?", default.group(1)
        ), image
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert f"ARG PYTHON_IMAGE={defaults['GPULOOM_PYTHON_IMAGE']}\n" in dockerfile


def test_the_gpuloom_image_is_built_once_and_run_by_every_gpuloom_service() -> None:
    """`up --build` builds the image once (not once per service), and every gpuloom service
    runs that image; the worker image (the example job's) is the only other build."""
    all_services = services()
    builders = {name: s["build"] for name, s in all_services.items() if "build" in s}
    assert set(builders) == {"migrate", "example"}
    assert builders["migrate"]["target"] == "service"
    assert builders["example"]["target"] == "worker"
    for name, service in all_services.items():
        if name not in {"postgres", "redis", "example"}:
            assert service["image"] == "${GPULOOM_IMAGE:-gpuloom:0.1.0}", name


def test_every_variable_compose_reads_is_in_env_example() -> None:
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", COMPOSE.read_text()))
    example = (ROOT / ".env.example").read_text()
    documented = set(re.findall(r"^([A-Z0-9_]+)=", example, re.MULTILINE))
    assert used - documented == set()
    profiles = re.search(r"^COMPOSE_PROFILES=(.*)$", example, re.MULTILINE)
    assert profiles is not None
    known = {p for s in services().values() for p in s.get("profiles", [])}
    assert set(profiles.group(1).split(",")) <= known


def test_docker_compose_config_accepts_it_where_docker_compose_is_installed(
    tmp_path: Path,
) -> None:
    """The schema check above runs everywhere; where `docker compose` exists (no daemon is
    needed), its own parser must accept the file with every profile."""
    docker = shutil.which("docker")
    if (
        docker is None
        or subprocess.run(
            [docker, "compose", "version"], capture_output=True, timeout=30
        ).returncode
    ):
        pytest.skip("no `docker compose` on this machine; the compose-spec schema check stands")
    env_file = tmp_path / ".env"
    env_file.write_text((ROOT / ".env.example").read_text())
    result = subprocess.run(
        [
            docker,
            "compose",
            "--env-file",
            str(env_file),
            "-f",
            str(COMPOSE),
            "--profile",
            "*",
            "config",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


class _OverrideLoader(yaml.SafeLoader):
    """YAML with compose's merge tags (`!reset`, `!override`) kept as (tag, value)."""


def _tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> tuple[str, Any]:
    if isinstance(node, yaml.MappingNode):
        return suffix, loader.construct_mapping(node)
    if isinstance(node, yaml.SequenceNode):
        return suffix, loader.construct_sequence(node)
    return suffix, loader.construct_scalar(node)  # type: ignore[arg-type]


_OverrideLoader.add_multi_constructor("!", _tagged)


def test_the_simulated_override_gives_every_gpu_slot_a_simulated_gpu_and_no_device() -> None:
    """compose.simulated.yaml (docs/deploy.md, "Without GPUs"): each dispatcher slot and the
    example job lose their NVIDIA device reservation and each dispatcher simulates one GPU."""
    override = yaml.load((ROOT / "compose.simulated.yaml").read_text(), _OverrideLoader)
    slots = {f"dispatcher-gpu{n}" for n in SLOTS}
    assert set(override["services"]) == slots | {"example"}
    for name, service in override["services"].items():
        assert service["deploy"] == ("reset", "null"), name
        if name in slots:
            assert service["environment"] == {
                "GPULOOM_DISPATCHER_BACKEND": "simulated",
                "GPULOOM_DISPATCHER_SIM_GPUS": "${GPULOOM_SIM_GPU:-A100-80GB}",
            }
    # Every device the base file reserves is one the override removes.
    reserving = {n for n, s in services().items() if "deploy" in s}
    assert reserving == slots | {"example"}
