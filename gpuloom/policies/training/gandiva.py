"""Gandiva (Xiao et al., OSDI 2018), its scheduling policy over the cluster model of model.py.

Reactive mode, on every arrival and departure, jobs that wait are taken in arrival order:

1. exclusive placement with server affinity (the paper's Algorithm 1): a job that fits one
   server goes first to a server whose jobs all ask for its GPU count, then to an empty
   server, then to any server with room; in each, to the GPU type it runs fastest on where
   that is known (`Job.fastest_on`), then best fit (fewest free GPUs first); a wider job takes
   whole free servers of one GPU type;
2. de-fragmentation: when enough GPUs are free on servers of one type but no single server
   holds the job, the server with the most free GPUs is emptied enough by migrating its
   single jobs to the servers with the fewest free GPUs that hold them;
3. over-subscription: the job joins the round-robin (suspend/resume time-slicing) of the
   least-high group of jobs of its GPU count, up to `max_height` jobs per group; only if
   there is none it waits (no head-of-line blocking: later jobs may take free GPUs ahead of
   it). Only where it is expected to pay (an equal share moves GPU time from the group's
   jobs to the newcomer, less the switching and migration costs): the job has waited
   `slice_after_s` for free GPUs, has not had `share_after_s` of service itself, has
   `queue_ahead` jobs of its shape waiting ahead of it (nearer the head, GPUs of its own
   come with the next ends), `bet_min_ended` jobs of its GPU count have ended, every job of
   the group has had `share_after_s` of service (least attained service first) and has a
   lower Gittins index than the newcomer (the newcomer is the likelier to end soon, from the
   lengths of the jobs that ended), and the group is not on a server held for an earlier job
   that has no round-robin of its GPU count to join (it waits for the server to drain
   instead of starving);
3b. suspension, before the placements: a job time-sliced in that has had `share_after_s`
   of service while an earlier job of its group has too goes back to the queue (`Suspend`):
   two long jobs sharing evenly both end later than one after the other.
3c. preemption: the head of the queue (the job that arrived first of those waiting), when
   none of the above starts it and it has waited `preempt_after_s`, takes the GPUs it needs
   from jobs that arrived after it and run alone there, each with `share_after_s` of service
   (the fewest GPUs taken; on one server, the latest arrivals first), if it is the likelier
   to end soon: its Gittins index above the sum of theirs, `bet_min_ended` jobs of each GPU
   count ended. They go back to the queue (`Suspend`, reason "preempt"), behind it. Only
   where the view allows it (`ClusterView.preempt`; live, the preempted job is suspended in
   place while the head runs in its time-slice group).

Rules of time (a wait, a job's service) may change the decision with nothing arriving or
ending: `review_at` says when to ask again.

Introspective mode, in the same call (the undo before the placements, the rest after):

4. undo: a packing whose trial measured a gain below time-slicing's (`packed_gain` <
   `slice_efficiency`) goes back to time-slicing, and that pair of job types on that GPU type
   is not packed again;
5. spread: jobs time-sliced or packed while GPUs of their count are free migrate there
   (highest groups first);
6. packing: the time-sliced one-GPU job with the lowest utilisation is packed with the
   one-GPU job of lowest utilisation that runs alone (or, in a group of two, with its
   partner in place), if the two fit one GPU's memory and were not undone before; then the
   next lowest job, and so on (only in place where the view says `pack_in_place`, as the
   live driver's does). The trial that decides success is the caller's measurement.

Grow-shrink (`gandiva-gs`, off in `gandiva`), in the same call:

0. shrink, first: when a job waits, every job grown beyond the GPUs it asked for goes back to
   them at once (the waiting jobs then find the cluster as without grow-shrink);
7. grow, last, when no job is left waiting: a job running alone on one server, with larger
   GPU counts in its elastic range (`Job.grow_to`), takes that server's GPUs that have been
   free for `grow_idle_s` (the largest count of its range they allow; smallest jobs first).

Priorities are not modelled (every job has the same).
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import asdict, dataclass

from gpuloom.policies.training.model import (
    Action,
    ClusterView,
    FreeMap,
    Job,
    Pack,
    Place,
    Resize,
    Slice,
    Slot,
    Suspend,
    Unpack,
)

MAX_HEIGHT = 8  # jobs time-sliced on one set of GPUs at most (then new jobs wait)
MAX_HEIGHT_LIMIT = 64  # the largest height "gandiva:HEIGHT" accepts
# Over-subscription only where it is expected to pay (docs/training.md, "When gandiva
# time-slices"). Time-slicing a waiting job into a group shares the group's GPUs equally: it
# only moves GPU time from the group's jobs to the newcomer, less the switching overhead and
# the migration that usually follows. That lowers the average JCT only when the newcomer is
# the shorter one; lengths are unknown, so both rules use only what has been seen:
SLICE_AFTER_S = 3600.0  # a job waits this long for free GPUs before it is time-sliced in
SHARE_AFTER_S = 3600.0  # ... and only with jobs that have each had this much service
# ... and only with QUEUE_AHEAD jobs of its shape waiting ahead of it: at the head of the
# queue, its wait as FIFO lasts until the next of its shape's groups ends, too little to pay
# for slowing a group down; further back, it lasts several ends.
QUEUE_AHEAD = 2
# ... and only when the newcomer is the likelier to end soon: its Gittins index at the service
# it has had is above every group job's at theirs, from the lengths of the jobs of its GPU
# count that ended (`ServiceHistory`). Until BET_MIN_ENDED of them have, nothing says which
# is the likelier (a few ended jobs are a poor sample: two short ones make every newcomer
# look short) and no job of that count is time-sliced in.
BET_MIN_ENDED = 5
# A job at the head of the queue that has waited this long for GPUs takes them back from the
# jobs behind it that took GPUs it needs (backfilling, which lets them pass it), if each has
# had `share_after_s` of service and the head is the likelier to end soon: they are
# suspended back to the queue (preempted), as FIFO would have had them wait. Without it a
# wide job can wait for ever behind narrow ones.
PREEMPT_AFTER_S = 3600.0
GROW_IDLE_S = 600.0  # grow-shrink: a GPU free this long may be given to a job that grows
# The soonest `review_at` asks to be called again for a job's service: when it will have had
# `share_after_s` is a bound (a stalled job gains none), which may have to be asked again;
# this floor keeps that from running to ever smaller steps.
REVIEW_STEP_S = 60.0


@dataclass(frozen=True, slots=True)
class GandivaKnobs:
    """Gandiva's rules of time, the arguments `GandivaPolicy` takes (the constants above are
    their defaults). Live, placement's settings `GPULOOM_PLACEMENT_TRAINING_SLICE_AFTER_S`,
    `..._SHARE_AFTER_S`, `..._QUEUE_AHEAD`, `..._BET_MIN_ENDED` and `..._PREEMPT_AFTER_S` set
    them, and placement's driver hands them to the policy it creates (`get_policy`).

    - `slice_after_s`: a waiting job is time-sliced into a round-robin only after waiting this
      long for free GPUs;
    - `share_after_s`: ... only into a round-robin whose jobs have each had this much service,
      while it has not; a job time-sliced in that has had it is suspended back to the queue;
      a job preempted for the head of the queue must have had it;
    - `queue_ahead`: ... only with at least this many jobs of its shape waiting ahead of it;
    - `bet_min_ended`: ... only once this many jobs of its GPU count have ended (the Gittins
      index's evidence; 0: with none ended, the other rules alone decide);
    - `preempt_after_s`: the head of the queue preempts later jobs running alone on the GPUs it
      needs once it has waited this long (inf: never)."""

    slice_after_s: float = SLICE_AFTER_S
    share_after_s: float = SHARE_AFTER_S
    queue_ahead: int = QUEUE_AHEAD
    bet_min_ended: int = BET_MIN_ENDED
    preempt_after_s: float = PREEMPT_AFTER_S

    def __post_init__(self) -> None:
        for name in ("slice_after_s", "share_after_s", "preempt_after_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or math.isnan(value) or value < 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        for name in ("queue_ahead", "bet_min_ended"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


class _Scratch:
    """The groups as the actions planned so far leave them."""

    def __init__(self, view: ClusterView) -> None:
        self.jobs = {g.id: list(g.jobs) for g in view.groups}
        self.slots = {g.id: g.slots for g in view.groups}
        self.packed = {g.id: g.packed for g in view.groups}
        self.of_job = {j: g.id for g in view.groups for j in g.jobs}
        self.sizes = [Counter[int]() for _ in view.servers]
        for g in view.groups:
            for server in {s for s, _ in g.slots}:
                self.sizes[server][len(g.slots)] += 1

    def remove(self, job: int, free: FreeMap) -> None:
        """`job` leaves its group; an emptied group frees its GPUs."""
        gid = self.of_job.pop(job, None)
        if gid is None:
            return
        self.jobs[gid].remove(job)
        if len(self.jobs[gid]) < 2:
            self.packed[gid] = False
        if not self.jobs[gid]:
            slots = self.slots.pop(gid)
            free.give(slots)
            for server in {s for s, _ in slots}:
                self.sizes[server][len(slots)] -= 1
            del self.jobs[gid], self.packed[gid]

    def resize(self, gid: int, slots: tuple[Slot, ...], free: FreeMap) -> None:
        """A group runs on `slots` now: the slots it leaves go back to `free` (the caller took
        the ones it gains)."""
        old = self.slots[gid]
        for server in {s for s, _ in old}:
            self.sizes[server][len(old)] -= 1
        free.give([slot for slot in old if slot not in slots])
        self.slots[gid] = slots
        for server in {s for s, _ in slots}:
            self.sizes[server][len(slots)] += 1

    def place(self, job: int, slots: tuple[Slot, ...]) -> None:
        gid = -1 - len(self.of_job) - len(self.slots)  # a stand-in id (the caller gives one)
        while gid in self.slots:
            gid -= 1
        self.jobs[gid], self.slots[gid], self.packed[gid] = [job], slots, False
        self.of_job[job] = gid
        for server in {s for s, _ in slots}:
            self.sizes[server][len(slots)] += 1


class GandivaPolicy:
    def __init__(
        self,
        max_height: int = MAX_HEIGHT,
        grow_shrink: bool = False,
        slice_after_s: float = SLICE_AFTER_S,
        share_after_s: float = SHARE_AFTER_S,
        queue_ahead: int = QUEUE_AHEAD,
        bet_min_ended: int = BET_MIN_ENDED,
        preempt_after_s: float = PREEMPT_AFTER_S,
    ) -> None:
        """`max_height`: jobs time-sliced on one set of GPUs at most; `grow_shrink`: the
        `gandiva-gs` passes; the rules of time: see GandivaKnobs (checked there)."""
        GandivaKnobs(slice_after_s, share_after_s, queue_ahead, bet_min_ended, preempt_after_s)
        self.queue_ahead = queue_ahead
        self.preempt_after_s = preempt_after_s  # inf: no preemption
        # 0: with no job of its count ended, a job is time-sliced in on the other rules alone
        self.bet_min_ended = bet_min_ended
        self.max_height = max_height
        self.grow_shrink = grow_shrink
        self.slice_after_s = slice_after_s
        self.share_after_s = share_after_s
        name = "gandiva-gs" if grow_shrink else "gandiva"
        self.name = name if max_height == MAX_HEIGHT else f"{name}:{max_height}"
        self.bad_pairs: set[tuple[str, str, str]] = set()  # (GPU type, job type, job type)

    @classmethod
    def with_knobs(
        cls, knobs: GandivaKnobs, max_height: int = MAX_HEIGHT, grow_shrink: bool = False
    ) -> GandivaPolicy:
        """The policy with its rules of time set by `knobs`."""
        return cls(max_height, grow_shrink, **asdict(knobs))

    def decide(self, view: ClusterView) -> list[Action]:
        free = FreeMap(view.servers, view.groups)
        scratch = _Scratch(view)
        actions: list[Action] = []
        self._undo(view, scratch, actions)
        demoted = self._demote(view, free, scratch, actions)
        waiting = (
            sorted((*view.waiting, *demoted), key=lambda j: (view.jobs[j].arrival_s, j))
            if demoted
            else view.waiting
        )
        if self.grow_shrink and waiting:
            self._shrink(view, free, scratch, actions)
        # A job that finds no GPUs leaves its GPU count (on its GPU types) blocked for the
        # rest of the call: placing others only takes GPUs and raises heights. One with no
        # round-robin of its GPU count to join also holds the fewest servers that would hold
        # it (those with the fewest jobs) against over-subscription by the jobs behind it:
        # they may take free GPUs there but not add to the round-robins it waits to see
        # drain (else a job of a GPU count no group has could wait for ever behind groups
        # that never empty, such as one-GPU jobs behind 4-GPU round-robins on every server).
        blocked: set[tuple[int, frozenset[str] | None]] = set()
        # A job that had its share of service, or waits too near the head of the queue to be
        # time-sliced in, leaves only exclusive placement blocked: one behind it may be.
        no_room: set[tuple[int, frozenset[str] | None]] = set()
        ahead = Counter[tuple[int, frozenset[str] | None]]()  # jobs of a shape left waiting
        held: set[int] = set()
        left_waiting = False
        queue = list(waiting)
        for n, job_id in enumerate(queue):  # grows: preempted jobs join it behind the head
            job = view.jobs[job_id]
            shape = (job.gpus, job.runs_on)
            if shape in blocked:
                continue
            room = shape not in no_room
            if not self._arrive(view, job, free, scratch, actions, held, room, ahead[shape]):
                preempted = self._preempt(view, job, free, scratch, actions) if n == 0 else []
                if preempted:
                    queue[1:] = sorted(
                        (*queue[1:], *preempted), key=lambda j: (view.jobs[j].arrival_s, j)
                    )
                    continue
                ahead[shape] += 1
                if self._had_share(view, job_id) or ahead[shape] <= self.queue_ahead:
                    no_room.add(shape)
                else:
                    blocked.add(shape)
                if not self._has_round_robin(view, job, scratch):
                    held |= _drain_for(view, job, free, scratch, held)
                left_waiting = True
                if len(held) == len(view.servers) and not any(free.free):
                    break  # no free GPU and no group open to slicing: nothing more can start
        self._spread(view, free, scratch, actions)
        self._pack(view, scratch, actions)
        if self.grow_shrink and not left_waiting:
            self._grow(view, free, scratch, actions)
        return actions

    def review_at(self, view: ClusterView) -> float:
        """The first time a waiting job will have waited `slice_after_s` or `preempt_after_s`,
        or a job of a group may have had `share_after_s` of service (a bound: time-sliced h
        ways, service grows at slice_efficiency / h of the clock, and a stalled job's not at
        all; asked no sooner than REVIEW_STEP_S from now); inf when no job waits and none is
        time-sliced."""
        if not view.waiting and all(g.height < 2 for g in view.groups):
            return math.inf
        now = view.now_s
        waits = [
            view.jobs[j].arrival_s + after
            for after in (self.slice_after_s, self.preempt_after_s)
            for j in view.waiting
            if view.jobs[j].arrival_s + after > now
        ]
        services = [
            now
            + (self.share_after_s - view.attained_s.get(j, 0.0))
            * (g.height / view.slice_efficiency if g.height > 1 else 1.0)
            for g in view.groups
            if not g.packed
            for j in g.jobs
            if view.attained_s.get(j, 0.0) < self.share_after_s
        ]
        service = max(min(services), now + REVIEW_STEP_S) if services else math.inf
        return min(min(waits, default=math.inf), service)

    def _had_share(self, view: ClusterView, job: int) -> bool:
        """Whether `job` has had `share_after_s` of service: it is no longer time-sliced in
        (0 turns this off: the paper's round-robin, with any job)."""
        return self.share_after_s > 0 and view.attained_s.get(job, 0.0) >= self.share_after_s

    # 3b. demote
    def _demote(
        self, view: ClusterView, free: FreeMap, scratch: _Scratch, actions: list[Action]
    ) -> list[int]:
        """Time-slicing pays only for the shorter job: once a job time-sliced into a group
        has had `share_after_s` of service itself, the group holds two jobs that have run
        long, and sharing evenly would finish both later than running one after the other.
        The one that arrived later goes back to the queue (suspended, its state kept): it
        waits for GPUs of its own in arrival order. Returns the jobs suspended."""
        suspended: list[int] = []
        for g in view.groups:
            if g.packed or g.height < 2:
                continue
            long = sorted(
                (j for j in g.jobs if self._had_share(view, j)),
                key=lambda j: (view.jobs[j].arrival_s, j),
            )
            for job in long[1:]:
                scratch.remove(job, free)
                actions.append(Suspend(job))
                suspended.append(job)
        return suspended

    # 3c. preemption
    def _preempt(
        self,
        view: ClusterView,
        head: Job,
        free: FreeMap,
        scratch: _Scratch,
        actions: list[Action],
    ) -> list[int]:
        """Take the GPUs `head` needs from later jobs running alone (see the module's
        docstring, 3c) and place it there; returns the jobs suspended (none: nothing done)."""
        if not view.preempt or view.now_s - head.arrival_s < self.preempt_after_s:
            return []
        victims = self._victims(view, head, free, scratch)
        if not victims:
            return []
        for victim in victims:
            scratch.remove(victim, free)
            actions.append(Suspend(victim, reason="preempt"))
        slots = self._exclusive(free, scratch, head)
        if slots is None:  # cannot happen: the victims' GPUs hold it
            raise AssertionError(f"job {head.id}: preempted {victims} and still no room")
        scratch.place(head.id, slots)
        actions.append(Place(head.id, slots, reason="preempt"))
        return victims

    def _victims(self, view: ClusterView, head: Job, free: FreeMap, scratch: _Scratch) -> list[int]:
        """The jobs to preempt for `head`: the fewest GPUs, from jobs running alone (not
        grown) that arrived after it and have had `share_after_s` of service; whole servers
        of one GPU type for a job wider than a server, else one server (latest arrivals
        first). Empty when no such set makes room."""
        k = head.gpus
        key = (head.arrival_s, head.id)
        takeable: dict[int, list[int]] = {}  # server -> its groups that may be preempted
        pinned: set[int] = set()  # servers with a group that may not
        for gid, jobs in scratch.jobs.items():
            servers = {s for s, _ in scratch.slots[gid]}
            job = view.jobs[jobs[0]]
            if (
                gid >= 0  # not one planned in this call
                and len(jobs) == 1
                and not scratch.packed[gid]
                and len(scratch.slots[gid]) == job.gpus
                and (job.arrival_s, job.id) > key
                and view.attained_s.get(job.id, 0.0) >= self.share_after_s
            ):
                for server in servers:
                    takeable.setdefault(server, []).append(gid)
            else:
                pinned |= servers
        servers = view.servers
        allowed = [n for n, server in enumerate(servers) if head.allows(server.gpu_type)]
        best: tuple[int, list[int]] | None = None  # (GPUs taken, groups)
        if free.wider_than_servers(k, head):
            by_type: dict[str, list[int]] = {}
            for n in allowed:
                if n not in pinned:
                    by_type.setdefault(servers[n].gpu_type, []).append(n)
            for candidates in by_type.values():
                candidates.sort(
                    key=lambda n: (sum(len(scratch.slots[g]) for g in takeable.get(n, [])), n)
                )
                chosen: dict[int, None] = {}
                total = 0
                for n in candidates:
                    if total >= k:
                        break
                    total += servers[n].gpus
                    chosen.update(dict.fromkeys(takeable.get(n, [])))
                cost = sum(len(scratch.slots[g]) for g in chosen)
                if total >= k and (best is None or cost < best[0]):
                    best = (cost, list(chosen))
        else:
            for n in allowed:
                if servers[n].gpus < k:
                    continue
                have = free.count(n)
                taken: list[int] = []
                latest_first = sorted(
                    takeable.get(n, []),
                    key=lambda g: (view.jobs[scratch.jobs[g][0]].arrival_s, g),
                    reverse=True,
                )
                for gid in latest_first:
                    if have >= k:
                        break
                    taken.append(gid)
                    have += sum(1 for s, _ in scratch.slots[gid] if s == n)
                cost = sum(len(scratch.slots[g]) for g in taken)
                if have >= k and (best is None or cost < best[0]):
                    best = (cost, taken)
        if best is None:
            return []
        victims = [scratch.jobs[g][0] for g in best[1]]
        return victims if self._likelier_to_end(view, head, victims) else []

    def _likelier_to_end(self, view: ClusterView, head: Job, victims: list[int]) -> bool:
        """Whether `head` is likelier to end soon than `victims` together: its Gittins index
        above the sum of theirs (they run at once: their chances to end add up), each from
        at least `bet_min_ended` ended jobs of its GPU count (else nothing says so)."""
        jobs = (head.id, *victims)
        if any(view.ended.ended(view.jobs[j].gpus) < self.bet_min_ended for j in jobs):
            return False
        mine = _index(view, head.id)  # None: bet_min_ended 0 and no evidence, the rule is off
        return mine is None or mine > sum(_index(view, j) or 0.0 for j in victims)

    # 0. shrink
    def _shrink(
        self, view: ClusterView, free: FreeMap, scratch: _Scratch, actions: list[Action]
    ) -> None:
        grown = [
            gid
            for gid, jobs in scratch.jobs.items()
            if len(jobs) == 1 and len(scratch.slots[gid]) > view.jobs[jobs[0]].gpus
        ]
        for gid in sorted(grown):
            keep = scratch.slots[gid][: view.jobs[scratch.jobs[gid][0]].gpus]
            scratch.resize(gid, keep, free)
            actions.append(Resize(gid, keep, reason="shrink"))

    # 7. grow
    def _grow(
        self, view: ClusterView, free: FreeMap, scratch: _Scratch, actions: list[Action]
    ) -> None:
        elastic = sorted(
            (
                gid
                for gid, jobs in scratch.jobs.items()
                if gid >= 0
                and len(jobs) == 1
                and not scratch.packed[gid]
                and view.jobs[jobs[0]].grow_to
                and len({s for s, _ in scratch.slots[gid]}) == 1
            ),
            key=lambda g: (len(scratch.slots[g]), g),
        )
        for gid in elastic:
            job = view.jobs[scratch.jobs[gid][0]]
            slots = scratch.slots[gid]
            server = slots[0][0]
            idle = [
                (server, i)
                for i in free.free[server]
                if view.now_s - view.idle_since.get((server, i), view.now_s) >= view.grow_idle_s
            ]
            counts = [n for n in job.grow_to if len(slots) < n <= len(slots) + len(idle)]
            if not counts:
                continue
            extra = idle[: max(counts) - len(slots)]
            free.take_exact(extra)
            grown = (*slots, *extra)
            scratch.resize(gid, grown, free)
            actions.append(Resize(gid, grown, reason="grow"))

    # 4. undo
    def _undo(self, view: ClusterView, scratch: _Scratch, actions: list[Action]) -> None:
        for g in view.groups:
            if g.packed and g.packed_gain is not None and g.packed_gain < view.slice_efficiency:
                a, b = (view.jobs[j].job_type for j in g.jobs)
                gpu_type = view.servers[g.server].gpu_type
                self.bad_pairs |= {(gpu_type, a, b), (gpu_type, b, a)}
                scratch.packed[g.id] = False
                actions.append(Unpack(g.id))

    # 1-3. reactive placement
    def _arrive(
        self,
        view: ClusterView,
        job: Job,
        free: FreeMap,
        scratch: _Scratch,
        actions: list[Action],
        held: set[int],
        room: bool = True,
        ahead: int = 0,
    ) -> bool:
        """Place, de-fragment for, or time-slice one waiting job; False if it must wait.
        `room`: whether free GPUs may hold it (False: a job of its shape found none);
        `ahead`: how many jobs of its shape wait ahead of it."""
        k, job_id = job.gpus, job.id
        slots = self._exclusive(free, scratch, job) if room else None
        if room and slots is None and self._defragment(view, job, free, scratch, actions):
            slots = self._exclusive(free, scratch, job)
        if slots is not None:
            scratch.place(job_id, slots)
            actions.append(Place(job_id, slots))
            return True
        if view.now_s - job.arrival_s < self.slice_after_s:
            return False  # GPUs that free up meanwhile are waited for, as FIFO would
        attained = view.attained_s
        if self._had_share(view, job_id):
            return False  # it has had its share: it waits for GPUs of its own, in turn
        if ahead < self.queue_ahead:
            return False  # near the head of the queue: GPUs of its own come with the next end
        if view.ended.ended(k) < self.bet_min_ended:
            return False  # too few of its count ended to say it is the likelier to end soon
        index = _index(view, job_id)
        shared = [
            gid
            for gid, jobs in scratch.jobs.items()
            if gid >= 0  # not one planned in this call (the caller numbers those)
            and len(scratch.slots[gid]) == k
            and all(view.jobs[j].gpus == k for j in jobs)  # not a grown job's GPUs
            and not scratch.packed[gid]
            and len(jobs) < self.max_height
            and job.allows(view.servers[scratch.slots[gid][0][0]].gpu_type)
            and not any(server in held for server, _ in scratch.slots[gid])
            # Least attained service first: a job that has run long is expected to run long
            # yet (heavy-tailed lengths), so a newcomer is likely the shorter one; a group
            # whose jobs have had little service is waited for instead.
            and all(attained.get(j, 0.0) >= self.share_after_s for j in jobs)
            # The newcomer is the likelier to end soon.
            and (index is None or all(index > (_index(view, j) or 0.0) for j in jobs))
        ]
        if shared:
            gid = min(shared, key=lambda g: (len(scratch.jobs[g]), g))
            scratch.jobs[gid].append(job_id)
            scratch.of_job[job_id] = gid
            actions.append(Slice(job_id, gid))
            return True
        return False

    def _has_round_robin(self, view: ClusterView, job: Job, scratch: _Scratch) -> bool:
        """Whether some group of `job`'s GPU count runs on a GPU type it allows: one it may
        be time-sliced into once its jobs have had their service or one of them ends."""
        return any(
            len(slots) == job.gpus
            and job.allows(view.servers[slots[0][0]].gpu_type)
            and all(view.jobs[j].gpus == job.gpus for j in scratch.jobs[gid])
            for gid, slots in scratch.slots.items()
        )

    def _exclusive(self, free: FreeMap, scratch: _Scratch, job: Job) -> tuple[Slot, ...] | None:
        k = job.gpus
        if free.wider_than_servers(k, job):
            return free.whole(k, job)
        fitting = free.fitting(k, job)
        if not fitting:
            return None
        sizes = scratch.sizes

        def best(servers: list[int]) -> int:
            # The GPU type it runs fastest on, then best fit: the fewest free GPUs (the bigger
            # servers stay whole for wider jobs).
            return min(
                servers,
                key=lambda n: (job.speed_rank(free.servers[n].gpu_type), free.count(n)),
            )

        affine = [n for n in fitting if +sizes[n] and set(+sizes[n]) == {k}]
        if affine:
            return free.take(best(affine), k)
        empty = [n for n in fitting if not +sizes[n]]
        return free.take(best(empty or fitting), k)

    # 2. de-fragmentation
    def _defragment(
        self,
        view: ClusterView,
        job: Job,
        free: FreeMap,
        scratch: _Scratch,
        actions: list[Action],
    ) -> bool:
        """Migrate single jobs off one server of a type `job` runs on until it holds the job's
        GPUs; False (and nothing planned) when no server can be emptied that far."""
        k = job.gpus
        servers = view.servers
        by_type = Counter[str]()
        for n, server in enumerate(servers):
            by_type[server.gpu_type] += free.count(n)
        targets = [
            n
            for n, server in enumerate(servers)
            if server.gpus >= k
            and by_type[server.gpu_type] >= k
            and free.count(n) < k
            and job.allows(server.gpu_type)
        ]
        for target in sorted(targets, key=lambda n: (-free.count(n), n)):
            trial = copy.deepcopy(free)
            moves: list[tuple[int, tuple[Slot, ...]]] = []
            movable = sorted(
                (
                    gid
                    for gid, jobs in scratch.jobs.items()
                    if len(jobs) == 1
                    and not scratch.packed[gid]
                    and {s for s, _ in scratch.slots[gid]} == {target}
                ),
                key=lambda gid: (len(scratch.slots[gid]), gid),
            )
            for gid in movable:
                if trial.count(target) >= k:
                    break
                size = len(scratch.slots[gid])  # it stays on its GPU type: it runs there
                homes = [
                    n
                    for n, server in enumerate(servers)
                    if n != target
                    and server.gpu_type == servers[target].gpu_type
                    and trial.count(n) >= size
                ]
                if not homes:
                    continue
                home = min(homes, key=lambda n: (trial.count(n), n))
                slots = trial.take(home, size)
                trial.give(scratch.slots[gid])
                moves.append((scratch.jobs[gid][0], slots))
            if trial.count(target) >= k:
                for moved, slots in moves:
                    scratch.remove(moved, free)
                    free.take_exact(slots)
                    scratch.place(moved, slots)
                    actions.append(Place(moved, slots, reason="defrag"))
                return True
        return False

    # 5. spread
    def _spread(
        self, view: ClusterView, free: FreeMap, scratch: _Scratch, actions: list[Action]
    ) -> None:
        crowded = sorted(
            (gid for gid, jobs in scratch.jobs.items() if len(jobs) > 1),
            key=lambda gid: (-len(scratch.jobs[gid]), gid),
        )
        full: set[tuple[int, frozenset[str] | None]] = set()  # shapes no server has room for
        for gid in crowded:
            while len(scratch.jobs[gid]) > 1:
                job = scratch.jobs[gid][-1]
                shape = (view.jobs[job].gpus, view.jobs[job].runs_on)
                if shape in full:
                    break
                slots = self._exclusive(free, scratch, view.jobs[job])
                if slots is None:
                    full.add(shape)
                    break
                scratch.remove(job, free)
                scratch.place(job, slots)
                actions.append(Place(job, slots, reason="spread"))

    # 6. packing
    def _pack(self, view: ClusterView, scratch: _Scratch, actions: list[Action]) -> None:
        def util(job: int) -> float:
            return view.jobs[job].utilisation

        candidates = sorted(
            (
                j
                for gid, jobs in scratch.jobs.items()
                if len(jobs) > 1 and not scratch.packed[gid] and len(scratch.slots[gid]) == 1
                for j in jobs
            ),
            key=lambda j: (util(j), j),
        )
        # One-GPU jobs alone, per GPU type, lowest utilisation first: the packing targets
        # (none where only jobs time-sliced together may be packed, in place).
        alone: dict[str, list[int]] = {}
        for gid in sorted(
            (
                g
                for g, jobs in scratch.jobs.items()
                if not view.pack_in_place
                and g >= 0
                and len(jobs) == 1
                and len(scratch.slots[g]) == 1
                and not scratch.packed[g]
            ),
            key=lambda g: (util(scratch.jobs[g][0]), g),
        ):
            alone.setdefault(view.servers[scratch.slots[gid][0][0]].gpu_type, []).append(gid)
        for job in candidates:
            own = scratch.of_job[job]
            if len(scratch.jobs[own]) < 2 or scratch.packed[own]:
                continue  # its group changed since (packed, or down to one job)
            gpu_type = view.servers[scratch.slots[own][0][0]].gpu_type
            targets = alone.get(gpu_type, [])
            if own >= 0 and len(scratch.jobs[own]) == 2:
                targets = sorted(
                    [*targets, own], key=lambda g: (util(_partner(scratch, g, job)), g)
                )
            kind = view.jobs[job].job_type
            for gid in targets:
                other = view.jobs[_partner(scratch, gid, job)].job_type
                key = (gpu_type, kind, other)
                if view.can_pack(*key) and key not in self.bad_pairs:
                    if gid != own:
                        scratch.jobs[own].remove(job)
                        scratch.jobs[gid].append(job)
                        scratch.of_job[job] = gid
                        alone[gpu_type].remove(gid)
                    scratch.packed[gid] = True
                    actions.append(Pack(job, gid))
                    break


def _servers_for(view: ClusterView, job: Job) -> set[int]:
    """The servers `job` could run on: of a GPU type it allows, big enough for it (all those
    of its types for a job wider than every such server)."""
    allowed = [n for n, server in enumerate(view.servers) if job.allows(server.gpu_type)]
    fitting = [n for n in allowed if view.servers[n].gpus >= job.gpus]
    return set(fitting or allowed)


def _drain_for(
    view: ClusterView, job: Job, free: FreeMap, scratch: _Scratch, held: set[int]
) -> set[int]:
    """The servers to let drain for `job`, which has no round-robin of its GPU count to join:
    as few as hold it, those with the fewest jobs (then the most free GPUs) among those it
    could run on, preferring ones already held."""
    on_server = Counter[int]()
    for gid, jobs in scratch.jobs.items():
        for server in {s for s, _ in scratch.slots[gid]}:
            on_server[server] += len(jobs)
    candidates = sorted(
        _servers_for(view, job),
        key=lambda n: (n not in held, on_server[n], -free.count(n), n),
    )
    chosen: set[int] = set()
    gpus = 0
    for n in candidates:
        if gpus >= job.gpus:
            break
        chosen.add(n)
        gpus += view.servers[n].gpus
    return chosen


def _index(view: ClusterView, job: int) -> float | None:
    """`job`'s Gittins index at the service it has had, from the ended jobs of its GPU count;
    None when none has ended."""
    gpus = view.jobs[job].gpus
    if not view.ended.ended(gpus):
        return None
    return view.ended.gittins_index(gpus, view.attained_s.get(job, 0.0))


def _partner(scratch: _Scratch, gid: int, job: int) -> int:
    return next(j for j in scratch.jobs[gid] if j != job)
