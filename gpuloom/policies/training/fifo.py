"""Exclusive FIFO: jobs start in arrival order, each alone on its GPUs until it ends; the head
of the queue blocks the jobs behind it (no backfilling). A job that fits one server takes the
server with the fewest free GPUs that still holds it (best fit); a wider job takes whole free
servers of one GPU type."""

from __future__ import annotations

from gpuloom.policies.training.model import Action, ClusterView, FreeMap, Place, Slot


def best_fit(free: FreeMap, k: int) -> tuple[Slot, ...] | None:
    """k GPUs on one server (fewest free first, then server order), or whole servers for a job
    wider than any server; None when nothing holds it now. Taken from `free` when found."""
    if k > free.widest:
        return free.whole(k)
    fitting = [n for n in range(len(free.servers)) if free.count(n) >= k]
    if not fitting:
        return None
    return free.take(min(fitting, key=free.count), k)


class FifoPolicy:
    name = "fifo"

    def decide(self, view: ClusterView) -> list[Action]:
        free = FreeMap(view.servers, view.groups)
        actions: list[Action] = []
        for job_id in view.waiting:
            slots = best_fit(free, view.jobs[job_id].gpus)
            if slots is None:
                break  # the head blocks the queue
            actions.append(Place(job_id, slots))
        return actions
