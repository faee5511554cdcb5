"""Replicas of a shared model that also ask for node CPU and host memory, and the pair with jobs
on several GPUs: the first round (the GPUs holding the model) offers only GPUs whose node has
the CPU and memory free, under every policy (the fleet policies read the nodes of the view);
the scheduler keeps replicas and node asks in buckets of their own and marks a replica due when
CPU frees on its model's node; a job on several GPUs cannot be a replica."""

from __future__ import annotations

import pytest

from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.placement import JobKind, JobSpec
from gpuloom.domain.shares import share_of
from gpuloom.policies.placement import (
    POLICIES,
    Fleet,
    GpuState,
    InvalidRequestError,
    JobRequest,
    get_policy,
    replica_memory,
)
from gpuloom.policies.placement.scheduler import Ask, Placed, Scheduler, Waiting

from .helpers import GIB, allocation_of, fleet_of, gpu, job, placed

ALL = {name: get_policy(name) for name in POLICIES}


def node_gpu(
    gpu_id: str, node: str, cpu: int, memory_gib: float = 16, model: str = "A"
) -> GpuState:
    return gpu(gpu_id, model, memory_gib, node=node, node_cpu_milli=cpu, node_memory_bytes=64 * GIB)


def replica(job_id: str, cpu: int = 2000, **kw) -> JobRequest:
    return job(job_id, 10, 10, 8, shared_model="bert", cpu_milli=cpu, **kw)


def three_nodes(cpu_of_n2: int) -> Fleet:
    """g0 on n1 (1000 milli, the model resident), g1 on n2 (the model resident), g2 on n3
    (8000 milli, no model)."""
    fleet = fleet_of(
        node_gpu("g0", "n1", 1000), node_gpu("g1", "n2", cpu_of_n2), node_gpu("g2", "n3", 8000)
    )
    fleet.set_models("g0", [("bert", 6 * GIB)])
    fleet.set_models("g1", [("bert", 6 * GIB)])
    return fleet


@pytest.mark.parametrize("policy", sorted(ALL))
def test_a_replica_goes_beside_its_model_only_on_a_node_with_its_cpu_free(policy: str) -> None:
    fleet = three_nodes(cpu_of_n2=8000)
    decision = placed(fleet.place(replica("r"), ALL[policy]))
    # g0 holds the model too, but its node has 1000 milli: g1, charged 8 - 6 GiB.
    assert decision.gpu_id == "g1"
    assert fleet.allocation("r").memory_bytes == replica_memory(8 * GIB, 6 * GIB) == 2 * GIB
    assert fleet.node("n2").cpu_used == 2000 and fleet.node("n1").cpu_used == 0
    fleet.verify()
    fleet.release("r")
    assert fleet.node("n2").cpu_used == 0 and fleet.slot("g1").memory_free == 10 * GIB
    fleet.verify()


@pytest.mark.parametrize("policy", sorted(ALL))
def test_no_resident_gpu_on_a_node_with_the_cpu_means_elsewhere_at_full_charge(
    policy: str,
) -> None:
    fleet = three_nodes(cpu_of_n2=1000)
    decision = placed(fleet.place(replica("r"), ALL[policy]))
    assert decision.gpu_id == "g2"
    assert fleet.allocation("r").memory_bytes == 8 * GIB
    assert fleet.node("n3").cpu_used == 2000
    fleet.verify()


@pytest.mark.parametrize("policy", sorted(ALL))
def test_a_replica_asking_no_cpu_still_gets_the_reduced_charge(policy: str) -> None:
    fleet = three_nodes(cpu_of_n2=8000)
    decision = placed(fleet.place(replica("r", cpu=0), ALL[policy]))
    assert decision.gpu_id in ("g0", "g1")
    assert fleet.allocation("r").memory_bytes == 2 * GIB
    fleet.verify()


