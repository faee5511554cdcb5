"""Issue 16's two live halves together: placement's Gandiva driver
(GPULOOM_PLACEMENT_TRAINING_POLICY=gandiva, a 2 s quantum) over REAL dispatchers on simulated
GPUs, whose clients are real training processes (`cudart_like train`, the fake training loop)
under the C shim on the fake driver, started by `gpuloom run`'s JobRunner from their
assignments. The fake GPU's engine log is the ground truth of which kernels ran when.

- Two training jobs share one GPU: placement time-slices them through the dispatcher's
  SuspendClient / ResumeClient (their phases flip; in the engine log one runs at a time), their
  mini-batch times reach Job.training from the dispatcher's heartbeats, and once both are
  measured the policy packs them (a packing trial is recorded) and both run at once.
- A training process with a checkpoint hook (SIGUSR1: it saves its next step and stops) on a
  crowded GPU migrates to a second dispatcher's GPU once that one registers; started again
  there from its checkpoint, every step runs exactly once (its output and the engine log).
- Over-subscription: a job asking for a whole GPU that is taken waits, then is time-sliced
  into it: reserved in the running job's rectangle (`time_slice_of`), suspended from the
  start, it runs nothing until its first turn; then they take turns and both finish.
- Memory in turns: two jobs whose memory sums above the GPU (the fake driver's processes share
  its memory; the dispatcher has its checkpoint API) take turns, each suspension moving the
  job's memory to host memory; every step runs once and the free memory comes back.
- Priorities: a priority-5 job waits, suspended, while a priority-0 job on its GPU runs; the
  priority-0 job is never suspended, not even when their dispatcher restarts and forgets the
  suspension (placement makes it again)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuloom.clients.placement import PlacementClient
from gpuloom.clients.run import JobRunner, RunOutcome
from gpuloom.domain.gpus import GpuInfo
from gpuloom.domain.placement import JobKind, JobSpec
from gpuloom.domain.shares import share_of
from gpuloom.domain.training import CheckpointHook
from gpuloom.policies.training.model import slice_efficiency
from gpuloom.services.dispatcher.app import GpuDispatcher, _stop, start_gpu_dispatcher
from gpuloom.services.dispatcher.gpu.simulated import SimulatedBackend
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.services.placement.training import SWITCH_S
from gpuloom.v1 import placement_pb2 as pb
from tests.dispatcher.conftest import dispatcher_settings
from tests.placement.conftest import GIB, Live, counter, start_placement
from tests.polling import eventually
from tests.shim.conftest import PROGRAM, shim_build  # noqa: F401  (fixture: builds the shim)

MIB = 1 << 20
PERIOD_US = 100_000  # one mini-batch every 100 ms
LAYERS = 8
ACTIVATIONS = 16 * MIB
WEIGHTS = 64 * MIB
KERNEL = "k_layer_1250us"  # 20 ms of GPU time per mini-batch: packing two pays off
QUANTUM_S = 2.0
GANDIVA = {  # placement's training settings in these tests
    "training_policy": "gandiva",
    "training_quantum_s": QUANTUM_S,
    "training_pack_trial_s": 2.0,
    "training_suspend_wait_ms": 500.0,
}
INTERFERENCE_SWITCH_US = 10000


@dataclass
class Plane:
    live: Live
    work: Path
    build: Path
    backend: SimulatedBackend = field(default_factory=lambda: SimulatedBackend("2xA100-80GB"))
    dispatchers: list[GpuDispatcher] = field(default_factory=list)
    # Suspensions free memory through the fake driver's checkpoint API (off by default here).
    release_memory: bool = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.live.app.port}"

    async def add_gpu(self) -> GpuDispatcher:
        """A real dispatcher for the backend's next GPU, linked to placement; returns once
        placement lists the GPU."""
        index = len(self.dispatchers)
        self.dispatchers.append(await self._dispatcher(index, 0))

        async def listed() -> bool:
            gpus = (await self.live.stub.ListGpus(pb.ListGpusRequest())).gpus
            return len(gpus) == index + 1

        await until(f"GPU {index} registered", listed, 15)
        return self.dispatchers[index]

    async def restart_gpu(self, index: int) -> GpuDispatcher:
        """GPU `index`'s dispatcher stopped and started again on its port and state (its
        reservations kept, its suspensions not); returns once it serves again."""
        port = self.dispatchers[index].port
        await _stop(self.dispatchers[index], 0)
        self.dispatchers[index] = await self._dispatcher(index, port)
        return self.dispatchers[index]

    async def _dispatcher(self, index: int, port: int) -> GpuDispatcher:
        return await start_gpu_dispatcher(
            dispatcher_settings(
                placement_address=self.address,
                node="n1",
                cuda_library=str(self.build / "fake" / "libcuda.so.1"),
                training_analyze_ms=300.0,
                training_window_s=2.0,
                suspend_release_memory=self.release_memory,
            ),
            self.backend,
            self.backend.gpu(index),
            "127.0.0.1",
            port,
            self.work / f"gpu{index}",
        )

    async def job(self, job_id: str) -> pb.Job:
        return await self.live.stub.GetJob(pb.GetJobRequest(job_id=job_id))

    async def job_named(self, name: str) -> pb.Job:
        jobs = (await self.live.stub.ListJobs(pb.ListJobsRequest())).jobs
        (job,) = [j for j in jobs if j.spec.name == name]
        return job

    def engine_runs(self) -> list[tuple[int, int, int]]:
        """(pid, start_ns, end_ns) of every kernel the fake GPU ran (CLOCK_MONOTONIC)."""
        log = self.work / "fake" / "runs.log"
        runs = []
        for line in log.read_text().splitlines() if log.exists() else []:
            _, pid, _, start, end = line.split()
            runs.append((int(pid), int(start), int(end)))
        return runs


async def until(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    """Poll `check` until it holds; generous deadlines: the machine may be loaded."""
    await eventually(check, what, timeout_s, pause_s=0.05)


@contextlib.asynccontextmanager
async def live_plane(
    work: Path,
    build: Path,
    monkeypatch: pytest.MonkeyPatch,
    switch_us: int = 0,
    **training: object,
) -> AsyncIterator[Plane]:
    """Placement with the `training` settings (training_policy, ...) and no dispatcher yet."""
    # The jobs' processes inherit this environment through JobRunner: the fake driver, one
    # fake GPU's engine log for the whole test, and its context-switch cost.
    (work / "fake").mkdir()
    for name in [n for n in os.environ if n.startswith("GPULOOM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("GPULOOM_FAKE_CUDA_DIR", str(work / "fake"))
    monkeypatch.setenv("GPULOOM_FAKE_CUDA_SWITCH_US", str(switch_us))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(build / "fake"))
    settings = PlacementSettings(
        port=0,
        database_url=f"sqlite:///{work / 'placement.db'}",
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=30,
        **training,  # type: ignore[arg-type]
    )
    live = await start_placement(settings, work)
    plane = Plane(live, work, build)
    try:
        yield plane
    finally:
        for dispatcher in plane.dispatchers:
            await _stop(dispatcher, 0)
        await live.stop()


@pytest.fixture
async def plane(
    short_dir: Path,
    shim_build: Path,  # noqa: F811  (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Plane]:
    async with live_plane(short_dir, shim_build, monkeypatch, **GANDIVA) as plane:
        yield plane


@pytest.fixture
async def interfering_plane(
    short_dir: Path,
    shim_build: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Plane]:
    """Packed jobs interfere here: the fake GPU charges 10 ms per switch between processes
    (their kernels alternate when both run), and a packing trial lasts 5 s, so the packed
    mini-batch time is measured over a detection window that holds only packed time."""
    training = {**GANDIVA, "training_pack_trial_s": 5.0}
    async with live_plane(
        short_dir, shim_build, monkeypatch, INTERFERENCE_SWITCH_US, **training
    ) as plane:
        yield plane


def spec(name: str, hook: CheckpointHook | None = None, priority: int = 5) -> JobSpec:
    """A training job two of which share one GPU (a time quota of 50%, up to 100%)."""
    return JobSpec(
        name=name,
        kind=JobKind.TRAINING,
        share=share_of(100, 50, 100, memory_bytes=GIB, priority=priority),
        mps=True,
        checkpoint=hook,
    )


def train(
    steps: int, out: Path, state: Path | None = None, period_us: int = PERIOD_US
) -> list[str]:
    """cudart_like's fake training loop, its output appended to `out` after a line naming its
    dispatcher's socket (exec: the job's process is the loop itself, the one the shim
    registers); with `state`, it checkpoints there on SIGUSR1 and starts from it."""
    loop = [
        str(PROGRAM), "module", KERNEL, "alloc", "alloc", str(WEIGHTS),
        "train", str(steps), str(period_us), str(LAYERS), str(ACTIVATIONS), KERNEL,
    ]  # fmt: skip
    saves = f"CUDART_LIKE_TRAIN_STATE={state} " if state else ""
    script = f'echo "socket $GPULOOM_DISPATCHER_SOCKET" >> {out}; {saves}exec "$@" >> {out}'
    return ["sh", "-c", script, "sh", *loop]


def start(plane: Plane, job: JobSpec, command: list[str], said: list[str]) -> asyncio.Future:
    def run() -> RunOutcome:
        with PlacementClient(plane.address) as client:
            runner = JobRunner(
                client, shim_path=str(plane.build / "libgpuloom.so"), on_message=said.append
            )
            return runner.run(job, command)

    return asyncio.ensure_future(asyncio.to_thread(run))


def start_pair(
    plane: Plane, name: str, steps: int, state: Path, said: list[str]
) -> tuple[asyncio.Future, asyncio.Future, Path]:
    """A plain loop (100 steps) and job `name`, a loop of `steps` that checkpoints to `state`
    on SIGUSR1 (its hook), both started; the latter's output file."""
    plain = start(plane, spec("plain"), train(100, plane.work / "plain.out"), said)
    out = plane.work / f"{name}.out"
    hook = CheckpointHook(signal="SIGUSR1", timeout_s=20)
    hooked = start(plane, spec(name, hook), train(steps, out, state=state), said)
    return plain, hooked, out


