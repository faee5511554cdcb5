"""Shared model weights for inference code (FaST-GShare's model sharing).

    from gpuloom.clients.models import attach
    with attach("resnet50") as model:      # the dispatcher of this process's GPU
        weights = model.tensors             # name -> torch.Tensor (torch installed) or Tensor

`attach` asks the GPU's dispatcher (GPULOOM_DISPATCHER_ADDRESS, default localhost:50060) for
the model's IPC handle, checks that the answer is the model asked for on this process's GPU,
and opens the handle with cuIpcOpenMemHandle: the tensors are views of the store's one copy,
not counted against this process's memory cap. CUDA IPC memory cannot be opened read-only:
writing into the tensors changes them for every replica (docs/dispatcher.md, "Model sharing").

`ModelsClient` is the blocking gRPC client of the store (load, attach, detach, list, unload);
`save_weights` writes a weights file the store can load (the safetensors layout).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpuloom.clients.blocking import BlockingClient, ClosedOnExit
from gpuloom.cudadrv import DEFAULT_LIBRARY, IPC_HANDLE_BYTES, Driver
from gpuloom.domain.models import DTYPE_BYTES, check_model_name, encode_header
from gpuloom.v1 import dispatcher_pb2 as pb
from gpuloom.v1 import dispatcher_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "localhost:50060"
ADDRESS_VARIABLE = "GPULOOM_DISPATCHER_ADDRESS"
LIBRARY_VARIABLE = "GPULOOM_CUDA_LIBRARY"
DEFAULT_TIMEOUT_S = 600.0  # a load copies the whole file to the GPU

# safetensors dtype <-> numpy; BF16 has no numpy type (its bytes are shown as uint16).
_NUMPY = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "|i1",
    "U8": "|u1",
    "BOOL": "|b1",
}
_FROM_NUMPY = {np.dtype(v).str: k for k, v in _NUMPY.items() if k != "BF16"}


class ModelHandleError(ValueError):
    """An answer that is not the handle asked for (another model or GPU); nothing was mapped."""


class ModelsClient(BlockingClient):
    def __init__(self, address: str = DEFAULT_ADDRESS, timeout_s: float = DEFAULT_TIMEOUT_S):
        super().__init__(address, pb_grpc.DispatcherStub, timeout_s)

    def load(self, name: str, path: str) -> pb.LoadModelResponse:
        return self._call("LoadModel", pb.LoadModelRequest(name=name, path=path))

    def attach(
        self, name: str, replica: str, gpu_uuid: str = "", model_id: str = ""
    ) -> pb.ModelHandle:
        request = pb.AttachModelRequest(
            name=name, replica=replica, gpu_uuid=gpu_uuid, model_id=model_id
        )
        return self._call("AttachModel", request)

    def detach(self, name: str, replica: str, model_id: str = "") -> bool:
        request = pb.DetachModelRequest(name=name, replica=replica, model_id=model_id)
        return self._call("DetachModel", request).detached

    def list(self) -> pb.ListModelsResponse:
        return self._call("ListModels", pb.ListModelsRequest())

    def unload(self, name: str, force: bool = False) -> pb.ModelInfo:
        return self._call("UnloadModel", pb.UnloadModelRequest(name=name, force=force)).model


@dataclass(frozen=True, slots=True)
class Tensor:
    """A tensor of an attached model without PyTorch: a device pointer and its shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pointer: int
    nbytes: int

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": _NUMPY[self.dtype],
            "data": (self.pointer, False),  # CUDA IPC memory is writable (see the module doc)
            "version": 3,
        }


def process_gpu_uuid() -> str:
    """The GPU this process runs on, when CUDA_VISIBLE_DEVICES names one by UUID ("" else)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return visible if visible.startswith(("GPU-", "MIG-")) and "," not in visible else ""


def default_replica_id() -> str:
    """The process's assignment id (GPULOOM_ASSIGNMENT_ID), else HOST:PID."""
    assignment = os.environ.get("GPULOOM_ASSIGNMENT_ID", "")
    if assignment:
        return assignment
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:100] or "host"
    return f"{host}:{os.getpid()}"


_drivers: dict[str, Driver] = {}


def _driver(library: str) -> Driver:
    if library not in _drivers:
        _drivers[library] = Driver(library)
    return _drivers[library]


def check_handle(handle: pb.ModelHandle, name: str, gpu_uuid: str) -> None:
    """Refuse (ModelHandleError, before anything is mapped) a handle that is not `name`'s on
    `gpu_uuid` (when known), or whose tensors do not lie inside its allocation."""
    if handle.name != name:
        raise ModelHandleError(f"name: the handle is model {handle.name!r}'s, not {name!r}'s")
    if gpu_uuid and handle.gpu.gpu_uuid != gpu_uuid:
        raise ModelHandleError(
            f"gpu_uuid: the handle is of GPU {handle.gpu.gpu_uuid}, this process runs on {gpu_uuid}"
        )
    if len(handle.ipc_handle) != IPC_HANDLE_BYTES:
        raise ModelHandleError(
            f"ipc_handle: {len(handle.ipc_handle)} bytes, not {IPC_HANDLE_BYTES}"
        )
    for tensor in handle.tensors:
        if tensor.dtype not in DTYPE_BYTES or tensor.offset + tensor.nbytes > handle.bytes:
            raise ModelHandleError(f"tensors: {tensor.name!r} lies outside the model's bytes")


