"""The kube-scheduler extender's messages (k8s.io/kube-scheduler/extender/v1), pure: what
kube-scheduler sends to Filter, Prioritize and Bind, and what it reads back. The Go types carry
no JSON tags, so the keys are the Go field names (`Pod`, `NodeNames`, `FailedNodes`, `Host`,
...); kube-scheduler sends the nodes' names only (`NodeNames`) when the extender is configured
`nodeCacheCapable`, else whole Node objects (`Nodes`), and expects the same form back.

Also the request ids the extender submits a Pod's jobs under: `k8s-<Pod UID>-<attempt>`, so
that a job names the Pod it is for (the device plugin checks it) and a retried Filter finds
the job it submitted before."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MAX_PRIORITY = 10  # extenderv1.MaxExtenderPriority
REQUEST_PREFIX = "k8s-"
_REQUEST_ID = re.compile(r"k8s-(?P<uid>[A-Za-z0-9-]{1,64})-(?P<attempt>\d{1,6})")


@dataclass(frozen=True, slots=True)
class ExtenderArgs:
    """Filter's and Prioritize's argument: the Pod, and the candidate nodes (by name; the Node
    objects too when kube-scheduler sent them)."""

    pod: Mapping[str, Any]
    node_names: tuple[str, ...]
    nodes: Mapping[str, Mapping[str, Any]] | None  # name -> Node, when sent whole

    @property
    def pod_uid(self) -> str:
        return str((self.pod.get("metadata") or {}).get("uid") or "")


@dataclass(frozen=True, slots=True)
class BindingArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str


def _get(document: Mapping[str, Any], key: str) -> Any:
    """A field by its Go name, matched as Go's JSON decoder does (case-insensitively)."""
    if key in document:
        return document[key]
    lowered = key.lower()
    for name, value in document.items():
        if isinstance(name, str) and name.lower() == lowered:
            return value
    return None


def parse_args(document: object) -> ExtenderArgs:
    """ValueError saying what is wrong for anything that is not an ExtenderArgs."""
    if not isinstance(document, Mapping):
        raise ValueError("ExtenderArgs must be a JSON object")
    pod = _get(document, "Pod")
    if not isinstance(pod, Mapping):
        raise ValueError("ExtenderArgs.Pod must be a Pod object")
    names = _get(document, "NodeNames")
    node_list = _get(document, "Nodes")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("ExtenderArgs.NodeNames must be a list of node names")
        return ExtenderArgs(pod, tuple(names), None)
    if not isinstance(node_list, Mapping) or not isinstance(node_list.get("items"), list):
        raise ValueError("ExtenderArgs needs NodeNames or Nodes (a NodeList)")
    nodes: dict[str, Mapping[str, Any]] = {}
    for node in node_list["items"]:
        name = (node.get("metadata") or {}).get("name") if isinstance(node, Mapping) else None
        if not isinstance(name, str):
            raise ValueError("ExtenderArgs.Nodes.items[]: every Node needs metadata.name")
        nodes[name] = node
    return ExtenderArgs(pod, tuple(nodes), nodes)


def parse_binding(document: object) -> BindingArgs:
    if not isinstance(document, Mapping):
        raise ValueError("ExtenderBindingArgs must be a JSON object")
    values = []
    for key in ("PodName", "PodNamespace", "PodUID", "Node"):
        value = _get(document, key)
        if not isinstance(value, str) or not value:
            raise ValueError(f"ExtenderBindingArgs.{key} must be a non-empty string")
        values.append(value)
    return BindingArgs(*values)


def filter_result(
    args: ExtenderArgs, passed: Iterable[str], failed: Mapping[str, str], error: str = ""
) -> dict[str, Any]:
    """ExtenderFilterResult: the nodes that passed, in the form they came in, and why each
    other candidate failed, as unresolvable: kube-scheduler's preemption cannot tell what
    frees room on a GPU (placement decides that), so it must not evict Pods for it."""
    chosen = [n for n in passed if n in args.node_names]
    result: dict[str, Any] = {"FailedNodes": {}, "FailedAndUnresolvableNodes": dict(failed)}
    if args.nodes is None:
        result["NodeNames"] = chosen
    else:
        result["Nodes"] = {"items": [args.nodes[n] for n in chosen]}
    if error:
        result["Error"] = error
    return result


def priorities(args: ExtenderArgs, scores: Mapping[str, int]) -> list[dict[str, Any]]:
    """HostPriorityList: a score 0..10 for every candidate (0 where none is given)."""
    return [
        {"Host": n, "Score": max(0, min(MAX_PRIORITY, int(scores.get(n, 0))))}
        for n in args.node_names
    ]


def binding_result(error: str = "") -> dict[str, Any]:
    return {"Error": error} if error else {}


def request_id(pod_uid: str, attempt: int) -> str:
    return f"{REQUEST_PREFIX}{pod_uid}-{attempt}"


def parse_request_id(text: str) -> tuple[str, int] | None:
    """(Pod UID, attempt) of a request id the extender made; None for any other."""
    match = _REQUEST_ID.fullmatch(text)
    return None if match is None else (match["uid"], int(match["attempt"]))
