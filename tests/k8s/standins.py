"""Stand-ins for the parts of Kubernetes gpuloom talks to, each speaking exactly the protocol the
real one speaks, with Pods and Nodes built by the official `kubernetes` client's models:

- `ApiServer`: the REST API subset gpuloom calls (list, get, merge-patch and delete Pods, the
  binding subresource, Deployments and their scale subresource, coordination.k8s.io/v1
  Leases with resourceVersion concurrency), over HTTP, with the
  server's Status objects for errors; creating a Pod runs it through the mutating admission
  webhook (an admission.k8s.io/v1 AdmissionReview over HTTPS, its JSONPatch applied), as the
  API server does, and so do Pod updates; callers are known by their bearer tokens.
- `Kubelet`: the kubelet's side of the device plugin API v1beta1: the Registration service on
  kubelet.sock; it then reads the plugin's devices (ListAndWatch), picks free ones for a
  container, calls Allocate, and starts the container's process as a runtime would (the
  answer's environment, its mounts resolved to their host paths).
- `schedule`: kube-scheduler's calls to an extender (ExtenderArgs to Filter and Prioritize,
  ExtenderBindingArgs to Bind, with the Go field names), after its own filters have chosen the
  candidate nodes.

Nothing here is gpuloom's code: a test that passes through them passes through the formats."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import ssl
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
from kubernetes import client
from kubernetes.client import ApiClient

from gpuloom.kubelet import deviceplugin_pb2 as dp
from gpuloom.kubelet import deviceplugin_pb2_grpc as dp_grpc

SERIALIZER = ApiClient()


def as_json(model: object) -> dict[str, Any]:
    """A client model (V1Pod, V1Deployment, ...) as the API server's JSON."""
    return SERIALIZER.sanitize_for_serialization(model)


def pod_model(
    name: str,
    limits: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    namespace: str = "team-a",
    restart_policy: str = "Never",
    priority_class: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> client.V1Pod:
    return client.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=client.V1ObjectMeta(
            name=name,
            namespace=namespace,
            annotations=dict(annotations) if annotations else None,
            labels=dict(labels) if labels else None,
        ),
        spec=client.V1PodSpec(
            restart_policy=restart_policy,
            priority_class_name=priority_class,
            containers=[
                client.V1Container(
                    name="main",
                    image="registry.example.com/serve:1",
                    resources=client.V1ResourceRequirements(limits=dict(limits))
                    if limits
                    else None,
                )
            ],
        ),
    )


# ---- JSON Patch (RFC 6902), the operations admission webhooks send ----


def _segments(pointer: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]


