"""The formats at the edges, on their own: kube-scheduler's extender messages (Go field names,
node names or whole Node objects), the admission webhook's answer to what is not an
AdmissionReview, and the HTTP server's answers to malformed requests."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from kubernetes import client

from gpuloom.kube import extender as wire
from gpuloom.kube.admission import AdmissionPolicy, FleetLimits, answer
from gpuloom.policies.placement import POLICIES
from gpuloom.services.k8s.http import MAX_BODY_BYTES, JsonServer
from tests.k8s.standins import apply_patch, as_json, pod_model

POLICY = AdmissionPolicy(POLICIES, "gpuloom", ("system:serviceaccount:gpuloom:gpuloom-k8s",))


def node(name: str) -> dict:
    return as_json(
        client.V1Node(api_version="v1", kind="Node", metadata=client.V1ObjectMeta(name=name))
    )


def test_extender_args_by_name_or_whole_nodes_answer_in_the_same_form() -> None:
    pod = as_json(pod_model("p", {"gpuloom.io/gpu": "1"}))
    by_name = wire.parse_args({"Pod": pod, "NodeNames": ["a", "b"]})
    assert by_name.node_names == ("a", "b") and by_name.nodes is None
    result = wire.filter_result(by_name, ["b", "zz"], {"a": "full"})
    assert result == {
        "NodeNames": ["b"],
        "FailedNodes": {},
        "FailedAndUnresolvableNodes": {"a": "full"},
    }
    whole = wire.parse_args(
        {"pod": pod, "nodes": {"items": [node("a"), node("b")]}}
    )  # Go: any case
    assert whole.node_names == ("a", "b")
    result = wire.filter_result(whole, ["a"], {"b": "full"}, error="")
    assert result["Nodes"]["items"] == [node("a")] and "NodeNames" not in result
    assert wire.priorities(whole, {"a": 99, "b": -3}) == [
        {"Host": "a", "Score": 10},
        {"Host": "b", "Score": 0},
    ]
    binding = wire.parse_binding({"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": "a"})
    assert (binding.pod_uid, binding.node) == ("u", "a")
    for bad in (
        [],
        {"Pod": 1},
        {"Pod": pod},
        {"Pod": pod, "NodeNames": [1]},
        {"Pod": pod, "Nodes": {"items": [{}]}},
    ):
        with pytest.raises(ValueError):
            wire.parse_args(bad)
    with pytest.raises(ValueError, match="PodUID"):
        wire.parse_binding({"PodName": "p", "PodNamespace": "ns", "Node": "a"})
    assert wire.parse_request_id(wire.request_id("0b1c-22", 7)) == ("0b1c-22", 7)
    assert wire.parse_request_id("scale-abc") is None


def review(
    pod: dict, operation: str = "CREATE", user: str = "alice", old: dict | None = None
) -> dict:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "r-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": operation,
            "userInfo": {"username": user},
            "object": pod,
            "oldObject": old,
        },
    }


def test_the_admission_patch_applies_and_the_fleet_limits_refuse() -> None:
    pod = as_json(
        pod_model("p", {"gpuloom.io/sm": "50", "gpuloom.io/memory": "8Gi"}, labels={"a": "b"})
    )
    pod["spec"]["containers"][0]["resources"]["requests"] = {"gpuloom.io/sm": "50"}
    verdict = answer(review(pod), POLICY)["response"]
    assert verdict["allowed"] and verdict["uid"] == "r-1" and verdict["patchType"] == "JSONPatch"
    patched = apply_patch(pod, json.loads(base64.b64decode(verdict["patch"])))
    assert patched["spec"]["schedulerName"] == "gpuloom"
    assert patched["metadata"]["labels"] == {"a": "b", "gpuloom.io/managed": "true"}
    resources = patched["spec"]["containers"][0]["resources"]
    assert resources["limits"]["gpuloom.io/gpu"] == resources["requests"]["gpuloom.io/gpu"] == "1"
    fleet = FleetLimits.of(
        [("n1", "A30-24GB", 24 << 30), ("n1", "A30-24GB", 24 << 30), ("n2", "A100-80GB", 80 << 30)]
    )
    limited = AdmissionPolicy(POLICIES, "gpuloom", (), fleet=fleet)
    assert answer(review(pod), limited)["response"]["allowed"]
    big = as_json(pod_model("p", {"gpuloom.io/gpu": "1"}, {"gpuloom.io/gpu-model": "A30-24GB"}))
    big["spec"]["containers"][0]["resources"]["limits"]["gpuloom.io/gpu"] = "3"
    refused = answer(review(big), limited)["response"]
    assert not refused["allowed"] and refused["status"]["code"] == 422
    assert (
        "gpuloom.io/gpu]: 3 GPUs on one node: no node has that many (the most: 2)"
        in refused["status"]["message"]
    )
    # Updates: gpuloom's own annotations by gpuloom only; anything else passes unpatched.
    marked = json.loads(json.dumps(pod))
    marked["metadata"]["annotations"] = {"gpuloom.io/job": "j-1"}
    assert not answer(review(marked, "UPDATE", old=pod), POLICY)["response"]["allowed"]
    ours = answer(
        review(marked, "UPDATE", "system:serviceaccount:gpuloom:gpuloom-k8s", pod), POLICY
    )
    assert ours["response"] == {"uid": "r-1", "allowed": True}
    # The validating webhook: the same checks, never a patch, and a gpuloom Pod that another
    # mutating webhook sent elsewhere afterwards is refused, naming the field.
    assert answer(review(patched), POLICY, validating=True)["response"] == {
        "uid": "r-1",
        "allowed": True,
    }
    unpatched = answer(review(pod), POLICY, validating=True)["response"]
    assert not unpatched["allowed"] and "patch" not in unpatched
    assert unpatched["status"]["message"] == (
        "gpuloom: spec.schedulerName: a Pod asking for gpuloom resources is scheduled by "
        "'gpuloom' (gpuloom's mutating webhook sets it; got 'None')"
    )
    assert not answer(review(big), limited, validating=True)["response"]["allowed"]
    plain = as_json(pod_model("plain"))
    assert answer(review(plain), POLICY, validating=True)["response"]["allowed"]
    assert not answer(review(marked, "UPDATE", old=pod), POLICY, True)["response"]["allowed"]
    for bad in (
        {},
        {"apiVersion": "admission.k8s.io/v1"},
        {"apiVersion": "admission.k8s.io/v1beta1", "request": {"uid": "x"}},
    ):
        with pytest.raises(ValueError):
            answer(bad, POLICY)


async def _raw(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


async def test_the_json_server_answers_malformed_requests_and_keeps_serving() -> None:
    calls: list[object] = []

    async def echo(document: object) -> tuple[int, object]:
        calls.append(document)
        if document == "boom":
            raise RuntimeError("boom")
        return 200, {"got": document}

    server = JsonServer({"/echo": echo})
    port = await server.start("127.0.0.1", 0)
    try:
        assert (await _raw(port, b"nonsense\r\n\r\n")).startswith(b"HTTP/1.1 400")
        big = f"POST /echo HTTP/1.1\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode()
        assert (await _raw(port, big)).startswith(b"HTTP/1.1 400")
        assert (
            await _raw(
                port, b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\nConnection: close\r\n\r\n{x}"
            )
        ).startswith(b"HTTP/1.1 400")
        assert (
            await _raw(
                port, b"POST /nope HTTP/1.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
            )
        ).startswith(b"HTTP/1.1 404")
        assert (
            await _raw(
                port, b'POST /echo HTTP/1.1\r\nContent-Length: 6\r\nConnection: close\r\n\r\n"boom"'
            )
        ).startswith(b"HTTP/1.1 500")
        assert (await _raw(port, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")).startswith(
            b"HTTP/1.1 200"
        )
        # Two requests on one kept-alive connection.
        both = await _raw(
            port,
            b"POST /echo HTTP/1.1\r\nContent-Length: 1\r\n\r\n1"
            b"POST /echo HTTP/1.1\r\nContent-Length: 1\r\nConnection: close\r\n\r\n2",
        )
        assert both.count(b"HTTP/1.1 200") == 2 and b'{"got": 2}' in both
        assert calls == ["boom", 1, 2]
    finally:
        await server.stop()


def test_a_device_plugin_changes_only_the_allocated_annotation() -> None:
    plugin = "system:serviceaccount:gpuloom:gpuloom-device-plugin"
    policy = AdmissionPolicy(
        POLICIES, "gpuloom", ("system:serviceaccount:gpuloom:gpuloom-k8s",), plugin_users=(plugin,)
    )
    old = as_json(pod_model("p", {"gpuloom.io/gpu": "1"}, {"gpuloom.io/job": "j-1"}))

    def update(new: dict, user: str = plugin) -> dict:
        request = {
            "uid": "r-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": "UPDATE",
            "userInfo": {"username": user},
            "object": new,
            "oldObject": old,
        }
        document = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}
        return answer({**document, "request": request}, policy, validating=True)["response"]

    allocated = json.loads(json.dumps(old))
    allocated["metadata"]["annotations"]["gpuloom.io/allocated"] = "1.5"
    assert update(allocated)["allowed"]
    relabelled = json.loads(json.dumps(allocated))
    relabelled["metadata"]["labels"] = {"team": "b"}
    rebound = json.loads(json.dumps(old))
    rebound["metadata"]["annotations"]["gpuloom.io/job"] = "j-2"
    respec = json.loads(json.dumps(old))
    respec["spec"]["containers"][0]["image"] = "evil:1"
    for new, field in (
        (relabelled, "metadata.labels"),
        (rebound, "metadata.annotations[gpuloom.io/job]"),
        (respec, "spec"),
    ):
        verdict = update(new)
        assert not verdict["allowed"]
        assert verdict["status"]["message"].startswith(f"gpuloom: {field}: a device plugin may")
    # gpuloom's own account may change its annotations; anyone else none of them.
    assert update(rebound, "system:serviceaccount:gpuloom:gpuloom-k8s")["allowed"]
    assert not update(allocated, "alice")["allowed"]
