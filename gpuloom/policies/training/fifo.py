"""Exclusive FIFO: jobs start in arrival order, each alone on its GPUs until it ends; the head
of the queue blocks the jobs behind it (no backfilling). A job that fits one server takes the
server with the fewest free GPUs that still holds it (best fit); a wider job takes whole free
servers of one GPU type."""

from __future__ import annotations

import math

from gpuloom.policies.training.model import Action, ClusterView, FreeMap, Job, Place, Slot


def best_fit(free: FreeMap, job: Job) -> tuple[Slot, ...] | None:
    """The job's GPUs on one server of a type it runs on (fewest free first, then server
    order), or whole servers for a job wider than any such server; None when nothing holds it
    now. Taken from `free` when found."""
    k = job.gpus
    if free.wider_than_servers(k, job):
        return free.whole(k, job)
    fitting = free.fitting(k, job)
    if not fitting:
        return None
    return free.take(min(fitting, key=free.count), k)


class FifoPolicy:
    name = "fifo"

    def decide(self, view: ClusterView) -> list[Action]:
        free = FreeMap(view.servers, view.groups)
        actions: list[Action] = []
        for job_id in view.waiting:
            slots = best_fit(free, view.jobs[job_id])
            if slots is None:
                break  # the head blocks the queue
            actions.append(Place(job_id, slots))
        return actions

    def review_at(self, view: ClusterView) -> float:
        return math.inf  # only arrivals and departures change what FIFO does
