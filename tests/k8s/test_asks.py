"""What a Pod asks of gpuloom, from Pods built with the official client's models: shares,
whole GPUs, the defaults, priority from an annotation or the PriorityClass, the training
kind and its checkpoint hook, function replicas; and every bad value refused naming the
Pod's field, before anything is asked of placement."""

from __future__ import annotations

import pytest
from kubernetes import client

from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.placement import JobKind
from gpuloom.kube.asks import asks_gpuloom, pod_ask, priority_classes_from_text
from gpuloom.kube.quantity import parse_quantity, parse_whole
from gpuloom.policies.placement import POLICIES
from tests.k8s.standins import as_json, pod_model

GIB = 1 << 30


def ask_of(pod: client.V1Pod, classes: dict[str, int] | None = None):
    return pod_ask(as_json(pod), POLICIES, classes)


def test_a_share_with_its_defaults() -> None:
    pod = pod_model(
        "infer", {"gpuloom.io/sm": "24", "gpuloom.io/quota": "40", "gpuloom.io/memory": "4Gi"}
    )
    ask = ask_of(pod)
    assert ask.pod == "team-a/infer" and ask.container == "main" and ask.gpus == 1
    spec = ask.spec
    assert spec.mps and spec.share.sm_percent == 24
    assert (spec.share.quota.request_percent, spec.share.quota.limit_percent) == (40, 40)
    assert spec.memory_bytes == 4 * GIB and spec.whole_gpus == 0
    assert spec.kind is JobKind.BATCH  # restartPolicy Never
    assert spec.priority == 5 and spec.name == "team-a/infer"
    only_quota = ask_of(
        pod_model(
            "q",
            {"gpuloom.io/quota": "30", "gpuloom.io/quota-limit": "60", "gpuloom.io/memory": "1Gi"},
            restart_policy="Always",
        )
    )
    assert only_quota.spec.mps and only_quota.spec.share.sm_percent == 100
    assert only_quota.spec.share.quota.limit_percent == 60
    assert only_quota.spec.kind is JobKind.INFERENCE


def test_whole_gpus_priority_training_and_its_hook() -> None:
    pod = pod_model(
        "train",
        {"gpuloom.io/gpu": "2"},
        {
            "gpuloom.io/kind": "training",
            "gpuloom.io/checkpoint-signal": "SIGUSR1",
            "gpuloom.io/checkpoint-timeout-s": "120",
            "gpuloom.io/gpu-model": "A100-80GB|H100-80GB",
        },
        priority_class="gpuloom-priority-1",
    )
    spec = ask_of(pod).spec
    assert spec.whole_gpus == 2 and not spec.mps and spec.kind is JobKind.TRAINING
    assert spec.priority == 1 and spec.gpu_models == ("A100-80GB", "H100-80GB")
    assert spec.checkpoint is not None and spec.checkpoint.signal == "SIGUSR1"
    assert spec.checkpoint.timeout_s == 120
    # The annotation wins over the class; other classes map through the setting.
    assert (
        ask_of(
            pod_model(
                "p",
                {"gpuloom.io/gpu": "1"},
                {"gpuloom.io/priority": "0"},
                priority_class="gpuloom-priority-7",
            )
        ).spec.priority
        == 0
    )
    classes = priority_classes_from_text("high=2, low=8")
    assert (
        ask_of(pod_model("p", {"gpuloom.io/gpu": "1"}, priority_class="low"), classes).spec.priority
        == 8
    )
    assert (
        ask_of(
            pod_model("p", {"gpuloom.io/gpu": "1"}, priority_class="other"), classes
        ).spec.priority
        == 5
    )
    command = ask_of(
        pod_model(
            "c",
            {"gpuloom.io/gpu": "1"},
            {
                "gpuloom.io/kind": "training",
                "gpuloom.io/checkpoint-command": '["python", "save.py"]',
            },
        )
    ).spec.checkpoint
    assert command is not None and command.command == ("python", "save.py")


def test_a_shared_model_and_a_function_replica() -> None:
    replica = ask_of(
        pod_model(
            "r",
            None,
            {"gpuloom.io/function": "resnet", "gpuloom.io/shared-model": "resnet50"},
            restart_policy="Always",
        )
    )
    assert replica.function == "resnet" and replica.gpus == 1
    assert replica.spec.shared_model == "resnet50" and replica.spec.task_key == "resnet"
    assert asks_gpuloom(as_json(pod_model("r", None, {"gpuloom.io/function": "resnet"})))
    assert not asks_gpuloom(as_json(pod_model("plain", {"cpu": "1"})))