async def five_steps(out: Path) -> None:
    async def running() -> bool:
        return out.exists() and out.read_text().count("train step") >= 5

    await until("the job with a hook running", running, 20)


def pid_of(out: Path) -> int:
    for line in out.read_text().splitlines():
        if line.startswith("init"):
            return int(line.split("pid=")[1].split()[0])
    raise AssertionError(f"no init line in {out}")


def alternations(runs: list[tuple[int, int, int]], since_ns: int, until_ns: int) -> int:
    """How often the fake GPU went from one process's kernels to the other's."""
    pids = [
        pid for pid, start, _ in sorted(runs, key=lambda r: r[1]) if since_ns < start < until_ns
    ]
    return sum(1 for a, b in itertools.pairwise(pids) if a != b)


async def test_two_real_training_processes_are_time_sliced_then_packed(plane: Plane) -> None:
    await plane.add_gpu()
    steps = 150
    said: list[str] = []
    outs = [plane.work / f"train-{i}.out" for i in range(2)]
    runs = [start(plane, spec(f"t{i}"), train(steps, outs[i]), said) for i in range(2)]
    try:

        async def both_assigned() -> bool:
            jobs = (await plane.live.stub.ListJobs(pb.ListJobsRequest())).jobs
            return len([j for j in jobs if j.state == pb.JOB_STATE_ASSIGNED]) == 2

        await until("both jobs assigned", both_assigned, 20)
        first, second = [(await plane.job_named(f"t{i}")).job_id for i in range(2)]
        assert (await plane.job(first)).assignment.gpu.gpu_uuid == (
            await plane.job(second)
        ).assignment.gpu.gpu_uuid

        # Time-slicing: each is seen suspended, and each running while the other is.
        seen: dict[str, set[int]] = {first: set(), second: set()}
        sliced_since_ns = 0

        async def flipped() -> bool:
            nonlocal sliced_since_ns
            a, b = await plane.job(first), await plane.job(second)
            for job in (a, b):
                seen[job.job_id].add(job.training.phase)
            if not sliced_since_ns and pb.TRAINING_PHASE_SUSPENDED in (
                a.training.phase,
                b.training.phase,
            ):
                sliced_since_ns = time.monotonic_ns()
            return all(
                {pb.TRAINING_PHASE_SUSPENDED, pb.TRAINING_PHASE_RUNNING} <= s for s in seen.values()
            )

        await until("both jobs suspended and resumed in turn", flipped, 20)
        job = await plane.job(first)
        assert job.training.height == 2

        # Mini-batch times from the real heartbeats, then the policy packs them.
        async def packed() -> bool:
            a, b = await plane.job(first), await plane.job(second)
            return bool(a.training.packings) and all(
                j.training.phase == pb.TRAINING_PHASE_PACKED for j in (a, b)
            )

        await until("a packing trial", packed, 30)
        packed_seen_ns = time.monotonic_ns()
        a, b = await plane.job(first), await plane.job(second)
        for job, other in ((a, b), (b, a)):
            # The loop's pace (100 ms; later, never sooner, on a loaded machine), as detected.
            assert 0.08 <= job.training.solo_minibatch_s <= 0.2, job.training
            assert job.training.packed_with == other.job_id
            trial = job.training.packings[-1]
            assert trial.partner == other.job_id
            assert trial.solo_minibatch_s == job.training.solo_minibatch_s
        offset_ns = time.time_ns() - time.monotonic_ns()
        packed_at_ns = a.training.packings[-1].started_at.ToNanoseconds() - offset_ns

        # Packed, both run at once: the engine interleaves their kernels.
        await asyncio.sleep(1.5)
        interleaved_until_ns = time.monotonic_ns()
    finally:
        outcomes = await asyncio.wait_for(asyncio.gather(*runs), 120)

    for outcome, out in zip(outcomes, outs, strict=True):
        assert outcome.exit_code == 0, (said, out.read_text())
        assert f"train minibatches={steps} done={steps} failed=0" in out.read_text()
    engine = plane.engine_runs()
    pids = {pid_of(out) for out in outs}
    assert {pid for pid, _, _ in engine} == pids
    # While time-sliced, one process runs at a time: the GPU goes from one's kernels to the
    # other's about once a quantum (at most twice, allowing a kernel queued before a
    # suspension), where running together they alternate every few kernels.
    window_s = (packed_at_ns - sliced_since_ns) / 1e9 - 0.2
    assert window_s > 1.5, "sliced too briefly to judge"
    sliced = alternations(engine, sliced_since_ns + int(0.1e9), packed_at_ns - int(0.1e9))
    assert sliced <= 2 * (window_s / QUANTUM_S + 2), (sliced, window_s)
    together = alternations(engine, packed_seen_ns, interleaved_until_ns)
    assert together > 4 * (interleaved_until_ns - packed_seen_ns) / 1e9, together


