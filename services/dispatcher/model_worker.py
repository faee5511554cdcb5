"""The model store's process: holds one GPU's shared model weights in device memory.

Started by the dispatcher (services/dispatcher/model_store.py) as
`python -m gpuloom.services.dispatcher.model_worker LIBRARY`, with CUDA_VISIBLE_DEVICES naming
its GPU and without the shim. It speaks JSON lines on stdin/stdout, one answer per request:
    {"op": "load", "name": N, "path": P, "data_start": S, "total": T,
     "tensors": [[BEGIN, NBYTES, DEVICE_OFFSET], ...]}
        -> {"ok": true, "pointer": PTR, "handle": HEX}  (allocates T bytes, copies, exports)
    {"op": "unload", "name": N} -> {"ok": true}
    {"op": "read", "name": N, "offset": O, "nbytes": B} -> {"ok": true, "data": HEX}
Failures answer {"ok": false, "error": TEXT, "code": CURESULT or null}. The first line it
writes says whether the driver opened: {"ok": true, "ready": true} or the error, then it exits.
The validation of names, paths and layouts is the dispatcher's; this process trusts its parent.
"""

from __future__ import annotations

import json
import sys
from typing import Any, BinaryIO

from gpuloom.cudadrv import CudaError, Driver

CHUNK_BYTES = 16 << 20


def _copy(driver: Driver, source: BinaryIO, request: dict[str, Any], pointer: int) -> None:
    data_start = int(request["data_start"])
    for begin, nbytes, offset in request["tensors"]:
        source.seek(data_start + begin)
        done = 0
        while done < nbytes:
            chunk = source.read(min(CHUNK_BYTES, nbytes - done))
            if not chunk:
                raise OSError(f"{request['path']} is shorter than its header says (changed?)")
            driver.copy_to_device(pointer + offset + done, chunk)
            done += len(chunk)


def serve(driver: Driver, requests: BinaryIO, answers: Any) -> None:
    models: dict[str, int] = {}

    def answer(value: dict[str, Any]) -> None:
        answers.write(json.dumps(value) + "\n")
        answers.flush()

    answer({"ok": True, "ready": True})
    for line in requests:
        request = json.loads(line)
        op, name = request.get("op"), request.get("name", "")
        try:
            if op == "load":
                pointer = driver.alloc(int(request["total"]))
                try:
                    with open(request["path"], "rb") as source:
                        _copy(driver, source, request, pointer)
                    handle = driver.ipc_handle(pointer)
                except BaseException:
                    driver.free(pointer)
                    raise
                models[name] = pointer
                answer({"ok": True, "pointer": pointer, "handle": handle.hex()})
            elif op == "unload":
                pointer = models.pop(name, None)
                if pointer is not None:
                    driver.free(pointer)
                answer({"ok": True})
            elif op == "read":
                data = driver.copy_from_device(
                    models[name] + int(request["offset"]), int(request["nbytes"])
                )
                answer({"ok": True, "data": data.hex()})
            else:
                answer({"ok": False, "error": f"unknown op {op!r}", "code": None})
        except CudaError as error:
            answer({"ok": False, "error": str(error), "code": error.code})
        except (OSError, KeyError, ValueError) as error:
            answer({"ok": False, "error": str(error), "code": None})


def main() -> int:
    library = sys.argv[1] if len(sys.argv) > 1 else "libcuda.so.1"
    try:
        driver = Driver(library)
    except (OSError, CudaError) as error:
        sys.stdout.write(json.dumps({"ok": False, "error": str(error), "code": None}) + "\n")
        sys.stdout.flush()
        return 1
    serve(driver, sys.stdin.buffer, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
