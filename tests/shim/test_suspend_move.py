"""Migration without a hook, on one node, end to end at the dispatcher level: two live
dispatchers (one per fake GPU of one node, GPULOOM_FAKE_CUDA_GPUS), the shim, and the fake
driver's checkpoint API. The source dispatcher suspends a training loop (lock + checkpoint),
`MoveClient` (`move_out`) restores it onto the target GPU (the driver's GPU pairs) and tells
its shim to register with the target's dispatcher under the target's reservation; the target's
`UnlockMovedClient` (`unlock_moved`) lets it run there. Every step runs exactly once, every
byte is intact, the memory is the target GPU's. Faults: a target of another chip type (stays
suspended on the source, the reason shown, resumable there), a move of a client that is not
checkpointed, bad targets (refused, nothing changed)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gpuloom.domain.errors import FailedPrecondition, InvalidArgument
from gpuloom.services.dispatcher.app import GpuDispatcher, start_gpu_dispatcher
from gpuloom.services.dispatcher.domain import MoveTarget
from gpuloom.services.dispatcher.gpu.simulated import SimulatedBackend
from gpuloom.v1 import dispatcher_pb2, dispatcher_pb2_grpc
from tests.dispatcher.conftest import dispatcher_settings, reserve_request, stop_live
from tests.shim.conftest import BUILD, Runner
from tests.shim.shared_gpu import GPU_MIB, LAYER, meminfo_free, shared_gpu_env, steady_ops

FAKE = str(BUILD / "fake" / "libcuda.so.1")
SOURCE = "GPU-aaaa0000-0000-0000-0000-000000000001"
TARGET = "GPU-aaaa0000-0000-0000-0000-000000000002"
OTHER_CHIP = "GPU-bbbb0000-0000-0000-0000-000000000003"
GPUS = f"{SOURCE}=H100:{GPU_MIB},{TARGET}=H100:{GPU_MIB},{OTHER_CHIP}=A100:{GPU_MIB}"
HELD = 4 * LAYER + 8


@dataclass
class Side:
    dispatcher: GpuDispatcher
    stub: dispatcher_pb2_grpc.DispatcherStub
    channel: grpc.aio.Channel

    async def reserve(self) -> dispatcher_pb2.Assignment:
        return await self.stub.Reserve(reserve_request(memory_gib=1.0))

    async def client(self, assignment_id: str) -> dispatcher_pb2.ClientStatus | None:
        status = await self.stub.GetGpuStatus(dispatcher_pb2.GetGpuStatusRequest())
        mine = [c for c in status.clients if c.assignment.assignment_id == assignment_id]
        return mine[0] if mine else None


class Node:
    """A source and a target dispatcher, and the cudart_like processes on their fake GPUs."""

    def __init__(self, run: Runner, source: Side, target: Side) -> None:
        self.run, self.source, self.target = run, source, target
        self.processes: list[asyncio.subprocess.Process] = []

    def env(self, gpu: str, socket: str = "", token: str = "") -> dict[str, str]:
        env = shared_gpu_env(self.run, shim=bool(token))
        env.update(GPULOOM_FAKE_CUDA_GPUS=GPUS, GPULOOM_FAKE_CUDA_GPU=gpu)
        if token:
            env.update(GPULOOM_DISPATCHER_SOCKET=socket, GPULOOM_ASSIGNMENT_TOKEN=token)
        return env

    async def free_bytes(self, gpu: str) -> int:
        process = await asyncio.create_subprocess_exec(
            str(BUILD / "cudart_like"), "meminfo", env=self.env(gpu),
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(process.communicate(), 30)
        return meminfo_free(out.decode().splitlines())

    async def training(self, token: str, steps: int) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            str(BUILD / "cudart_like"), *steady_ops(steps),
            env=self.env(SOURCE, self.source.dispatcher.core.socket_path, token),
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        self.processes.append(process)
        assert process.stdout is not None
        while not (await asyncio.wait_for(process.stdout.readline(), 30)).startswith(
            b"steady allocated"
        ):
            pass
        return process


async def _side(data_dir: Path, index: int, uuid: str) -> Side:
    backend = SimulatedBackend("2xA100-80GB")
    gpu = dataclasses.replace(backend.gpu(index), gpu_uuid=uuid)
    settings = dispatcher_settings(suspend_release_memory=True, cuda_library=FAKE)
    dispatcher = await start_gpu_dispatcher(settings, backend, gpu, "127.0.0.1", 0, data_dir)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{dispatcher.port}")
    return Side(dispatcher, dispatcher_pb2_grpc.DispatcherStub(channel), channel)


@pytest.fixture
async def node(run: Runner, short_dir: Path) -> AsyncIterator[Node]:
    source = await _side(short_dir, 0, SOURCE)
    target = await _side(short_dir, 1, TARGET)
    fake = Node(run, source, target)
    yield fake
    for process in fake.processes:
        if process.returncode is None:
            process.kill()
            await process.wait()
    for side in (source, target):
        await side.channel.close()
        await stop_live(side.dispatcher)


async def _suspend(side: Side, assignment_id: str) -> dispatcher_pb2.ClientStatus:
    return await side.stub.SuspendClient(
        dispatcher_pb2.SuspendClientRequest(assignment_id=assignment_id, reason="move")
    )


async def _finish(process: asyncio.subprocess.Process) -> list[str]:
    assert process.stdout is not None
    out = await asyncio.wait_for(process.stdout.read(), 60)
    await process.wait()
    return out.decode().splitlines()


def _steps(lines: list[str]) -> list[int]:
    return [int(x.split()[2]) for x in lines if x.startswith("steady step")]


async def _until_connected(side: Side, assignment_id: str) -> dispatcher_pb2.ClientStatus:
    for _ in range(200):
        client = await side.client(assignment_id)
        if client is not None and client.connected:
            return client
        await asyncio.sleep(0.05)
    raise AssertionError(f"{assignment_id} never registered with the target")


async def test_a_job_without_a_hook_moves_to_another_gpu_of_its_node(node: Node) -> None:
    source_before, target_before = await node.free_bytes(SOURCE), await node.free_bytes(TARGET)
    a = await node.source.reserve()
    job = await node.training(a.assignment_token, steps=40)
    assert source_before - await node.free_bytes(SOURCE) >= HELD
    suspended = await _suspend(node.source, a.assignment_id)
    assert suspended.suspended and suspended.suspended_memory_released, suspended
    b = await node.target.reserve()
    moved = await node.source.stub.MoveClient(
        dispatcher_pb2.MoveClientRequest(
            assignment_id=a.assignment_id,
            target_gpu_uuid=TARGET,
            target_socket_path=node.target.dispatcher.core.socket_path,
            target_token=b.assignment_token,
        )
    )
    assert moved.suspended_memory_note == "", moved
    client = await _until_connected(node.target, b.assignment_id)
    assert client.pid == job.pid  # the same process, registered with the target
    # Restored onto the target (still locked): its memory is the target GPU's now.
    assert await node.free_bytes(SOURCE) == source_before
    assert target_before - await node.free_bytes(TARGET) >= HELD
    await node.target.stub.UnlockMovedClient(
        dispatcher_pb2.UnlockMovedClientRequest(assignment_id=b.assignment_id)
    )
    await node.source.stub.Release(dispatcher_pb2.ReleaseRequest(assignment_id=a.assignment_id))
    lines = await _finish(job)
    assert _steps(lines) == list(range(40))  # every step exactly once, in order
    assert lines[-1] == "steady minibatches=40 done=40 failed=0 corrupt=0 damaged_layers=0"
    assert job.returncode == 0
    assert await node.free_bytes(TARGET) == target_before
    assert await node.free_bytes(SOURCE) == source_before


async def test_a_move_onto_another_chip_type_leaves_it_suspended_with_the_reason(
    node: Node,
) -> None:
    a = await node.source.reserve()
    job = await node.training(a.assignment_token, steps=20)
    assert (await _suspend(node.source, a.assignment_id)).suspended_memory_released
    b = await node.target.reserve()
    status = await node.source.dispatcher.core.move_out(
        a.assignment_id,
        MoveTarget(OTHER_CHIP, node.target.dispatcher.core.socket_path, b.assignment_token),
    )
    assert status.suspension is not None
    assert status.suspension.memory_released
    assert status.suspension.memory_note.startswith("move failed"), status
    assert "101" in status.suspension.memory_note  # CUDA_ERROR_INVALID_DEVICE
    seen = await node.source.client(a.assignment_id)
    assert seen is not None and seen.suspended and seen.suspended_memory_note.startswith("move")
    target_client = await node.target.client(b.assignment_id)
    assert target_client is not None and not target_client.connected  # its shim not told
    # Still the source's: resumed there, it runs on.
    resumed = await node.source.stub.ResumeClient(
        dispatcher_pb2.ResumeClientRequest(assignment_id=a.assignment_id)
    )
    assert not resumed.suspended
    lines = await _finish(job)
    assert _steps(lines) == list(range(20))
    assert lines[-1].endswith("failed=0 corrupt=0 damaged_layers=0")


async def test_bad_moves_are_refused_and_change_nothing(node: Node) -> None:
    a = await node.source.reserve()
    job = await node.training(a.assignment_token, steps=20)
    socket, token = node.target.dispatcher.core.socket_path, "t" * 40
    core = node.source.dispatcher.core
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await node.source.stub.MoveClient(
            dispatcher_pb2.MoveClientRequest(
                assignment_id=a.assignment_id, target_gpu_uuid=TARGET,
                target_socket_path=socket, target_token=token,
            )
        )  # fmt: skip
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "not suspended with its memory checkpointed" in str(refused.value.details())
    with pytest.raises(FailedPrecondition, match="no process registered"):
        await node.target.dispatcher.core.unlock_moved((await node.target.reserve()).assignment_id)
    bad = [
        (MoveTarget("GPU-12", socket, token), "target_gpu_uuid"),
        (MoveTarget(SOURCE, socket, token), "own GPU"),
        (MoveTarget(TARGET, "relative.sock", token), "target_socket_path"),
        (MoveTarget(TARGET, "/" + "s" * 200, token), "target_socket_path"),
        (MoveTarget(TARGET, socket, "short"), "target_token"),
    ]
    for target, says in bad:
        with pytest.raises(InvalidArgument, match=says):
            await core.move_out(a.assignment_id, target)
    # A MoveTo frame whose token the shim cannot use: it says so and stays where it is.
    assert await core._on_channel(lambda: core.channel.move_client(a.assignment_id, socket, "x"))
    await asyncio.sleep(0.3)
    client = await node.source.client(a.assignment_id)
    assert client is not None and client.connected and not client.suspended
    assert client.pid == job.pid
    lines = await _finish(job)
    assert _steps(lines) == list(range(20))
    assert lines[-1].endswith("failed=0 corrupt=0 damaged_layers=0")