async def test_a_packing_that_loses_to_time_slicing_is_undone(interfering_plane: Plane) -> None:
    """Two real training loops (16 kernels of 1.25 ms per 40 ms mini-batch) on a fake GPU that
    charges 10 ms per switch between processes: packed, their kernels alternate and each
    mini-batch takes several times as long, a gain well below time-slicing's
    0.67 (2 s turns, 1 s per switch). The trial measures that from the dispatcher's mini-batch
    times, undoes the packing, and the jobs go back to taking turns, never packed again."""
    plane = interfering_plane
    await plane.add_gpu()
    undone_before = counter("gpuloom_placement_training_packings_total", outcome="undone")
    steps = 240  # about 6 s alone: enough to be taking turns still when the trial is undone
    said: list[str] = []
    outs = [plane.work / f"train-{i}.out" for i in range(2)]
    runs = [
        start(plane, spec(f"t{i}"), train(steps, outs[i], period_us=40_000), said) for i in range(2)
    ]
    try:

        async def trial_measured() -> bool:
            jobs = (await plane.live.stub.ListJobs(pb.ListJobsRequest())).jobs
            return len(jobs) == 2 and all(
                j.training.packings and j.training.packings[-1].gain > 0 for j in jobs
            )

        await until("a measured packing trial", trial_measured, 60)
        ids = [(await plane.job_named(f"t{i}")).job_id for i in range(2)]
        efficiency = slice_efficiency(QUANTUM_S, SWITCH_S)
        for job_id in ids:
            trial = (await plane.job(job_id)).training.packings[-1]
            assert 0 < trial.gain < efficiency, trial
            assert trial.packed_minibatch_s > 2 * trial.solo_minibatch_s, trial

        async def sliced_again() -> bool:
            a, b = [await plane.job(j) for j in ids]
            undone = all(j.training.packings[-1].undone for j in (a, b))
            phases = {a.training.phase, b.training.phase}
            return undone and phases == {pb.TRAINING_PHASE_SUSPENDED, pb.TRAINING_PHASE_RUNNING}

        await until("back to time-slicing", sliced_again, 15)
        assert (
            counter("gpuloom_placement_training_packings_total", outcome="undone")
            == undone_before + 1
        )
        # Not packed again: a quantum and a half later, still one packing trial each.
        await asyncio.sleep(1.5 * QUANTUM_S)
        for job_id in ids:
            job = await plane.job(job_id)
            assert len(job.training.packings) == 1, job.training
            assert job.training.phase != pb.TRAINING_PHASE_PACKED
    finally:
        outcomes = await asyncio.wait_for(asyncio.gather(*runs), 120)
    for outcome, out in zip(outcomes, outs, strict=True):
        assert outcome.exit_code == 0, (said, out.read_text())
        assert f"train minibatches={steps} done={steps} failed=0" in out.read_text()


