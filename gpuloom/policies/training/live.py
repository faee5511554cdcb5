"""The training policies on a live cluster: placement's training jobs and GPUs as a
`ClusterView` (model.py), and the policy's actions as live decisions. Pure: the same policy
object and decision code as `gpuloom sim training`; placement's driver
(services/placement/training.py) calls these and turns the result into dispatcher calls.

How the live cluster maps onto the model:

- a server is a node's GPUs of one model, in GPU uuid order; its GPU type is the model;
- a group is a GPU holding training jobs (those without a checkpoint hook first, then in
  submission order: the policy moves a group's last jobs; jobs on several whole GPUs, the same
  ones, are a group over them all, their first GPU first), packed when the driver runs them
  at once, with the packing trial's measured gain; a job whose mini-batch time alone is not
  measured yet has a type of its own that packs with nothing (packing is decided on
  measurements);
- a GPU that holds no training job but other work (inference, batch, direct reservations, a
  GPU that takes no shares) is a group of one stand-in job that nothing packs with or moves;
- an elastic job (grow-shrink: a training job on whole GPUs with a range up to `max_gpus`) is a
  group of its own over all its GPUs (its first GPU first), with the larger counts of its range
  as `Job.grow_to`; its type packs with nothing (it holds whole GPUs); a free GPU carries the
  time since when it has been free (`idle_since`), for the policy's grow;
- placement's scheduler places arriving jobs (they share a GPU when their shares fit
  together), the policy decides what they do there. The jobs that wait in the view are the
  pending ones the policy may act for: a training job the scheduler found no room for
  (`LivePending.sliceable`: it may be time-sliced into a full GPU, over-subscription, or one on
  several whole GPUs into the GPUs of a job of its count), and one that a shrink would make
  room for: one that would fit a server holding a grown job if that
  job went back to the GPUs it asked for (GPU model, memory of one GPU, GPU count, the node's
  CPU and host memory as the caller filtered them). While a job is grown, a sliceable job that
  a shrink would not help is not shown: the policy shrinks grown jobs when, and only when, a
  pending job needs their GPUs;
- each job's service so far (`LiveJob.attained_s`: the seconds the driver saw it running, not
  suspended) is the policy's `attained_s`, which its time-slicing rules read, and the service
  of the jobs that ended (`ended`, the caller's) its `ended`, from which gandiva's Gittins
  rule estimates which job is likelier to end soon;
- a job is not moved onto a busy GPU live, so the policy packs in place only
  (`ClusterView.pack_in_place`).

Live decisions taken from the actions: `Unpack` (back to time-slicing), `Pack` of two jobs
already on one GPU (in place), `Place` of a job onto a free GPU to spread it (a migration:
only for jobs with a checkpoint hook), `Slice` of a sliceable pending job into the round-robin
of a GPU's training jobs (not an elastic job's), and `Resize` of an elastic job (grow onto idle
GPUs of its server, or shrink back; its first GPU stays). The `Place` of a waiting job
(placement's scheduler places it) and a de-fragmenting `Place` are not taken live (a job is
not moved onto a busy GPU, nor moved for a job the policy would place elsewhere than the
scheduler), nor is a `Suspend` back to the queue for a demotion (a job placement has placed
stays placed). Head-of-queue preemption is taken through suspension (`ClusterView.preempt` is
on): a `Place` of the waiting head, reason "preempt", onto exactly the GPUs of one job the same
call suspends for it (reason "preempt") becomes a preemption: the head joins that job's
time-slice group and the job stays suspended there until the head ends. A preemption onto GPUs
partly free, or held by several preempted jobs, is not taken live (a binding joins one group).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from gpuloom.policies.training.model import (
    ClusterView,
    Group,
    Job,
    Pack,
    Place,
    Resize,
    Server,
    ServiceHistory,
    Slice,
    Suspend,
    TrainingPolicy,
    Unpack,
)

OTHER_WORK = "\0other"  # the job type of a stand-in for work that is not a training job
UNMEASURED = "\0unmeasured:"  # + job id: the type of a job not measured alone yet
WHOLE = "\0whole:"  # + job id: the type of an elastic job (on whole GPUs: packs with nothing)
WAITING = "\0waiting:"  # + job id: the type of a pending job a shrink would make room for


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
    # Grow-shrink: the GPUs after its first (an elastic job on several GPUs), the GPU count it
    # asked for (the bottom of its range) and the top of its range (0: not elastic).
    extra_gpus: tuple[str, ...] = ()
    gpus: int = 1
    max_gpus: int = 0
    attained_s: float = 0.0  # its service so far: seconds seen running (not suspended)

    @property
    def elastic(self) -> bool:
        return self.max_gpus > self.gpus


@dataclass(frozen=True, slots=True)
class LivePending:
    """A job placement's scheduler could not place yet (grow-shrink: it may need a shrink)."""

    job_id: str
    gpus: int
    memory_bytes: int
    submitted_at: float
    gpu_model: str = ""  # "" = any model; "A|B": either
    nodes: frozenset[str] | None = None  # the nodes with its CPU and host memory free; None: any
    # A one-GPU training job: the policy may time-slice it into a full GPU (over-subscription).
    sliceable: bool = False


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
    # Grow-shrink: (job id, every GPU it runs on next, first GPU first, "grow" or "shrink").
    resizes: tuple[tuple[str, tuple[str, ...], str], ...] = ()
    # Over-subscription: (pending job id, GPU uuid) to join the round-robin of the training
    # jobs of that GPU (their first GPU, for jobs on several).
    slices: tuple[tuple[str, str], ...] = ()
    # Head-of-queue preemption: (pending head's job id, GPU uuid, preempted job's id): the head
    # joins the round-robin of that GPU's training jobs, and the preempted one stays suspended
    # there until the head ends.
    preemptions: tuple[tuple[str, str, str], ...] = ()


