"""The memory cap on every allocation path, against a live dispatcher (real socket, the fake
driver and the fake NVML): over the cap -> exactly CUDA_ERROR_OUT_OF_MEMORY without reaching
the driver, under it -> success, and cuMemGetInfo and NVML's nvmlDeviceGetMemoryInfo(_v2)
answering the same capped view. Policy per path: docs/dispatcher.md, "The memory cap"."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.dispatcher.conftest import GIB, LiveDispatcher
from tests.shim.conftest import CUDA_ERROR_OUT_OF_MEMORY, Run, Runner

MIB = 1 << 20
FAKE_GPU_MIB = 8192  # the fake GPU's memory (GPULOOM_FAKE_CUDA_MEM_MIB)


def _env(live: LiveDispatcher, token: str) -> dict[str, str]:
    return {
        "GPULOOM_DISPATCHER_SOCKET": live.socket_path,
        "GPULOOM_ASSIGNMENT_TOKEN": token,
        "GPULOOM_FAKE_CUDA_MEM_MIB": str(FAKE_GPU_MIB),
    }


async def _run_capped(live: LiveDispatcher, run: Runner, ops: list[str]) -> Run:
    """cudart_like's `ops` under a new reservation capped at 1 GiB; it must exit 0."""
    assignment = await live.reserve(memory_gib=1.0)
    result = await run.run_async(*ops, env=_env(live, assignment.assignment_token))
    assert result.returncode == 0, result.stderr
    return result


def _views(result: Run) -> list[dict[str, dict[str, int]]]:
    """Each view printed after a `meminfo nvml` pair: {"cuda"|"nvml"|"nvml_v2": fields}."""
    views: list[dict[str, dict[str, int]]] = []
    for line in result.stdout.splitlines():
        head, _, rest = line.partition(" ")
        if head not in ("meminfo", "nvml", "nvml_v2", "nvml_other"):
            continue
        fields = dict(part.split("=", 1) for part in rest.split())
        assert fields.pop("rc") == "0", line
        if head == "meminfo":
            views.append({})
        views[-1][{"meminfo": "cuda"}.get(head, head)] = {k: int(v) for k, v in fields.items()}
    return views


def _assert_capped(view: dict[str, dict[str, int]], cap: int, counted: int) -> None:
    """cuMemGetInfo and both NVML queries agree: total = cap, free = cap - counted."""
    assert view["cuda"] == {"free": cap - counted, "total": cap}
    for nvml in ("nvml", "nvml_v2"):
        assert view[nvml]["total"] == cap, view
        assert view[nvml]["free"] == cap - counted, view
        assert view[nvml]["used"] == counted, view
    assert view["nvml_v2"]["reserved"] == 0


PATHS = ["alloc", "pitch", "managed", "async", "pool", "create", "vmm"]
# Arrays (the driver's padded size), graph memory nodes, the pre-3.2 32-bit entry points.
PATHS += ["array", "array3d", "mipmap", "graphnode", "addnode", "legacy", "legacypitch"]
PATHS += ["legacyarray"]


@pytest.mark.parametrize("flavour", [[], ["--proc", "--ptds"]], ids=["direct", "cudart-ptds"])
@pytest.mark.parametrize("kind", PATHS)
async def test_each_allocation_path_is_capped_and_both_views_agree(
    live: LiveDispatcher, run: Runner, kind: str, flavour: list[str]
) -> None:
    ops = [*flavour, "meminfo", "nvml"]
    ops += ["alloc", kind, str(600 * MIB), "meminfo", "nvml"]
    ops += ["alloc", kind, str(500 * MIB)]  # 1,100 MiB: over the 1 GiB cap
    ops += ["alloc", kind, str(400 * MIB), "meminfo", "nvml"]  # 1,000 MiB: fits
    ops += ["freeall", "meminfo", "nvml"]
    result = await _run_capped(live, run, ops)
    lines = result.stdout.splitlines()
    assert f"alloc {kind} {600 * MIB} rc=0" in lines
    assert f"alloc {kind} {500 * MIB} rc={CUDA_ERROR_OUT_OF_MEMORY}" in lines
    assert f"alloc {kind} {400 * MIB} rc=0" in lines
    assert "freeall rc=0" in lines
    assert not any(line.startswith("vmm map") for line in lines), lines
    views = _views(result)
    assert len(views) == 4
    for view, counted in zip(views, [0, 600 * MIB, 1000 * MIB, 0], strict=True):
        _assert_capped(view, GIB, counted)
    # The refused request never reached the driver; the others did.
    reached = [line for line in result.fake_trace if f" {500 * MIB} " in f"{line} "]
    assert not reached, reached
    assert any(f" {400 * MIB} ok" in line for line in result.fake_trace)


