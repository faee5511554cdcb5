"""The GPU's model store (FaST-GShare's model sharing): one copy of a model's weights in device
memory, handed to every replica of the model on this GPU as a CUDA IPC memory handle.

The dispatcher side (this module) validates requests, charges the weights to the reservation
book once (they count against the GPU's memory like a reservation, not against any replica's
cap), and keeps which replicas attached. The device work is done by a child process per GPU
(model_worker.py) that the store starts on the first load and talks to over JSON lines:
- one dispatcher process serves several GPUs, and the driver is used in one context per
  device, pinned by CUDA_VISIBLE_DEVICES to the store's GPU;
- the exporter of an IPC handle must be another process than the openers and must outlive
  them: the worker lives as long as the dispatcher, whichever process attaches;
- the dispatcher itself never loads libcuda, so a driver fault stops the store, not the
  dispatcher. If the worker dies its memory is gone: the store forgets its models, gives the
  bytes back to the book and starts a new worker on the next load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog

from gpuloom.domain.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from gpuloom.domain.gpus import GpuInfo
from gpuloom.domain.models import (
    DeviceTensor,
    check_model_name,
    check_replica_id,
    device_layout,
    header_length,
    parse_header,
)
from gpuloom.services.dispatcher.reservations import ReservationBook

log = structlog.get_logger("gpuloom.dispatcher.models")

MAX_MODELS = 256
MAX_REPLICAS = 1024
MAX_PATH_CHARS = 4096
CUDA_ERROR_OUT_OF_MEMORY = 2


@dataclass(frozen=True, slots=True)
class StoreConfig:
    models_dir: Path | None  # None: LoadModel is refused (nothing may be read)
    cuda_library: str = "libcuda.so.1"
    log_path: Path | None = None  # the worker's stderr
    # Extra environment of the worker, asked when it starts: on a GPU whose MPS daemon runs,
    # the MPS client environment (a process outside the MPS server could not share memory
    # with the replicas, which are its clients).
    environment: Callable[[], dict[str, str]] | None = None


@dataclass(frozen=True, slots=True)
class ModelView:
    name: str
    model_id: str
    path: str
    nbytes: int  # the device allocation (tensors, aligned)
    tensors: tuple[DeviceTensor, ...]
    ipc_handle: bytes
    loaded_at_unix_s: float
    replicas: tuple[str, ...]


@dataclass
class _Model:
    name: str
    model_id: str
    path: str
    nbytes: int
    tensors: tuple[DeviceTensor, ...]
    ipc_handle: bytes
    loaded_at_unix_s: float
    # replica id -> whether it is the id of a reservation of this GPU (the default of
    # `attach`: GPULOOM_ASSIGNMENT_ID); such a replica is detached when its reservation ends.
    replicas: dict[str, bool] = field(default_factory=dict)

    def view(self) -> ModelView:
        return ModelView(
            self.name,
            self.model_id,
            self.path,
            self.nbytes,
            self.tensors,
            self.ipc_handle,
            self.loaded_at_unix_s,
            tuple(sorted(self.replicas)),
        )


class _WorkerGone(Exception):
    pass


class _Worker:
    """The child process and its pipes; blocking, used from one thread at a time."""

    def __init__(self, config: StoreConfig, gpu: GpuInfo) -> None:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        if gpu.gpu_uuid.startswith(("GPU-", "MIG-")):
            env["CUDA_VISIBLE_DEVICES"] = gpu.gpu_uuid
        if config.environment is not None:
            env.update(config.environment())
        self._log: IO[bytes] | None = None
        if config.log_path is not None:
            self._log = open(config.log_path, "ab")  # noqa: SIM115 (lives with the process)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpuloom.services.dispatcher.model_worker", config.cuda_library],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log if self._log is not None else subprocess.DEVNULL,
            env=env,
        )
        first = self._read()
        if not first.get("ok"):
            self.close()
            raise FailedPrecondition(f"the model store cannot use the GPU: {first.get('error')}")

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise _WorkerGone(f"the model store process exited with code {code}")
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            self.process.kill()
            self.process.wait()
            raise _WorkerGone(f"the model store process wrote {line[:80]!r}, not an answer")
        return answer

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            code = self.process.wait()
            raise _WorkerGone(f"the model store process exited with code {code}") from None
        return self._read()

    def close(self) -> None:
        if self.process.stdin is not None:
            # A dead worker: what was left unwritten does not matter.
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        if self._log is not None:
            self._log.close()


def _read_layout(path: Path) -> tuple[int, tuple[DeviceTensor, ...], int, list[list[int]]]:
    """The file's data start, the device layout, its size and the copy list for the worker."""
    with open(path, "rb") as source:
        size = os.fstat(source.fileno()).st_size
        length = header_length(source.read(8))
        header = source.read(length)
        if len(header) != length:
            raise InvalidArgument("path", "is not a weights file: the header runs past the end")
    weights = parse_header(header, size)
    tensors, total = device_layout(weights.tensors)
    copies = [
        [s.data_begin, s.nbytes, d.offset] for s, d in zip(weights.tensors, tensors, strict=True)
    ]
    return weights.data_start, tensors, total, copies


