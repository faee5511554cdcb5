"""deploy/k8s checked offline: no Kubernetes cluster can run where these tests run, so nothing
here is applied; the manifests are parsed, validated against the Kubernetes schemas
(kubernetes-validate, strict), built with kustomize where kubectl is installed, and checked
against the code they configure:

- every file of every kustomization parses, and every resource is valid Kubernetes (the oldest
  release meant, 1.28, and the newest the package knows);
- both installs build (the NVIDIA one, deploy/k8s, and the simulated-GPU one,
  overlays/simulated) from a credentials directory `gpuloom credentials init --kubernetes`
  makes, and what they build is valid too: the Secret holds every key a Pod mounts, the
  webhooks' caBundle is the directory's CA, the simulated dispatchers need no NVIDIA runtime;
- everything referenced exists: ServiceAccounts, Secrets (and their keys), ConfigMaps, the
  ClusterRoles bound, the webhooks' Service, port and paths, the scheduler extender's URL and
  verbs, the files each container's settings name;
- RBAC grants exactly the API calls each component makes: which KubeApi methods the k8s
  process and the device plugin call is read from their modules, each method is called
  against a recording HTTP server, and each request is turned into RBAC's (group, resource,
  verb) as the API server does;
- the k8s components call placement with their own certificate and the submitter
  `kubernetes`'s token (never the services'), and placement gives auto-scaling's replicas to
  that submitter."""

from __future__ import annotations

import ast
import base64
import inspect
import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from gpuloom.credentials import (
    KUBERNETES_SUBMITTER,
    ensure_kubernetes,
    kubernetes_hosts,
)
from gpuloom.kube.asks import GPU, PRIORITY_CLASS, RESOURCES
from gpuloom.services.k8s import metrics
from gpuloom.services.k8s.app import routes
from gpuloom.services.k8s.kubeapi import KubeApi, KubeApiConfig
from gpuloom.services.k8s.settings import DevicePluginSettings, K8sSettings
from tests.deploy.conftest import ROOT, tool

K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
KUSTOMIZATIONS = [K8S, BASE, K8S / "kube-system", K8S / "overlays" / "simulated"]
INSTALLS = {"nvidia": K8S, "simulated": K8S / "overlays" / "simulated"}
NAMESPACE = "gpuloom"
CREDENTIALS = "/etc/gpuloom/credentials"
# Made by hand before the install (docs/deploy.md), not by a kustomization.
HAND_MADE_SECRETS = {"gpuloom-postgres"}
# Roles every cluster has (kube-scheduler's own, bound to gpuloom's kube-scheduler).
BUILT_IN_ROLES = {
    "system:kube-scheduler",
    "system:volume-scheduler",
    "extension-apiserver-authentication-reader",
}
# The modules of each component that holds a Kubernetes API client.
COMPONENT_MODULES = {
    "gpuloom-k8s": [
        "controller.py",
        "extender.py",
        "webhook.py",
        "app.py",
        "migtasks.py",
        "leader.py",
    ],
    "gpuloom-device-plugin": ["deviceplugin.py"],
}
KUBECTL = shutil.which("kubectl")


# ---- reading the manifests ----


def kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def files_of(directory: Path) -> list[Path]:
    """The manifests a kustomization lists (resources that are files) and its patches."""
    found = kustomization(directory)
    paths = [directory / r for r in found.get("resources", []) if (directory / r).is_file()]
    paths += [directory / p["path"] for p in found.get("patches", [])]
    return paths


def resources(directory: Path = BASE) -> list[dict[str, Any]]:
    return [doc for path in files_of(directory) for doc in yaml.safe_load_all(path.read_text())]


def by_kind(kind: str, directory: Path = BASE) -> dict[str, dict[str, Any]]:
    return {r["metadata"]["name"]: r for r in resources(directory) if r["kind"] == kind}