def apply_patch(document: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    result = copy.deepcopy(document)
    for op in patch:
        *parents, last = _segments(op["path"])
        target: Any = result
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if op["op"] in ("add", "replace"):
            if isinstance(target, list):
                index = len(target) if last == "-" else int(last)
                if op["op"] == "add":
                    target.insert(index, op["value"])
                else:
                    target[index] = op["value"]
            else:
                if op["op"] == "replace" and last not in target:
                    raise ValueError(f"replace of a missing member {op['path']}")
                target[last] = op["value"]
        elif op["op"] == "remove":
            del target[int(last) if isinstance(target, list) else last]
        else:
            raise ValueError(f"unsupported op {op['op']}")
    return result


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# ---- the API server ----


class Refused(Exception):
    """What kubectl would print: the admission webhook denied the request."""


@dataclass
class Webhook:
    url: str
    ca_file: str


@dataclass
class ApiServer:
    """The REST subset over HTTP; `users` maps bearer tokens to user names."""

    users: dict[str, str]
    webhook: Webhook | None = None
    # Called after the mutating webhook with the Pod as it left it, as the API server calls a
    # ValidatingWebhookConfiguration's webhooks; a patch from it is an error.
    validating: Webhook | None = None
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    deployments: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    leases: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    fail_bindings: int = 0  # answer this many binding POSTs with 500
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (user, method, path)
    lock: threading.Lock = field(default_factory=threading.RLock)
    _server: ThreadingHTTPServer | None = None
    _version: int = 0  # the last resourceVersion given (Leases)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> None:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                user = api.users.get(token)
                if user is None:
                    status, answer = 401, _status(401, "Unauthorized")
                else:
                    with api.lock:
                        api.requests.append((user, self.command, self.path))
                        status, answer = api.handle(
                            user, self.command, self.path, body, self.headers
                        )
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _serve

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # ---- what users do (kubectl) ----

    def create_pod(self, pod: client.V1Pod | dict[str, Any], user: str = "alice") -> dict:
        document = as_json(pod) if not isinstance(pod, dict) else copy.deepcopy(pod)
        meta = document.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        if not meta.get("name"):
            meta["name"] = f"{meta.pop('generateName', 'pod-')}{uuid.uuid4().hex[:5]}"
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        document.setdefault("spec", {}).setdefault("schedulerName", "default-scheduler")
        document = self._admit("CREATE", document, None, user)
        _validate_extended_resources(document)
        document["status"] = {"phase": "Pending"}
        with self.lock:
            key = (meta["namespace"], document["metadata"]["name"])
            if key in self.pods:
                raise Refused(f'pods "{key[1]}" already exists')
            self.pods[key] = document
        return copy.deepcopy(document)

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            found = self.pods.get((namespace, name))
            return copy.deepcopy(found) if found else None

    def set_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """What the kubelet reports (the status subresource: no admission)."""
        with self.lock:
            self.pods[(namespace, name)]["status"] = status

    def delete_pod(self, namespace: str, name: str) -> None:
        with self.lock:
            self.pods.pop((namespace, name), None)

    def annotate(self, namespace: str, name: str, annotations: dict, user: str = "alice") -> None:
        status, answer = self.handle(
            user,
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}",
            {"metadata": {"annotations": annotations}},
            {},
        )
        if status != 200:
            raise Refused(answer["message"])

    def create_deployment(self, deployment: client.V1Deployment) -> None:
        document = as_json(deployment)
        meta = document["metadata"]
        with self.lock:
            self.deployments[(meta["namespace"], meta["name"])] = document

    def sync_replicasets(self) -> None:
        """The ReplicaSet controller's work for every Deployment: create Pods from its template
        (through admission, as the controller's creates go) until it has `replicas`, delete
        the extra ones, unscheduled first, then the lowest pod-deletion-cost."""
        with self.lock:
            deployments = [copy.deepcopy(d) for d in self.deployments.values()]
        for deployment in deployments:
            meta, spec = deployment["metadata"], deployment["spec"]
            owner = {"test.gpuloom.io/deployment": meta["name"]}
            with self.lock:
                pods = [
                    p
                    for (ns, _), p in self.pods.items()
                    if ns == meta["namespace"]
                    and _labels_match(p, "test.gpuloom.io/deployment=" + meta["name"])
                ]
            for _ in range(spec["replicas"] - len(pods)):
                template = copy.deepcopy(spec["template"])
                template["metadata"] = {
                    **template.get("metadata", {}),
                    "namespace": meta["namespace"],
                    "generateName": f"{meta['name']}-",
                    "labels": {**(template.get("metadata", {}).get("labels") or {}), **owner},
                }
                self.create_pod(
                    template, user="system:serviceaccount:kube-system:replicaset-controller"
                )

            def rank(pod: dict[str, Any]) -> tuple[bool, int]:
                cost = (pod["metadata"].get("annotations") or {}).get(
                    "controller.kubernetes.io/pod-deletion-cost", "0"
                )
                return (bool(pod["spec"].get("nodeName")), int(cost))

            for pod in sorted(pods, key=rank)[: max(0, len(pods) - spec["replicas"])]:
                self.delete_pod(pod["metadata"]["namespace"], pod["metadata"]["name"])

    def everything(self) -> str:
        """Every object the server holds, as text (to look for secrets)."""
        with self.lock:
            return json.dumps([list(self.pods.values()), list(self.deployments.values())])

    # ---- the REST API ----

    def handle(
        self, user: str, method: str, raw: str, body: Any, headers: Any
    ) -> tuple[int, dict[str, Any]]:
        parsed = urllib.parse.urlsplit(raw)
        query = dict(urllib.parse.parse_qsl(parsed.query))
        parts = [urllib.parse.unquote(p) for p in parsed.path.strip("/").split("/")]
        try:
            if parts == ["api", "v1", "pods"] and method == "GET":
                return 200, self._list("PodList", self.pods.values(), query)
            if parts[:4] == ["api", "v1", "namespaces", parts[3] if len(parts) > 3 else ""] and (
                len(parts) >= 6 and parts[4] == "pods"
            ):
                return self._pod_call(user, method, parts[3], parts[5], parts[6:], body)
            if parts[:4] == ["apis", "coordination.k8s.io", "v1", "namespaces"] and (
                len(parts) in (6, 7) and parts[5] == "leases"
            ):
                return self._lease_call(method, parts[4], parts[6:], body)
            if parts == ["apis", "apps", "v1", "deployments"] and method == "GET":
                return 200, self._list("DeploymentList", self.deployments.values(), query)
            if (
                len(parts) == 8
                and parts[:4] == ["apis", "apps", "v1", "namespaces"]
                and parts[5] == "deployments"
                and parts[7] == "scale"
                and method == "PATCH"
            ):
                deployment = self.deployments.get((parts[4], parts[6]))
                if deployment is None:
                    return 404, _status(404, f'deployments.apps "{parts[6]}" not found')
                deployment["spec"]["replicas"] = int(body["spec"]["replicas"])
                return 200, _scale(deployment)
        except Refused as error:
            return 400, _status(400, str(error))
        return 404, _status(404, f"no such path {parsed.path}")

    def _pod_call(
        self, user: str, method: str, namespace: str, name: str, rest: list[str], body: Any
    ) -> tuple[int, dict[str, Any]]:
        key = (namespace, name)
        pod = self.pods.get(key)
        if pod is None:
            return 404, _status(404, f'pods "{name}" not found')
        if rest == ["binding"] and method == "POST":
            if self.fail_bindings:
                self.fail_bindings -= 1
                return 500, _status(500, "etcdserver: request timed out")
            if body["metadata"].get("uid") not in (None, pod["metadata"]["uid"]):
                return 409, _status(409, "Precondition failed: UID in precondition")
            if pod["spec"].get("nodeName"):
                return 409, _status(409, f"pod {name} is already assigned to a node")
            pod["spec"]["nodeName"] = body["target"]["name"]
            return 201, {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}
        if rest:
            return 404, _status(404, "no such subresource")
        if method == "GET":
            return 200, copy.deepcopy(pod)
        if method == "PATCH":
            updated = merge_patch(pod, body)
            updated = self._admit("UPDATE", updated, pod, user)
            self.pods[key] = updated
            return 200, copy.deepcopy(updated)
        if method == "DELETE":
            wanted = ((body or {}).get("preconditions") or {}).get("uid")
            if wanted and wanted != pod["metadata"]["uid"]:
                return 409, _status(409, "Precondition failed: UID in precondition")
            del self.pods[key]
            return 200, copy.deepcopy(pod)
        return 405, _status(405, "method not allowed")

    def _lease_call(
        self, method: str, namespace: str, rest: list[str], body: Any
    ) -> tuple[int, dict[str, Any]]:
        """coordination.k8s.io/v1 Leases: GET, POST (create), PUT (replace) with the
        API server's optimistic concurrency (a PUT naming another resourceVersion: 409)."""
        if method == "POST" and not rest:
            _check_lease(body)
            key = (namespace, body["metadata"]["name"])
            if key in self.leases:
                return 409, _status(409, f'leases.coordination.k8s.io "{key[1]}" already exists')
            self._version += 1
            lease = copy.deepcopy(body)
            lease["metadata"].update(namespace=namespace, resourceVersion=str(self._version))
            self.leases[key] = lease
            return 201, copy.deepcopy(lease)
        if len(rest) != 1:
            return 405, _status(405, "method not allowed")
        key = (namespace, rest[0])
        lease = self.leases.get(key)
        if lease is None:
            return 404, _status(404, f'leases.coordination.k8s.io "{rest[0]}" not found')
        if method == "GET":
            return 200, copy.deepcopy(lease)
        if method == "PUT":
            _check_lease(body)
            wanted = body["metadata"].get("resourceVersion")
            if wanted != lease["metadata"]["resourceVersion"]:
                return 409, _status(
                    409,
                    f'Operation cannot be fulfilled on leases.coordination.k8s.io "{rest[0]}": '
                    "the object has been modified; please apply your changes to the latest "
                    "version and try again",
                )
            self._version += 1
            replaced = copy.deepcopy(body)
            replaced["metadata"].update(namespace=namespace, resourceVersion=str(self._version))
            self.leases[key] = replaced
            return 200, copy.deepcopy(replaced)
        return 405, _status(405, "method not allowed")

    def _list(self, kind: str, items: Any, query: Mapping[str, str]) -> dict[str, Any]:
        chosen = [
            copy.deepcopy(o)
            for o in items
            if _fields_match(o, query.get("fieldSelector", ""))
            and _labels_match(o, query.get("labelSelector", ""))
        ]
        return {"kind": kind, "apiVersion": "v1", "metadata": {}, "items": chosen}

    def _admit(
        self, operation: str, document: dict[str, Any], old: dict[str, Any] | None, user: str
    ) -> dict[str, Any]:
        if self.webhook is None:
            return document
        document, _ = self._review(self.webhook, operation, document, old, user)
        if self.validating is not None:
            final, patched = self._review(self.validating, operation, document, old, user)
            assert not patched and final == document, "a validating webhook sent a patch"
        return document

    def _review(
        self,
        webhook: Webhook,
        operation: str,
        document: dict[str, Any],
        old: dict[str, Any] | None,
        user: str,
    ) -> tuple[dict[str, Any], bool]:
        """The webhook's verdict on `document`: (it, patched), or Refused."""
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": document["metadata"].get("namespace"),
                "name": document["metadata"].get("name"),
                "operation": operation,
                "userInfo": {"username": user},
                "object": document,
                "oldObject": old,
                "dryRun": False,
            },
        }
        context = ssl.create_default_context(cafile=webhook.ca_file)
        request = urllib.request.Request(
            webhook.url,
            data=json.dumps(review).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, context=context, timeout=10) as answer:
            verdict = json.loads(answer.read())
        response = verdict["response"]
        assert verdict["kind"] == "AdmissionReview" and response["uid"] == review["request"]["uid"]
        if not response["allowed"]:
            raise Refused(
                f'admission webhook "gpuloom" denied the request: {response["status"]["message"]}'
            )
        if response.get("patchType") == "JSONPatch" or "patch" in response:
            patch = json.loads(base64.b64decode(response["patch"]))
            return apply_patch(document, patch), True
        return document, False


