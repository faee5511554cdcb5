"""The admission webhooks' answers (admission.k8s.io/v1 AdmissionReview), pure: the mutating
webhook's, and the validating webhook's (`validating`: the same checks on the Pod as every
mutating webhook left it, no patch).

A Pod that asks for gpuloom resources is validated (`pod_ask`, and against the fleet
placement registered: GPU models, memory, GPUs per node) and, when valid, patched (JSONPatch)
so that gpuloom's scheduler profile, whose extender asks placement, schedules it, with the
label `gpuloom.io/managed=true` and one `gpuloom.io/gpu` device for the device plugin when it
named none. A refusal names the Pod's field. Updates that change the annotations only gpuloom
writes are refused unless gpuloom's own service account makes them, so that the device plugin
may trust them. A device plugin's account (`plugin_users`) may change one thing of a Pod: the
annotation `gpuloom.io/allocated` (its labels, its other annotations and the rest stay as they
were), so a node's plugin, which RBAC lets patch Pods, cannot bind Pods to jobs or relabel
them. Pods that ask nothing of gpuloom pass untouched.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuloom.domain.errors import InvalidArgument
from gpuloom.kube.asks import (
    ALLOCATED,
    GPU,
    GPU_MODEL,
    MANAGED_LABEL,
    MEMORY,
    WRITTEN_BY_GPULOOM,
    PodAsk,
    asks_gpuloom,
    pod_ask,
)
from gpuloom.policies.placement.model import describe_gib

API_VERSION = "admission.k8s.io/v1"
PLUGIN_ONLY = f"a device plugin may change only the annotation {ALLOCATED}"


@dataclass(frozen=True, slots=True)
class FleetLimits:
    """What the fleet registered with placement can hold, per GPU model: the most memory of
    one GPU and the most GPUs of one node. Empty: nothing known (no fleet checks)."""

    memory: Mapping[str, int] = field(default_factory=dict)
    gpus_per_node: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, gpus: Collection[tuple[str, str, int]]) -> FleetLimits:
        """From (node, model, memory bytes) of every registered GPU."""
        memory: dict[str, int] = {}
        per_node: dict[tuple[str, str], int] = {}
        for node, model, size in gpus:
            memory[model] = max(memory.get(model, 0), size)
            per_node[(node, model)] = per_node.get((node, model), 0) + 1
        most: dict[str, int] = {}
        for (_, model), count in per_node.items():
            most[model] = max(most.get(model, 0), count)
        return cls(memory, most)

    def check(self, ask: PodAsk) -> None:
        """InvalidArgument naming the Pod's field when no GPU (of the models it names) could
        ever hold the ask."""
        if not self.memory:
            return
        spec = ask.spec
        where = f"spec.containers[{ask.container_index}].resources.limits"
        models = spec.gpu_models or tuple(self.memory)
        unknown = [m for m in models if m not in self.memory]
        if spec.gpu_models and len(unknown) == len(models):
            raise InvalidArgument(
                f"metadata.annotations[{GPU_MODEL}]",
                f"no registered GPU is of model {spec.gpu_model!r}; the fleet has "
                f"{', '.join(sorted(self.memory))}",
            )
        known = [m for m in models if m in self.memory]
        largest = max(self.memory[m] for m in known)
        if spec.memory_bytes > largest:
            raise InvalidArgument(
                f"{where}[{MEMORY}]",
                f"{describe_gib(spec.memory_bytes)} is more than any GPU has (the most: "
                f"{describe_gib(largest)})",
            )
        most = max(self.gpus_per_node[m] for m in known)
        if ask.gpus > most:
            raise InvalidArgument(
                f"{where}[{GPU}]",
                f"{ask.gpus} GPUs on one node: no node has that many (the most: {most})",
            )


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """What the webhook needs to decide: placement's policy names, the PriorityClass levels,
    the scheduler profile gpuloom Pods go to, the users that may write gpuloom's own
    annotations (gpuloom's service account) and the fleet's limits."""

    policies: Collection[str]
    scheduler_name: str
    gpuloom_users: Collection[str]
    priority_classes: Mapping[str, int] = field(default_factory=dict)
    fleet: FleetLimits = field(default_factory=FleetLimits)
    plugin_users: Collection[str] = ()


def answer(
    review: Mapping[str, Any], policy: AdmissionPolicy, validating: bool = False
) -> dict[str, Any]:
    """The AdmissionReview to send back for `review`. Raises ValueError when `review` is no
    AdmissionReview request (the server answers 400).

    `validating`: the answer of the validating webhook (ValidatingWebhookConfiguration), which
    the API server calls with the Pod as every mutating webhook left it: the same checks, no
    patch (a validating webhook may not send one), and a gpuloom Pod must still be sent to
    gpuloom's scheduler profile (another webhook may have changed it after this one's)."""
    if not isinstance(review, Mapping) or review.get("apiVersion") != API_VERSION:
        raise ValueError(f"not an {API_VERSION} AdmissionReview")
    request = review.get("request")
    if not isinstance(request, Mapping) or not isinstance(request.get("uid"), str):
        raise ValueError("an AdmissionReview without a request (or its uid)")
    response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
    try:
        patch = _decide(request, policy)
        if validating:
            _check_final(request, policy)
            patch = []
    except InvalidArgument as error:
        response["allowed"] = False
        response["status"] = {
            "code": 422,
            "reason": "Invalid",
            "message": f"gpuloom: {error.message}",
        }
    else:
        if patch:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def _decide(request: Mapping[str, Any], policy: AdmissionPolicy) -> list[dict[str, Any]]:
    if _dig(request, "kind", "kind") != "Pod" or _dig(request, "kind", "group"):
        return []
    pod = request.get("object")
    if not isinstance(pod, Mapping):
        return []
    user = _dig(request, "userInfo", "username")
    ours = isinstance(user, str) and user in policy.gpuloom_users
    annotations = _annotations(pod)
    operation = request.get("operation")
    if operation == "UPDATE" and isinstance(user, str) and user in policy.plugin_users:
        _check_plugin_update(pod, request.get("oldObject"))
        return []
    if operation == "UPDATE":
        before = _annotations(request.get("oldObject"))
        for key in WRITTEN_BY_GPULOOM:
            if annotations.get(key) != before.get(key) and not ours:
                raise InvalidArgument(f"metadata.annotations[{key}]", "is written by gpuloom only")
        return []
    if operation != "CREATE" or not asks_gpuloom(pod):
        return []
    for key in WRITTEN_BY_GPULOOM:
        if key in annotations and not ours:
            raise InvalidArgument(f"metadata.annotations[{key}]", "is written by gpuloom only")
    ask = pod_ask(pod, policy.policies, policy.priority_classes)
    policy.fleet.check(ask)
    return _patch(pod, ask, policy.scheduler_name)


def _check_plugin_update(pod: Mapping[str, Any], old: object) -> None:
    """A device plugin's update: nothing changed but the annotation gpuloom.io/allocated."""
    before = old if isinstance(old, Mapping) else {}
    after, was = _annotations(pod), _annotations(before)
    for key in sorted(set(after) | set(was)):
        if key != ALLOCATED and after.get(key) != was.get(key):
            raise InvalidArgument(f"metadata.annotations[{key}]", PLUGIN_ONLY)
    for part in ("labels", "ownerReferences", "finalizers"):
        if _dig(pod, "metadata", part) != _dig(before, "metadata", part):
            raise InvalidArgument(f"metadata.{part}", PLUGIN_ONLY)
    for part in ("spec", "status"):
        if pod.get(part) != before.get(part):
            raise InvalidArgument(part, PLUGIN_ONLY)


