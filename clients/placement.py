"""A synchronous client for gpuloom.v1.Placement, and the job file format.

The client returns domain dataclasses (`JobView` with its `Assignment`, `GpuEntry`,
`FunctionScaling` of gpuloom.domain.placement; the job spec and states of the placement domain)
and raises the domain errors of gpuloom/domain/errors.py with the server's message (NotFound,
InvalidArgument with `.field`, FailedPrecondition, Unavailable when the service cannot be
reached, ...), so callers never look at protobuf messages or gRPC status codes.
gpuloom.convert.placement does the converting.

A job file (YAML or JSON) holds one job spec; `spec_from_document` turns its content into a
`placement_pb2.JobSpec`, naming the file and the key of anything malformed. docs/jobs.md has the
format.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import yaml

from gpuloom.clients.blocking import BlockingClient
from gpuloom.convert import placement as convert
from gpuloom.convert.placement import share_into_pb
from gpuloom.convert.status import error_from_rpc
from gpuloom.domain.errors import DomainError, FailedPrecondition
from gpuloom.domain.placement import (
    FunctionScaling,
    GpuEntry,
    JobSpec,
    JobState,
    JobView,
)
from gpuloom.domain.shares import LOWEST_PRIORITY, MIG_SLICE_SIZES, share_of
from gpuloom.v1 import placement_pb2 as pb
from gpuloom.v1 import placement_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "localhost:50051"
ADDRESS_ENV = "GPULOOM_PLACEMENT_ADDRESS"
GIB = 1 << 30

KINDS = {
    "inference": pb.JOB_KIND_INFERENCE,
    "training": pb.JOB_KIND_TRAINING,
    "batch": pb.JOB_KIND_BATCH,
}
# A spec to submit: the domain's, a message, or a job document as a job file holds it.
SpecLike = JobSpec | pb.JobSpec | Mapping[str, Any]


def default_address() -> str:
    return os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS)


class JobNotAssigned(FailedPrecondition):
    """The job finished (failed, cancelled, lost, ...) instead of being assigned."""

    def __init__(self, job: JobView) -> None:
        detail = f": {job.message}" if job.message else ""
        super().__init__(f"job {job.job_id} ended {job.state.value}{detail}")
        self.job = job


class WaitTimedOut(DomainError):
    """The job was not assigned within the time allowed; `job` is how it was last seen."""

    def __init__(self, job: JobView, timeout_s: float) -> None:
        reason = f" ({job.pending_reason})" if job.pending_reason else ""
        super().__init__(
            f"job {job.job_id} was not assigned within {timeout_s:g} s: still "
            f"{job.state.value}{reason}"
        )
        self.job = job


class PlacementClient(BlockingClient):
    """Blocking calls to the placement service at `address` (default: GPULOOM_PLACEMENT_ADDRESS,
    else localhost:50051). Use as a context manager, or call close()."""

    def __init__(self, address: str | None = None, timeout_s: float = 30.0) -> None:
        super().__init__(address or default_address(), pb_grpc.PlacementStub, timeout_s)

    # ---- jobs ----

    def submit(self, spec: SpecLike, request_id: str | None = None) -> JobView:
        """Submit a job: a JobSpec, or a job document as a job file holds it (whose
        `request_id`, if any, is used when `request_id` is not given). Without a request id a
        fresh one is made, so every call is a new job. Answers once the job is assigned or left
        pending (see `pending_reason`)."""
        if isinstance(spec, Mapping):
            document = spec
            spec = spec_from_document(document, "spec")
            if request_id is None:
                request_id = document.get("request_id")
        request = pb.SubmitJobRequest(
            request_id=request_id or uuid.uuid4().hex, spec=_spec_message(spec)
        )
        return convert.job_from_pb(self._call("SubmitJob", request))

    def get(self, job_id: str) -> JobView:
        return convert.job_from_pb(self._call("GetJob", pb.GetJobRequest(job_id=job_id)))

    def list(
        self,
        states: Iterable[JobState | str] = (),
        task_key: str = "",
        function: str = "",
        gpu_uuid: str = "",
        limit: int | None = None,
        page_size: int = 100,
    ) -> Iterator[JobView]:
        """Every matching job (at most `limit`), fetching pages as the iteration goes. States are
        JobStates or their names ('pending', 'assigned', ...)."""
        codes = [convert.STATE_TO_PB[_state(s)] for s in states]
        if limit is not None:
            page_size = max(1, min(page_size, limit))
        token, seen = "", 0
        while True:
            response = self._call(
                "ListJobs",
                pb.ListJobsRequest(
                    states=codes,
                    task_key=task_key,
                    function=function,
                    gpu_uuid=gpu_uuid,
                    page_size=page_size,
                    page_token=token,
                ),
            )
            for job in response.jobs:
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield convert.job_from_pb(job)
            token = response.next_page_token
            if not token or (limit is not None and seen >= limit):
                return

    def cancel(self, job_id: str, reason: str = "") -> JobView:
        request = pb.CancelJobRequest(job_id=job_id, reason=reason)
        return convert.job_from_pb(self._call("CancelJob", request))

    def report_done(
        self, job_id: str, succeeded: bool, exit_code: int, message: str = ""
    ) -> JobView:
        """Tell placement that an assigned job's process ended; its capacity is released."""
        request = pb.ReportJobDoneRequest(
            job_id=job_id, succeeded=succeeded, exit_code=exit_code, message=message
        )
        return convert.job_from_pb(self._call("ReportJobDone", request))

    def report_checkpoint(
        self, job_id: str, migration_id: str, succeeded: bool, message: str = ""
    ) -> JobView:
        """Tell placement how the checkpoint hook of a migration went (ReportCheckpoint): the
        answer carries the job's new assignment (with its token) when it succeeded."""
        request = pb.ReportCheckpointRequest(
            job_id=job_id, migration_id=migration_id, succeeded=succeeded, message=message
        )
        return convert.job_from_pb(self._call("ReportCheckpoint", request))

    def watch(self, job_id: str, timeout_s: float | None = None) -> Iterator[JobView]:
        """The job now, then every change, until it finishes. Closing the iterator early hangs
        up. With `timeout_s`, the whole stream is bounded (it ends with Unavailable)."""
        call = self._stub.WatchJob(pb.WatchJobRequest(job_id=job_id), timeout=timeout_s)
        try:
            for job in call:
                yield convert.job_from_pb(job)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None
        finally:
            call.cancel()

    def wait_assigned(
        self,
        job_id: str,
        timeout_s: float | None = None,
        on_update: Callable[[JobView], None] | None = None,
    ) -> JobView:
        """Follow the job until it is ASSIGNED and return it (read by GetJob, so with its
        token); a MIG batch task, until its batch hands it its instance (its runner must start
        it then, and following it is what tells placement a runner waits). Raises
        JobNotAssigned if it finishes instead (failed, cancelled, lost, ...) and WaitTimedOut
        after `timeout_s` (None: no limit). `on_update` sees every revision on the way."""
        last: JobView | None = None
        call = self._stub.WatchJob(pb.WatchJobRequest(job_id=job_id), timeout=timeout_s)
        try:
            for message in call:
                job = last = convert.job_from_pb(message)
                if on_update is not None:
                    on_update(job)
                if job.state is JobState.ASSIGNED and _startable(job):
                    # Watch answers never carry the assignment token; GetJob does.
                    job = self.get(job_id)
                    if job.state is JobState.ASSIGNED:
                        return job
                if job.state.finished:
                    raise JobNotAssigned(job)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s is not None:  # type: ignore[attr-defined]
                raise WaitTimedOut(last or self.get(job_id), timeout_s) from None
            raise error_from_rpc(error) from None
        finally:
            call.cancel()
        # The stream ended without an ASSIGNED or finished job (the server went away).
        raise FailedPrecondition(f"the watch of job {job_id} ended before it was assigned")

    def set_function_load(
        self, function: str, requests_per_s: float, template: SpecLike
    ) -> FunctionScaling:
        """Auto-scaling: the request rate `function` must serve; `template` is the replicas'
        spec (a JobSpec or a job document; its MPS share is chosen by the scaler)."""
        if isinstance(template, Mapping):
            template = spec_from_document(template, "template", require_resources=False)
        request = pb.SetFunctionLoadRequest(
            function=function, requests_per_s=requests_per_s, template=_spec_message(template)
        )
        return convert.scaling_from_pb(self._call("SetFunctionLoad", request))

    # ---- inventory ----

    def gpus(self, node: str = "", page_size: int = 1000) -> Iterator[GpuEntry]:
        """Every registered GPU (of `node`, if given), over all pages."""
        token = ""
        while True:
            response = self._call(
                "ListGpus", pb.ListGpusRequest(node=node, page_size=page_size, page_token=token)
            )
            for entry in response.gpus:
                yield convert.gpu_entry_from_pb(entry)
            token = response.next_page_token
            if not token:
                return