async def test_a_vmm_allocation_counts_until_released_and_unmapped(
    live: LiveDispatcher, run: Runner
) -> None:
    """cuMemRelease of a mapped handle frees nothing (the driver keeps it for the mapping):
    the bytes stay counted until the unmap."""
    ops = ["alloc", "vmm", str(700 * MIB), "vmmrelease", "meminfo", "nvml"]
    ops += ["alloc", "alloc", str(400 * MIB)]  # still over: the mapping holds 700 MiB
    ops += ["freeall", "meminfo", "nvml", "alloc", "alloc", str(400 * MIB)]
    result = await _run_capped(live, run, ops)
    lines = result.stdout.splitlines()
    assert "vmmrelease rc=0" in lines
    assert lines.count(f"alloc alloc {400 * MIB} rc={CUDA_ERROR_OUT_OF_MEMORY}") == 1
    assert lines[-1] == f"alloc alloc {400 * MIB} rc=0"
    released, unmapped = _views(result)
    _assert_capped(released, GIB, 700 * MIB)
    _assert_capped(unmapped, GIB, 0)


async def _exporting(
    run: Runner,
    env: dict[str, str],
    handle: Path,
    go: Path,
    ops: list[str],
    after: tuple[str, ...] = (),
) -> asyncio.Task[Run]:
    """Starts a process that runs `ops` (which write `handle`), then stays alive, holding its
    memory, until `go` exists, then runs `after`; returns once the handle is there."""
    command = [*ops, "waitfile", str(go), *after]
    task = asyncio.create_task(run.run_async(*command, env=env, timeout=60))
    for _ in range(600):
        if handle.exists() or task.done():
            break
        await asyncio.sleep(0.02)
    assert handle.exists(), (await task).stderr if task.done() else "no handle"
    return task


async def test_ipc_memory_is_counted_once_by_the_process_that_allocated_it(
    live: LiveDispatcher, run: Runner
) -> None:
    exporter = await live.reserve(memory_gib=1.0)
    opener = await live.reserve(memory_gib=1.0)
    handle, go = run.work / "ipc.handle", run.work / "go"
    ops = ["alloc", "alloc", str(800 * MIB), "ipcget", str(handle), "meminfo", "nvml"]
    ops += ["alloc", "alloc", str(300 * MIB)]  # the exporter is charged: over its cap
    exporting = await _exporting(run, _env(live, exporter.assignment_token), handle, go, ops)
    try:
        # The opener maps the 800 MiB without being charged: 900 MiB of its own still fit.
        opened = await run.run_async(
            "alloc",
            "alloc",
            str(100 * MIB),
            "ipcopen",
            str(handle),
            "meminfo",
            "nvml",
            "alloc",
            "alloc",
            str(800 * MIB),
            "ipcclose",
            env=_env(live, opener.assignment_token),
        )
    finally:
        go.touch()
        exported = await exporting
    assert exported.returncode == 0, exported.stderr
    lines = exported.stdout.splitlines()
    assert "ipcget rc=0" in lines
    assert f"alloc alloc {300 * MIB} rc={CUDA_ERROR_OUT_OF_MEMORY}" in lines
    _assert_capped(_views(exported)[0], GIB, 800 * MIB)
    assert opened.returncode == 0, opened.stderr
    lines = opened.stdout.splitlines()
    assert "ipcopen rc=0" in lines and "ipcclose rc=0" in lines
    assert f"alloc alloc {800 * MIB} rc=0" in lines
    _assert_capped(_views(opened)[0], GIB, 100 * MIB)