class AttachedModel(ClosedOnExit):
    """A model's tensors opened from the store's IPC handle; close() unmaps and detaches."""

    def __init__(
        self,
        client: ModelsClient,
        driver: Driver,
        handle: pb.ModelHandle,
        replica: str,
        use_torch: bool,
    ) -> None:
        self.name = handle.name
        self.model_id = handle.model_id
        self.gpu_uuid = handle.gpu.gpu_uuid
        self.nbytes = handle.bytes
        self.replica = replica
        self._client = client
        self._driver = driver
        self.pointer = driver.ipc_open(bytes(handle.ipc_handle))
        self.raw = {
            t.name: Tensor(t.name, t.dtype, tuple(t.shape), self.pointer + t.offset, t.nbytes)
            for t in handle.tensors
        }
        self.tensors: dict[str, Any] = (
            {name: _torch_tensor(t) for name, t in self.raw.items()} if use_torch else self.raw
        )

    def read(self, name: str) -> np.ndarray:
        """A host copy of one tensor (cuMemcpyDtoH from the shared bytes)."""
        tensor = self.raw[name]
        data = self._driver.copy_from_device(tensor.pointer, tensor.nbytes)
        return np.frombuffer(data, dtype=_NUMPY[tensor.dtype]).reshape(tensor.shape)

    def write(self, name: str, values: np.ndarray) -> None:
        """Overwrite one tensor's shared bytes (every replica sees it: IPC is not read-only)."""
        tensor = self.raw[name]
        data = np.ascontiguousarray(values, dtype=_NUMPY[tensor.dtype]).tobytes()
        if len(data) != tensor.nbytes:
            raise ValueError(f"{name}: {len(data)} bytes given, the tensor has {tensor.nbytes}")
        self._driver.copy_to_device(tensor.pointer, data)

    def close(self) -> None:
        if self.pointer:
            self.tensors = {}
            self._driver.ipc_close(self.pointer)
            self.pointer = 0
            try:
                self._client.detach(self.name, self.replica, self.model_id)
            finally:
                self._client.close()


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _torch_tensor(tensor: Tensor) -> Any:
    import torch

    if tensor.dtype == "BF16":
        raw = torch.as_tensor(tensor, device="cuda")  # uint16 bytes (numpy has no bfloat16)
        return raw.view(torch.bfloat16)
    return torch.as_tensor(tensor, device="cuda")


def attach(
    name: str,
    address: str | None = None,
    replica: str | None = None,
    library: str | None = None,
    use_torch: bool | None = None,
) -> AttachedModel:
    """Attach this process to `name` in its GPU's model store (see the module doc).
    use_torch: None = PyTorch tensors when torch is installed, raw `Tensor`s otherwise."""
    check_model_name("name", name)
    replica = replica or default_replica_id()
    gpu_uuid = process_gpu_uuid()
    client = ModelsClient(address or os.environ.get(ADDRESS_VARIABLE, DEFAULT_ADDRESS))
    try:
        handle = client.attach(name, replica, gpu_uuid)
        try:
            check_handle(handle, name, gpu_uuid)
            driver = _driver(library or os.environ.get(LIBRARY_VARIABLE, DEFAULT_LIBRARY))
            torch_tensors = _torch_available() if use_torch is None else use_torch
            return AttachedModel(client, driver, handle, replica, torch_tensors)
        except BaseException:
            client.detach(name, replica, handle.model_id)
            raise
    except BaseException:
        client.close()
        raise


def save_weights(path: str | Path, arrays: dict[str, np.ndarray]) -> int:
    """Write `arrays` as a weights file the store loads; returns the file's size."""
    specs: dict[str, tuple[str, tuple[int, ...], int]] = {}
    blobs = []
    for name, array in arrays.items():
        contiguous = np.ascontiguousarray(array).reshape(np.shape(array))  # keeps 0-d
        dtype = _FROM_NUMPY.get(contiguous.dtype.newbyteorder("<").str)
        if dtype is None:
            raise ValueError(f"{name}: dtype {array.dtype} has no weights-file type")
        data = contiguous.astype(contiguous.dtype.newbyteorder("<"), copy=False).tobytes()
        specs[name] = (dtype, tuple(contiguous.shape), len(data))
        blobs.append(data)
    header = encode_header(specs)
    with open(path, "wb") as out:
        out.write(header)
        for data in blobs:
            out.write(data)
    return len(header) + sum(len(b) for b in blobs)