def _spec_message(spec: JobSpec | pb.JobSpec) -> pb.JobSpec:
    return spec if isinstance(spec, pb.JobSpec) else convert.spec_to_pb(spec)


def _state(state: JobState | str) -> JobState:
    if isinstance(state, JobState):
        return state
    try:
        return JobState(state.lower())
    except ValueError:
        known = ", ".join(s.value for s in JobState)
        raise ValueError(f"unknown job state {state!r}; known: {known}") from None


# ---- job files ----


class JobFileError(ValueError):
    """A job file that cannot be read or makes no sense: names the file and, where there is
    one, the key."""

    def __init__(self, source: str, key: str | None, problem: str) -> None:
        where = f"{source}: key {key!r}: " if key else f"{source}: "
        super().__init__(where + problem)
        self.source = source
        self.key = key
        self.problem = problem


def load_job_file(path: str | Path) -> dict[str, Any]:
    """The document in a job file: JSON for *.json, YAML otherwise. Raises JobFileError when the
    file cannot be read or parsed, or does not hold a mapping."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise JobFileError(source, None, f"cannot read it: {error}") from None
    try:
        is_json = path.suffix.lower() == ".json"
        document = json.loads(text) if is_json else yaml.safe_load(text)
    except json.JSONDecodeError as error:
        raise JobFileError(source, None, f"not valid JSON: {error}") from None
    except yaml.YAMLError as error:
        raise JobFileError(source, None, f"not valid YAML: {error}") from None
    if not isinstance(document, dict):
        raise JobFileError(
            source,
            None,
            "must hold a mapping of keys (name, kind, resources, ...), got "
            + ("an empty document" if document is None else type(document).__name__),
        )
    return document


_TOP_KEYS = (
    "name",
    "kind",
    "task_key",
    "priority",
    "policy",
    "gpu_model",
    "shared_model",
    "gpu_spec",
    "resources",
    "slo",
    "request_id",
    "command",
    "checkpoint",
)
_CHECKPOINT_KEYS = ("command", "signal", "timeout_s")
_RESOURCE_KEYS = (
    "memory_gib",
    "memory_bytes",
    "mps",
    "whole_gpus",
    "max_gpus",
    "mig",
    "cpu_milli",
    "host_memory_gib",
)
_MPS_KEYS = ("sm_percent", "quota_request_percent", "quota_limit_percent")
_SLO_KEYS = ("p99_latency_ms", "target_requests_per_s")


class _Reader:
    """Typed access to one mapping of a job document, naming `source` and the dotted key."""

    def __init__(self, source: str, mapping: Mapping[str, Any], prefix: str = "") -> None:
        self.source, self.mapping, self.prefix = source, mapping, prefix

    def fail(self, key: str | None, problem: str) -> JobFileError:
        return JobFileError(self.source, self.path(key) if key else self.prefix or None, problem)

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def only(self, allowed: tuple[str, ...]) -> None:
        unknown = [str(k) for k in self.mapping if k not in allowed]
        if unknown:
            names = ", ".join(repr(self.path(k)) for k in unknown)
            raise JobFileError(
                self.source,
                self.path(unknown[0]),
                f"unknown key{'s' if len(unknown) > 1 else ''} {names}; allowed here: "
                + ", ".join(allowed),
            )

    def text(self, key: str, required: bool = False) -> str:
        value = self.mapping.get(key)
        if value is None:
            if required:
                raise self.fail(key, "required")
            return ""
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, got {value!r}")
        return value

    def integer(self, key: str) -> int | None:
        value = self.mapping.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be a whole number, got {value!r}")
        return value

    def number(self, key: str) -> float | None:
        value = self.mapping.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"must be a number, got {value!r}")
        if not math.isfinite(value):
            raise self.fail(key, f"must be finite, got {value!r}")
        return float(value)

    def section(self, key: str) -> _Reader | None:
        value = self.mapping.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fail(key, f"must be a mapping, got {type(value).__name__}")
        return _Reader(self.source, value, self.path(key))


def spec_from_document(
    doc: Mapping[str, Any], source: str, require_resources: bool = True
) -> pb.JobSpec:
    """A JobSpec from a job document (the content of a job file). Checks the shape and types
    here, naming `source` and the key (JobFileError); value ranges other than the priority are
    the service's to check (its InvalidArgument names the spec field)."""
    if not isinstance(doc, Mapping):
        raise JobFileError(source, None, f"must hold a mapping of keys, got {type(doc).__name__}")
    top = _Reader(source, doc)
    top.only(_TOP_KEYS)
    spec = pb.JobSpec(name=top.text("name", required=True))
    kind = top.text("kind", required=True)
    if kind not in KINDS:
        raise top.fail("kind", f"must be one of {', '.join(KINDS)}, got {kind!r}")
    spec.kind = KINDS[kind]
    spec.task_key = top.text("task_key")
    spec.policy = top.text("policy")
    spec.gpu_model = top.text("gpu_model")
    spec.shared_model = top.text("shared_model")
    gpu_spec = top.text("gpu_spec")  # the trace's name for it: "V100M16|V100M32"
    if gpu_spec:
        if spec.gpu_model:
            raise top.fail("gpu_spec", "give gpu_model or gpu_spec, not both")
        spec.gpu_model = gpu_spec
    top.text("request_id")  # a string if given; the caller sends it with the spec
    priority = top.integer("priority")
    if priority is not None and not 0 <= priority <= LOWEST_PRIORITY:
        raise top.fail(
            "priority", f"must be within 0..{LOWEST_PRIORITY} (0 is highest), got {priority}"
        )
    _resources_into(spec, top.section("resources"), top, require_resources, priority)
    command = top.mapping.get("command")
    if command is not None:
        if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
            raise top.fail("command", f"must be a list of strings, got {command!r}")
        spec.command.extend(command)
    checkpoint = top.section("checkpoint")
    if checkpoint is not None:
        checkpoint.only(_CHECKPOINT_KEYS)
        hook = checkpoint.mapping.get("command")
        if hook is not None and (
            not isinstance(hook, list) or not all(isinstance(a, str) for a in hook)
        ):
            raise checkpoint.fail("command", f"must be a list of strings, got {hook!r}")
        spec.checkpoint.SetInParent()
        spec.checkpoint.command.extend(hook or ())
        spec.checkpoint.signal = checkpoint.text("signal")
        spec.checkpoint.timeout_s = checkpoint.number("timeout_s") or 0.0
    slo = top.section("slo")
    if slo is not None:
        slo.only(_SLO_KEYS)
        spec.slo.p99_latency_ms = slo.number("p99_latency_ms") or 0.0
        spec.slo.target_requests_per_s = slo.number("target_requests_per_s") or 0.0
    return spec


