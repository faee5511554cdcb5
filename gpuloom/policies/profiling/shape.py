"""The SMs a kernel's launch shape asks for on a GPU model: what spatial admission adds up
(gpuloom/policies/harvest/spatial.py) and the profiler stores as KernelStats.sm_usage.

    threads   = block.x * block.y * block.z, allocated in whole warps of 32
    resident  = min(the model's max blocks per SM, (max threads per SM / 32) // warps per block)
    sm_usage  = min(the model's SMs, ceil(grid.x * grid.y * grid.z / resident))

This is Orion's "SM_needed" (blocks over what one SM holds at once), in SM-equivalents of
capacity: the hardware spreads a small grid over many SMs, but the room left in each is room
another process's blocks can use under MPS. A grid larger than one wave runs in waves on
every SM, hence the cap at the SM count.

Which way it errs: the shim measures neither registers per thread nor shared memory per
block, and either can only lower how many blocks an SM holds. `resident` is therefore an
upper bound and sm_usage a lower bound on the SMs the kernel really asks for: a register- or
shared-memory-heavy kernel asks for more than this says (up to one SM per block, at most the
SM count), so spatial admission may pack it beside more than fits.

A CUDA graph is measured as one unit with no launch shape (all six dimensions 0): its usage is
unknown, 0.
"""

from __future__ import annotations

from gpuloom.domain.gpus import GpuModel
from gpuloom.domain.profiles import Dim3

WARP_SIZE = 32
MAX_THREADS_PER_BLOCK = 1024  # every compute capability since 2.0
NO_SHAPE = Dim3(0, 0, 0)


def _volume(dim: Dim3, what: str) -> int:
    if min(dim.x, dim.y, dim.z) < 1:
        raise ValueError(f"{what} {dim.x}x{dim.y}x{dim.z}: every dimension must be >= 1")
    return dim.x * dim.y * dim.z


def blocks_per_sm(block: Dim3, model: GpuModel) -> int:
    """Blocks of this shape one SM of the model holds at once, by threads and block slots alone
    (registers and shared memory unknown: an upper bound)."""
    threads = _volume(block, "block")
    if threads > MAX_THREADS_PER_BLOCK:
        raise ValueError(
            f"block {block.x}x{block.y}x{block.z} has {threads} threads, "
            f"at most {MAX_THREADS_PER_BLOCK} can launch"
        )
    warps = -(-threads // WARP_SIZE)
    return min(model.max_blocks_per_sm, model.max_threads_per_sm // WARP_SIZE // warps)


def sm_usage(grid: Dim3, block: Dim3, model: GpuModel) -> int:
    """SMs the launch asks for on the model, 1..its SM count; 0 for a graph's entry (no shape).
    ValueError for a shape that cannot launch."""
    if grid == NO_SHAPE and block == NO_SHAPE:
        return 0
    blocks = _volume(grid, "grid")
    resident = blocks_per_sm(block, model)
    return min(model.sm_count, -(-blocks // resident))