async def _high_then_low(
    plane: Plane, steps: dict[str, int], said: list[str]
) -> tuple[dict[str, Path], list[asyncio.Future]]:
    """Training job "high" of priority 0 started, then, once its kernels run, "low" of
    priority 5 (`steps` each): their output files and runs."""
    outs = {name: plane.work / f"{name}.out" for name in ("high", "low")}
    runs = [start(plane, spec("high", priority=0), train(steps["high"], outs["high"]), said)]

    async def high_runs() -> bool:
        return bool(plane.engine_runs())

    await until("the high job's first kernels", high_runs, 20)
    runs.append(start(plane, spec("low", priority=5), train(steps["low"], outs["low"]), said))
    return outs, runs


def _every_step_ran_once(
    outcomes: list[RunOutcome], outs: dict[str, Path], steps: dict[str, int], said: list[str]
) -> None:
    for outcome, name in zip(outcomes, ("high", "low"), strict=True):
        text = outs[name].read_text()
        assert outcome.exit_code == 0, (said, text)
        assert f"train minibatches={steps[name]} done={steps[name]} failed=0" in text


async def test_a_lower_priority_job_waits_and_the_higher_one_is_never_suspended(
    plane: Plane,
) -> None:
    """Two real training processes of priorities 0 and 5 on one GPU: the round-robin is over
    the highest priority present only, so the priority-5 job is suspended while the other
    runs, the priority-0 job never is, and the waiting one finishes every step after it."""
    await plane.add_gpu()
    said: list[str] = []
    steps = {"high": 50, "low": 20}
    outs, runs = await _high_then_low(plane, steps, said)
    phases: dict[str, set[int]] = {"high": set(), "low": set()}
    waited_since_ns = 0
    try:

        async def high_done() -> bool:
            nonlocal waited_since_ns
            jobs = (await plane.live.stub.ListJobs(pb.ListJobsRequest())).jobs
            by_name = {j.spec.name: j for j in jobs}
            for name, job in by_name.items():
                phases[name].add(job.training.phase)
            low = by_name.get("low")
            if not waited_since_ns and low and low.training.phase == pb.TRAINING_PHASE_SUSPENDED:
                waited_since_ns = time.monotonic_ns()
            return by_name["high"].state == pb.JOB_STATE_SUCCEEDED

        await until("the high job done", high_done, 60)
        high_ended_ns = time.monotonic_ns()
    finally:
        outcomes = await asyncio.wait_for(asyncio.gather(*runs), 120)
    _every_step_ran_once(outcomes, outs, steps, said)
    assert pb.TRAINING_PHASE_SUSPENDED not in phases["high"], phases
    assert waited_since_ns, f"the low job was never seen suspended: {phases}"
    # From its suspension to the high job's end, the low one ran nothing (a kernel queued
    # before the suspension aside).
    low_pid = pid_of(outs["low"])
    late = [r for r in plane.engine_runs() if r[0] == low_pid]
    during = [r for r in late if waited_since_ns + int(0.3e9) < r[1] < high_ended_ns - int(0.5e9)]
    assert not during, len(during)


async def test_a_suspension_a_restarted_dispatcher_lost_is_made_again(plane: Plane) -> None:
    """The priority-5 job is suspended beside a priority-0 one; their dispatcher restarts
    (it keeps reservations, not suspensions) and the shims reconnect, so the low job runs
    again; once the dispatcher reports it running, placement suspends it again. No step of
    either job is lost or run twice."""
    await plane.add_gpu()
    said: list[str] = []
    steps = {"high": 250, "low": 20}
    outs, runs = await _high_then_low(plane, steps, said)
    try:
        low = await _until_suspended(plane, "low")
        restarted = await plane.restart_gpu(0)
        restarted_ns = time.monotonic_ns()
        low_pid = pid_of(outs["low"])

        async def low_ran_again() -> bool:
            return any(p == low_pid and begin > restarted_ns for p, begin, _ in plane.engine_runs())

        await until("the low job running after the restart", low_ran_again, 30)
        await _until_suspended(plane, "low", restarted)
        suspended_ns = time.monotonic_ns()
        high = await plane.job_named("high")
        assert high.state == pb.JOB_STATE_ASSIGNED, "the high job ended too soon for the test"
        await asyncio.sleep(2.0)
        assert (await plane.job_named("high")).training.phase != pb.TRAINING_PHASE_SUSPENDED
        # Suspended at the dispatcher for real (a kernel queued before it aside).
        late = [r for r in plane.engine_runs() if r[0] == low_pid and r[1] > suspended_ns + 3e8]
        assert not late, len(late)
        assert low.job_id == (await plane.job_named("low")).job_id
    finally:
        outcomes = await asyncio.wait_for(asyncio.gather(*runs), 180)
    _every_step_ran_once(outcomes, outs, steps, said)


async def _until_suspended(
    plane: Plane, name: str, dispatcher: GpuDispatcher | None = None
) -> pb.Job:
    """Until placement shows job `name` suspended and (`dispatcher`) that dispatcher holds
    its client suspended."""

    async def suspended() -> bool:
        jobs = (await plane.live.stub.ListJobs(pb.ListJobsRequest())).jobs
        job = next((j for j in jobs if j.spec.name == name), None)
        if job is None or job.training.phase != pb.TRAINING_PHASE_SUSPENDED:
            return False
        if dispatcher is None:
            return True
        status = await dispatcher.core.client_status(job.job_id)
        return status.suspension is not None

    await until(f"job {name} suspended", suspended, 30)
    return await plane.job_named(name)


