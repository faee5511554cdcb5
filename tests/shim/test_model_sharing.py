"""Model sharing end to end on the fake driver: a live dispatcher's model store loads a model
once; two replica processes, each under the shim with a memory cap smaller than the model,
attach it through `gpuloom.clients.models.attach` and read the same bytes; their caps are not
charged for the shared bytes. CUDA IPC memory is not read-only: a replica's write reaches the
other (the limit docs/dispatcher.md states)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from gpuloom.clients.models import save_weights
from gpuloom.v1 import dispatcher_pb2 as pb
from tests.dispatcher.conftest import GIB, LiveDispatcher, running_live

MIB = 1 << 20
CAP = 32 * MIB
SCRATCH = 24 * MIB
CUDA_ERROR_OUT_OF_MEMORY = 2

REPLICA = """
import hashlib, json, sys
import numpy as np
from gpuloom.clients.models import attach
from gpuloom.cudadrv import CudaError

model_bytes, scratch = int(sys.argv[1]), int(sys.argv[2])
model = attach("net", use_torch=False)  # GPULOOM_DISPATCHER_ADDRESS: from Reserve's answer
driver = model._driver
report = {"replica": model.replica, "model_id": model.model_id,
          "digests": {n: hashlib.sha256(model.read(n).tobytes()).hexdigest() for n in model.raw}}
try:
    driver.free(driver.alloc(model_bytes))
    report["own_copy"] = 0
except CudaError as error:
    report["own_copy"] = error.code
pointer = driver.alloc(scratch)
report["meminfo"] = driver.memory_info()
print(json.dumps(report), flush=True)
command = sys.stdin.readline().strip()
if command == "write":
    model.write("small", np.full(16, 7, dtype=np.int32))
    print("written", flush=True)
    sys.stdin.readline()
elif command == "peek":
    print(json.dumps(model.read("small").tolist()), flush=True)
driver.free(pointer)
model.close()
"""


def replica_env(live: LiveDispatcher, build: Path, fake_dir: Path, assignment: pb.Assignment):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GPULOOM_") and k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")
    }
    env.update(
        LD_LIBRARY_PATH=str(build / "fake"),
        LD_PRELOAD=str(build / "libgpuloom.so"),
        GPULOOM_FAKE_CUDA_DIR=str(fake_dir),
        **assignment.environment,
    )
    return env


class Replica:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def line(self) -> str:
        assert self.process.stdout is not None
        raw = await asyncio.wait_for(self.process.stdout.readline(), 30)
        if not raw:
            _, err = await self.process.communicate()
            raise AssertionError(f"replica ended early: {err.decode()[-2000:]}")

        return raw.decode()

    async def send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text.encode() + b"\n")
        await self.process.stdin.drain()

    async def finish(self) -> None:
        _, err = await asyncio.wait_for(self.process.communicate(), 30)
        assert self.process.returncode == 0, err.decode()[-2000:]


ARRAYS = {
    "big": np.arange(10 * MIB, dtype=np.float32),  # 40 MiB: more than a replica's cap
    "small": np.arange(16, dtype=np.int32),
}


@pytest.fixture
async def live(short_dir: Path, shim_build: Path) -> AsyncIterator[LiveDispatcher]:
    """A live dispatcher whose model store runs on the fake driver, with net.safetensors."""
    models = short_dir / "models"
    models.mkdir()
    save_weights(models / "net.safetensors", ARRAYS)
    library = str(shim_build / "fake" / "libcuda.so.1")
    async with running_live(short_dir, models_dir=models, cuda_library=library) as running:
        yield running


async def test_two_replicas_share_one_copy_and_their_caps_are_not_charged(
    live: LiveDispatcher, shim_build: Path, tmp_path: Path
) -> None:
    fake_dir = tmp_path / "fake"
    fake_dir.mkdir()
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    loaded = await live.stub.LoadModel(pb.LoadModelRequest(name="net", path="net.safetensors"))
    model_bytes = loaded.model.bytes
    assert model_bytes > CAP
    replicas = []
    for _ in range(2):
        assignment = await live.reserve(memory_gib=CAP / GIB)
        address = assignment.environment["GPULOOM_DISPATCHER_ADDRESS"]
        assert address == f"127.0.0.1:{live.dispatcher.port}"
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            str(model_bytes),
            str(SCRATCH),
            env=replica_env(live, shim_build, fake_dir, assignment),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        replicas.append(Replica(process))
    reports = [json.loads(await r.line()) for r in replicas]

    expected = {n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in ARRAYS.items()}
    for report in reports:
        assert report["digests"] == expected  # the same bytes, the file's
        assert report["model_id"] == loaded.model.model_id
        # Its own copy would not fit its cap; beside the shared one, its own scratch does, and
        # cuMemGetInfo shows the cap less the scratch only.
        assert report["own_copy"] == CUDA_ERROR_OUT_OF_MEMORY
        assert report["meminfo"] == [CAP - SCRATCH, CAP]
    listed = await live.stub.ListModels(pb.ListModelsRequest())
    assert sorted(listed.models[0].replicas) == sorted(r["replica"] for r in reports)
    assert listed.store_bytes == model_bytes  # once, not per replica

    # Not read-only: one replica's write reaches the other.
    writer, reader = replicas
    await writer.send("write")
    assert (await writer.line()).strip() == "written"
    await reader.send("peek")
    assert json.loads(await reader.line()) == [7] * 16
    await writer.send("")
    for replica in replicas:
        await replica.finish()
    assert not (await live.stub.ListModels(pb.ListModelsRequest())).models[0].replicas
