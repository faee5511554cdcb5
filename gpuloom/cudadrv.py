"""A minimal ctypes binding of the CUDA driver API: what the model store and the replicas that
attach its models need (context, allocation, copies, IPC handles). Nothing of CUDA is vendored:
the driver library is opened at run time (`libcuda.so.1`, or a path such as the fake driver's).

Functions are looked up in the process's global namespace after the library is loaded there,
so a process running with the gpuloom shim preloaded goes through the shim's hooks (its memory
cap) exactly as a framework's own calls would.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from collections.abc import Sequence

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_INVALID_HANDLE = 400
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
IPC_HANDLE_BYTES = 64
DEFAULT_LIBRARY = "libcuda.so.1"


class CudaError(Exception):
    """A driver call failed; `code` is its CUresult."""

    def __init__(self, function: str, code: int) -> None:
        super().__init__(f"{function} failed with CUresult {code}")
        self.function = function
        self.code = code


class IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


_CU = ctypes.c_int
_PTR = ctypes.c_uint64


class Driver:
    """One process's use of the driver on one device (ordinal 0 of what it can see), in the
    device's primary context. Thread-safe: every call makes the context current first."""

    def __init__(self, library: str = DEFAULT_LIBRARY) -> None:
        try:
            ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
        except OSError as error:
            raise OSError(f"cannot load the CUDA driver {library!r}: {error}") from None
        self.library = library
        self._lib = ctypes.CDLL(None)  # the global namespace: a preloaded shim comes first
        self._local = threading.local()
        self._check("cuInit", self._fn("cuInit", [ctypes.c_uint])(0))
        device = ctypes.c_int()
        self._check(
            "cuDeviceGet",
            self._fn("cuDeviceGet", [ctypes.c_void_p, ctypes.c_int])(ctypes.byref(device), 0),
        )
        self._context = ctypes.c_void_p()
        retain = self._fn("cuDevicePrimaryCtxRetain", [ctypes.c_void_p, ctypes.c_int])
        self._check("cuDevicePrimaryCtxRetain", retain(ctypes.byref(self._context), device))
        self._set_current = self._fn("cuCtxSetCurrent", [ctypes.c_void_p])
        self._alloc = self._fn("cuMemAlloc_v2", [ctypes.c_void_p, ctypes.c_size_t])
        self._free = self._fn("cuMemFree_v2", [_PTR])
        self._htod = self._fn("cuMemcpyHtoD_v2", [_PTR, ctypes.c_void_p, ctypes.c_size_t])
        self._dtoh = self._fn("cuMemcpyDtoH_v2", [ctypes.c_void_p, _PTR, ctypes.c_size_t])
        self._ipc_get = self._fn("cuIpcGetMemHandle", [ctypes.c_void_p, _PTR])
        self._ipc_open = self._fn(
            "cuIpcOpenMemHandle_v2", [ctypes.c_void_p, IpcMemHandle, ctypes.c_uint]
        )
        self._ipc_close = self._fn("cuIpcCloseMemHandle", [_PTR])
        self._mem_info = self._fn("cuMemGetInfo_v2", [ctypes.c_void_p, ctypes.c_void_p])

    def _fn(self, name: str, argtypes: list[object]) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        try:
            function = getattr(self._lib, name)
        except AttributeError:
            raise OSError(f"the CUDA driver {self.library!r} has no {name}") from None
        function.argtypes = argtypes
        function.restype = _CU
        return function

    @staticmethod
    def _check(function: str, result: int) -> None:
        if result != CUDA_SUCCESS:
            raise CudaError(function, result)

    def _current(self) -> None:
        if getattr(self._local, "context", None) != self._context.value:
            self._check("cuCtxSetCurrent", self._set_current(self._context))
            self._local.context = self._context.value

    def alloc(self, nbytes: int) -> int:
        self._current()
        pointer = _PTR()
        self._check("cuMemAlloc_v2", self._alloc(ctypes.byref(pointer), nbytes))
        return pointer.value

    def free(self, pointer: int) -> None:
        self._current()
        self._check("cuMemFree_v2", self._free(pointer))

    def copy_to_device(self, pointer: int, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if not view.nbytes:
            return
        self._current()
        buffer = (ctypes.c_char * view.nbytes).from_buffer_copy(view)
        self._check("cuMemcpyHtoD_v2", self._htod(pointer, buffer, view.nbytes))

    def copy_from_device(self, pointer: int, nbytes: int) -> bytes:
        self._current()
        buffer = ctypes.create_string_buffer(nbytes)
        if nbytes:
            self._check("cuMemcpyDtoH_v2", self._dtoh(buffer, pointer, nbytes))
        return buffer.raw

    def ipc_handle(self, pointer: int) -> bytes:
        self._current()
        handle = IpcMemHandle()
        self._check("cuIpcGetMemHandle", self._ipc_get(ctypes.byref(handle), pointer))
        return bytes(handle)  # all 64 bytes (.reserved would stop at a zero byte)

    def ipc_open(self, handle: bytes) -> int:
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        self._current()
        pointer = _PTR()
        value = IpcMemHandle()
        ctypes.memmove(ctypes.addressof(value), handle, IPC_HANDLE_BYTES)
        result = self._ipc_open(ctypes.byref(pointer), value, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        self._check("cuIpcOpenMemHandle", result)
        return pointer.value

    def ipc_close(self, pointer: int) -> None:
        self._current()
        self._check("cuIpcCloseMemHandle", self._ipc_close(pointer))

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes as cuMemGetInfo answers: the capped view under the shim."""
        self._current()
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._check("cuMemGetInfo_v2", self._mem_info(ctypes.byref(free), ctypes.byref(total)))
        return free.value, total.value


# ---- the driver's checkpoint API (CUDA Checkpointing, r570 and newer drivers) ----

CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_ILLEGAL_STATE = 401
CUDA_ERROR_TIMEOUT = 909
CHECKPOINT_FUNCTIONS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)


class ProcessState(enum.IntEnum):
    """CUprocessState: where a process is in the checkpoint state machine."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class CheckpointUnsupported(OSError):
    """The driver has no checkpoint API (older than r570, or a driver without it)."""


class _LockArgs(ctypes.Structure):
    _fields_ = [
        ("timeout_ms", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class _ReservedArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class _GpuPair(ctypes.Structure):
    """CUcheckpointGpuPair (CUDA 13.0): the GPU checkpointed and the GPU to restore onto."""

    _fields_ = [("old_uuid", ctypes.c_ubyte * 16), ("new_uuid", ctypes.c_ubyte * 16)]


class _RestoreArgs(ctypes.Structure):
    """CUcheckpointRestoreArgs as CUDA 13.0 declares it (older headers: 64 reserved bytes)."""

    _fields_ = [
        ("gpu_pairs", ctypes.POINTER(_GpuPair)),
        ("gpu_pairs_count", ctypes.c_uint),
        ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
        ("reserved1", ctypes.c_uint64),
    ]


def gpu_uuid_bytes(uuid: str) -> bytes:
    """A GPU UUID as NVML writes it (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx) -> its 16 bytes.
    Raises ValueError naming it when it is not one."""
    digits = uuid[4:].replace("-", "") if uuid.startswith("GPU-") else ""
    if len(digits) != 32 or any(c not in "0123456789abcdefABCDEF" for c in digits):
        raise ValueError(f"not a GPU UUID (GPU-<32 hex digits>): {uuid!r}")
    return bytes.fromhex(digits)


class CheckpointDriver:
    """The checkpoint API as an external controller calls it: on another process, by pid.
    Lock blocks the process's further CUDA calls (waiting for those in flight), checkpoint
    moves its device memory to host memory and releases the GPU's, restore brings it back
    (to the same addresses), unlock lets it run. Each call raises CudaError on failure.
    Thread-safe (the driver serialises requests per process)."""

    def __init__(self, library: str = DEFAULT_LIBRARY) -> None:
        try:
            lib = ctypes.CDLL(library)
        except OSError as error:
            raise CheckpointUnsupported(
                f"cannot load the CUDA driver {library!r}: {error}"
            ) from None
        missing = [name for name in CHECKPOINT_FUNCTIONS if not hasattr(lib, name)]
        if missing:
            raise CheckpointUnsupported(
                f"the CUDA driver {library!r} has no checkpoint API (missing {', '.join(missing)})"
            )
        self.library = library
        init = lib.cuInit
        init.argtypes, init.restype = [ctypes.c_uint], _CU
        Driver._check("cuInit", init(0))
        self._fns = {}
        for name in CHECKPOINT_FUNCTIONS:
            function = getattr(lib, name)
            function.argtypes = [ctypes.c_int, ctypes.c_void_p]
            function.restype = _CU
            self._fns[name] = function

    def state(self, pid: int) -> ProcessState:
        value = ctypes.c_int()
        Driver._check(
            "cuCheckpointProcessGetState",
            self._fns["cuCheckpointProcessGetState"](pid, ctypes.byref(value)),
        )
        return ProcessState(value.value)

    def lock(self, pid: int, timeout_ms: int = 0) -> None:
        """timeout_ms: give up (CUDA_ERROR_TIMEOUT, the process left running) after that long
        waiting for its calls in flight; 0: no limit."""
        args = _LockArgs(timeout_ms=timeout_ms)
        Driver._check(
            "cuCheckpointProcessLock", self._fns["cuCheckpointProcessLock"](pid, ctypes.byref(args))
        )

    def _call(self, name: str, pid: int) -> None:
        args = _ReservedArgs()
        Driver._check(name, self._fns[name](pid, ctypes.byref(args)))

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid)

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
        """gpu_pairs: (UUID checkpointed on, UUID to restore onto) for each GPU to move (the
        restore args of CUDA 13.0, same chip type only); none: back onto the same GPUs. A bad
        UUID raises ValueError before the driver is called."""
        if len(gpu_pairs) > 8:
            raise ValueError(f"at most 8 GPU pairs, got {len(gpu_pairs)}")
        pairs = (_GpuPair * max(1, len(gpu_pairs)))()
        for index, (old, new) in enumerate(gpu_pairs):
            pairs[index].old_uuid[:] = gpu_uuid_bytes(old)
            pairs[index].new_uuid[:] = gpu_uuid_bytes(new)
        args = _RestoreArgs(gpu_pairs=pairs if gpu_pairs else None, gpu_pairs_count=len(gpu_pairs))
        Driver._check(
            "cuCheckpointProcessRestore",
            self._fns["cuCheckpointProcessRestore"](pid, ctypes.byref(args)),
        )

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid)