def live_view(
    gpus: Sequence[LiveGpu],
    jobs: Sequence[LiveJob],
    groups: Mapping[str, LiveGroupState],
    now: float,
    slice_efficiency: float,
    *,
    idle_since: Mapping[str, float] = MappingProxyType({}),
    grow_idle_s: float = math.inf,
    pending: Sequence[LivePending] = (),
    ended: ServiceHistory | None = None,
    preempt: bool = False,
) -> LiveView:
    """The cluster as the training policies see it (see the module's docstring); `ended`: the
    service of the training jobs that ended (none if not given); `preempt`: whether the head
    of the queue may preempt (the caller takes it through suspension)."""
    by_server: dict[tuple[str, str], list[LiveGpu]] = {}
    for gpu in sorted(gpus, key=lambda g: (g.node, g.model, g.gpu_uuid)):
        by_server.setdefault((gpu.node, gpu.model), []).append(gpu)
    servers: list[Server] = []
    nodes: list[str] = []
    slot_of: dict[str, tuple[int, int]] = {}
    memory: dict[str, int] = {}
    for n, ((node, model), members) in enumerate(by_server.items()):
        servers.append(Server(model, len(members)))
        nodes.append(node)
        for i, gpu in enumerate(members):
            slot_of[gpu.gpu_uuid] = (n, i)
            memory[model] = max(memory.get(model, 0), gpu.memory_bytes)
    on_gpu: dict[str, list[LiveJob]] = {}
    by_id = {job.job_id: job for job in jobs}
    # Jobs that cannot move first: the policy moves a group's last jobs.
    for job in sorted(jobs, key=lambda j: (j.movable, j.submitted_at, j.job_id)):
        if job.gpu_uuid in slot_of:
            on_gpu.setdefault(job.gpu_uuid, []).append(job)
    # The further GPUs of jobs on several (all of them known, the same for every job of the
    # first GPU: time-sliced together): part of their group.
    spans: dict[str, tuple[str, ...]] = {}
    for first, members_on in on_gpu.items():
        extra = members_on[0].extra_gpus
        if (
            extra
            and all(job.extra_gpus == extra for job in members_on)
            and all(u in slot_of for u in extra)
        ):
            spans[first] = (first, *extra)
    spanned = {u for uuids in spans.values() for u in uuids[1:]}
    # A further GPU outside such a group is held all the same: busy to the policy.
    claimed = {u for job in jobs for u in job.extra_gpus} - spanned
    view_jobs: dict[int, Job] = {}
    job_ids: dict[int, str] = {}
    view_groups: list[Group] = []
    gpu_of_group: dict[int, str] = {}
    type_memory: dict[str, int] = {}
    for gpu in (g for members in by_server.values() for g in members):
        if gpu.gpu_uuid in spanned:
            continue  # in the group of the job on several GPUs that holds it
        members_on = on_gpu.get(gpu.gpu_uuid)
        if not members_on and not gpu.busy and gpu.gpu_uuid not in claimed:
            continue  # free
        gid = len(view_groups)
        numbers = []
        for job in members_on or ():
            number = len(job_ids)
            job_ids[number] = job.job_id
            if job.elastic:
                job_type = WHOLE + job.job_id
            else:
                job_type = job.job_type if job.measured else UNMEASURED + job.job_id
            view_jobs[number] = Job(
                number,
                job_type,
                job.gpus if job.elastic or job.extra_gpus else 1,
                job.submitted_at,
                job.utilisation,
                _models(job.gpu_model),
                tuple(range(job.gpus + 1, job.max_gpus + 1)) if job.elastic else (),
            )
            if job.measured and not job.elastic:
                type_memory[job_type] = max(type_memory.get(job_type, 0), job.memory_bytes)
            numbers.append(number)
        if not numbers:  # busy with other work: a stand-in nothing packs with
            number = len(job_ids)
            job_ids[number] = ""
            view_jobs[number] = Job(number, OTHER_WORK, 1, 0.0, 1.0, frozenset())
            numbers.append(number)
        state = groups.get(gpu.gpu_uuid, LiveGroupState())
        packed = state.packed and len(numbers) == 2
        view_groups.append(
            Group(
                gid,
                tuple(slot_of[u] for u in spans.get(gpu.gpu_uuid, (gpu.gpu_uuid,))),
                tuple(numbers),
                packed,
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
    waiting = _waiting(pending, servers, nodes, view_groups, view_jobs, job_ids, memory)
    attained = {
        number: job.attained_s
        for number, job_id in job_ids.items()
        for job in (by_id.get(job_id),)
        if job is not None
    }
    view = ClusterView(
        now_s=now,
        servers=tuple(servers),
        jobs=MappingProxyType(view_jobs),
        groups=tuple(view_groups),
        waiting=waiting,
        slice_efficiency=slice_efficiency,
        packable=packable,
        idle_since=MappingProxyType(
            {slot_of[u]: since for u, since in idle_since.items() if u in slot_of}
        ),
        grow_idle_s=grow_idle_s,
        attained_s=MappingProxyType(attained),
        pack_in_place=True,
        preempt=preempt,
        ended=ServiceHistory() if ended is None else ended,
    )
    gpu_of_slot = {slot: uuid for uuid, slot in slot_of.items()}
    return LiveView(view, MappingProxyType(job_ids), gpu_of_group, gpu_of_slot)


def _models(gpu_model: str) -> frozenset[str] | None:
    return frozenset(m.strip() for m in gpu_model.split("|")) if gpu_model else None


def _waiting(
    pending: Sequence[LivePending],
    servers: Sequence[Server],
    nodes: Sequence[str],
    groups: Sequence[Group],
    jobs: dict[int, Job],
    job_ids: dict[int, str],
    memory: Mapping[str, int],
) -> tuple[int, ...]:
    """The pending jobs the policy sees waiting, added to `jobs` and `job_ids` (the job's id
    for a sliceable one, else empty: nothing to take live); their numbers, oldest first: the
    sliceable ones, and those that would fit a server holding a grown job were it shrunk (a
    sliceable one only if so while a job is grown: no shrink that helps nothing)."""
    used = [0] * len(servers)
    grown = [0] * len(servers)  # GPUs a shrink would give back, per server
    for g in groups:
        for server, _ in g.slots:
            used[server] += 1
        if len(g.jobs) == 1 and len(g.slots) > jobs[g.jobs[0]].gpus:
            grown[g.server] += len(g.slots) - jobs[g.jobs[0]].gpus
    waiting = []
    for p in sorted(pending, key=lambda p: (p.submitted_at, p.job_id)):
        models = _models(p.gpu_model)
        needs = any(
            grown[n]
            and (models is None or server.gpu_type in models)
            and (p.nodes is None or nodes[n] in p.nodes)
            and p.memory_bytes <= memory.get(server.gpu_type, 0)
            and p.gpus <= server.gpus - used[n] + grown[n]
            for n, server in enumerate(servers)
        )
        if needs or (p.sliceable and not any(grown)):
            number = len(job_ids)
            job_ids[number] = p.job_id if p.sliceable else ""
            jobs[number] = Job(number, WAITING + p.job_id, p.gpus, p.submitted_at, 1.0, models)
            waiting.append(number)
    return tuple(waiting)


def live_plan(live: LiveView, policy: TrainingPolicy) -> LivePlan:
    """Ask `policy` and keep the actions that can be taken live (see the module's docstring)."""
    unpack: list[str] = []
    pack: list[str] = []
    moves: list[tuple[str, str, str]] = []
    resizes: list[tuple[str, tuple[str, ...], str]] = []
    slices: list[tuple[str, str]] = []
    preemptions: list[tuple[str, str, str]] = []
    preempted: set[int] = set()
    waiting = set(live.view.waiting)
    group_of: dict[int, int] = {j: g.id for g in live.view.groups for j in g.jobs}
    groups = {g.id: g for g in live.view.groups}
    for action in policy.decide(live.view):
        if isinstance(action, Suspend):
            if action.reason == "preempt":
                preempted.add(action.job)
        elif isinstance(action, Unpack):
            gpu = live.gpu_of_group.get(action.group)
            if gpu is not None:
                unpack.append(gpu)
        elif isinstance(action, Pack):
            if group_of.get(action.job) == action.group and live.job_ids.get(action.job):
                pack.append(live.gpu_of_group[action.group])
        elif isinstance(action, Place):
            job_id = live.job_ids.get(action.job)
            if action.reason == "preempt" and job_id and action.job in waiting:
                taken = _preemption(live, groups, preempted, action)
                if taken is not None:
                    preemptions.append((job_id, *taken))
            elif (
                job_id
                and action.reason != "defrag"
                and len(action.slots) == 1
                and action.job in group_of
            ):
                moves.append((job_id, live.gpu_of_slot[action.slots[0]], action.reason))
        elif isinstance(action, Resize):
            group = groups.get(action.group)
            if group is None or len(group.jobs) != 1 or not action.slots:
                continue
            job_id = live.job_ids.get(group.jobs[0])
            uuids = tuple(live.gpu_of_slot[slot] for slot in action.slots)
            if job_id and uuids[0] == live.gpu_of_group[group.id]:  # its first GPU stays
                resizes.append((job_id, uuids, action.reason))
        elif isinstance(action, Slice):
            group = groups.get(action.group)
            job_id = live.job_ids.get(action.job)
            # Into training jobs only: not a stand-in's, nor an elastic job's.
            if (
                job_id
                and action.job in waiting
                and group is not None
                and all(
                    live.job_ids.get(j) and not live.view.jobs[j].job_type.startswith(WHOLE)
                    for j in group.jobs
                )
            ):
                slices.append((job_id, live.gpu_of_group[group.id]))
    return LivePlan(
        tuple(unpack), tuple(pack), tuple(moves), tuple(resizes), tuple(slices), tuple(preemptions)
    )


def _preemption(
    live: LiveView, groups: Mapping[int, Group], preempted: set[int], action: Place
) -> tuple[str, str] | None:
    """A head-of-queue preemption as it is taken live: the head goes onto exactly the GPUs of
    one preempted training job running alone (it joins that job's time-slice group, which
    stays suspended until the head ends): (its first GPU, its job id). None where the head's
    GPUs are partly free or held by several preempted jobs (not taken live: a binding joins
    one group)."""
    for group in groups.values():
        if (
            len(group.jobs) == 1
            and group.jobs[0] in preempted
            and set(group.slots) == set(action.slots)
            and live.job_ids.get(group.jobs[0])
        ):
            return live.gpu_of_group[group.id], live.job_ids[group.jobs[0]]
    return None