async def test_a_real_job_with_a_signal_hook_migrates_between_real_dispatchers(
    plane: Plane,
) -> None:
    """A plain training loop and one that checkpoints on SIGUSR1 (cudart_like's `train` with
    CUDART_LIKE_TRAIN_STATE) share GPU 0; a second dispatcher's GPU registers; placement
    spreads the one with the hook there through `gpuloom run`'s checkpoint: it saves its next
    step, stops, and starts again from it on the new dispatcher, and every step runs once."""
    first = await plane.add_gpu()
    moved_before = counter("gpuloom_placement_training_migrations_total", outcome="moved")
    said: list[str] = []
    steps = 60
    plain, mover, out = start_pair(plane, "mover", steps, plane.work / "mover.state", said)
    try:
        await five_steps(out)
        job = await plane.job_named("mover")
        assert job.assignment.gpu.gpu_uuid == first.core.gpu.gpu_uuid
        second = await plane.add_gpu()
        result = await asyncio.wait_for(mover, 60)
    finally:
        outcome = await asyncio.wait_for(plain, 120)
    assert outcome.exit_code == 0, said
    assert result.exit_code == 0, (said, out.read_text())
    lines = out.read_text().splitlines()
    sockets = [line.split()[1] for line in lines if line.startswith("socket ")]
    assert sockets == [first.core.socket_path, second.core.socket_path], lines
    starts = [int(line.split("=")[1]) for line in lines if line.startswith("train start")]
    (checkpoint,) = [int(line.split("=")[1]) for line in lines if line.startswith("train check")]
    assert starts == [0, checkpoint] and 0 < checkpoint < steps, lines
    done = [int(line.split()[2]) for line in lines if line.startswith("train step")]
    assert done == list(range(steps)), lines  # every step once: none lost, none redone
    summaries = [line for line in lines if line.startswith("train minibatches")]
    assert summaries == [
        f"train minibatches={steps} done={checkpoint} failed=0",
        f"train minibatches={steps} done={steps - checkpoint} failed=0",
    ]
    # Two processes, one after the other; each ran its mini-batches' kernels on the GPU.
    before, after = (int(line.split("pid=")[1]) for line in lines if line.startswith("init"))
    engine = plane.engine_runs()
    assert len([r for r in engine if r[0] == before]) == checkpoint * 2 * LAYERS
    assert len([r for r in engine if r[0] == after]) == (steps - checkpoint) * 2 * LAYERS
    assert max(r[2] for r in engine if r[0] == before) < min(r[1] for r in engine if r[0] == after)
    moved = await plane.job(job.job_id)
    assert moved.state == pb.JOB_STATE_SUCCEEDED
    assert moved.assignment.gpu.gpu_uuid == second.core.gpu.gpu_uuid
    assert (
        counter("gpuloom_placement_training_migrations_total", outcome="moved") == moved_before + 1
    )
    assert any(f"moved to GPU {second.core.gpu.gpu_uuid}" in line for line in said), said
    # The first dispatcher let the reservation go; the second released it at its end.
    for dispatcher in (first, second):
        await until(
            "the reservations released",
            lambda d=dispatcher: _holds_none(d, job.job_id),
            10,
        )


async def test_a_job_whose_hook_fails_starts_again_on_its_own_reservation(
    plane: Plane,
) -> None:
    """The same set-up as the migration, but the job cannot save its checkpoint (its state
    directory does not exist): it exits non-zero on SIGUSR1, `gpuloom run` reports the hook
    failed and starts it again where it was, on the same assignment, and the dispatcher lets
    the new process take over the token of the one that exited."""
    first = await plane.add_gpu()
    said: list[str] = []
    steps = 40
    state = plane.work / "missing" / "broken.state"
    plain, mover, out = start_pair(plane, "broken", steps, state, said)
    try:
        await five_steps(out)
        job = await plane.job_named("broken")
        await plane.add_gpu()

        async def restarted() -> bool:
            return out.read_text().count("init ") >= 2

        await until("the job started again", restarted, 30)
        pids = [
            int(line.split("pid=")[1]) for line in out.read_text().splitlines() if "pid=" in line
        ]
        reservation = first.core.book.get(job.assignment.assignment_id)
        assert reservation is not None and reservation.bound is not None
        assert reservation.bound.pid == pids[-1]  # the new process holds the token now
        result = await asyncio.wait_for(mover, 60)
    finally:
        outcome = await asyncio.wait_for(plain, 120)
    assert outcome.exit_code == 0, said
    assert result.exit_code == 0, (said, out.read_text())
    assert any("checkpoint hook failed" in line for line in said), said
    lines = out.read_text().splitlines()
    sockets = [line.split()[1] for line in lines if line.startswith("socket ")]
    assert sockets == [first.core.socket_path] * 2, lines  # started again where it was
    assert f"train minibatches={steps} done={steps} failed=0" in lines, lines


async def _holds_none(dispatcher: GpuDispatcher, assignment_id: str) -> bool:
    return dispatcher.core.book.get(assignment_id) is None