def _resources_into(
    spec: pb.JobSpec,
    resources: _Reader | None,
    top: _Reader,
    required: bool,
    priority: int | None,
) -> None:
    """The document's resources and priority into `spec`: its share made by share_of, where
    the defaults are (an MPS share's quota limit, the priority)."""
    if resources is None:
        if required:
            raise top.fail("resources", "required: memory_gib plus mps, or whole_gpus: 1")
        share_into_pb(spec, share_of(priority=priority), mps=False)
        return
    resources.only(_RESOURCE_KEYS)
    gib = resources.number("memory_gib")
    memory_bytes = resources.integer("memory_bytes")
    if gib is not None and memory_bytes is not None:
        raise resources.fail("memory_gib", "give memory_gib or memory_bytes, not both")
    if gib is not None:
        if not 0 <= gib < 1 << 33:
            raise resources.fail("memory_gib", f"must be >= 0 (and sane), got {gib:g}")
        memory_bytes = round(gib * GIB)
    elif memory_bytes is not None and not 0 <= memory_bytes < 1 << 64:
        raise resources.fail("memory_bytes", f"must be >= 0, got {memory_bytes}")
    cpu_milli = resources.integer("cpu_milli")
    if cpu_milli is not None:
        if not 0 <= cpu_milli < 1 << 64:
            raise resources.fail("cpu_milli", f"must be >= 0, got {cpu_milli}")
        spec.cpu_milli = cpu_milli
    host_gib = resources.number("host_memory_gib")
    if host_gib is not None:
        if not 0 <= host_gib < 1 << 33:
            raise resources.fail("host_memory_gib", f"must be >= 0 (and sane), got {host_gib:g}")
        spec.host_memory_bytes = round(host_gib * GIB)
    mps = resources.section("mps")
    whole = resources.integer("whole_gpus")
    mig = resources.mapping.get("mig")
    if sum(x is not None for x in (mps, whole, mig)) > 1:
        raise resources.fail("mps", "give one of mps, whole_gpus and mig")
    max_gpus = resources.integer("max_gpus")
    if max_gpus is not None:
        if whole is None:
            raise resources.fail(
                "max_gpus", "an elastic range needs whole_gpus (its smallest GPU count)"
            )
        if not 0 <= max_gpus < 1 << 32:  # what the message can carry; the service checks more
            raise resources.fail("max_gpus", f"must be within whole_gpus..64, got {max_gpus}")
        spec.max_gpus = max_gpus
    memory = memory_bytes or 0
    if mig is not None:
        # A MIG batch task: true lets the batch planner choose the instance size; a number of
        # compute slices asks for that size.
        if mig is not True and (isinstance(mig, bool) or mig not in MIG_SLICE_SIZES):
            sizes = ", ".join(map(str, MIG_SLICE_SIZES))
            raise resources.fail(
                "mig", f"must be true (the planner sizes it) or one of {sizes}, got {mig!r}"
            )
        spec.resources.mig.SetInParent()
        if mig is not True:
            spec.resources.mig.slices = mig
    elif whole is not None:
        if not 0 <= whole < 1 << 32:
            raise resources.fail("whole_gpus", f"must be within 1..64, got {whole}")
        spec.resources.whole_gpus = whole
    elif mps is not None:
        mps.only(_MPS_KEYS)
        sm = mps.integer("sm_percent")
        request = mps.number("quota_request_percent")
        if sm is None:
            raise mps.fail("sm_percent", "required (1..100)")
        if request is None:
            raise mps.fail("quota_request_percent", "required (percent of the time window)")
        if not 0 <= sm < 1 << 32:  # what the message can carry; the service checks 1..100
            raise mps.fail("sm_percent", f"must be within 1..100, got {sm}")
        limit = mps.number("quota_limit_percent") or None  # 0, like unset: the request
        share_into_pb(spec, share_of(sm, request, limit, memory, priority), mps=True)
        return
    elif required:
        raise resources.fail(
            None, "set one of mps (sm_percent and quota), whole_gpus: 1 or mig: true"
        )
    share_into_pb(spec, share_of(memory_bytes=memory, priority=priority), mps=False)