def test_a_waiting_replica_is_placed_beside_its_model_when_cpu_frees_on_another_gpu() -> None:
    # n1: g0 (model A) holds the model, g1 (model B) does not; the node's 4000 milli are all
    # held by a job on g1.
    fleet = fleet_of(node_gpu("g0", "n1", 4000), node_gpu("g1", "n1", 4000, model="B"))
    fleet.set_models("g0", [("bert", 6 * GIB)])
    scheduler = Scheduler(ALL, "mra", fleet=fleet)
    hog = scheduler.submit(Ask(job("hog", 10, 10, 1, cpu_milli=4000, gpu_model="B")))
    assert isinstance(hog, Placed) and hog.placement.gpu_id == "g1"
    waiting = scheduler.submit(Ask(replica("r", cpu=1000, gpu_model="A"), submitted_at=1))
    assert isinstance(waiting, Waiting) and "1000 milli CPU" in waiting.reason
    assert not scheduler.wants_decide
    scheduler.end("hog")  # frees 4000 milli of n1, on a GPU of another model
    assert scheduler.wants_decide
    (got,) = scheduler.decide().placed
    assert got.ask.job_id == "r" and got.placement.gpu_id == "g0"
    assert fleet.allocation("r").memory_bytes == 2 * GIB
    assert fleet.node("n1").cpu_used == 1000
    fleet.verify()


def test_replicas_and_node_asks_wait_in_buckets_of_their_own() -> None:
    fleet = fleet_of(node_gpu("g0", "n1", 1000, memory_gib=1))  # nothing below fits
    scheduler = Scheduler(ALL, "mra", fleet=fleet)
    asks = [
        job("plain", 10, 10, 8),
        job("replica", 10, 10, 8, shared_model="bert"),
        job("cpu", 10, 10, 8, cpu_milli=500),
        job("replica-cpu", 10, 10, 8, shared_model="bert", cpu_milli=500),
        job("replica-memory", 10, 10, 8, shared_model="bert", host_memory_bytes=GIB),
    ]
    for i, request in enumerate(asks):
        assert isinstance(scheduler.submit(Ask(request, submitted_at=i)), Waiting)
    assert scheduler.buckets == len(asks)
    # The same request again joins its bucket.
    again = job("replica-cpu-2", 10, 10, 8, shared_model="bert", cpu_milli=500)
    assert isinstance(scheduler.submit(Ask(again, submitted_at=9)), Waiting)
    assert scheduler.buckets == len(asks)


def test_a_job_on_several_gpus_is_no_replica() -> None:
    with pytest.raises(InvalidRequestError, match="replica"):
        JobRequest("j", share_of(memory_bytes=GIB), gpus=2, shared_model="bert").validate()
    JobRequest("j", share_of(memory_bytes=GIB), gpus=1, shared_model="bert").validate()
    spec = JobSpec(
        name="j",
        kind=JobKind.BATCH,
        share=share_of(memory_bytes=GIB),
        whole_gpus=2,
        shared_model="bert",
    )
    with pytest.raises(InvalidArgument) as error:
        spec.validate(POLICIES)
    assert error.value.field == "spec.shared_model"
    JobSpec(
        name="j",
        kind=JobKind.BATCH,
        share=share_of(memory_bytes=GIB),
        whole_gpus=1,
        shared_model="bert",
    ).validate(POLICIES)


def test_an_allocation_loaded_without_a_rect_keeps_its_node_resources_and_gang() -> None:
    # As training's migration adds one (first-fit): its CPU, host memory and gang stay charged.
    loose = allocation_of("j#1", 100, 100, GIB, cpu_milli=1500, host_memory_bytes=GIB, gang="j")
    fleet = fleet_of(
        gpu("g0", "A", 16, node="n1", node_cpu_milli=4000, node_memory_bytes=8 * GIB),
        gpu(
            "g1",
            "A",
            16,
            node="n1",
            node_cpu_milli=4000,
            node_memory_bytes=8 * GIB,
            allocations=(loose,),
        ),
    )
    held = fleet.allocation("j#1")
    assert held is not None and held.rect is not None
    assert (held.cpu_milli, held.host_memory_bytes, held.gang) == (1500, GIB, "j")
    assert fleet.node("n1").cpu_used == 1500 and fleet.node("n1").memory_used == GIB
    fleet.verify()