CUDA_ERROR_INVALID_HANDLE = 400


async def test_ipc_opened_memory_is_the_exporters_bytes_and_is_writable(run: Runner) -> None:
    """The fake driver backs device memory with shared memory: an opener reads the exporter's
    bytes. CUDA IPC memory cannot be opened read-only, so an opener's writes reach every other
    process (the limit docs/dispatcher.md states); once the exporter is gone, opening its
    handle fails and maps nothing."""
    handle, go = run.work / "ipc.handle", run.work / "go"
    env = {"GPULOOM_FAKE_CUDA_MEM_MIB": "4096"}
    ops = ["alloc", "alloc", str(8 * MIB), "fill", "90", "ipcget", str(handle)]
    exporting = await _exporting(run, env, handle, go, ops, after=("peek",))
    try:
        reader = await run.run_async("ipcopen", str(handle), "ipcpeek", "ipcclose", env=env)
        writer = await run.run_async("ipcopen", str(handle), "ipcfill", "17", env=env)
    finally:
        go.touch()
        exported = await exporting
    assert "ipcpeek rc=0 first=90 uniform=1" in reader.stdout.splitlines(), reader.stdout
    assert "ipcfill rc=0" in writer.stdout.splitlines(), writer.stdout
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.splitlines()[-1] == "peek rc=0 first=17 uniform=1"  # overwritten
    late = await run.run_async("ipcopen", str(handle), "ipcpeek", env=env)
    assert f"ipcopen rc={CUDA_ERROR_INVALID_HANDLE}" in late.stdout.splitlines(), late.stdout
    assert not any(line.startswith("ipcpeek rc=0") for line in late.stdout.splitlines())


@pytest.mark.parametrize(
    ("visible", "other_capped"),
    [("GPU-fa4e0000", False), ("", True)],
    ids=["visible-by-uuid", "no-visible-devices"],
)
async def test_nvml_caps_the_processs_own_gpu(
    live: LiveDispatcher, run: Runner, visible: str, other_capped: bool
) -> None:
    """With CUDA_VISIBLE_DEVICES naming the process's GPU by UUID (prefix), as Reserve's answer
    does on real GPUs, only that NVML device gets the capped view; another GPU of the node is
    answered as it is. Without it the shim cannot tell, and every device gets the view."""
    assignment = await live.reserve(memory_gib=1.0)
    env = _env(live, assignment.assignment_token)
    if visible:
        env["CUDA_VISIBLE_DEVICES"] = visible
    result = await run.run_async("alloc", "alloc", str(300 * MIB), "meminfo", "nvml", env=env)
    assert result.returncode == 0, result.stderr
    (view,) = _views(result)
    _assert_capped(view, GIB, 300 * MIB)
    other = view["nvml_other"]
    if other_capped:  # the process's own counted bytes, as on its GPU
        assert other == {"free": GIB - 300 * MIB, "total": GIB, "used": 300 * MIB}
    else:
        whole = FAKE_GPU_MIB * MIB
        assert other == {"free": whole, "total": whole, "used": 0}


def test_without_a_dispatcher_nvml_and_cuda_pass_through(run: Runner) -> None:
    """No assignment: no cap, both views are the device's (the fake's own bookkeeping)."""
    result = run(
        "alloc", "vmm", str(300 * MIB), "meminfo", "nvml", env={"GPULOOM_FAKE_CUDA_MEM_MIB": "4096"}
    )
    assert result.returncode == 0, result.stderr
    (view,) = _views(result)
    total = 4096 * MIB
    assert view["cuda"] == {"free": total - 300 * MIB, "total": total}
    assert view["nvml"] == {"free": total - 300 * MIB, "total": total, "used": 300 * MIB}
    assert any("dlsym nvmlDeviceGetMemoryInfo hooked" in line for line in result.shim_trace)