def _check_lease(body: Any) -> None:
    """A Lease as the API server decodes it: its fields by their JSON names (the official
    client's V1Lease / V1LeaseSpec), MicroTimes in RFC 3339 with microseconds."""
    if not isinstance(body, dict) or body.get("kind") != "Lease":
        raise Refused("a Lease is expected")
    if body.get("apiVersion") != "coordination.k8s.io/v1" or not body["metadata"].get("name"):
        raise Refused("a coordination.k8s.io/v1 Lease with a name is expected")
    spec = body.get("spec") or {}
    unknown = set(spec) - set(client.V1LeaseSpec.attribute_map.values())
    if unknown:
        raise Refused(f"unknown field(s) of a LeaseSpec: {sorted(unknown)}")
    for name in ("acquireTime", "renewTime"):
        if name in spec:
            datetime.strptime(spec[name], "%Y-%m-%dT%H:%M:%S.%fZ")
    if not isinstance(spec.get("leaseDurationSeconds", 1), int):
        raise Refused("leaseDurationSeconds is an integer")


def _status(code: int, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "message": message,
    }


def _scale(deployment: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {k: deployment["metadata"][k] for k in ("name", "namespace")},
        "spec": {"replicas": deployment["spec"]["replicas"]},
    }


def _get_path(obj: Mapping[str, Any], dotted: str) -> Any:
    value: Any = obj
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _fields_match(obj: Mapping[str, Any], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        path, _, wanted = term.partition("=")
        if (_get_path(obj, path) or "") != wanted:
            return False
    return True


def _labels_match(obj: Mapping[str, Any], selector: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, sep, wanted = term.partition("=")
        if key not in labels or (sep and labels[key] != wanted):
            return False
    return True


def _validate_extended_resources(pod: dict[str, Any]) -> None:
    """The API server's rule for extended resources: whole numbers, set as limits, a request
    equal to its limit."""
    for container in pod["spec"]["containers"]:
        resources = container.get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        for name in {**requests, **limits}:
            if "/" not in name or name.startswith("kubernetes.io/"):
                continue
            if name not in limits:
                raise Refused(f"Limit must be set for non overcommitable resources: {name}")
            if name in requests and requests[name] != limits[name]:
                raise Refused(f"must be equal to {name} limit")


# ---- kube-scheduler ----


def post(url: str, body: object, ca_file: str, cert: tuple[str, str] | None = None) -> Any:
    """POST as kube-scheduler does: checking the server with `ca_file`, presenting `cert`
    (certificate, key) when given (its extender tlsConfig's certFile and keyFile)."""
    context = ssl.create_default_context(cafile=ca_file) if url.startswith("https") else None
    if context is not None and cert is not None:
        context.load_cert_chain(*cert)
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, context=context, timeout=30) as answer:
        return json.loads(answer.read())


@dataclass
class Scheduled:
    node: str | None
    filter_result: dict[str, Any]
    bind_error: str = ""


def schedule(
    extender: str,
    ca_file: str,
    pod: dict[str, Any],
    nodes: list[str],
    cert: tuple[str, str] | None = None,
) -> Scheduled:
    """One scheduling cycle of kube-scheduler for `pod` with `nodes` as the nodes its own
    filters left (nodeCacheCapable: names only): Filter, Prioritize, then Bind to the best."""
    args = {"Pod": pod, "NodeNames": nodes}
    result = post(f"{extender}/filter", args, ca_file, cert)
    if result.get("Error") or not result.get("NodeNames"):
        return Scheduled(None, result)
    passed = result["NodeNames"]
    scores = post(f"{extender}/prioritize", {"Pod": pod, "NodeNames": passed}, ca_file, cert)
    best = max(scores, key=lambda h: h["Score"])["Host"]
    meta = pod["metadata"]
    bound = post(
        f"{extender}/bind",
        {
            "PodName": meta["name"],
            "PodNamespace": meta["namespace"],
            "PodUID": meta["uid"],
            "Node": best,
        },
        ca_file,
        cert,
    )
    return Scheduled(best, result, bound.get("Error", ""))


# ---- the kubelet ----


class Kubelet(dp_grpc.RegistrationServicer):
    """One node's kubelet, as far as device plugins go."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.registrations: list[dp.RegisterRequest] = []
        self.devices: dict[str, str] = {}
        self.allocated: set[str] = set()
        self._server: grpc.aio.Server | None = None
        self._watch: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self.plugin: dp_grpc.DevicePluginStub | None = None

    async def start(self) -> None:
        self._server = grpc.aio.server()
        dp_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.directory / 'kubelet.sock'}")
        await self._server.start()

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._channel is not None:
            await self._channel.close()
        if self._server is not None:
            await self._server.stop(0)

    async def Register(self, request: dp.RegisterRequest, context: Any) -> dp.Empty:
        if request.version != "v1beta1":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unsupported version")
        self.registrations.append(request)
        if self._watch is not None:
            self._watch.cancel()
        self._channel = grpc.aio.insecure_channel(f"unix://{self.directory / request.endpoint}")
        self.plugin = dp_grpc.DevicePluginStub(self._channel)
        self._watch = asyncio.create_task(self._list_and_watch(self.plugin))
        return dp.Empty()

    async def _list_and_watch(self, plugin: dp_grpc.DevicePluginStub) -> None:
        with_options = await plugin.GetDevicePluginOptions(dp.Empty())
        assert not with_options.pre_start_required
        async for answer in plugin.ListAndWatch(dp.Empty()):
            self.devices = {d.ID: d.health for d in answer.devices}

    async def wait_devices(self, count: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.devices) < count:
            assert time.monotonic() < deadline, f"devices: {self.devices}"
            await asyncio.sleep(0.02)

    async def allocate(self, count: int) -> dp.ContainerAllocateResponse:
        """Pick `count` free healthy devices for a container and call Allocate, as the
        kubelet's device manager does while admitting a Pod."""
        free = sorted(
            d for d, h in self.devices.items() if h == "Healthy" and d not in self.allocated
        )
        chosen = free[:count]
        assert self.plugin is not None and len(chosen) == count, (free, count)
        answer = await self.plugin.Allocate(
            dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=chosen)])
        )
        self.allocated.update(chosen)
        (container,) = answer.container_responses
        return container


def container_environment(answer: dp.ContainerAllocateResponse) -> dict[str, str]:
    """The container's environment as a runtime makes it: the answer's variables, with paths
    inside the mounts resolved to their host paths (this test runs the process on the host)."""
    env = dict(answer.envs)
    for mount in answer.mounts:
        for key, value in env.items():
            if value == mount.container_path or value.startswith(mount.container_path + "/"):
                env[key] = mount.host_path + value[len(mount.container_path) :]
    return env
