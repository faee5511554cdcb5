"""The training policies on a live cluster: placement's training jobs and GPUs as a
`ClusterView` (model.py), and the policy's actions as live decisions. Pure: the same policy
object and decision code as `gpuloom sim training`; placement's driver
(services/placement/training.py) calls these and turns the result into dispatcher calls.

How the live cluster maps onto the model:

- a server is a node's GPUs of one model, in GPU uuid order; its GPU type is the model;
- a group is a GPU holding training jobs (those without a checkpoint hook first, then in
  submission order: the policy moves a group's last jobs), packed when the driver runs them
  at once, with the packing trial's measured gain; a job whose mini-batch time alone is not
  measured yet has a type of its own that packs with nothing (packing is decided on
  measurements);
- a GPU that holds no training job but other work (inference, batch, direct reservations, a
  GPU that takes no shares) is a group of one stand-in job that nothing packs with or moves;
- nothing waits in the view: placement's scheduler places arriving jobs (they share a GPU when
  their shares fit together), the policy decides what they do there.

Live decisions taken from the actions: `Unpack` (back to time-slicing), `Pack` of two jobs
already on one GPU (in place), and `Place` of a job onto a free GPU (a migration: only for
jobs with a checkpoint hook). A `Pack` across GPUs and a `Slice` are not taken live (there are
no waiting jobs to slice, and a job is not moved onto a busy GPU).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from gpuloom.policies.training.model import (
    ClusterView,
    Group,
    Job,
    Pack,
    Place,
    Server,
    TrainingPolicy,
    Unpack,
)

OTHER_WORK = "\0other"  # the job type of a stand-in for work that is not a training job
UNMEASURED = "\0unmeasured:"  # + job id: the type of a job not measured alone yet


@dataclass(frozen=True, slots=True)
class LiveGpu:
    gpu_uuid: str
    node: str
    model: str
    memory_bytes: int
    busy: bool  # holds work other than training jobs, or takes no shares (lost, MIG mode)


@dataclass(frozen=True, slots=True)
class LiveJob:
    job_id: str
    gpu_uuid: str
    job_type: str  # its task key, or its name without one
    memory_bytes: int
    submitted_at: float
    utilisation: float = 1.0  # 0..1: measured while it ran alone; 1 until then
    gpu_model: str = ""  # "" = any model; "A|B": either
    measured: bool = True  # its mini-batch time alone is known (else it is packed with none)
    movable: bool = True  # it can migrate (it has a checkpoint hook)


@dataclass(frozen=True, slots=True)
class LiveGroupState:
    packed: bool = False
    gain: float | None = None  # the packing trial's measured gain; None until known


@dataclass(frozen=True, slots=True)
class LiveView:
    view: ClusterView
    job_ids: Mapping[int, str]  # the view's job number -> job id
    gpu_of_group: Mapping[int, str]  # group id -> GPU uuid
    gpu_of_slot: Mapping[tuple[int, int], str]


@dataclass(frozen=True, slots=True)
class LivePlan:
    unpack: tuple[str, ...] = ()  # GPUs whose packed pair goes back to time-slicing
    pack: tuple[str, ...] = ()  # GPUs whose two time-sliced jobs now run packed
    moves: tuple[tuple[str, str, str], ...] = ()  # (job id, target GPU uuid, reason)


def live_view(
    gpus: Sequence[LiveGpu],
    jobs: Sequence[LiveJob],
    groups: Mapping[str, LiveGroupState],
    now: float,
    slice_efficiency: float,
) -> LiveView:
    """The cluster as the training policies see it (see the module's docstring)."""
    by_server: dict[tuple[str, str], list[LiveGpu]] = {}
    for gpu in sorted(gpus, key=lambda g: (g.node, g.model, g.gpu_uuid)):
        by_server.setdefault((gpu.node, gpu.model), []).append(gpu)
    servers: list[Server] = []
    slot_of: dict[str, tuple[int, int]] = {}
    memory: dict[str, int] = {}
    for n, ((_, model), members) in enumerate(by_server.items()):
        servers.append(Server(model, len(members)))
        for i, gpu in enumerate(members):
            slot_of[gpu.gpu_uuid] = (n, i)
            memory[model] = max(memory.get(model, 0), gpu.memory_bytes)
    on_gpu: dict[str, list[LiveJob]] = {}
    # Jobs that cannot move first: the policy moves a group's last jobs.
    for job in sorted(jobs, key=lambda j: (j.movable, j.submitted_at, j.job_id)):
        if job.gpu_uuid in slot_of:
            on_gpu.setdefault(job.gpu_uuid, []).append(job)
    view_jobs: dict[int, Job] = {}
    job_ids: dict[int, str] = {}
    view_groups: list[Group] = []
    gpu_of_group: dict[int, str] = {}
    type_memory: dict[str, int] = {}
    for gpu in (g for members in by_server.values() for g in members):
        members_on = on_gpu.get(gpu.gpu_uuid)
        if not members_on and not gpu.busy:
            continue  # free
        gid = len(view_groups)
        numbers = []
        for job in members_on or ():
            number = len(job_ids)
            job_ids[number] = job.job_id
            job_type = job.job_type if job.measured else UNMEASURED + job.job_id
            view_jobs[number] = Job(
                number,
                job_type,
                1,
                job.submitted_at,
                job.utilisation,
                frozenset(m.strip() for m in job.gpu_model.split("|")) if job.gpu_model else None,
            )
            if job.measured:
                type_memory[job_type] = max(type_memory.get(job_type, 0), job.memory_bytes)
            numbers.append(number)
        if not numbers:  # busy with other work: a stand-in nothing packs with
            number = len(job_ids)
            job_ids[number] = ""
            view_jobs[number] = Job(number, OTHER_WORK, 1, 0.0, 1.0, frozenset())
            numbers.append(number)
        state = groups.get(gpu.gpu_uuid, LiveGroupState())
        packed = state.packed and len(numbers) == 2
        # A GPU with one job is marked packed (full) so that the policy offers it to no
        # packing: a job is not moved onto a busy GPU live (only in-place packs are taken).
        view_groups.append(
            Group(
                gid,
                (slot_of[gpu.gpu_uuid],),
                tuple(numbers),
                packed or len(numbers) == 1,
                state.gain if packed else None,
            )
        )
        gpu_of_group[gid] = gpu.gpu_uuid
    packable = frozenset(
        (model, a, b)
        for model, limit in memory.items()
        for a, mem_a in type_memory.items()
        for b, mem_b in type_memory.items()
        if mem_a + mem_b <= limit
    )
    view = ClusterView(
        now_s=now,
        servers=tuple(servers),
        jobs=MappingProxyType(view_jobs),
        groups=tuple(view_groups),
        waiting=(),
        slice_efficiency=slice_efficiency,
        packable=packable,
    )
    gpu_of_slot = {slot: uuid for uuid, slot in slot_of.items()}
    return LiveView(view, MappingProxyType(job_ids), gpu_of_group, gpu_of_slot)


def live_plan(live: LiveView, policy: TrainingPolicy) -> LivePlan:
    """Ask `policy` and keep the actions that can be taken live (see the module's docstring)."""
    unpack: list[str] = []
    pack: list[str] = []
    moves: list[tuple[str, str, str]] = []
    group_of: dict[int, int] = {j: g.id for g in live.view.groups for j in g.jobs}
    for action in policy.decide(live.view):
        if isinstance(action, Unpack):
            gpu = live.gpu_of_group.get(action.group)
            if gpu is not None:
                unpack.append(gpu)
        elif isinstance(action, Pack):
            if group_of.get(action.job) == action.group and live.job_ids.get(action.job):
                pack.append(live.gpu_of_group[action.group])
        elif isinstance(action, Place):
            job_id = live.job_ids.get(action.job)
            if job_id and len(action.slots) == 1 and action.job in group_of:
                moves.append((job_id, live.gpu_of_slot[action.slots[0]], action.reason))
    return LivePlan(tuple(unpack), tuple(pack), tuple(moves))
