"""deploy/k8s/base: every manifest valid against the Kubernetes schemas (kubernetes-validate,
offline, strict), and shaped as docs/deploy.md says: probes and resource requests everywhere,
the migration before the services with a database, the dispatcher DaemonSet serving every GPU
of its node, API access for gpuloom's Kubernetes components only, every address pointing at a
Service that exists. tests/k8s/test_manifests.py checks the kustomizations built and the
Kubernetes components' wiring (RBAC from the code, webhooks, the scheduler)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import ROOT, broken_copy, tool

K8S = ROOT / "deploy" / "k8s" / "base"
KUSTOMIZATION = K8S / "kustomization.yaml"
# The oldest Kubernetes release the manifests are meant for, and the newest the package knows.
VERSIONS = ("1.28.0", None)
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}


def manifests() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p != KUSTOMIZATION)


def resources() -> list[dict[str, Any]]:
    return [doc for path in manifests() for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {r["metadata"]["name"]: r for r in resources() if r["kind"] == kind}


def workloads() -> dict[str, dict[str, Any]]:
    return {r["metadata"]["name"]: r for r in resources() if r["kind"] in WORKLOADS}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_kubernetes(version: str | None) -> None:
    args = ["--strict", *(["--kubernetes-version", version] if version else []), *manifests()]
    result = tool("kubernetes-validate", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    passed = re.findall(r"passed for resource (\S+)", result.stdout + result.stderr)
    assert len(passed) == len(resources())


@pytest.mark.parametrize(
    ("broken", "replacement"),
    [
        ("          readinessProbe:\n", "          readinesProbe:\n"),
        ("              containerPort: 50051\n", "              containerPort: fifty-one\n"),
        ("  replicas: 1\n", "  replicas: one\n"),
    ],
)
def test_validation_fails_on_a_broken_manifest(
    tmp_path: Path, broken: str, replacement: str
) -> None:
    copy = broken_copy(K8S / "placement.yaml", tmp_path, broken, replacement)
    result = tool("kubernetes-validate", "--strict", copy)
    assert result.returncode != 0, result.stdout


def test_the_kustomization_lists_every_manifest_and_renames_the_image() -> None:
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in manifests()]
    assert kustomization["namespace"] == "gpuloom"
    images = {image["name"] for image in kustomization["images"]}
    ours = {
        c["image"]
        for w in workloads().values()
        for c in w["spec"]["template"]["spec"].get("initContainers", [])
        + w["spec"]["template"]["spec"]["containers"]
        if not c["image"].startswith(("postgres:", "redis:"))
    }
    assert ours == images == {"gpuloom", "gpuloom-worker", "kube-scheduler"}


def test_every_container_has_probes_and_resources() -> None:
    for name, workload in workloads().items():
        pod = workload["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            resources = container["resources"]
            assert {"cpu", "memory"} <= resources["requests"].keys(), (name, container["name"])
            assert "memory" in resources["limits"], (name, container["name"])
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        for container in pod["containers"]:
            assert "readinessProbe" in container and "livenessProbe" in container, name


PORTS = {"profile-store": 50052, "profiler": 50053, "placement": 50051, "dispatcher": 50060}
CREDENTIALS = "/etc/gpuloom/credentials"


def test_gpuloom_services_are_probed_over_grpc_health_on_their_port() -> None:
    # The kubelet's own gRPC probe speaks no TLS: the image's healthcheck asks instead, over
    # TLS with the service's own certificate (its container's GPULOOM_TLS_* settings).
    for name, port in PORTS.items():
        (container,) = workloads()[name]["spec"]["template"]["spec"]["containers"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = container[probe]["exec"]["command"]
            assert command == ["python", "/opt/gpuloom/bin/healthcheck.py", f"127.0.0.1:{port}"]
            assert container[probe]["timeoutSeconds"] >= 5, (name, probe)
        assert container["securityContext"].get("runAsUser", 10001) == 10001
        pod = workloads()[name]["spec"]["template"]["spec"]
        assert pod.get("securityContext", {}).get("runAsUser", 10001) == 10001


# The only workloads that call the Kubernetes API: gpuloom's Kubernetes components.
API_CALLERS = {
    "gpuloom-k8s": "gpuloom-k8s",
    "device-plugin": "gpuloom-device-plugin",
    "gpuloom-scheduler": "gpuloom-scheduler",
}


def test_only_the_kubernetes_components_get_api_access() -> None:
    accounts = by_kind("ServiceAccount")
    with_token = {n for n, a in accounts.items() if a["automountServiceAccountToken"] is not False}
    assert with_token == set(API_CALLERS.values())
    bound = {
        s["name"]
        for kind in ("RoleBinding", "ClusterRoleBinding")
        for b in by_kind(kind).values()
        for s in b["subjects"]
    }
    assert bound == set(API_CALLERS.values())
    for name, workload in workloads().items():
        pod = workload["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] in accounts, name
        if name in API_CALLERS:
            assert pod["serviceAccountName"] == API_CALLERS[name], name
            assert pod["automountServiceAccountToken"] is True, name
        else:
            assert pod["automountServiceAccountToken"] is False, name


def test_services_with_a_database_migrate_first_and_not_themselves() -> None:
    for name, variable in (("profile-store", "PROFILE_STORE"), ("placement", "PLACEMENT")):
        pod = workloads()[name]["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        (main,) = pod["containers"]
        assert init["args"] == ["migrate", name]
        assert env_of(main)[f"GPULOOM_{variable}_AUTO_MIGRATE"] == "false"
        url = f"GPULOOM_{variable}_DATABASE_URL"
        assert env_of(init)[url] == env_of(main)[url]
        # $(POSTGRES_PASSWORD) expands only from a variable defined before it.
        names = [e["name"] for e in main["env"]]
        assert names.index("POSTGRES_PASSWORD") < names.index(url)


def test_the_dispatcher_daemonset_serves_every_gpu_of_its_node() -> None:
    daemonset = by_kind("DaemonSet")["dispatcher"]
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = env_of(container)
    assert env["GPULOOM_DISPATCHER_GPUS"] == "all"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["GPULOOM_DISPATCHER_NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["GPULOOM_DISPATCHER_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert pod["hostPID"] is True
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    # It reads NVML; the GPUs' nvidia.com/gpu resources stay for the jobs.
    assert "nvidia.com/gpu" not in str(container["resources"])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    # The socket path a job is given is the same on the node as in the pod.
    assert mounts["sockets"] == host_paths["sockets"] == env["GPULOOM_DISPATCHER_SOCKET_DIR"]
    assert mounts["state"] == host_paths["state"] == "/var/lib/gpuloom"
    ports = [p["containerPort"] for p in container["ports"] if p["name"].startswith("gpu")]
    assert ports == [50060 + i for i in range(len(ports))]


def test_every_address_names_a_service_and_its_port() -> None:
    services = {
        name: {p["port"] for p in s["spec"]["ports"]} for name, s in by_kind("Service").items()
    }
    checked = 0
    for workload in workloads().values():
        pod = workload["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            for value in env_of(container).values():
                if not isinstance(value, str):
                    continue
                for host, port in re.findall(r"(?:@|//|^)([a-z][a-z0-9-]*):(\d+)", value):
                    assert int(port) in services.get(host, set()), value
                    checked += 1
    assert checked >= 8


def test_the_databases_answer_only_the_services_that_use_them() -> None:
    policies = by_kind("NetworkPolicy")
    allowed = {}
    for policy in policies.values():
        (target,) = policy["spec"]["podSelector"]["matchLabels"].values()
        (rule,) = policy["spec"]["ingress"]
        (source,) = rule["from"]
        selector = source["podSelector"]
        names = set(selector.get("matchLabels", {}).values())
        for expression in selector.get("matchExpressions", []):
            assert expression["operator"] == "In"
            names |= set(expression["values"])
        allowed[target] = names
    assert allowed == {"postgres": {"profile-store", "placement"}, "redis": {"profile-store"}}
    # ... and those are the pods whose containers hold the database and cache addresses.
    for name, workload in workloads().items():
        pod = workload["spec"]["template"]["spec"]
        values = str([env_of(c) for c in pod.get("initContainers", []) + pod["containers"]])
        assert ("@postgres:5432" in values) == (name in allowed["postgres"]), name
        assert ("redis:6379" in values) == (name in allowed["redis"]), name
        assert workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == name


def test_every_service_serves_mutual_tls_and_tokens_from_the_credentials_secret() -> None:
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    (generator,) = kustomization["secretGenerator"]
    assert generator["name"] == "gpuloom-credentials"
    generated = {Path(path).name for path in generator["files"]}
    assert all(path.startswith("credentials/") for path in generator["files"])
    assert not any(name.startswith("admin") for name in generated)  # the admin's stay out
    assert "deploy/k8s/base/credentials/" in (ROOT / ".gitignore").read_text()
    for name in PORTS:
        pod = workloads()[name]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = env_of(container)
        assert env["GPULOOM_TLS_CERT_FILE"] == f"{CREDENTIALS}/{name}.crt"
        assert env["GPULOOM_TLS_KEY_FILE"] == f"{CREDENTIALS}/{name}.key"
        assert env["GPULOOM_TLS_CA_FILE"] == f"{CREDENTIALS}/ca.crt"
        assert env["GPULOOM_TLS_SERVER_NAME"] == "gpuloom"
        assert env["GPULOOM_AUTH_TOKENS_FILE"] == f"{CREDENTIALS}/tokens"
        assert env["GPULOOM_AUTH_TOKEN_FILE"] == f"{CREDENTIALS}/service.token"
        assert "GPULOOM_INSECURE" not in env and "GPULOOM_TLS_CLIENT_AUTH" not in env
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["credentials"]["mountPath"] == CREDENTIALS
        assert mounts["credentials"]["readOnly"] is True
        (volume,) = [v for v in pod["volumes"] if v["name"] == "credentials"]
        items = {item["key"] for item in volume["secret"]["items"]}
        # Only what this service needs: not another service's key, not the admin's.
        assert items == {"ca.crt", "tokens", "service.token", f"{name}.crt", f"{name}.key"}
        assert items <= generated
        assert volume["secret"]["secretName"] == "gpuloom-credentials"
        assert volume["secret"]["defaultMode"] == 0o440
        assert pod["securityContext"]["fsGroup"] == 10001
