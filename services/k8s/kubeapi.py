"""The few calls gpuloom makes to the Kubernetes API server, over its REST API (JSON over
HTTPS, the service account's bearer token): list and read Pods, patch their annotations, bind
a Pod to a node, delete a Pod, and read and set a Deployment's scale.

No client library: the calls are plain HTTP, made with the standard library in a worker thread
so the event loop never blocks. Inside a Pod the API server, the token and the CA come from the
service account (KUBERNETES_SERVICE_HOST / _PORT and /var/run/secrets/...); the settings may
name others. The token file is read at every call (Kubernetes rotates it)."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
MERGE_PATCH = "application/merge-patch+json"
MAX_ANSWER_BYTES = 64 << 20


class KubeApiError(Exception):
    """The API server answered with an error status (or could not be reached: status 0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API: {status or 'unreachable'}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class KubeApiConfig:
    """Where the API server is and how to prove who we are; `server` "" = in the cluster."""

    server: str = ""
    token_file: str = ""
    ca_file: str = ""
    timeout_s: float = 10.0

    def resolved(self) -> KubeApiConfig:
        """The in-cluster defaults filled in for whatever is not set."""
        server = self.server
        if not server:
            host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise KubeApiError(
                    0, "no API server: not in a cluster and GPULOOM_K8S_API_SERVER is not set"
                )
            server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        token_file = self.token_file or (
            f"{SERVICE_ACCOUNT}/token" if not self.server or server.startswith("https") else ""
        )
        ca_file = self.ca_file or (f"{SERVICE_ACCOUNT}/ca.crt" if not self.server else "")
        return KubeApiConfig(server.rstrip("/"), token_file, ca_file, self.timeout_s)


class KubeApi:
    def __init__(self, config: KubeApiConfig) -> None:
        self._config = config.resolved()
        self._ssl: ssl.SSLContext | None = None
        if self._config.server.startswith("https"):
            self._ssl = ssl.create_default_context(cafile=self._config.ca_file or None)

    @property
    def server(self) -> str:
        return self._config.server

    # ---- Pods ----

    async def list_pods(self, field_selector: str = "", label_selector: str = "") -> list[dict]:
        query = {
            k: v
            for k, v in (("fieldSelector", field_selector), ("labelSelector", label_selector))
            if v
        }
        answer = await self.call("GET", "/api/v1/pods", query=query)
        return list(answer.get("items") or [])

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return await self.call("GET", _pod(namespace, name))

    async def annotate_pod(
        self, namespace: str, name: str, annotations: Mapping[str, str | None]
    ) -> dict[str, Any]:
        """Set (or, with None, remove) annotations by a JSON merge patch."""
        body = {"metadata": {"annotations": dict(annotations)}}
        return await self.call("PATCH", _pod(namespace, name), body, MERGE_PATCH)

    async def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        """POST the Pod's binding subresource, as kube-scheduler's binder does: the Pod (this
        very one: its UID) goes to `node`."""
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        await self.call("POST", f"{_pod(namespace, name)}/binding", binding)

    async def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        """Delete the Pod if it is still this one (its UID); gone already is no error."""
        options = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
        try:
            await self.call("DELETE", _pod(namespace, name), options)
        except KubeApiError as error:
            if error.status not in (404, 409):
                raise

    # ---- Deployments ----

    async def list_deployments(self, label_selector: str) -> list[dict]:
        answer = await self.call(
            "GET", "/apis/apps/v1/deployments", query={"labelSelector": label_selector}
        )
        return list(answer.get("items") or [])

    async def set_scale(self, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """The Deployment's scale subresource set to `replicas` (a merge patch of spec)."""
        path = f"/apis/apps/v1/namespaces/{_q(namespace)}/deployments/{_q(name)}/scale"
        return await self.call("PATCH", path, {"spec": {"replicas": replicas}}, MERGE_PATCH)

    # ---- Leases (leader election) ----

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
        return await self.call("GET", _lease(namespace, name))

    async def create_lease(self, namespace: str, lease: Mapping[str, Any]) -> dict[str, Any]:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{_q(namespace)}/leases"
        return await self.call("POST", path, dict(lease))

    async def update_lease(
        self, namespace: str, name: str, lease: Mapping[str, Any]
    ) -> dict[str, Any]:
        """PUT the whole Lease; its metadata.resourceVersion makes the API server refuse it
        (409) when another writer changed it since it was read."""
        return await self.call("PUT", _lease(namespace, name), dict(lease))

    # ---- the call ----

    async def call(
        self,
        method: str,
        path: str,
        body: object = None,
        content_type: str = "application/json",
        query: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        return await asyncio.to_thread(self._call, method, path, body, content_type, query)

    def _call(
        self,
        method: str,
        path: str,
        body: object,
        content_type: str,
        query: Mapping[str, str] | None,
    ) -> dict[str, Any]:
        url = self._config.server + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        token = self._token()
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(
                request, timeout=self._config.timeout_s, context=self._ssl
            ) as answer:
                text = answer.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as error:
            raise KubeApiError(error.code, _status_message(error)) from None
        except (urllib.error.URLError, OSError, TimeoutError) as error:
            reason = getattr(error, "reason", error)
            raise KubeApiError(0, f"{method} {path}: {reason}") from None
        if len(text) > MAX_ANSWER_BYTES:
            raise KubeApiError(0, f"{method} {path}: answer over {MAX_ANSWER_BYTES} bytes")
        try:
            decoded = json.loads(text) if text else {}
        except ValueError:
            raise KubeApiError(0, f"{method} {path}: the answer is not JSON") from None
        return decoded if isinstance(decoded, dict) else {}

    def _token(self) -> str:
        if not self._config.token_file:
            return ""
        try:
            with open(self._config.token_file, encoding="utf-8") as file:
                return file.read().strip()
        except OSError as error:
            raise KubeApiError(
                0, f"cannot read the token {self._config.token_file}: {error.strerror}"
            ) from None


def _q(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def _pod(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{_q(namespace)}/pods/{_q(name)}"


def _lease(namespace: str, name: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{_q(namespace)}/leases/{_q(name)}"


def _status_message(error: urllib.error.HTTPError) -> str:
    """The message of the API server's Status object, else the HTTP reason."""
    try:
        status = json.loads(error.read(1 << 16) or b"{}")
        message = status.get("message") if isinstance(status, dict) else None
    except (ValueError, OSError):
        message = None
    return str(message or error.reason)