@pytest.mark.parametrize("gpus", [1, 2])
async def test_a_pending_job_is_time_sliced_into_a_full_gpu(
    short_dir: Path,
    shim_build: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    gpus: int,
) -> None:
    """Two jobs each asking for the whole GPU (time quota 100%), or both for two whole GPUs:
    the second waits, then (its wait and the first one's service past the shortened rules)
    joins the first one's round-robin: reserved in its rectangle on each GPU (on each GPU's
    dispatcher) and suspended from the start, its process runs no kernel until the first job
    is suspended for its turn; they take turns; every step of both runs exactly once."""
    training = {
        **GANDIVA,
        "training_slice_after_s": 1.0,
        "training_share_after_s": 1.0,
        "training_queue_ahead": 0,
        "training_bet_min_ended": 0,  # no training job has ended before
    }
    async with live_plane(short_dir, shim_build, monkeypatch, **training) as plane:
        for _ in range(gpus):
            await plane.add_gpu()
        said: list[str] = []
        steps = {"first": 80, "rider": 30}
        outs = {name: plane.work / f"{name}.out" for name in steps}

        def whole(name: str) -> JobSpec:
            if gpus > 1:
                return JobSpec(
                    name=name,
                    kind=JobKind.TRAINING,
                    share=share_of(memory_bytes=GIB),
                    whole_gpus=gpus,
                )
            return JobSpec(
                name=name,
                kind=JobKind.TRAINING,
                share=share_of(100, 100, memory_bytes=GIB),
                mps=True,
            )

        runs = [start(plane, whole("first"), train(steps["first"], outs["first"]), said)]

        async def first_runs() -> bool:
            return bool(plane.engine_runs())

        await until("the first job's kernels", first_runs, 20)
        runs.append(start(plane, whole("rider"), train(steps["rider"], outs["rider"]), said))
        states: set[int] = set()
        phases: dict[str, set[int]] = {"first": set(), "rider": set()}
        first_suspended_ns = 0
        try:

            async def rider_known() -> bool:
                jobs = (await plane.live.stub.ListJobs(pb.ListJobsRequest())).jobs
                rider = next((j for j in jobs if j.spec.name == "rider"), None)
                if rider is not None:
                    states.add(rider.state)
                return rider is not None

            await until("the rider submitted", rider_known, 20)
            assert states == {pb.JOB_STATE_PENDING}, "the GPU was not full"

            async def taking_turns() -> bool:
                nonlocal first_suspended_ns
                jobs = (await plane.live.stub.ListJobs(pb.ListJobsRequest())).jobs
                by_name = {j.spec.name: j for j in jobs}
                for name, job in by_name.items():
                    if job.state == pb.JOB_STATE_ASSIGNED:
                        phases[name].add(job.training.phase)
                first = by_name["first"]
                if not first_suspended_ns and first.training.phase == pb.TRAINING_PHASE_SUSPENDED:
                    first_suspended_ns = time.monotonic_ns()
                return all(
                    {pb.TRAINING_PHASE_SUSPENDED, pb.TRAINING_PHASE_RUNNING} <= seen
                    for seen in phases.values()
                )

            await until("the two taking turns", taking_turns, 30)
            first, rider = await plane.job_named("first"), await plane.job_named("rider")
            assert rider.assignment.time_slice_of == first.job_id
            assert rider.assignment.gpu.gpu_uuid == first.assignment.gpu.gpu_uuid
            assert [g.gpu.gpu_uuid for g in rider.assignment.extra_gpus] == [
                g.gpu.gpu_uuid for g in first.assignment.extra_gpus
            ]
            assert len(rider.assignment.extra_gpus) == gpus - 1
            assert first.training.height == 2
            status = await plane.dispatchers[0].core.client_status(rider.job_id)
            assert status is not None
        finally:
            outcomes = await asyncio.wait_for(asyncio.gather(*runs), 180)
        for outcome, name in zip(outcomes, steps, strict=True):
            text = outs[name].read_text()
            assert outcome.exit_code == 0, (said, text)
            assert f"train minibatches={steps[name]} done={steps[name]} failed=0" in text
        # Suspended from its reservation: the rider's first kernel ran in its first turn, the
        # first job suspended (no kernel of it in the next second; a quantum is 2 s), not
        # beside the first job as it would have from its start (a mini-batch every 0.1 s).
        engine = plane.engine_runs()
        rider_pid, first_pid = pid_of(outs["rider"]), pid_of(outs["first"])
        rider_first = min(begin for pid, begin, _ in engine if pid == rider_pid)
        beside = [
            begin for pid, begin, _ in engine if pid == first_pid and 0 < begin - rider_first < 1e9
        ]
        assert not beside, f"{len(beside)} kernels of the first job beside the rider's first"
        assert first_suspended_ns


STEADY_LAYER = 64 * MIB  # 4 layers: 256 MiB per job, two of them above the fake GPU's 400 MiB
STEADY_KERNELS = "k_fwd_200us,k_bwd_300us,k_opt_100us"
RELEASED = "gpuloom_dispatcher_suspend_memory_total"


def steady(steps: int, out: Path, layer: int = STEADY_LAYER) -> list[str]:
    """cudart_like's loop that allocates once and reuses (as PyTorch's caching allocator
    does; 4 layers of 64 MiB, a mini-batch every 20 ms), its output appended to `out`: it
    checks at every step that no step was lost or repeated, and every byte at the end."""
    loop = [
        str(PROGRAM), "module", STEADY_KERNELS,
        "steady", str(steps), "20000", "4", str(layer), STEADY_KERNELS,
    ]  # fmt: skip
    return ["sh", "-c", f'exec "$@" >> {out}', "sh", *loop]