@pytest.mark.parametrize("pool", ["pool", "default"])
async def test_what_a_pool_keeps_after_frees_is_counted_up_to_its_release_threshold(
    live: LiveDispatcher, run: Runner, pool: str
) -> None:
    """A pool with a release threshold keeps freed memory: it stays counted (a plain allocation
    that would not fit beside it is refused), a new allocation from the pool takes it first
    (fits), and a trim or a lower threshold gives it back. `default`: the device's current pool
    (cuMemAllocAsync's) with the threshold PyTorch's async allocator sets (keep everything)."""
    kind, threshold = ("pool", str(GIB)) if pool == "pool" else ("async", str(2**64 - 1))
    setting = "poolthreshold" if pool == "pool" else "defaultthreshold"
    ops = ["stream", "alloc", kind, str(600 * MIB), setting, threshold]
    ops += ["freeall", "meminfo", "nvml"]  # kept: 600 MiB counted
    ops += ["alloc", "alloc", str(500 * MIB)]  # refused: 600 kept + 500 > 1 GiB
    ops += ["alloc", kind, str(600 * MIB), "meminfo", "nvml"]  # reuses what the pool kept
    ops += ["freeall", setting, "0", "meminfo", "nvml"]  # threshold 0: given back
    ops += ["alloc", "alloc", str(1000 * MIB)]
    result = await _run_capped(live, run, ops)
    lines = result.stdout.splitlines()
    assert f"{setting} {threshold} rc=0" in lines
    assert f"alloc alloc {500 * MIB} rc={CUDA_ERROR_OUT_OF_MEMORY}" in lines
    assert lines.count(f"alloc {kind} {600 * MIB} rc=0") == 2
    assert lines[-1] == f"alloc alloc {1000 * MIB} rc=0"
    kept, reused, released = _views(result)
    _assert_capped(kept, GIB, 600 * MIB)
    _assert_capped(reused, GIB, 600 * MIB)
    _assert_capped(released, GIB, 0)


async def test_a_trim_gives_back_what_a_pool_keeps(live: LiveDispatcher, run: Runner) -> None:
    ops = ["stream", "poolthreshold", str(GIB), "alloc", "pool", str(600 * MIB), "freeall"]
    ops += ["pooltrim", str(100 * MIB), "meminfo", "nvml", "pooltrim", "0", "meminfo", "nvml"]
    result = await _run_capped(live, run, ops)
    trimmed, empty = _views(result)
    _assert_capped(trimmed, GIB, 100 * MIB)
    _assert_capped(empty, GIB, 0)


@pytest.mark.parametrize("kind", ["alloc", "legacy", "graphnode"])
async def test_a_double_free_leaves_the_count_at_zero_not_below(
    live: LiveDispatcher, run: Runner, kind: str
) -> None:
    """The count cannot go below zero (a wrapped count would refuse everything, a negative one
    would let the process past its cap): after a double free the whole cap is still there,
    and no more."""
    ops = ["alloc", kind, str(600 * MIB), "freelast", "freeagain", "meminfo", "nvml"]
    ops += ["alloc", "alloc", str(GIB), "alloc", "alloc", str(MIB)]
    result = await _run_capped(live, run, ops)
    lines = result.stdout.splitlines()
    assert "freelast rc=0" in lines
    assert "freeagain rc=0" not in lines  # the driver refuses it; the count does not move
    assert f"alloc alloc {GIB} rc=0" in lines
    assert lines[-1] == f"alloc alloc {MIB} rc={CUDA_ERROR_OUT_OF_MEMORY}"
    (view,) = _views(result)
    _assert_capped(view, GIB, 0)