def test_a_mig_instance_is_a_mig_batch_task_of_the_containers_command() -> None:
    pod = pod_model("resize", {"gpuloom.io/mig": "1"}, {"gpuloom.io/task-key": "resize"})
    pod.spec.containers[0].command = ["python", "resize.py"]
    pod.spec.containers[0].args = ["--in", "/data"]
    ask = ask_of(pod)
    assert ask.mig and ask.gpus == 1
    spec = ask.spec
    assert spec.is_mig_batch and spec.kind is JobKind.BATCH and spec.task_key == "resize"
    assert not spec.mps and spec.whole_gpus == 0 and spec.share.whole
    assert spec.command == ("python", "resize.py", "--in", "/data")
    # The image's entrypoint: the image stands for the program, the args follow.
    entrypoint = pod_model("e", {"gpuloom.io/mig": "1"}, {"gpuloom.io/task-key": "resize"})
    entrypoint.spec.containers[0].args = ["--fast"]
    assert ask_of(entrypoint).spec.command == ("registry.example.com/serve:1", "--fast")
    # restartPolicy Always makes a Pod inference: refused, naming the field that did it.
    always = pod_model(
        "a", {"gpuloom.io/mig": "1"}, {"gpuloom.io/task-key": "k"}, restart_policy="Always"
    )
    with pytest.raises(InvalidArgument, match="a MIG Pod is a batch task") as caught:
        ask_of(always)
    assert caught.value.field == "spec.restartPolicy"
    # No size: placement's planner chooses; a size, as slices or a MIG profile's name.
    assert spec.mig_size == 0
    for text, slices in (("3", 3), ("3g.40gb", 3), ("1g.10gb+me", 1), (" 7g.80gb ", 7)):
        sized = pod_model(
            "s", {"gpuloom.io/mig": "1"}, {"gpuloom.io/task-key": "k", "gpuloom.io/mig-size": text}
        )
        assert ask_of(sized).spec.mig_size == slices, text
    long = pod_model("l", {"gpuloom.io/mig": "1"}, {"gpuloom.io/task-key": "k"})
    long.spec.containers[0].command = ["x" * 5000]
    with pytest.raises(InvalidArgument) as caught:
        ask_of(long)
    assert caught.value.field == "spec.containers[0].command"