def _check_final(request: Mapping[str, Any], policy: AdmissionPolicy) -> None:
    """A gpuloom Pod created as every mutating webhook left it is still gpuloom's to
    schedule: its schedulerName is gpuloom's profile."""
    pod = request.get("object")
    if request.get("operation") != "CREATE" or not isinstance(pod, Mapping):
        return
    if _dig(request, "kind", "kind") != "Pod" or not asks_gpuloom(pod):
        return
    name = _dig(pod, "spec", "schedulerName")
    if name != policy.scheduler_name:
        raise InvalidArgument(
            "spec.schedulerName",
            f"a Pod asking for gpuloom resources is scheduled by {policy.scheduler_name!r} "
            f"(gpuloom's mutating webhook sets it; got {str(name)[:64]!r})",
        )


def _dig(document: object, *keys: str) -> object:
    """document[k1][k2]..., None where a level is missing or not an object."""
    for key in keys:
        if not isinstance(document, Mapping):
            return None
        document = document.get(key)
    return document


def _annotations(pod: object) -> Mapping[str, Any]:
    found = _dig(pod, "metadata", "annotations")
    return found if isinstance(found, Mapping) else {}


def _patch(pod: Mapping[str, Any], ask: PodAsk, scheduler_name: str) -> list[dict[str, Any]]:
    ops: list[dict[str, Any]] = [
        {"op": "add", "path": "/spec/schedulerName", "value": scheduler_name}
    ]
    labels = (pod.get("metadata") or {}).get("labels")
    if labels is None:
        ops.append({"op": "add", "path": "/metadata/labels", "value": {MANAGED_LABEL: "true"}})
    else:
        path = f"/metadata/labels/{_escape(MANAGED_LABEL)}"
        ops.append({"op": "add", "path": path, "value": "true"})
    container = pod["spec"]["containers"][ask.container_index]
    resources = container.get("resources") or {}
    limits = resources.get("limits")
    base = f"/spec/containers/{ask.container_index}/resources"
    if GPU not in (limits or {}):
        if not resources:
            ops.append({"op": "add", "path": base, "value": {"limits": {GPU: "1"}}})
        elif limits is None:
            ops.append({"op": "add", "path": f"{base}/limits", "value": {GPU: "1"}})
        else:
            ops.append({"op": "add", "path": f"{base}/limits/{_escape(GPU)}", "value": "1"})
        requests = resources.get("requests")
        if requests and any(k.startswith("gpuloom.io/") for k in requests) and GPU not in requests:
            ops.append({"op": "add", "path": f"{base}/requests/{_escape(GPU)}", "value": "1"})
    return ops


def _escape(key: str) -> str:
    """A map key as one JSON Pointer segment (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")