async def fake_gpu_free(plane: Plane) -> int:
    """The fake GPU's free memory, as a process outside the shim sees it."""
    process = await asyncio.create_subprocess_exec(
        str(PROGRAM), "meminfo", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(process.communicate(), 30)
    line = next(x for x in out.decode().splitlines() if x.startswith("meminfo"))
    return int(line.split("free=")[1].split()[0])


async def test_two_jobs_whose_memory_sums_above_the_gpu_take_turns(
    short_dir: Path,
    shim_build: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Suspension that frees memory, through placement: two jobs each asking for 50 GiB of
    an 80 GiB GPU (and really allocating 256 MiB each of the fake GPU's 400 MiB, which the
    fake driver's processes share). The dispatcher has the driver's checkpoint API (the fake
    driver's) and says so in its heartbeats, so placement time-slices the second into the
    first's group with the memory taken in turns; each suspension checkpoints the job's
    memory to host memory, so the other can allocate. Every step of both runs exactly once,
    every byte survives, and the fake GPU's free memory is back within 1% at the end."""
    training = {
        **GANDIVA,
        "training_slice_after_s": 1.0,
        "training_share_after_s": 1.0,
        "training_queue_ahead": 0,
        "training_bet_min_ended": 0,
    }
    async with live_plane(short_dir, shim_build, monkeypatch, **training) as plane:
        monkeypatch.setenv("GPULOOM_FAKE_CUDA_SHARED_MEMORY", "1")
        monkeypatch.setenv("GPULOOM_FAKE_CUDA_MEM_MIB", "400")
        plane.release_memory = True
        free_before = await fake_gpu_free(plane)
        released_before = counter(RELEASED, gpu="0", outcome="released")
        failed_before = counter(RELEASED, gpu="0", outcome="restore_failed")
        dispatcher = await plane.add_gpu()
        assert dispatcher.core.book.memory_in_turns
        said: list[str] = []
        steps = {"first": 500, "rider": 150}
        outs = {name: plane.work / f"{name}.out" for name in steps}

        def half_gpu_memory_and_more(name: str) -> JobSpec:
            return JobSpec(
                name=name,
                kind=JobKind.TRAINING,
                share=share_of(100, 100, memory_bytes=50 * GIB),
                mps=True,
            )

        runs = [
            start(
                plane,
                half_gpu_memory_and_more("first"),
                steady(steps["first"], outs["first"]),
                said,
            )
        ]

        async def first_allocated() -> bool:
            return outs["first"].exists() and "steady allocated" in outs["first"].read_text()

        await until("the first job's memory allocated", first_allocated, 20)
        runs.append(
            start(
                plane,
                half_gpu_memory_and_more("rider"),
                steady(steps["rider"], outs["rider"]),
                said,
            )
        )
        phases: dict[str, set[int]] = {"first": set(), "rider": set()}
        released_seen = False
        try:

            async def taking_turns() -> bool:
                nonlocal released_seen
                jobs = (await plane.live.stub.ListJobs(pb.ListJobsRequest())).jobs
                for job in jobs:
                    if job.state == pb.JOB_STATE_ASSIGNED:
                        phases[job.spec.name].add(job.training.phase)
                        released_seen |= job.training.memory_released
                return released_seen and all(
                    {pb.TRAINING_PHASE_SUSPENDED, pb.TRAINING_PHASE_RUNNING} <= seen
                    for seen in phases.values()
                )

            await until("the two taking turns, a suspension's memory released", taking_turns, 40)
            first, rider = await plane.job_named("first"), await plane.job_named("rider")
            assert rider.assignment.time_slice_of == first.job_id
            assert rider.training.memory_in_turns and first.training.memory_in_turns
        finally:
            outcomes = await asyncio.wait_for(asyncio.gather(*runs), 180)
        for outcome, name in zip(outcomes, steps, strict=True):
            text = outs[name].read_text()
            assert outcome.exit_code == 0, (said, text)
            n = steps[name]
            assert f"steady minibatches={n} done={n} failed=0 corrupt=0 damaged_layers=0" in text
            ran = [int(x.split()[2]) for x in text.splitlines() if x.startswith("steady step")]
            assert ran == list(range(n)), f"{name}: a step lost or repeated"
        # 256 + 256 MiB never fit the 400 MiB fake GPU together: the rider allocated only
        # because the first job's memory went to host memory while it was suspended.
        assert counter(RELEASED, gpu="0", outcome="released") > released_before
        assert counter(RELEASED, gpu="0", outcome="restore_failed") == failed_before
        free_after = await fake_gpu_free(plane)
        assert abs(free_after - free_before) <= free_before / 100, (free_before, free_after)


async def test_the_head_of_the_queue_preempts_a_backfilled_job_live(
    short_dir: Path,
    shim_build: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Head-of-queue preemption through suspension, live: "head" (60 GiB of the 80 GiB GPU,
    half its time) waits behind "first" (40 GiB); "late" (30 GiB) arrives after it and takes
    the other half (backfilling). Once "first" ends the head still does not fit beside
    "late"; having waited its (shortened) turn it preempts "late": it joins late's time-slice
    group with the memory in turns (really 320 + 128 MiB on the fake GPU's 400 MiB), "late" is
    suspended (its memory checkpointed) and runs no kernel until the head has ended, then
    runs on. Every step of each runs exactly once; the free memory comes back."""
    training = {
        **GANDIVA,
        "training_slice_after_s": 604_800.0,  # never time-sliced in: only preemption
        "training_share_after_s": 1.0,
        "training_queue_ahead": 0,
        "training_bet_min_ended": 0,
        "training_preempt_after_s": 1.0,
    }
    async with live_plane(short_dir, shim_build, monkeypatch, **training) as plane:
        monkeypatch.setenv("GPULOOM_FAKE_CUDA_SHARED_MEMORY", "1")
        monkeypatch.setenv("GPULOOM_FAKE_CUDA_MEM_MIB", "400")
        plane.release_memory = True
        free_before = await fake_gpu_free(plane)
        await plane.add_gpu()
        said: list[str] = []
        steps = {"first": 100, "head": 100, "late": 300}
        layers = {"first": 32 * MIB, "head": 80 * MIB, "late": 32 * MIB}
        memory = {"first": 40, "head": 60, "late": 30}
        outs = {name: plane.work / f"{name}.out" for name in steps}

        def half(name: str) -> JobSpec:
            return JobSpec(
                name=name,
                kind=JobKind.TRAINING,
                share=share_of(100, 50, 100, memory_bytes=memory[name] * GIB),
                mps=True,
            )

        def run(name: str) -> asyncio.Future:
            return start(plane, half(name), steady(steps[name], outs[name], layers[name]), said)

        async def state_of(name: str) -> int:
            jobs = (await plane.live.stub.ListJobs(pb.ListJobsRequest())).jobs
            return next((j.state for j in jobs if j.spec.name == name), 0)

        runs = {"first": run("first")}
        try:

            async def first_allocated() -> bool:
                return outs["first"].exists() and "steady allocated" in outs["first"].read_text()

            await until("the first job's memory allocated", first_allocated, 20)
            runs["head"] = run("head")

            async def head_waits() -> bool:
                return await state_of("head") == pb.JOB_STATE_PENDING

            await until("the head waiting", head_waits, 20)
            runs["late"] = run("late")
            preempted_ns = 0

            async def preempted() -> bool:
                nonlocal preempted_ns
                jobs = (await plane.live.stub.ListJobs(pb.ListJobsRequest())).jobs
                late = next((j for j in jobs if j.spec.name == "late"), None)
                if late is not None and late.training.preempted_by and not preempted_ns:
                    preempted_ns = time.monotonic_ns()
                return bool(preempted_ns)

            await until("the late job preempted", preempted, 40)
            head, late = await plane.job_named("head"), await plane.job_named("late")
            assert late.training.preempted_by == head.job_id
            assert head.assignment.time_slice_of == late.job_id

            async def head_done() -> bool:
                return await state_of("head") == pb.JOB_STATE_SUCCEEDED

            await until("the head done", head_done, 60)
            head_done_ns = time.monotonic_ns()
        finally:
            outcomes = await asyncio.wait_for(asyncio.gather(*runs.values()), 180)
        for outcome, name in zip(outcomes, runs, strict=True):
            text = outs[name].read_text()
            assert outcome.exit_code == 0, (said, text)
            n = steps[name]
            assert f"steady minibatches={n} done={n} failed=0 corrupt=0 damaged_layers=0" in text
            ran = [int(x.split()[2]) for x in text.splitlines() if x.startswith("steady step")]
            assert ran == list(range(n)), f"{name}: a step lost or repeated"
        # While the head ran, the preempted job ran nothing (the suspension at most a period
        # late after placement showed it; the head's last kernels a heartbeat before its end).
        engine = plane.engine_runs()
        late_pid, head_pid = pid_of(outs["late"]), pid_of(outs["head"])
        head_runs = [begin for pid, begin, _ in engine if pid == head_pid]
        assert head_runs and min(head_runs) > preempted_ns - int(2e9)
        during = [
            begin
            for pid, begin, _ in engine
            if pid == late_pid and min(head_runs) < begin < max(head_runs)
        ]
        assert not during, f"{len(during)} kernels of the preempted job while the head ran"
        assert max(head_runs) < head_done_ns
        free_after = await fake_gpu_free(plane)
        assert abs(free_after - free_before) <= free_before / 100, (free_before, free_after)


FAKE_UUIDS = (
    "GPU-aaaa0000-0000-0000-0000-000000000000",
    "GPU-aaaa0000-0000-0000-0000-000000000001",
)


class FakeGpusBackend(SimulatedBackend):
    """The simulated GPUs under the fake driver's GPU UUIDs (GPULOOM_FAKE_CUDA_GPUS), which
    the driver's GPU pairs name."""

    def gpu(self, index: int) -> GpuInfo:
        return dataclasses.replace(super().gpu(index), gpu_uuid=FAKE_UUIDS[index])

    def gpus(self) -> list[GpuInfo]:
        return [self.gpu(i) for i in range(len(super().gpus()))]


async def test_a_job_without_a_hook_migrates_between_real_dispatchers(
    short_dir: Path,
    shim_build: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Migration without a hook, live: two loops that allocate once and reuse (no checkpoint
    hook) share GPU 0 of a node whose two fake GPUs (GPULOOM_FAKE_CUDA_GPUS, one chip type)
    each have a dispatcher with the driver's checkpoint API; once GPU 1 registers, placement
    spreads one of them there by suspending it (its memory checkpointed), MoveClient
    (restored onto GPU 1, its shim registered with GPU 1's dispatcher) and UnlockMovedClient.
    The same process runs on, every step exactly once and every byte intact, `gpuloom run`
    never restarting it, and its memory is GPU 1's."""
    async with live_plane(short_dir, shim_build, monkeypatch, **GANDIVA) as plane:
        gpus = ",".join(f"{uuid}=A100:1024" for uuid in FAKE_UUIDS)
        monkeypatch.setenv("GPULOOM_FAKE_CUDA_GPUS", gpus)
        monkeypatch.setenv("GPULOOM_FAKE_CUDA_GPU", FAKE_UUIDS[0])  # where jobs start
        plane.release_memory = True
        plane.backend = FakeGpusBackend("2xA100-80GB")
        moved_before = counter("gpuloom_placement_training_migrations_total", outcome="moved")
        first = await plane.add_gpu()
        said: list[str] = []
        steps = 300
        outs = {name: plane.work / f"{name}.out" for name in ("a", "b")}
        runs = [start(plane, spec(name), steady(steps, out), said) for name, out in outs.items()]
        try:

            async def allocated() -> bool:
                return all(
                    o.exists() and "steady allocated" in o.read_text() for o in outs.values()
                )

            await until("both jobs' memory allocated", allocated, 20)
            second = await plane.add_gpu()

            async def one_moved() -> bool:
                jobs = (await plane.live.stub.ListJobs(pb.ListJobsRequest())).jobs
                return any(
                    j.assignment.gpu.gpu_uuid == FAKE_UUIDS[1] and j.training.migrations == 1
                    for j in jobs
                )

            await until("a job moved to GPU 1", one_moved, 60)
        finally:
            outcomes = await asyncio.wait_for(asyncio.gather(*runs), 180)
        for outcome, (name, out) in zip(outcomes, outs.items(), strict=True):
            text = out.read_text()
            assert outcome.exit_code == 0, (said, text)
            assert f"steady minibatches={steps} done={steps} failed=0 corrupt=0" in text, text
            ran = [int(x.split()[2]) for x in text.splitlines() if x.startswith("steady step")]
            assert ran == list(range(steps)), f"{name}: a step lost or repeated"
            assert text.count("init rc=0") == 1, f"{name}: started again"
        moved = [await plane.job_named(name) for name in outs]
        assert sorted(j.assignment.gpu.gpu_uuid for j in moved) == sorted(FAKE_UUIDS)
        assert (
            counter("gpuloom_placement_training_migrations_total", outcome="moved")
            == moved_before + 1
        )
        for dispatcher in (first, second):
            for job in moved:
                await until(
                    "the reservations released",
                    lambda d=dispatcher, j=job: _holds_none(d, j.job_id),
                    10,
                )