class ModelStore:
    def __init__(self, gpu: GpuInfo, book: ReservationBook, config: StoreConfig) -> None:
        self.gpu = gpu
        self._book = book
        self._config = config
        self._models: dict[str, _Model] = {}
        self._worker: _Worker | None = None
        self._lock = asyncio.Lock()
        self._generation = 0
        # Called (on the loop) when the models held change: the placement link reports them.
        self.on_change: Callable[[], None] | None = None

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # -- queries --

    def list(self) -> list[ModelView]:
        self._prune()
        return [m.view() for m in sorted(self._models.values(), key=lambda m: m.name)]

    def _prune(self) -> None:
        """Detach the replicas whose reservation was released (or evicted) since they attached:
        a job that ended without detaching does not stay counted."""
        for model in self._models.values():
            for replica in [r for r, tied in model.replicas.items() if tied]:
                if self._book.get(replica) is None:
                    del model.replicas[replica]
                    log.info(
                        "replica detached: its reservation ended",
                        model=model.model_id,
                        replica=replica,
                    )

    def _held(self, name: str, field_name: str = "name") -> _Model:
        check_model_name(field_name, name)
        model = self._models.get(name)
        if model is None:
            held = ", ".join(sorted(self._models)) or "none"
            raise NotFound(
                f"model {name!r} is not in the store of GPU {self.gpu.index} (held: {held})"
            )
        return model

    def _check_handle(self, model: _Model, gpu_uuid: str, model_id: str) -> None:
        if gpu_uuid and gpu_uuid != self.gpu.gpu_uuid:
            raise InvalidArgument(
                "gpu_uuid",
                f"this store serves GPU {self.gpu.gpu_uuid}, not {gpu_uuid[:128]!r}: "
                "ask the dispatcher of that GPU",
            )
        if model_id and model_id != model.model_id:
            raise InvalidArgument(
                "model_id",
                f"{model_id[:160]!r} is not the handle of model {model.name!r} "
                f"(now {model.model_id!r}): another model's, or one unloaded since",
            )

    # -- changes --

    async def load(self, name: str, path: str) -> tuple[ModelView, bool]:
        """Load `path` (under the models directory) as `name`; (view, loaded now)."""
        check_model_name("name", name)
        source = self._resolve(path)
        async with self._lock:
            existing = self._models.get(name)
            if existing is not None:
                if existing.path == str(source):
                    return existing.view(), False
                raise AlreadyExists(f"model {name!r} is loaded from {existing.path}")
            if len(self._models) >= MAX_MODELS:
                raise ResourceExhausted(f"the store holds the maximum of {MAX_MODELS} models")
            try:
                data_start, tensors, total, copies = await asyncio.to_thread(_read_layout, source)
            except OSError as error:
                raise InvalidArgument("path", f"cannot read {path!r}: {error.strerror}") from None
            self._book.charge_store(total)
            try:
                answer = await self._ask(
                    {
                        "op": "load",
                        "name": name,
                        "path": str(source),
                        "data_start": data_start,
                        "total": total,
                        "tensors": copies,
                    }
                )
            except BaseException:
                self._book.uncharge_store(total)
                raise
            if not answer.get("ok"):
                self._book.uncharge_store(total)
                problem = f"loading {name!r} failed: {answer.get('error')}"
                if answer.get("code") == CUDA_ERROR_OUT_OF_MEMORY:  # the GPU, not the book
                    raise ResourceExhausted(problem)
                raise FailedPrecondition(problem)
            self._generation += 1
            model = _Model(
                name,
                f"{name}@{self._generation}",
                str(source),
                total,
                tensors,
                bytes.fromhex(answer["handle"]),
                time.time(),
            )
            self._models[name] = model
            log.info("model loaded", gpu=self.gpu.index, model=model.model_id, bytes=total)
            self._changed()
            return model.view(), True

    async def attach(self, name: str, replica: str, gpu_uuid: str, model_id: str) -> ModelView:
        model = self._held(name)
        check_replica_id("replica", replica)
        self._check_handle(model, gpu_uuid, model_id)
        self._prune()
        if replica not in model.replicas and len(model.replicas) >= MAX_REPLICAS:
            raise ResourceExhausted(f"model {name!r} has the maximum of {MAX_REPLICAS} replicas")
        model.replicas[replica] = self._book.get(replica) is not None
        return model.view()

    async def detach(self, name: str, replica: str, model_id: str) -> bool:
        model = self._held(name)
        check_replica_id("replica", replica)
        self._check_handle(model, "", model_id)
        if replica not in model.replicas:
            return False
        del model.replicas[replica]
        return True

    async def unload(self, name: str, force: bool) -> ModelView:
        async with self._lock:
            model = self._held(name)
            self._prune()
            if model.replicas and not force:
                raise FailedPrecondition(
                    f"model {name!r} has {len(model.replicas)} attached replicas "
                    f"({', '.join(sorted(model.replicas)[:5])}); detach them or force"
                )
            answer = await self._ask({"op": "unload", "name": name})
            if not answer.get("ok"):
                raise FailedPrecondition(f"unloading {name!r} failed: {answer.get('error')}")
            del self._models[name]
            self._book.uncharge_store(model.nbytes)
            log.info("model unloaded", gpu=self.gpu.index, model=model.model_id, force=force)
            self._changed()
            return model.view()

    async def read(self, name: str, offset: int, nbytes: int) -> bytes:
        """The store's own copy of a model's bytes (for checks and tests)."""
        async with self._lock:
            model = self._held(name)
            if offset < 0 or nbytes < 0 or offset + nbytes > model.nbytes:
                raise InvalidArgument("offset", f"outside the model's {model.nbytes} bytes")
            answer = await self._ask(
                {"op": "read", "name": name, "offset": offset, "nbytes": nbytes}
            )
            if not answer.get("ok"):
                raise FailedPrecondition(f"reading {name!r} failed: {answer.get('error')}")
            return bytes.fromhex(answer["data"])

    async def close(self) -> None:
        async with self._lock:
            if self._worker is not None:
                worker, self._worker = self._worker, None
                await asyncio.to_thread(worker.close)
            for model in self._models.values():
                self._book.uncharge_store(model.nbytes)
            self._models.clear()

    # -- the worker --

    def _resolve(self, path: str) -> Path:
        base = self._config.models_dir
        if base is None:
            raise FailedPrecondition(
                "model loading is off on this dispatcher: GPULOOM_DISPATCHER_MODELS_DIR is not set"
            )
        if not path or len(path) > MAX_PATH_CHARS or "\0" in path:
            raise InvalidArgument("path", f"must be 1..{MAX_PATH_CHARS} characters, no NUL")
        root = base.resolve()
        source = (root / path).resolve()
        if not source.is_relative_to(root):
            raise InvalidArgument("path", f"must be inside the models directory {root}")
        if not source.is_file():
            raise InvalidArgument("path", f"no file {path!r} in the models directory {root}")
        return source

    async def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Called with the lock held."""
        if self._worker is None:
            try:
                self._worker = await asyncio.to_thread(_Worker, self._config, self.gpu)
            except _WorkerGone as error:
                where = self._config.log_path or "its stderr (not kept)"
                raise FailedPrecondition(f"{error} while starting; see {where}") from None
            log.info(
                "model store process started", gpu=self.gpu.index, pid=self._worker.process.pid
            )
        try:
            return await asyncio.to_thread(self._worker.ask, request)
        except _WorkerGone as error:
            lost = sorted(self._models)
            for model in self._models.values():
                self._book.uncharge_store(model.nbytes)
            self._models.clear()
            self._changed()
            worker, self._worker = self._worker, None
            await asyncio.to_thread(worker.close)
            log.error("model store process gone", gpu=self.gpu.index, error=str(error), lost=lost)
            raise FailedPrecondition(f"{error}; the models it held are gone: {lost}") from None