@pytest.mark.parametrize(
    ("limits", "annotations", "field", "says"),
    [
        (
            {"gpuloom.io/sm": "120", "gpuloom.io/memory": "1Gi"},
            {},
            "spec.containers[0].resources.limits[gpuloom.io/sm]",
            "within 1..100, got 120",
        ),
        ({"gpuloom.io/sm": "0", "gpuloom.io/memory": "1Gi"}, {}, "limits[gpuloom.io/sm]", "got 0"),
        (
            {"gpuloom.io/quota": "60", "gpuloom.io/quota-limit": "40", "gpuloom.io/memory": "1Gi"},
            {},
            "limits[gpuloom.io/quota]",
            "must not exceed",
        ),
        ({"gpuloom.io/sm": "50"}, {}, "limits[gpuloom.io/memory]", "required with a share"),
        (
            {"gpuloom.io/sm": "50", "gpuloom.io/memory": "1.5"},
            {},
            "limits[gpuloom.io/memory]",
            "whole number",
        ),
        (
            {"gpuloom.io/sm": "50", "gpuloom.io/memory": "lots"},
            {},
            "limits[gpuloom.io/memory]",
            "quantity",
        ),
        (
            {"gpuloom.io/gpu": "2", "gpuloom.io/sm": "50", "gpuloom.io/memory": "1Gi"},
            {},
            "limits[gpuloom.io/gpu]",
            "a share is of one GPU",
        ),
        ({"gpuloom.io/gpu": "0"}, {}, "limits[gpuloom.io/gpu]", "within 1..64"),
        (
            {"gpuloom.io/mig": "2"},
            {"gpuloom.io/task-key": "resize"},
            "limits[gpuloom.io/mig]",
            "within 1..1, got 2",
        ),
        (
            {"gpuloom.io/mig": "0"},
            {"gpuloom.io/task-key": "resize"},
            "limits[gpuloom.io/mig]",
            "within 1..1, got 0",
        ),
        (
            {"gpuloom.io/mig": "1", "gpuloom.io/sm": "50"},
            {"gpuloom.io/task-key": "resize"},
            "limits[gpuloom.io/sm]",
            "no MPS share or memory",
        ),
        (
            {"gpuloom.io/mig": "1", "gpuloom.io/memory": "4Gi"},
            {"gpuloom.io/task-key": "resize"},
            "limits[gpuloom.io/memory]",
            "no MPS share or memory",
        ),
        (
            {"gpuloom.io/mig": "1", "gpuloom.io/gpu": "2"},
            {"gpuloom.io/task-key": "resize"},
            "limits[gpuloom.io/gpu]",
            "must be 1 with gpuloom.io/mig",
        ),
        (
            {"gpuloom.io/mig": "1"},
            {},
            "metadata.annotations[gpuloom.io/task-key]",
            "required with gpuloom.io/mig",
        ),
        (
            {"gpuloom.io/mig": "1"},
            {"gpuloom.io/task-key": "resize", "gpuloom.io/kind": "inference"},
            "metadata.annotations[gpuloom.io/kind]",
            "a MIG Pod is a batch task",
        ),
        (
            {"gpuloom.io/mig": "1"},
            {"gpuloom.io/task-key": "resize", "gpuloom.io/function": "f"},
            "limits[gpuloom.io/mig]",
            "never in a MIG instance",
        ),
        (
            {"gpuloom.io/mig": "1"},
            {"gpuloom.io/task-key": "resize", "gpuloom.io/shared-model": "m"},
            "metadata.annotations[gpuloom.io/shared-model]",
            "MIG batch task",
        ),
        ({"gpuloom.io/cores": "3"}, {}, "limits[gpuloom.io/cores]", "unknown gpuloom resource"),
        (
            {"gpuloom.io/gpu": "1"},
            {"gpuloom.io/prio": "1"},
            "metadata.annotations[gpuloom.io/prio]",
            "unknown gpuloom annotation",
        ),
        (
            {"gpuloom.io/gpu": "1"},
            {"gpuloom.io/priority": "10"},
            "metadata.annotations[gpuloom.io/priority]",
            "0..9",
        ),
        (
            {"gpuloom.io/gpu": "1"},
            {"gpuloom.io/kind": "serving"},
            "metadata.annotations[gpuloom.io/kind]",
            "inference, training or batch",
        ),
        (
            {"gpuloom.io/gpu": "1"},
            {"gpuloom.io/shared-model": "a b"},
            "metadata.annotations[gpuloom.io/shared-model]",
            "A-Z",
        ),
        (
            {"gpuloom.io/gpu": "1"},
            {"gpuloom.io/policy": "nope"},
            "metadata.annotations[gpuloom.io/policy]",
            "unknown placement policy",
        ),
        (
            {"gpuloom.io/gpu": "1"},
            {"gpuloom.io/checkpoint-signal": "SIGUSR1"},
            "metadata.annotations[gpuloom.io/checkpoint-signal]",
            "only training jobs",
        ),
        (
            {"gpuloom.io/gpu": "1"},
            {"gpuloom.io/kind": "training", "gpuloom.io/checkpoint-signal": "SIGKILL"},
            "metadata.annotations[gpuloom.io/checkpoint-signal]",
            "must be one of",
        ),
        (
            {"gpuloom.io/gpu": "1"},
            {"gpuloom.io/kind": "training", "gpuloom.io/checkpoint-command": "save.sh"},
            "metadata.annotations[gpuloom.io/checkpoint-command]",
            "JSON list",
        ),
        (
            {"gpuloom.io/gpu": "1"},
            {"gpuloom.io/checkpoint-timeout-s": "5"},
            "metadata.annotations[gpuloom.io/checkpoint-timeout-s]",
            "needs a hook",
        ),
        (
            {"gpuloom.io/sm": "50", "gpuloom.io/memory": "1Gi"},
            {"gpuloom.io/function": "f"},
            "limits[gpuloom.io/sm]",
            "auto-scaling chose",
        ),
        (
            {"gpuloom.io/gpu": "1"},
            {"gpuloom.io/gpu-model": "A|"},
            "metadata.annotations[gpuloom.io/gpu-model]",
            "alternatives",
        ),
        (
            {"gpuloom.io/gpu": "1"},
            {"gpuloom.io/mig-size": "3"},
            "metadata.annotations[gpuloom.io/mig-size]",
            "goes with gpuloom.io/mig",
        ),
        (
            {"gpuloom.io/mig": "1"},
            {"gpuloom.io/task-key": "k", "gpuloom.io/mig-size": "big"},
            "metadata.annotations[gpuloom.io/mig-size]",
            "3g.40gb",
        ),
        (
            {"gpuloom.io/mig": "1"},
            {"gpuloom.io/task-key": "k", "gpuloom.io/mig-size": "5g.50gb"},
            "metadata.annotations[gpuloom.io/mig-size]",
            "must be one of 1, 2, 3, 4, 7 slices, got 5",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_pods_field(
    limits: dict, annotations: dict, field: str, says: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        ask_of(pod_model("bad", limits, annotations or None))
    assert caught.value.field.endswith(field), caught.value
    assert says in caught.value.message, caught.value


def test_one_container_asks_and_only_an_app_container() -> None:
    pod = pod_model("two", {"gpuloom.io/gpu": "1"})
    pod.spec.containers.append(
        client.V1Container(
            name="side", resources=client.V1ResourceRequirements(limits={"gpuloom.io/gpu": "1"})
        )
    )
    with pytest.raises(InvalidArgument, match="one container per Pod") as caught:
        ask_of(pod)
    assert caught.value.field == "spec.containers[1].resources"
    init = pod_model("init", {"gpuloom.io/gpu": "1"})
    init.spec.init_containers = [
        client.V1Container(
            name="warm", resources=client.V1ResourceRequirements(limits={"gpuloom.io/gpu": "1"})
        )
    ]
    with pytest.raises(InvalidArgument) as caught:
        ask_of(init)
    assert caught.value.field == "spec.initContainers[0].resources"


def test_quantities_as_the_api_server_writes_them() -> None:
    assert parse_whole("4Gi") == 4 * GIB and parse_whole("1k") == 1000 and parse_whole(40) == 40
    assert parse_whole("1e3") == 1000 and parse_quantity("500m") * 2 == 1
    for bad in ("", "4GiB", "1.5", "--1", True, None, "9" * 80):
        with pytest.raises(ValueError):
            parse_whole(bad)
    with pytest.raises(ValueError, match="NAME=LEVEL"):
        priority_classes_from_text("high=12")
