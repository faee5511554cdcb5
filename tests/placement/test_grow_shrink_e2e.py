"""Grow-shrink live end to end: placement with `gandiva-gs` (a 2 s idle period) over two REAL
dispatchers on simulated GPUs of one node, and a real training loop (`cudart_like train`, the
fake training loop, under the C shim on the fake driver) started by `gpuloom run`'s JobRunner
with an elastic range of 1..2 whole GPUs and a SIGUSR1 checkpoint hook.

The job starts on GPU 0; GPU 1 stays idle for the period, so the job is asked to grow: it
saves its next step, stops, and starts again from it on both GPUs (GPULOOM_GPU_UUIDS names
them). A job asking for a whole GPU then arrives and waits; the grown job is asked to shrink at
once, starts again from its checkpoint on GPU 0 alone, and the newcomer gets GPU 1. Every
step of the loop runs exactly once (its output and the fake GPU's engine log)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gpuloom.convert.placement import spec_to_pb
from gpuloom.domain.placement import JobKind, JobSpec
from gpuloom.domain.shares import share_of
from gpuloom.domain.training import CheckpointHook
from gpuloom.v1 import placement_pb2 as pb
from tests.placement.conftest import counter
from tests.placement.test_training_e2e import (
    KERNEL,
    LAYERS,
    PERIOD_US,
    Plane,
    live_plane,
    pid_of,
    start,
    until,
)
from tests.shim.conftest import PROGRAM, shim_build  # noqa: F401  (fixture: builds the shim)

MIB = 1 << 20
IDLE_S = 2.0


@pytest.fixture
async def plane(
    short_dir: Path,
    shim_build: Path,  # noqa: F811  (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Plane]:
    training = {"training_policy": "gandiva-gs", "training_grow_idle_s": IDLE_S}
    async with live_plane(short_dir, shim_build, monkeypatch, **training) as plane:
        yield plane


def elastic_train(steps: int, out: Path, state: Path) -> list[str]:
    """The fake training loop (16 MiB of activations per layer over 64 MiB of weights), which
    checkpoints to `state` on SIGUSR1 and starts from it; before each run a line says which
    dispatcher socket and which GPUs it was given."""
    loop = [
        str(PROGRAM), "module", KERNEL, "alloc", "alloc", str(64 * MIB),
        "train", str(steps), str(PERIOD_US), str(LAYERS), str(16 * MIB), KERNEL,
    ]  # fmt: skip
    script = (
        f'echo "socket $GPULOOM_DISPATCHER_SOCKET gpus ${{GPULOOM_GPU_UUIDS:-one}}" >> {out}; '
        f'CUDART_LIKE_TRAIN_STATE={state} exec "$@" >> {out}'
    )
    return ["sh", "-c", script, "sh", *loop]


async def test_an_elastic_job_grows_onto_an_idle_gpu_and_shrinks_for_a_new_job(
    plane: Plane,
) -> None:
    first = await plane.add_gpu()
    second = await plane.add_gpu()
    grown_before, shrunk_before = (
        counter("gpuloom_placement_training_resizes_total", reason="grow"),
        counter("gpuloom_placement_training_resizes_total", reason="shrink"),
    )
    steps = 90
    out = plane.work / "elastic.out"
    spec = JobSpec(
        name="elastic",
        kind=JobKind.TRAINING,
        share=share_of(),
        whole_gpus=1,
        max_gpus=2,
        checkpoint=CheckpointHook(signal="SIGUSR1", timeout_s=20),
    )
    said: list[str] = []
    runner = start(plane, spec, elastic_train(steps, out, plane.work / "elastic.state"), said)
    newcomer = None
    try:

        async def grown() -> bool:
            return out.exists() and out.read_text().count("gpus ") == 2

        await until("the job grown onto the idle GPU", grown, 20)
        job = await plane.job_named("elastic")
        both = [first.core.gpu.gpu_uuid, second.core.gpu.gpu_uuid]
        assert [
            job.assignment.gpu.gpu_uuid,
            *(g.gpu.gpu_uuid for g in job.assignment.extra_gpus),
        ] == both

        async def running_again() -> bool:
            lines = out.read_text().splitlines()
            last = max(i for i, line in enumerate(lines) if line.startswith("socket "))
            return sum(1 for line in lines[last:] if line.startswith("train step")) >= 5

        await until("the grown job running", running_again, 20)
        newcomer = await plane.live.stub.SubmitJob(
            pb.SubmitJobRequest(
                request_id="newcomer",
                spec=spec_to_pb(
                    JobSpec(name="newcomer", kind=JobKind.BATCH, share=share_of(), whole_gpus=1)
                ),
            )
        )
        assert newcomer.state == pb.JOB_STATE_PENDING

        async def newcomer_placed() -> bool:
            return (await plane.job(newcomer.job_id)).state == pb.JOB_STATE_ASSIGNED

        await until("the newcomer placed on the GPU given back", newcomer_placed, 20)
        placed = await plane.job(newcomer.job_id)
        assert placed.assignment.gpu.gpu_uuid == second.core.gpu.gpu_uuid
        shrunk = await plane.job(job.job_id)
        assert shrunk.assignment.gpu.gpu_uuid == first.core.gpu.gpu_uuid
        assert not shrunk.assignment.extra_gpus
        outcome = await asyncio.wait_for(runner, 60)
    finally:
        if newcomer is not None:
            await plane.live.stub.CancelJob(pb.CancelJobRequest(job_id=newcomer.job_id))
        if not runner.done():
            await asyncio.wait_for(runner, 60)
    assert outcome.exit_code == 0, (said, out.read_text())
    lines = out.read_text().splitlines()
    runs = [line.split() for line in lines if line.startswith("socket ")]
    # Three runs, all through GPU 0's dispatcher: on one GPU, on both, on one again.
    assert [r[1] for r in runs] == [first.core.socket_path] * 3, lines
    assert [r[3] for r in runs] == ["one", ",".join(both), "one"], lines
    starts = [int(line.split("=")[1]) for line in lines if line.startswith("train start")]
    checkpoints = [int(line.split("=")[1]) for line in lines if line.startswith("train check")]
    assert len(checkpoints) == 2 and starts == [0, *checkpoints], lines
    assert 0 < checkpoints[0] < checkpoints[1] < steps, lines
    done = [int(line.split()[2]) for line in lines if line.startswith("train step")]
    assert done == list(range(steps)), lines  # every step once: none lost, none redone
    # Three processes one after the other, each running its own steps' kernels.
    pids = [int(line.split("pid=")[1].split()[0]) for line in lines if line.startswith("init")]
    assert len(pids) == 3 and pid_of(out) == pids[0]
    engine = plane.engine_runs()
    bounds = [0, *checkpoints, steps]
    for pid, (low, high) in zip(pids, itertools.pairwise(bounds), strict=True):
        assert len([r for r in engine if r[0] == pid]) == (high - low) * 2 * LAYERS
    assert any("checkpointing to grow to 2 GPUs" in line for line in said), said
    assert any("checkpointing to shrink to 1 GPU" in line for line in said), said
    assert (
        counter("gpuloom_placement_training_resizes_total", reason="grow") == grown_before + 1
        and counter("gpuloom_placement_training_resizes_total", reason="shrink")
        == shrunk_before + 1
    )
