"""What a Pod asks of gpuloom, read from its spec as the API server holds it (a JSON object),
validated once, with the defaults applied once: the admission webhook, the scheduler
extender and the device plugin all read a Pod through `pod_ask`, so they agree on it.

A Pod asks through one container's resources (`limits`, or `requests` where no limit is set;
Kubernetes makes them equal for extended resources): `gpuloom.io/gpu` (GPUs: N whole GPUs of
one node, or 1 with a share; the device plugin's resource), `gpuloom.io/sm`,
`gpuloom.io/quota`, `gpuloom.io/quota-limit` (an MPS share: SM percent and time quota in
percent, each 100 when not given, the limit the quota), `gpuloom.io/memory` (the GPU memory
cap, required with a share), `gpuloom.io/mig` (1: one MIG instance, a MIG batch task whose
instance size placement chooses from its MIG profile, or the size `gpuloom.io/mig-size` names;
with a task key, of kind batch); and through the Pod's annotations: `gpuloom.io/priority`,
`gpuloom.io/kind`, `gpuloom.io/shared-model`, `gpuloom.io/gpu-model`, `gpuloom.io/task-key`,
`gpuloom.io/policy`, the checkpoint hook (`gpuloom.io/checkpoint-signal`, `-command`,
`-timeout-s`) and `gpuloom.io/function` (a replica of an auto-scaled function). docs/deploy.md
("Asking for a share") has the table with the defaults.

The annotations gpuloom itself writes on a Pod (`WRITTEN_BY_GPULOOM`) are refused from anyone
else. Every refusal is an InvalidArgument naming the Pod's field, e.g.
`spec.containers[0].resources.limits[gpuloom.io/sm]: must be within 1..100, got 120`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.placement import MAX_NAME, JobKind, JobSpec
from gpuloom.domain.shares import DEFAULT_PRIORITY, LOWEST_PRIORITY, share_of
from gpuloom.domain.training import CheckpointHook
from gpuloom.kube.quantity import parse_whole

DOMAIN = "gpuloom.io"
# Extended resources of a container.
GPU = "gpuloom.io/gpu"
SM = "gpuloom.io/sm"
QUOTA = "gpuloom.io/quota"
QUOTA_LIMIT = "gpuloom.io/quota-limit"
MEMORY = "gpuloom.io/memory"
MIG = "gpuloom.io/mig"
# A MIG size: slices, alone or as a profile name's start ("3g.40gb", "1g.10gb+me").
MIG_SIZE_TEXT = re.compile(r"([1-9])(?:g\.[0-9]+gb(?:\+me)?)?")
RESOURCES = (GPU, SM, QUOTA, QUOTA_LIMIT, MEMORY, MIG)
SHARE_RESOURCES = (SM, QUOTA, QUOTA_LIMIT)
# Annotations a Pod's author writes.
PRIORITY = "gpuloom.io/priority"
KIND = "gpuloom.io/kind"
SHARED_MODEL = "gpuloom.io/shared-model"
GPU_MODEL = "gpuloom.io/gpu-model"
TASK_KEY = "gpuloom.io/task-key"
MIG_SIZE = "gpuloom.io/mig-size"
POLICY = "gpuloom.io/policy"
CHECKPOINT_SIGNAL = "gpuloom.io/checkpoint-signal"
CHECKPOINT_COMMAND = "gpuloom.io/checkpoint-command"
CHECKPOINT_TIMEOUT = "gpuloom.io/checkpoint-timeout-s"
FUNCTION = "gpuloom.io/function"
AUTHOR_ANNOTATIONS = (
    PRIORITY,
    KIND,
    SHARED_MODEL,
    GPU_MODEL,
    TASK_KEY,
    MIG_SIZE,
    POLICY,
    CHECKPOINT_SIGNAL,
    CHECKPOINT_COMMAND,
    CHECKPOINT_TIMEOUT,
    FUNCTION,
)
# Annotations only gpuloom writes: the job bound to the Pod (by the extender, at Bind), the
# job placement placed while the Pod waited (the controller, to have it tried again), and
# when the device plugin handed the Pod its assignment.
JOB = "gpuloom.io/job"
BOUND_AT = "gpuloom.io/bound-at"
PLACED = "gpuloom.io/placed"
ALLOCATED = "gpuloom.io/allocated"
WRITTEN_BY_GPULOOM = (JOB, BOUND_AT, PLACED, ALLOCATED)
# The label the webhook puts on every gpuloom Pod (for selectors: NetworkPolicies, metrics).
MANAGED_LABEL = "gpuloom.io/managed"
# A PriorityClass named gpuloom-priority-N gives level N (the chart ships ten of them).
PRIORITY_CLASS = re.compile(r"gpuloom-priority-([0-9])")
FUNCTION_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_POD_NAME = 253


@dataclass(frozen=True, slots=True)
class PodAsk:
    """What a Pod asks of gpuloom: the job spec placement is asked for (name `ns/pod`), the
    container that asks (the one the device plugin gives the assignment to) and the number of
    `gpuloom.io/gpu` devices it asks of its node. A replica of an auto-scaled function
    (`function` set) takes the share of the replica it is bound to instead of asking one."""

    namespace: str
    name: str
    uid: str
    container: str
    container_index: int
    gpus: int
    spec: JobSpec
    function: str = ""

    @property
    def pod(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def mig(self) -> bool:
        """Whether the Pod asks for a MIG instance (a MIG batch task in placement's terms)."""
        return self.spec.is_mig_batch


def asks_gpuloom(pod: Mapping[str, Any]) -> bool:
    """Whether the Pod asks anything of gpuloom: a gpuloom.io resource in any container, or
    an annotation of the gpuloom.io domain."""
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    if isinstance(spec, Mapping):
        for group in ("initContainers", "containers", "ephemeralContainers"):
            containers = spec.get(group)
            if isinstance(containers, list) and any(map(_gpuloom_resources, containers)):
                return True
    metadata = pod.get("metadata") if isinstance(pod, Mapping) else None
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    return isinstance(annotations, Mapping) and any(
        isinstance(key, str) and _ours(key) for key in annotations
    )


def pod_ask(
    pod: Mapping[str, Any],
    policies: Collection[str],
    priority_classes: Mapping[str, int] | None = None,
) -> PodAsk:
    """The Pod's ask, validated; InvalidArgument naming the Pod's field otherwise.
    `policies` are placement's policy names; `priority_classes` maps further PriorityClass
    names to levels (besides gpuloom-priority-N)."""
    metadata = _object(pod.get("metadata"), "metadata")
    spec = _object(pod.get("spec"), "spec")
    annotations = _strings(metadata.get("annotations"), "metadata.annotations")
    namespace = metadata.get("namespace") or "default"
    name = metadata.get("name") or metadata.get("generateName") or ""
    if not isinstance(namespace, str) or not isinstance(name, str):
        raise InvalidArgument("metadata.name", "the Pod's name and namespace must be strings")
    for key in annotations:
        if _ours(key) and key not in AUTHOR_ANNOTATIONS and key not in WRITTEN_BY_GPULOOM:
            raise InvalidArgument(
                _annotation(key),
                f"unknown gpuloom annotation; known: {', '.join(AUTHOR_ANNOTATIONS)}",
            )
    index, container, limits = _asking_container(spec)
    where = f"spec.containers[{index}].resources"
    gpus = _whole(limits, GPU, where, 1, 64) if GPU in limits else 1
    mig = MIG in limits
    if mig:
        _check_mig(limits, where, annotations, spec)
    elif MIG_SIZE in annotations:
        raise InvalidArgument(_annotation(MIG_SIZE), f"a MIG size goes with {MIG}: 1")
    function = annotations.get(FUNCTION, "")
    if function and not FUNCTION_NAME.fullmatch(function):
        raise InvalidArgument(_annotation(FUNCTION), "must be 1..128 of A-Z a-z 0-9 . _ : -")
    shared = any(key in limits for key in SHARE_RESOURCES)
    if function and shared:
        raise InvalidArgument(
            _resource(where, next(k for k in SHARE_RESOURCES if k in limits)),
            f"a replica of function {function!r} runs at the share auto-scaling chose for it: "
            "ask for no SM percent or quota",
        )
    memory = _whole(limits, MEMORY, where, 1, 1 << 50) if MEMORY in limits else 0
    if (shared or function) and gpus != 1:
        raise InvalidArgument(
            _resource(where, GPU),
            f"a share is of one GPU: must be 1 with an SM percent, a quota or a function, got "
            f"{gpus}",
        )
    priority = _priority(annotations, spec, priority_classes or {})
    if mig:
        share = share_of(priority=priority)
    elif shared:
        sm = _whole(limits, SM, where, 1, 100) if SM in limits else None
        quota = _whole(limits, QUOTA, where, 1, 100) if QUOTA in limits else None
        limit = _whole(limits, QUOTA_LIMIT, where, 1, 100) if QUOTA_LIMIT in limits else None
        share = share_of(
            sm,
            None if quota is None else float(quota),
            None if limit is None else float(limit),
            memory,
            priority,
        )
        if share.quota.request_percent > share.quota.limit_percent:
            raise InvalidArgument(
                _resource(where, QUOTA),
                f"the quota ({share.quota.request_percent:g}) must not exceed {QUOTA_LIMIT} "
                f"({share.quota.limit_percent:g})",
            )
        if not memory:
            raise InvalidArgument(
                _resource(where, MEMORY), "required with a share (the GPU memory cap, e.g. 4Gi)"
            )
    else:
        share = share_of(memory_bytes=memory, priority=priority)
    job = JobSpec(
        name=f"{namespace}/{name}"[:MAX_NAME] or "pod",
        kind=_kind(annotations, spec),
        share=share,
        mps=shared,
        whole_gpus=0 if shared or mig else gpus,
        mig_slices=1 if mig else 0,
        mig_size=_mig_size(annotations) if mig else 0,
        command=_container_command(container, index) if mig else (),
        task_key=annotations.get(TASK_KEY, function),
        policy=annotations.get(POLICY, ""),
        gpu_model=annotations.get(GPU_MODEL, ""),
        shared_model=annotations.get(SHARED_MODEL, ""),
        checkpoint=_checkpoint(annotations),
    )
    fields = {
        "spec.resources.mps": _resource(where, SM),
        "spec.resources.mps.sm_percent": _resource(where, SM),
        "spec.resources.mps.quota.request_percent": _resource(where, QUOTA),
        "spec.resources.mps.quota.limit_percent": _resource(where, QUOTA_LIMIT),
        "spec.resources.memory_bytes": _resource(where, MEMORY),
        "spec.resources.whole_gpus": _resource(where, GPU),
        "spec.resources": f"{where}.limits",
        "spec.priority.level": _annotation(PRIORITY),
        "spec.kind": _annotation(KIND),
        "spec.task_key": _annotation(TASK_KEY),
        "spec.resources.mig.slices": _annotation(MIG_SIZE),
        "spec.policy": _annotation(POLICY),
        "spec.gpu_model": _annotation(GPU_MODEL),
        "spec.shared_model": _annotation(SHARED_MODEL),
        "spec.checkpoint": _annotation(CHECKPOINT_SIGNAL),
        "spec.checkpoint.signal": _annotation(CHECKPOINT_SIGNAL),
        "spec.checkpoint.timeout_s": _annotation(CHECKPOINT_TIMEOUT),
        "spec.checkpoint.command": _annotation(CHECKPOINT_COMMAND),
        "spec.name": "metadata.name",
        "spec.command": f"spec.containers[{index}].command",
    }
    try:
        job.validate(policies)
    except InvalidArgument as error:
        field = fields.get(error.field)
        if field is None and error.field.startswith("spec.checkpoint.command["):
            field = _annotation(CHECKPOINT_COMMAND)
        if field is None and error.field.startswith("spec.command["):
            field = f"spec.containers[{index}].command"
        problem = error.message.split(": ", 1)[1]
        raise InvalidArgument(field or error.field, problem) from None
    return PodAsk(
        namespace=namespace,
        name=name,
        uid=str(metadata.get("uid") or ""),
        container=str(container.get("name") or ""),
        container_index=index,
        gpus=gpus,
        spec=job,
        function=function,
    )


def priority_classes_from_text(text: str) -> dict[str, int]:
    """`name=level,name=level` (a setting) as a mapping; ValueError saying what is wrong."""
    table: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, level = item.partition("=")
        if not name or not level.strip().isdigit() or int(level) > LOWEST_PRIORITY:
            raise ValueError(
                f"{item!r}: each entry is NAME=LEVEL with a level 0..{LOWEST_PRIORITY}"
            )
        table[name.strip()] = int(level)
    return table


# ---- inside ----


def _ours(key: str) -> bool:
    return key.split("/", 1)[0] == DOMAIN and "/" in key


def _resource(where: str, name: str) -> str:
    return f"{where}.limits[{name}]"


def _annotation(name: str) -> str:
    return f"metadata.annotations[{name}]"


def _object(value: object, field: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgument(field, "must be an object")
    return value


def _strings(value: object, field: str) -> dict[str, str]:
    mapping = _object(value, field)
    for key, item in mapping.items():
        if not isinstance(item, str):
            raise InvalidArgument(f"{field}[{key}]", "must be a string")
    return dict(mapping)


def _gpuloom_resources(container: Mapping[str, Any]) -> dict[str, Any]:
    """The container's gpuloom.io resources: its limits, else its requests."""
    if not isinstance(container, Mapping):
        return {}
    resources = container.get("resources") or {}
    if not isinstance(resources, Mapping):
        return {}
    found: dict[str, Any] = {}
    for part in ("requests", "limits"):  # limits win
        values = resources.get(part) or {}
        if isinstance(values, Mapping):
            found.update({k: v for k, v in values.items() if isinstance(k, str) and _ours(k)})
    return found


def _asking_container(spec: Mapping[str, Any]) -> tuple[int, Mapping[str, Any], dict[str, Any]]:
    """The one app container that asks for gpuloom resources (a job is one process tree
    under one token); refusals for init containers and for several asking containers."""
    for group in ("initContainers", "ephemeralContainers"):
        for i, container in enumerate(_containers(spec, group)):
            if _gpuloom_resources(container):
                raise InvalidArgument(
                    f"spec.{group}[{i}].resources",
                    "only an app container (spec.containers) may ask for gpuloom resources",
                )
    containers = _containers(spec, "containers")
    asking = [(i, c, _gpuloom_resources(c)) for i, c in enumerate(containers)]
    asking = [entry for entry in asking if entry[2]]
    if len(asking) > 1:
        raise InvalidArgument(
            f"spec.containers[{asking[1][0]}].resources",
            f"one container per Pod may ask for gpuloom resources (container "
            f"{asking[0][1].get('name')!r} already does): an assignment's token serves one "
            "process tree",
        )
    if not asking:
        if not containers:
            raise InvalidArgument("spec.containers", "the Pod has no container")
        # Only annotations: the first container asks for one GPU (a function replica's share).
        _check_resources(containers[0], "spec.containers[0].resources")
        return 0, containers[0], {}
    index, container, limits = asking[0]
    _check_resources(container, f"spec.containers[{index}].resources")
    for key in limits:
        if key not in RESOURCES:
            raise InvalidArgument(
                _resource(f"spec.containers[{index}].resources", key),
                f"unknown gpuloom resource; known: {', '.join(RESOURCES)}",
            )
    return index, container, limits


def _check_mig(
    limits: Mapping[str, Any],
    where: str,
    annotations: Mapping[str, str],
    spec: Mapping[str, Any],
) -> None:
    """A MIG ask: `gpuloom.io/mig: 1` (one instance, whose size placement's batch planner
    chooses from the task's MIG profile), alone of the resources, a batch task with a task
    key. Each refusal names the field."""
    _whole(limits, MIG, where, 1, 1)
    for key in (*SHARE_RESOURCES, MEMORY):
        if key in limits:
            raise InvalidArgument(
                _resource(where, key),
                f"a MIG instance brings its own SMs and memory: ask for no MPS share or memory "
                f"with {MIG}",
            )
    if GPU in limits and _whole(limits, GPU, where, 1, 64) != 1:
        raise InvalidArgument(_resource(where, GPU), f"must be 1 with {MIG} (one instance)")
    if FUNCTION in annotations:
        raise InvalidArgument(
            _resource(where, MIG),
            f"a replica of an auto-scaled function ({FUNCTION}) runs at the share auto-scaling "
            "chose for it, never in a MIG instance",
        )
    if _kind(annotations, spec) is not JobKind.BATCH:
        field = _annotation(KIND) if KIND in annotations else "spec.restartPolicy"
        raise InvalidArgument(
            field,
            f"a MIG Pod is a batch task: restartPolicy Never or OnFailure, or {KIND}: batch",
        )
    if not annotations.get(TASK_KEY):
        raise InvalidArgument(
            _annotation(TASK_KEY),
            f"required with {MIG}: the MIG profile of this task key (`gpuloom profile put "
            "mig`) gives the task's time on each instance size, from which placement chooses it",
        )


def _mig_size(annotations: Mapping[str, str]) -> int:
    """The instance size `gpuloom.io/mig-size` asks for, in compute slices: a number ("3") or
    a MIG profile name ("3g.40gb": its slices before the "g"); 0 when not given (placement's
    planner chooses). Placement checks the number (1, 2, 3, 4 or 7)."""
    text = annotations.get(MIG_SIZE)
    if text is None:
        return 0
    found = MIG_SIZE_TEXT.fullmatch(text.strip())
    if found is None:
        raise InvalidArgument(
            _annotation(MIG_SIZE),
            f"must be compute slices (1, 2, 3, 4 or 7) or a MIG profile name such as 3g.40gb, "
            f"got {text[:64]!r}",
        )
    return int(found.group(1))


def _container_command(container: Mapping[str, Any], index: int) -> tuple[str, ...]:
    """What a MIG Pod's job records as its command (the kubelet starts the container; placement
    only keeps it): the container's command, or its image where it runs the image's
    entrypoint, then its args."""
    parts: dict[str, list[str]] = {}
    for part in ("command", "args"):
        values = container.get(part) or []
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise InvalidArgument(f"spec.containers[{index}].{part}", "must be a list of strings")
        parts[part] = values
    if parts["command"]:
        return (*parts["command"], *parts["args"])
    image = container.get("image")
    if not isinstance(image, str) or not image:
        raise InvalidArgument(f"spec.containers[{index}].image", "required")
    return (image, *parts["args"])


def _check_resources(container: Mapping[str, Any], where: str) -> None:
    """The asking container's resources, limits and requests are objects (the admission
    patch adds to them)."""
    resources = container.get("resources")
    if resources is None:
        return
    if not isinstance(resources, Mapping):
        raise InvalidArgument(where, "must be an object")
    for part in ("limits", "requests"):
        if resources.get(part) is not None and not isinstance(resources[part], Mapping):
            raise InvalidArgument(f"{where}.{part}", "must be an object")


def _containers(spec: Mapping[str, Any], group: str) -> list[Mapping[str, Any]]:
    containers = spec.get(group) or []
    if not isinstance(containers, list):
        raise InvalidArgument(f"spec.{group}", "must be a list")
    for i, container in enumerate(containers):
        if not isinstance(container, Mapping):
            raise InvalidArgument(f"spec.{group}[{i}]", "must be an object")
    return containers


def _whole(limits: Mapping[str, Any], key: str, where: str, least: int, most: int) -> int:
    field = _resource(where, key)
    try:
        value = parse_whole(limits[key])
    except ValueError as error:
        raise InvalidArgument(field, str(error)) from None
    if not least <= value <= most:
        raise InvalidArgument(field, f"must be within {least}..{most}, got {value}")
    return value


def _kind(annotations: Mapping[str, str], spec: Mapping[str, Any]) -> JobKind:
    text = annotations.get(KIND)
    if text is None:
        restart = spec.get("restartPolicy") or "Always"
        return JobKind.INFERENCE if restart == "Always" else JobKind.BATCH
    try:
        return JobKind(text)
    except ValueError:
        raise InvalidArgument(
            _annotation(KIND), f"must be inference, training or batch, got {text[:40]!r}"
        ) from None


def _priority(
    annotations: Mapping[str, str], spec: Mapping[str, Any], classes: Mapping[str, int]
) -> int:
    text = annotations.get(PRIORITY)
    if text is not None:
        if not text.strip().isdigit() or int(text) > LOWEST_PRIORITY:
            raise InvalidArgument(
                _annotation(PRIORITY),
                f"must be 0..{LOWEST_PRIORITY} (0 is highest), got {text[:40]!r}",
            )
        return int(text)
    name = spec.get("priorityClassName") or ""
    match = PRIORITY_CLASS.fullmatch(name) if isinstance(name, str) else None
    if match:
        return int(match[1])
    return classes.get(name, DEFAULT_PRIORITY) if isinstance(name, str) else DEFAULT_PRIORITY


def _checkpoint(annotations: Mapping[str, str]) -> CheckpointHook | None:
    signal = annotations.get(CHECKPOINT_SIGNAL, "")
    command_text = annotations.get(CHECKPOINT_COMMAND)
    timeout_text = annotations.get(CHECKPOINT_TIMEOUT)
    if not signal and command_text is None:
        if timeout_text is not None:
            raise InvalidArgument(
                _annotation(CHECKPOINT_TIMEOUT),
                f"needs a hook: {CHECKPOINT_SIGNAL} or {CHECKPOINT_COMMAND}",
            )
        return None
    command: tuple[str, ...] = ()
    if command_text is not None:
        try:
            parsed = json.loads(command_text)
        except ValueError:
            parsed = None
        if not isinstance(parsed, list) or not all(isinstance(a, str) for a in parsed):
            raise InvalidArgument(
                _annotation(CHECKPOINT_COMMAND),
                'must be a JSON list of strings, e.g. ["python", "save.py"]',
            )
        command = tuple(parsed)
    timeout_s = 0.0
    if timeout_text is not None:
        try:
            timeout_s = float(timeout_text)
        except ValueError:
            raise InvalidArgument(
                _annotation(CHECKPOINT_TIMEOUT), f"must be seconds, got {timeout_text[:40]!r}"
            ) from None
    return CheckpointHook(command=command, signal=signal, timeout_s=timeout_s)
