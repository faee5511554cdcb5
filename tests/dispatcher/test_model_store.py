"""The GPU's model store through the dispatcher's gRPC surface, on the fake driver: weights
loaded once and charged once to the GPU's reserved memory, and every bad request refused with
the field or cause named and nothing loaded, charged or attached."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from click.testing import CliRunner, Result
from google.protobuf import json_format

from gpuloom.clients.cli import cli
from gpuloom.clients.models import ModelHandleError, attach, check_handle, save_weights
from gpuloom.domain.errors import InvalidArgument, NotFound
from gpuloom.domain.models import device_layout, header_length, parse_header
from gpuloom.v1 import common_pb2, dispatcher_pb2_grpc
from gpuloom.v1 import dispatcher_pb2 as pb
from tests.dispatcher.conftest import (
    GIB,
    LiveDispatcher,
    reserve_request,
    running_live,
    start_live,
    stop_live,
)
from tests.shim.conftest import shim_build  # noqa: F401  (fixture: builds the fake driver)

MIB = 1 << 20
FAKE_MPS_CONTROL = Path(__file__).with_name("fake_mps_control.py")


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((64, 33)).astype(np.float32),
        "layer.bias": rng.integers(-100, 100, 17).astype(np.int8),
        "head.weight": rng.standard_normal((5, 7)).astype(np.float16),
    }


@pytest.fixture
async def store(
    short_dir: Path,
    shim_build: Path,  # noqa: F811  (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[LiveDispatcher]:
    models = short_dir / "models"
    models.mkdir()
    save_weights(models / "net.safetensors", weights(0))
    save_weights(models / "other.safetensors", weights(1))
    monkeypatch.setenv("GPULOOM_FAKE_CUDA_DIR", str(short_dir / "fake"))
    library = str(shim_build / "fake" / "libcuda.so.1")
    async with running_live(short_dir, models_dir=models, cuda_library=library) as running:
        yield running


def expected_bytes(path: Path) -> int:
    data = path.read_bytes()
    parsed = parse_header(data[8 : 8 + header_length(data[:8])], len(data))
    return device_layout(parsed.tensors)[1]


async def load(live: LiveDispatcher, name: str = "net", path: str = "net.safetensors"):
    return await live.stub.LoadModel(pb.LoadModelRequest(name=name, path=path))


async def listing(live: LiveDispatcher) -> pb.ListModelsResponse:
    return await live.stub.ListModels(pb.ListModelsRequest())


async def assert_refused(call, code: grpc.StatusCode, *words: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    for word in words:
        assert word in caught.value.details(), caught.value.details()


async def test_load_charges_the_weights_once_and_the_store_holds_the_files_bytes(
    store: LiveDispatcher,
) -> None:
    answer = await load(store)
    nbytes = expected_bytes(store.data_dir / "models" / "net.safetensors")
    assert answer.loaded and answer.model.bytes == nbytes and answer.model.tensor_count == 3
    again = await load(store)  # idempotent: same name, same file
    assert not again.loaded and again.model.model_id == answer.model.model_id
    listed = await listing(store)
    assert [m.name for m in listed.models] == ["net"] and listed.store_bytes == nbytes
    status = await store.stub.GetGpuStatus(pb.GetGpuStatusRequest())
    assert status.memory_reserved_bytes == nbytes
    # Replicas attached: the bytes are still charged once.
    for replica in ("r1", "r2", "r3"):
        handle = await store.stub.AttachModel(pb.AttachModelRequest(name="net", replica=replica))
        assert len(handle.ipc_handle) == 64 and handle.bytes == nbytes
    status = await store.stub.GetGpuStatus(pb.GetGpuStatusRequest())
    assert status.memory_reserved_bytes == nbytes
    assert list((await listing(store)).models[0].replicas) == ["r1", "r2", "r3"]
    # The store's device copy is the file's tensors, at the offsets the handle names.
    models = store.dispatcher.models
    assert models is not None
    for tensor in handle.tensors:
        data = await models.read("net", tensor.offset, tensor.nbytes)
        assert data == np.ascontiguousarray(weights(0)[tensor.name]).tobytes()


async def test_the_stores_bytes_count_against_the_gpus_memory(store: LiveDispatcher) -> None:
    await load(store)
    nbytes = (await listing(store)).store_bytes
    whole = store.dispatcher.core.gpu.memory_bytes
    request = reserve_request(memory_gib=whole / GIB)  # would fit an empty GPU
    await assert_refused(
        store.stub.Reserve(request), grpc.StatusCode.RESOURCE_EXHAUSTED, "not enough GPU memory"
    )
    assert await store.stub.Reserve(reserve_request(memory_gib=(whole - nbytes) / GIB))


async def test_a_model_that_does_not_fit_beside_the_reservations_is_refused(
    store: LiveDispatcher,
) -> None:
    whole = store.dispatcher.core.gpu.memory_bytes
    await store.stub.Reserve(reserve_request(memory_gib=(whole - 1024) / GIB))
    await assert_refused(load(store), grpc.StatusCode.RESOURCE_EXHAUSTED, "for the model")
    assert not (await listing(store)).models and (await listing(store)).store_bytes == 0


async def test_unload_refuses_while_replicas_are_attached_and_gives_the_bytes_back(
    store: LiveDispatcher,
) -> None:
    loaded = await load(store)
    await store.stub.AttachModel(pb.AttachModelRequest(name="net", replica="r1"))
    await assert_refused(
        store.stub.UnloadModel(pb.UnloadModelRequest(name="net")),
        grpc.StatusCode.FAILED_PRECONDITION,
        "1 attached replicas",
    )
    detached = await store.stub.DetachModel(
        pb.DetachModelRequest(name="net", replica="r1", model_id=loaded.model.model_id)
    )
    assert detached.detached
    await store.stub.UnloadModel(pb.UnloadModelRequest(name="net"))
    assert (await listing(store)).store_bytes == 0
    status = await store.stub.GetGpuStatus(pb.GetGpuStatusRequest())
    assert status.memory_reserved_bytes == 0
    # Loaded again: a new model id, so a handle of the old one is told apart.
    again = await load(store)
    assert again.model.model_id != loaded.model.model_id
    await assert_refused(
        store.stub.AttachModel(
            pb.AttachModelRequest(name="net", replica="r1", model_id=loaded.model.model_id)
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "model_id",
        "unloaded",
    )
    await store.stub.AttachModel(pb.AttachModelRequest(name="net", replica="r9"))
    assert (await store.stub.UnloadModel(pb.UnloadModelRequest(name="net", force=True))).model


async def test_bad_attach_requests_are_refused_and_attach_nothing(
    store: LiveDispatcher,
) -> None:
    net = await load(store)
    other = await load(store, "other", "other.safetensors")
    cases = [
        (pb.AttachModelRequest(name="absent", replica="r"), grpc.StatusCode.NOT_FOUND, "absent"),
        (
            pb.AttachModelRequest(name="bad name", replica="r"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "name",
        ),
        (
            pb.AttachModelRequest(name="net", replica=""),
            grpc.StatusCode.INVALID_ARGUMENT,
            "replica",
        ),
        (
            pb.AttachModelRequest(name="net", replica="r", gpu_uuid="GPU-elsewhere"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "gpu_uuid",
        ),
        (
            pb.AttachModelRequest(name="net", replica="r", model_id=other.model.model_id),
            grpc.StatusCode.INVALID_ARGUMENT,
            "model_id",
        ),
    ]
    for request, code, word in cases:
        await assert_refused(store.stub.AttachModel(request), code, word)
    assert all(not m.replicas for m in (await listing(store)).models)
    # The right GPU and model id are accepted.
    gpu = store.dispatcher.core.gpu.gpu_uuid
    handle = await store.stub.AttachModel(
        pb.AttachModelRequest(name="net", replica="r", gpu_uuid=gpu, model_id=net.model.model_id)
    )
    assert handle.gpu.gpu_uuid == gpu and handle.model_id == net.model.model_id


async def test_bad_load_requests_are_refused_and_load_nothing(store: LiveDispatcher) -> None:
    models = store.data_dir / "models"
    (models / "garbage.bin").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    (models / "short.bin").write_bytes(b"\x01\x02")
    (store.data_dir / "outside.safetensors").write_bytes((models / "net.safetensors").read_bytes())
    (models / "link.safetensors").symlink_to(store.data_dir / "outside.safetensors")
    cases = [
        (("net", "../outside.safetensors"), grpc.StatusCode.INVALID_ARGUMENT, "path", "inside"),
        (("net", "/etc/passwd"), grpc.StatusCode.INVALID_ARGUMENT, "path", "inside"),
        (("net", "link.safetensors"), grpc.StatusCode.INVALID_ARGUMENT, "path", "inside"),
        (("net", "missing.safetensors"), grpc.StatusCode.INVALID_ARGUMENT, "path", "no file"),
        (("net", "garbage.bin"), grpc.StatusCode.INVALID_ARGUMENT, "path", "JSON"),
        (("net", "short.bin"), grpc.StatusCode.INVALID_ARGUMENT, "path", "weights file"),
        (("", "net.safetensors"), grpc.StatusCode.INVALID_ARGUMENT, "name"),
        (("a/b", "net.safetensors"), grpc.StatusCode.INVALID_ARGUMENT, "name"),
    ]
    for (name, path), code, *words in cases:
        await assert_refused(load(store, name, path), code, *words)
    listed = await listing(store)
    assert not listed.models and listed.store_bytes == 0
    await load(store)
    await assert_refused(
        load(store, "net", "other.safetensors"), grpc.StatusCode.ALREADY_EXISTS, "net"
    )
    await assert_refused(
        store.stub.UnloadModel(pb.UnloadModelRequest(name="absent")), grpc.StatusCode.NOT_FOUND
    )


async def test_without_a_models_directory_loading_is_off(short_dir: Path) -> None:
    async with running_live(short_dir) as live:
        await assert_refused(
            load(live), grpc.StatusCode.FAILED_PRECONDITION, "GPULOOM_DISPATCHER_MODELS_DIR"
        )


async def test_a_store_process_that_dies_loses_its_models_and_their_charge(
    store: LiveDispatcher,
) -> None:
    await load(store)
    models = store.dispatcher.models
    assert models is not None and models._worker is not None
    os.kill(models._worker.process.pid, signal.SIGKILL)
    await assert_refused(
        load(store, "other", "other.safetensors"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "exited",
        "net",
    )
    listed = await listing(store)
    assert not listed.models and listed.store_bytes == 0
    assert (await load(store)).loaded  # a new store process


SERVICE_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[")


async def invoke(*args: str) -> Result:
    # The dispatcher serves on this event loop: the blocking CLI runs in a worker thread.
    result = await asyncio.to_thread(CliRunner().invoke, cli, list(args))
    result.lines = [  # type: ignore[attr-defined]
        line for line in result.output.splitlines() if not SERVICE_LOG.match(line)
    ]
    return result


async def test_the_models_command_shows_what_the_store_holds(store: LiveDispatcher) -> None:
    address = f"127.0.0.1:{store.dispatcher.port}"
    loaded = await invoke("models", "load", "net", "net.safetensors", "--dispatcher", address)
    assert loaded.exit_code == 0, loaded.output
    nbytes = (await listing(store)).store_bytes
    assert loaded.lines == [f"net@1 loaded: {nbytes:,} bytes"]
    await store.stub.AttachModel(pb.AttachModelRequest(name="net", replica="r1"))
    await store.stub.AttachModel(pb.AttachModelRequest(name="net", replica="r2"))
    shown = await invoke("models", "--dispatcher", address)
    assert shown.exit_code == 0, shown.output
    header, _rule, row = shown.lines[1:]
    assert header.split() == ["NAME", "ID", "MIB", "TENSORS", "REPLICAS", "FILE"]
    assert row.split()[:2] == ["net", "net@1"] and row.split()[3:5] == ["3", "2"]
    as_json = await invoke("models", "list", "--dispatcher", address, "--json")
    # The ListModelsResponse in the protos' JSON mapping (uint64 as strings), as grpcurl shows it.
    document = json.loads("\n".join(as_json.lines))
    parsed = json_format.Parse(json.dumps(document), pb.ListModelsResponse())
    assert document["store_bytes"] == str(nbytes) and parsed.store_bytes == nbytes
    assert [(m.name, m.bytes, list(m.replicas)) for m in parsed.models] == [
        ("net", nbytes, ["r1", "r2"])
    ]
    refused = await invoke("models", "unload", "net", "--dispatcher", address)
    assert refused.exit_code == 1 and "2 attached replicas" in refused.output
    missing = await invoke("models", "unload", "absent", "--dispatcher", address)
    assert missing.exit_code == 1 and "'absent' is not in the store" in missing.output
    forced = await invoke("models", "unload", "net", "--force", "--dispatcher", address)
    assert forced.exit_code == 0 and forced.lines == [f"net@1 unloaded: {nbytes:,} bytes freed"]


async def test_a_replica_named_by_its_reservation_is_detached_when_the_reservation_ends(
    store: LiveDispatcher,
) -> None:
    await load(store)
    await store.reserve(memory_gib=0.5, assignment_id="job-a")
    await store.reserve(memory_gib=0.5, assignment_id="job-b")
    for replica in ("job-a", "job-b", "by-hand"):
        await store.stub.AttachModel(pb.AttachModelRequest(name="net", replica=replica))
    assert list((await listing(store)).models[0].replicas) == ["by-hand", "job-a", "job-b"]
    await store.stub.Release(pb.ReleaseRequest(assignment_id="job-a"))
    await store.stub.EvictClient(pb.EvictClientRequest(assignment_id="job-b", reason="test"))
    # An id that is no reservation's stays until it detaches.
    assert list((await listing(store)).models[0].replicas) == ["by-hand"]
    await store.stub.DetachModel(pb.DetachModelRequest(name="net", replica="by-hand"))
    assert (await store.stub.UnloadModel(pb.UnloadModelRequest(name="net"))).model.name == "net"


def handle_of(name: str = "net", gpu: str = "GPU-1", offset: int = 0) -> pb.ModelHandle:
    return pb.ModelHandle(
        name=name,
        model_id=f"{name}@1",
        gpu=common_pb2.GpuRef(gpu_uuid=gpu),
        ipc_handle=bytes(64),
        bytes=512,
        tensors=[pb.ModelTensor(name="w", dtype="F32", shape=[4], offset=offset, nbytes=16)],
    )


@pytest.mark.parametrize(
    ("handle", "words"),
    [
        (handle_of(name="other"), "name: the handle is model 'other'"),
        (handle_of(gpu="GPU-2"), "gpu_uuid: the handle is of GPU GPU-2"),
        (handle_of(offset=500), "tensors: 'w' lies outside"),
    ],
)
def test_attach_refuses_a_handle_of_another_model_or_gpu_before_mapping(
    handle: pb.ModelHandle, words: str
) -> None:
    check_handle(handle_of(), "net", "GPU-1")  # the right one passes
    with pytest.raises(ModelHandleError, match=re.escape(words)):
        check_handle(handle, "net", "GPU-1")


async def test_attach_from_a_process_on_another_gpu_is_refused_and_maps_nothing(
    store: LiveDispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    await load(store)
    address = f"127.0.0.1:{store.dispatcher.port}"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-not-this-one")
    # The driver library does not exist: an attach that got as far as mapping would fail with
    # OSError, so these errors show the refusal came first.
    with pytest.raises(InvalidArgument) as caught:
        await asyncio.to_thread(attach, "net", address, "r1", "no-such-libcuda.so")
    assert caught.value.field == "gpu_uuid"
    with pytest.raises(NotFound, match="'absent' is not in the store"):
        await asyncio.to_thread(attach, "absent", address, "r1", "no-such-libcuda.so")
    assert not (await listing(store)).models[0].replicas


async def test_without_a_usable_driver_loading_says_why_and_charges_nothing(
    short_dir: Path,
) -> None:
    models = short_dir / "models"
    models.mkdir()
    save_weights(models / "net.safetensors", weights(0))
    no_driver = str(short_dir / "no-libcuda.so.1")
    async with running_live(short_dir, models_dir=models, cuda_library=no_driver) as live:
        await assert_refused(
            load(live), grpc.StatusCode.FAILED_PRECONDITION, "cannot load the CUDA driver"
        )
        listed = await listing(live)
        assert not listed.models and listed.store_bytes == 0
        status = await live.stub.GetGpuStatus(pb.GetGpuStatusRequest())
        assert status.memory_reserved_bytes == 0


async def test_on_a_gpu_running_mps_the_store_process_is_an_mps_client(
    short_dir: Path,
    shim_build: Path,  # noqa: F811  (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    models = short_dir / "models"
    models.mkdir()
    save_weights(models / "net.safetensors", weights(0))
    monkeypatch.setenv("GPULOOM_FAKE_CUDA_DIR", str(short_dir / "fake"))
    dispatcher, channel = await start_live(
        short_dir,
        models_dir=models,
        cuda_library=str(shim_build / "fake" / "libcuda.so.1"),
        mps="on",
        mps_control=shlex.join([sys.executable, str(FAKE_MPS_CONTROL)]),
    )
    try:
        stub = dispatcher_pb2_grpc.DispatcherStub(channel)
        await stub.LoadModel(pb.LoadModelRequest(name="net", path="net.safetensors"))
        assert dispatcher.models is not None and dispatcher.models._worker is not None
        environ = Path(f"/proc/{dispatcher.models._worker.process.pid}/environ").read_bytes()
        variables = dict(item.split("=", 1) for item in environ.decode().split("\0") if item)
        assert dispatcher.mps is not None
        assert variables["CUDA_MPS_PIPE_DIRECTORY"] == str(dispatcher.mps.config.pipe_dir)
        assert variables["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
        assert "LD_PRELOAD" not in variables
    finally:
        await channel.close()
        await stop_live(dispatcher)


async def test_a_model_the_device_has_no_room_for_is_resource_exhausted(
    store: LiveDispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The book admits it (a simulated 80 GB GPU) but the fake device has 1 MiB: the driver's
    CUDA_ERROR_OUT_OF_MEMORY is RESOURCE_EXHAUSTED, and nothing stays charged."""
    save_weights(store.data_dir / "models" / "big.safetensors", {"w": np.zeros(MIB, np.float32)})
    monkeypatch.setenv("GPULOOM_FAKE_CUDA_MEM_MIB", "1")  # read by the store process it starts
    await assert_refused(
        load(store, "big", "big.safetensors"), grpc.StatusCode.RESOURCE_EXHAUSTED, "CUresult 2"
    )
    listed = await listing(store)
    assert not listed.models and listed.store_bytes == 0
    assert (await load(store)).loaded  # a model that fits still loads
