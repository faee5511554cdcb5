"""The Pods and the Deployment docs/deploy.md shows ("Pods that ask for a share") are what it
says they are: valid Kubernetes objects, admitted by gpuloom's webhook, and read as the asks
the text next to them describes."""

from __future__ import annotations

import base64
import copy
import json
import re
from pathlib import Path
from typing import Any

import yaml

from gpuloom.domain.placement import JobKind
from gpuloom.kube.admission import AdmissionPolicy, answer
from gpuloom.kube.asks import FUNCTION, pod_ask
from gpuloom.policies.placement import POLICIES
from gpuloom.services.k8s.controller import FUNCTION_LABEL
from tests.deploy.conftest import ROOT, tool
from tests.k8s.standins import apply_patch
from tests.k8s.test_wire import review

POLICY = AdmissionPolicy(POLICIES, "gpuloom", ())


def examples() -> list[dict[str, Any]]:
    text = (ROOT / "docs" / "deploy.md").read_text()
    section = text[text.index("## Pods that ask for a share") : text.index("## What is checked")]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]


def admitted(pod: dict[str, Any]) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    pod["metadata"].setdefault("uid", "0b1c-22")
    verdict = answer(review(pod), POLICY)["response"]
    assert verdict["allowed"], verdict
    return apply_patch(pod, json.loads(base64.b64decode(verdict["patch"])))


def test_the_examples_are_valid_admitted_and_ask_what_the_text_says(tmp_path: Path) -> None:
    found = examples()
    whole = [d for d in found if "kind" in d]
    path = tmp_path / "examples.yaml"
    path.write_text(yaml.safe_dump_all(whole))
    result = tool("kubernetes-validate", "--strict", path)
    assert result.returncode == 0, result.stdout + result.stderr

    pods = {d["metadata"]["name"]: d for d in whole if d["kind"] == "Pod"}
    server = pod_ask(admitted(pods["resnet-server"]), POLICIES)
    assert server.spec.priority == 2 and server.spec.mps
    share = server.spec.share
    assert (share.sm_percent, share.quota.request_percent, share.quota.limit_percent) == (
        24,
        40,
        60,
    )
    assert share.memory_bytes == 4 << 30

    trainer = pod_ask(admitted(pods["trainer"]), POLICIES)
    assert trainer.gpus == 2 and trainer.spec.whole_gpus == 2
    assert trainer.spec.priority == 6  # from gpuloom-priority-6
    assert trainer.spec.kind is JobKind.TRAINING and trainer.spec.checkpoint is not None
    assert trainer.spec.gpu_model == "A100-80GB"

    resize = pod_ask(admitted(pods["resize-images"]), POLICIES)
    assert resize.mig and resize.spec.kind is JobKind.BATCH and resize.spec.task_key == "resize"
    assert resize.spec.command == ("python", "resize.py") and resize.gpus == 1

    # The shared model's snippet, made a whole Pod.
    (snippet,) = [d for d in found if "kind" not in d]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "replica", "namespace": "team-a", **snippet["metadata"]},
        "spec": copy.deepcopy(snippet["spec"]),
    }
    pod["spec"]["containers"][0]["image"] = "registry.example.com/serve:1"
    replica = pod_ask(admitted(pod), POLICIES)
    assert replica.spec.shared_model == "llama-7b" and replica.spec.share.sm_percent == 50

    # The function's Deployment: found by the controller's label, its Pods adopt replicas.
    (deployment,) = [d for d in whole if d["kind"] == "Deployment"]
    function = deployment["metadata"]["labels"][FUNCTION_LABEL]
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"][FUNCTION] == function
    assert (
        deployment["spec"]["selector"]["matchLabels"].items()
        <= template["metadata"]["labels"].items()
    )
    replica_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "resnet-x", "namespace": "serving", **template["metadata"]},
        "spec": template["spec"],
    }
    assert pod_ask(admitted(replica_pod), POLICIES).function == function