def pods() -> dict[str, dict[str, Any]]:
    """Workload name -> its Pod template's spec."""
    return {
        r["metadata"]["name"]: r["spec"]["template"]["spec"]
        for r in resources()
        if r["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
    }


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod.get("initContainers", []) + pod["containers"]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def container_serving(role: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(workload, pod spec, container) of the container running `gpuloom serve ROLE`."""
    (found,) = [
        (name, pod, c)
        for name, pod in pods().items()
        for c in pod["containers"]
        if c.get("args") == ["serve", role]
    ]
    return found


def generated_keys() -> set[str]:
    (generator,) = kustomization(BASE)["secretGenerator"]
    assert generator["name"] == "gpuloom-credentials"
    return {Path(f).name for f in generator["files"]}


# ---- files and schemas ----


def test_every_file_of_every_kustomization_exists_and_parses() -> None:
    for directory in KUSTOMIZATIONS:
        found = kustomization(directory)
        assert found["kind"] == "Kustomization", directory
        for entry in found.get("resources", []):
            target = directory / entry
            assert target.is_file() or (target / "kustomization.yaml").is_file(), target
        for path in files_of(directory):
            documents = list(yaml.safe_load_all(path.read_text()))
            assert documents and all(isinstance(d, dict) for d in documents), path
            for document in documents:
                assert {"apiVersion", "kind", "metadata"} <= document.keys(), path
                assert document["metadata"].get("name"), path


@pytest.mark.parametrize("version", ["1.28.0", None])
def test_every_resource_of_base_and_kube_system_is_valid_kubernetes(version: str | None) -> None:
    paths = [p for d in KUSTOMIZATIONS if "overlays" not in d.parts for p in files_of(d)]
    args = ["--strict", *(["--kubernetes-version", version] if version else []), *paths]
    result = tool("kubernetes-validate", *args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_each_patch_of_the_simulated_install_targets_what_base_has() -> None:
    # A patch is a partial object: it is validated once applied (the build test below); here,
    # that it names a resource, and containers, of the base (else kustomize adds, or fails).
    workloads = {(r["kind"], r["metadata"]["name"]): r for r in resources()}
    for patch in resources(INSTALLS["simulated"]):
        target = workloads[(patch["kind"], patch["metadata"]["name"])]
        assert patch["metadata"].get("namespace", NAMESPACE) == NAMESPACE
        names = {c["name"] for c in target["spec"]["template"]["spec"]["containers"]}
        patched = patch["spec"]["template"]["spec"].get("containers", [])
        assert {c["name"] for c in patched} <= names, patch["metadata"]["name"]
        for container in patched:
            (base,) = [
                c
                for c in target["spec"]["template"]["spec"]["containers"]
                if c["name"] == container["name"]
            ]
            removed = {e["name"] for e in container.get("env", []) if e.get("$patch") == "delete"}
            assert removed <= set(env_of(base)), removed


def test_the_credentials_secret_holds_what_init_kubernetes_makes_and_nothing_private(
    tmp_path: Path,
) -> None:
    made = ensure_kubernetes(tmp_path / "credentials", NAMESPACE)
    on_disk = {p.name for p in made.directory.iterdir() if not p.name.startswith(".")}
    keys = generated_keys()
    assert keys <= on_disk
    # The CA's key, the admin's credentials and the client settings stay with the operator.
    assert not keys & {"ca.key", "admin.crt", "admin.key", "admin.token", "client.env"}
    mounted = {
        item["key"]
        for pod in pods().values()
        for volume in pod.get("volumes", [])
        if volume.get("secret", {}).get("secretName") == "gpuloom-credentials"
        for item in volume["secret"]["items"]
    }
    assert mounted == keys  # every key is some Pod's, and every Pod's key is there


@pytest.mark.skipif(KUBECTL is None, reason="kubectl (with its kustomize) is not installed")
@pytest.mark.parametrize("install", sorted(INSTALLS))
def test_each_install_builds_and_what_it_builds_is_valid(tmp_path: Path, install: str) -> None:
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("credentials"))
    made = ensure_kubernetes(copy / "base" / "credentials", NAMESPACE)
    target = copy / INSTALLS[install].relative_to(K8S)
    assert KUBECTL is not None
    built = subprocess.run(
        [KUBECTL, "kustomize", str(target)], capture_output=True, text=True, timeout=120
    )
    assert built.returncode == 0, built.stderr
    output = tmp_path / "built.yaml"
    output.write_text(built.stdout)
    result = tool("kubernetes-validate", "--strict", output)
    assert result.returncode == 0, result.stdout + result.stderr
    documents = [d for d in yaml.safe_load_all(built.stdout) if d]
    (secret,) = [d for d in documents if d["kind"] == "Secret"]
    assert set(secret["data"]) == generated_keys()
    ca = base64.b64encode(made.ca.read_bytes()).decode()
    webhooks = [d for d in documents if d["kind"].endswith("WebhookConfiguration")]
    assert len(webhooks) == 2
    for configuration in webhooks:
        for webhook in configuration["webhooks"]:
            assert webhook["clientConfig"]["caBundle"].replace("\n", "") == ca
    # Every reference to the Secret follows its generated name.
    names = {
        v["secret"]["secretName"]
        for d in documents
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
        for v in d["spec"]["template"]["spec"].get("volumes", [])
        if "secret" in v
    }
    assert names == {secret["metadata"]["name"]}
    bindings = {d["metadata"]["name"]: d for d in documents if d["kind"] == "RoleBinding"}
    assert {n: b["metadata"]["namespace"] for n, b in bindings.items()} == {
        "gpuloom-scheduler-authentication-reader": "kube-system",
        "gpuloom-k8s-leader": NAMESPACE,  # the leader election's Lease, in gpuloom's own
    }
    daemonsets = {d["metadata"]["name"]: d for d in documents if d["kind"] == "DaemonSet"}
    dispatcher = daemonsets["dispatcher"]["spec"]["template"]["spec"]
    env = env_of(dispatcher["containers"][0])
    if install == "simulated":
        assert "runtimeClassName" not in dispatcher and "NVIDIA_VISIBLE_DEVICES" not in env
        assert env["GPULOOM_DISPATCHER_BACKEND"] == "simulated"
        selector = {"gpuloom.io/simulated-gpus": "true"}
    else:
        assert dispatcher["runtimeClassName"] == "nvidia" and env["NVIDIA_VISIBLE_DEVICES"] == "all"
        selector = {"nvidia.com/gpu.present": "true"}
    for daemonset in daemonsets.values():
        assert daemonset["spec"]["template"]["spec"]["nodeSelector"] == selector


# ---- references ----


def test_every_account_secret_and_config_map_referenced_exists() -> None:
    accounts = by_kind("ServiceAccount")
    config_maps = by_kind("ConfigMap")
    secrets = {"gpuloom-credentials"} | HAND_MADE_SECRETS
    keys = generated_keys()
    for name, pod in pods().items():
        assert pod["serviceAccountName"] in accounts, name
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets, (name, volume)
                if volume["secret"]["secretName"] == "gpuloom-credentials":
                    assert {i["key"] for i in volume["secret"]["items"]} <= keys, name
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, (name, volume)
        for container in containers(pod):
            for value in env_of(container).values():
                if isinstance(value, dict) and "secretKeyRef" in value:
                    assert value["secretKeyRef"]["name"] in secrets, (name, value)
    roles = set(by_kind("ClusterRole")) | set(by_kind("Role")) | BUILT_IN_ROLES
    bindings = [*by_kind("ClusterRoleBinding").values(), *by_kind("RoleBinding").values()]
    bindings += [*by_kind("RoleBinding", K8S / "kube-system").values()]
    for binding in bindings:
        assert binding["roleRef"]["name"] in roles, binding["metadata"]["name"]
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["namespace"] == NAMESPACE
            assert subject["name"] in accounts, binding["metadata"]["name"]


def test_every_credentials_file_a_container_names_is_mounted_there() -> None:
    checked = 0
    for name, pod in pods().items():
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in containers(pod):
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            for variable, value in env_of(container).items():
                if not isinstance(value, str) or not value.startswith(CREDENTIALS + "/"):
                    continue
                volume = volumes[mounts[CREDENTIALS]]
                items = {i["path"] for i in volume["secret"]["items"]}
                assert value.removeprefix(CREDENTIALS + "/") in items, (name, variable)
                checked += 1
    assert checked >= 6 * 5


def test_the_components_call_placement_as_the_submitter_kubernetes() -> None:
    for role, who in (("k8s", "k8s"), ("device-plugin", "device-plugin")):
        _, pod, container = container_serving(role)
        env = env_of(container)
        assert env["GPULOOM_AUTH_TOKEN_FILE"] == f"{CREDENTIALS}/{who}.token"
        assert env["GPULOOM_TLS_CERT_FILE"] == f"{CREDENTIALS}/{who}.crt"
        assert env["GPULOOM_TLS_KEY_FILE"] == f"{CREDENTIALS}/{who}.key"
        (volume,) = [v for v in pod["volumes"] if v["name"] == "credentials"]
        items = {i["key"] for i in volume["secret"]["items"]}
        # Not the services' token, nor the tokens file every service reads.
        assert items == {"ca.crt", f"{who}.crt", f"{who}.key", f"{who}.token"}
        assert "GPULOOM_AUTH_TOKENS_FILE" not in env
    _, _, placement = container_serving("placement")
    assert env_of(placement)["GPULOOM_PLACEMENT_FUNCTION_OWNER"] == KUBERNETES_SUBMITTER


def test_the_webhooks_reach_the_k8s_process_on_its_routes() -> None:
    served = set(
        routes(
            SimpleNamespace(review=0, validate=0), SimpleNamespace(filter=0, prioritize=0, bind=0)
        )
    )  # type: ignore[arg-type]
    service = by_kind("Service")["gpuloom-k8s"]
    name, _, container = container_serving("k8s")
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": name}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    https = {p["port"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert ports[https[443]] == int(env_of(container)["GPULOOM_K8S_PORT"])
    paths = {}
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        (configuration,) = by_kind(kind).values()
        for webhook in configuration["webhooks"]:
            client = webhook["clientConfig"]["service"]
            assert (client["name"], client["namespace"], client["port"]) == (
                "gpuloom-k8s",
                NAMESPACE,
                443,
            )
            assert webhook["failurePolicy"] == "Fail" and webhook["sideEffects"] == "None"
            assert webhook["namespaceSelector"] == {
                "matchLabels": {"gpuloom.io/webhook": "enabled"}
            }
            assert [r["resources"] for r in webhook["rules"]] == [["pods"]]
            paths[kind] = (client["path"], webhook["rules"][0]["operations"])
    assert paths == {
        "MutatingWebhookConfiguration": ("/admission", ["CREATE"]),
        "ValidatingWebhookConfiguration": ("/validate", ["CREATE", "UPDATE"]),
    }
    assert {p for p, _ in paths.values()} <= served
    # gpuloom's own namespace is not reviewed: its Pods start whatever the webhook's state.
    namespace = by_kind("Namespace")[NAMESPACE]
    assert "gpuloom.io/webhook" not in namespace["metadata"].get("labels", {})
    # The webhooks trust these users to write gpuloom's annotations: the two components'.
    # The k8s process writes them all; the device plugins gpuloom.io/allocated only.
    fields = K8sSettings.model_fields
    assert fields["service_accounts"].default == f"system:serviceaccount:{NAMESPACE}:gpuloom-k8s"
    assert (
        fields["device_plugin_accounts"].default
        == f"system:serviceaccount:{NAMESPACE}:gpuloom-device-plugin"
    )
    for role, account in (("k8s", "gpuloom-k8s"), ("device-plugin", "gpuloom-device-plugin")):
        assert container_serving(role)[1]["serviceAccountName"] == account


def test_the_scheduler_asks_the_extender_for_gpuloom_resources_only() -> None:
    config = yaml.safe_load(by_kind("ConfigMap")["gpuloom-scheduler"]["data"]["config.yaml"])
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    (profile,) = config["profiles"]
    assert profile["schedulerName"] == K8sSettings.model_fields["scheduler_name"].default
    assert profile["schedulerName"] == DevicePluginSettings.model_fields["scheduler_name"].default
    (extender,) = config["extenders"]
    served = routes(
        SimpleNamespace(review=0, validate=0),  # type: ignore[arg-type]
        SimpleNamespace(filter=0, prioritize=0, bind=0),  # type: ignore[arg-type]
    )
    for verb in ("filterVerb", "prioritizeVerb", "bindVerb"):
        assert f"/{extender[verb]}" in served
    host, _, port = extender["urlPrefix"].removeprefix("https://").partition(":")
    assert host in kubernetes_hosts(NAMESPACE)  # the k8s certificate names it
    assert host.split(".")[0] == "gpuloom-k8s" and int(port) == 443
    assert extender["enableHTTPS"] is True and extender["nodeCacheCapable"] is True
    managed = {m["name"]: m["ignoredByScheduler"] for m in extender["managedResources"]}
    assert managed == {r: r != GPU for r in RESOURCES}
    tls = extender["tlsConfig"]
    deployment = pods()["gpuloom-scheduler"]
    (container,) = deployment["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = next(
        v for v in deployment["volumes"] if v["name"] == mounts[str(Path(tls["caFile"]).parent)]
    )
    # The CA that checks the k8s process, and the client certificate its extender requires.
    files = [Path(tls[k]) for k in ("caFile", "certFile", "keyFile")]
    assert {f.parent for f in files} == {Path(tls["caFile"]).parent}
    assert [i["path"] for i in volume["secret"]["items"]] == [f.name for f in files]
    assert [f.name for f in files] == ["ca.crt", "scheduler.crt", "scheduler.key"]
    _, _, k8s = container_serving("k8s")
    assert env_of(k8s)["GPULOOM_K8S_EXTENDER_CLIENT_CA_FILE"] == f"{CREDENTIALS}/ca.crt"
    config_mount = next(a for a in container["command"] if a.startswith("--config="))
    config_volume = mounts[str(Path(config_mount.removeprefix("--config=")).parent)]
    assert next(v for v in deployment["volumes"] if v["name"] == config_volume)["configMap"]


def test_the_priority_classes_are_the_levels_pods_name() -> None:
    classes = by_kind("PriorityClass")
    assert sorted(classes) == [f"gpuloom-priority-{n}" for n in range(10)]
    assert all(PRIORITY_CLASS.fullmatch(name) for name in classes)
    values = [classes[f"gpuloom-priority-{n}"]["value"] for n in range(10)]
    assert values == sorted(values, reverse=True) and len(set(values)) == 10
    assert all(
        c["preemptionPolicy"] == "Never" and not c["globalDefault"] for c in classes.values()
    )


def test_the_device_plugin_serves_the_kubelet_and_its_metrics_per_pod() -> None:
    name, pod, container = container_serving("device-plugin")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    kubelet_dir = DevicePluginSettings.model_fields["kubelet_dir"].default
    assert mounts["kubelet"] == volumes["kubelet"]["hostPath"]["path"] == kubelet_dir
    (init,) = pod["initContainers"]
    shim = env_of(container)["GPULOOM_DEVICE_PLUGIN_SHIM_HOST_PATH"]
    assert init["command"][-1] == shim
    assert volumes["shim"]["hostPath"]["path"] == str(Path(shim).parent)
    # The same nodes as the dispatchers.
    dispatcher = pods()["dispatcher"]
    assert pod["nodeSelector"] == dispatcher["nodeSelector"]
    assert pod["tolerations"] == dispatcher["tolerations"]
    # Its metrics, scraped, carry the Pod's namespace, name and container.
    port = env_of(container)["GPULOOM_METRICS_PORT"]
    (workload,) = [r for r in resources() if r["metadata"]["name"] == name]
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": port}
    assert {"namespace", "pod", "container"} <= set(metrics.POD_LABELS)


# ---- RBAC from the code ----


class _Recorder(BaseHTTPRequestHandler):
    seen: list[tuple[str, str]] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        type(self).seen.append((self.command, self.path))
        body = json.dumps({"items": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    _Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def api_methods_called(module: str) -> set[str]:
    """The KubeApi methods a module calls (`self._api.NAME(...)` or `self.api.NAME(...)`)."""
    tree = ast.parse((ROOT / "services" / "k8s" / module).read_text())
    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr in ("_api", "api"):
                called.add(node.func.attr)
    return called


def rbac_of(method: str, path: str) -> tuple[str, str, str]:
    """(API group, resource[/subresource], verb) of a request, as the API server's request
    info resolver makes them."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    if parts[0] == "api":
        group, rest = "", parts[2:]
    else:
        group, rest = parts[1], parts[3:]
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    resource, name, subresource = rest[0], rest[1:2], rest[2:3]
    verb = {
        "GET": "get" if name else "list",
        "POST": "create",
        "PATCH": "patch",
        "PUT": "update",
        "DELETE": "delete" if name else "deletecollection",
    }[method]
    return group, "/".join([resource, *subresource]), verb


async def requests_of(server: str, names: set[str]) -> set[tuple[str, str, str]]:
    api = KubeApi(KubeApiConfig(server=server))
    arguments = {
        "namespace": "ns",
        "name": "n",
        "uid": "u",
        "node": "node-a",
        "annotations": {"gpuloom.io/job": "j"},
        "replicas": 1,
        "field_selector": "spec.nodeName=node-a",
        "label_selector": "gpuloom.io/function",
        "lease": {"metadata": {"name": "gpuloom-k8s"}},
    }
    for name in sorted(names):
        method = getattr(api, name)
        parameters = inspect.signature(method).parameters
        await method(**{p: arguments[p] for p in parameters if p in arguments})
    return {rbac_of(verb, path) for verb, path in _Recorder.seen}


def granted(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.mark.parametrize("account", sorted(COMPONENT_MODULES))
async def test_rbac_grants_exactly_the_calls_the_code_makes(recorder: str, account: str) -> None:
    called: set[str] = set()
    for module in COMPONENT_MODULES[account]:
        called |= api_methods_called(module)
    assert "call" not in called, "a raw KubeApi.call: give it a method so RBAC can follow it"
    assert called and called <= {n for n, _ in inspect.getmembers(KubeApi, inspect.isfunction)}
    needed = await requests_of(recorder, called)
    bindings = [
        b for b in by_kind("ClusterRoleBinding").values() if b["subjects"][0]["name"] == account
    ]
    (binding,) = bindings
    role = by_kind("ClusterRole")[binding["roleRef"]["name"]]
    # In gpuloom's namespace (the install's): the leader election's Lease, by its name.
    local = [
        by_kind("Role")[b["roleRef"]["name"]]
        for b in by_kind("RoleBinding").values()
        if b["subjects"][0]["name"] == account
    ]
    assert granted(role) | {g for r in local for g in granted(r)} == needed
    leases = [rule for r in local for rule in r["rules"] if "get" in rule["verbs"]]
    for rule in leases:
        assert rule["resourceNames"] == [K8sSettings.model_fields["lease_name"].default]


def test_the_request_translation_is_the_api_servers() -> None:
    # Examples of k8s.io/apiserver's RequestInfoFactory.
    assert rbac_of("GET", "/api/v1/pods?fieldSelector=x") == ("", "pods", "list")
    assert rbac_of("GET", "/api/v1/namespaces/a/pods/p") == ("", "pods", "get")
    assert rbac_of("POST", "/api/v1/namespaces/a/pods/p/binding") == ("", "pods/binding", "create")
    assert rbac_of("PATCH", "/apis/apps/v1/namespaces/a/deployments/d/scale") == (
        "apps",
        "deployments/scale",
        "patch",
    )
    assert rbac_of("GET", "/apis/apps/v1/deployments") == ("apps", "deployments", "list")
    assert rbac_of("DELETE", "/api/v1/namespaces/a/pods/p") == ("", "pods", "delete")
    assert rbac_of("PUT", "/apis/coordination.k8s.io/v1/namespaces/a/leases/l") == (
        "coordination.k8s.io",
        "leases",
        "update",
    )