# Spec fields in the service's InvalidArgument -> the key of a job file that sets them.
_FILE_KEYS = {
    "spec.resources.mps.quota.request_percent": "resources.mps.quota_request_percent",
    "spec.resources.mps.quota.limit_percent": "resources.mps.quota_limit_percent",
    "spec.resources.memory_bytes": "resources.memory_gib",
    "spec.priority.level": "priority",
    "spec.cpu_milli": "resources.cpu_milli",
    "spec.host_memory_bytes": "resources.host_memory_gib",
    "spec.max_gpus": "resources.max_gpus",
}


def file_key_for(field: str, doc: Mapping[str, Any] | None = None) -> str | None:
    """The job file key behind a field the service named (`spec.resources.mps.sm_percent` ->
    `resources.mps.sm_percent`), or None when the field is not the spec's. With the document,
    the memory key is the one it used."""
    if field == "spec.resources.memory_bytes" and doc is not None:
        resources = doc.get("resources")
        if isinstance(resources, Mapping) and "memory_bytes" in resources:
            return "resources.memory_bytes"
    if field in _FILE_KEYS:
        return _FILE_KEYS[field]
    if field == "request_id":
        return field
    if field.startswith("spec."):
        return field.removeprefix("spec.")
    return None


def _startable(job: JobView) -> bool:
    """An assigned job its command can start in: a MIG batch task once it holds its instance."""
    if not job.spec.is_mig_batch:
        return True
    slot = job.assignment.mig if job.assignment is not None else None
    return slot is not None and bool(slot.instance_uuid)
