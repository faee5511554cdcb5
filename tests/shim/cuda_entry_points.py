"""The driver API's entry points as the ABI names libcuda exports, read from the cuda.h the
shim is built against (the nvidia-cuda-runtime-cu12 wheel's, as shim/find_cuda_include.py finds
it), and which of them allocate device memory by the rule below. Used by
test_memcap_coverage.py; no CUDA is needed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# An entry point "allocates" when its name says it allocates, creates, imports, registers,
# maps, opens, loads, reserves or retains something, instantiates or clones a graph, adds a
# graph node that can allocate (memory nodes, the generic cuGraphAddNode, child graphs),
# prefetches or advises memory, sets a limit, changes a pool or the graph memory pool, or
# restores a checkpoint: every way the driver can come to hold device memory for the process.
# Names that only free, unmap, export or query (Get...) are not, except the Get...Mapped... of
# external and graphics memory, which map memory into the process.
ALLOCATING = re.compile(
    r"Alloc|Create|Import|Register|Map|Open|Load|Reserve|Retain|Instantiate|Clone"
    r"|AddNode|AddMemAllocNode|AddChildGraphNode|Prefetch|Advise|SetLimit|MemPool|GraphMemTrim|GraphMemAttribute"
    r"|Trim|Checkpoint|Multicast"
)
NOT_ALLOCATING = re.compile(
    r"Un(register|map|load|bind)|Destroy|Free|Release|Export|Get|SetMapFlags|Callback"
)
MAPPING_QUERY = re.compile(r"GetMapped")


def cuda_header() -> Path:
    found = subprocess.run(
        [sys.executable, str(ROOT / "shim" / "find_cuda_include.py")],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(found.stdout.strip()) / "cuda.h"


def abi_names(header: Path) -> set[str]:
    """Every exported name cuda.h stands for: each declared function under the name its
    versioning macro gives it (cuMemAlloc -> cuMemAlloc_v2), the legacy originals cuda.h
    declares for the driver's own build, and the _ptsz/_ptds twins of its per-thread macros."""
    text = header.read_text()
    declared = set(re.findall(r"CUresult\s+CUDAAPI\s+(\w+)\s*\(", text))
    renames: dict[str, str] = {}
    twins: set[str] = set()
    for name, target in re.findall(r"#define\s+(cu\w+)\s+(\S.*)", text):
        twin = re.match(r"__CUDA_API_PT(SZ|DS)\((\w+)\)", target.strip())
        if twin:
            twins.add(f"{twin.group(2)}_{'ptsz' if twin.group(1) == 'SZ' else 'ptds'}")
        elif re.fullmatch(r"cu\w+", target.strip()) and name not in renames:
            renames[name] = target.strip()
    legacy_block = re.search(
        r"#if defined\(__CUDA_API_VERSION_INTERNAL\)\s*\n\s*#undef(.*?)\n#endif", text, re.S
    )
    legacy = set()
    if legacy_block:
        legacy = set(re.findall(r"CUresult\s+CUDAAPI\s+(\w+)\s*\(", legacy_block.group(0)))
    names = {renames.get(name, name) for name in declared} | legacy | twins
    return {name for name in names if name.startswith("cu")}


def allocating(names: set[str]) -> set[str]:
    def base(name: str) -> str:
        return re.sub(r"(_v\d+)?(_pt[sd][sz])?$", "", name)

    return {
        name
        for name in names
        if ALLOCATING.search(base(name))
        and (not NOT_ALLOCATING.search(base(name)) or MAPPING_QUERY.search(base(name)))
    }


def hooked() -> set[str]:
    text = (ROOT / "shim" / "src" / "hooks.h").read_text()
    return set(re.findall(r"HOOK\((cu\w+),", text))


def exempt(path: Path) -> dict[str, str]:
    """shim/memcap_entry_points.txt: `name: reason` lines (# comments, blank lines)."""
    entries: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, reason = line.partition(":")
        if not sep or not reason.strip():
            raise ValueError(f"{path}:{number}: expected `name: reason`, got {line!r}")
        entries[name.strip()] = reason.strip()
    return entries


EXEMPT = ROOT / "shim" / "memcap_entry_points.txt"


def unaccounted(names: set[str], hooks: set[str], exempted: dict[str, str]) -> list[str]:
    """The allocating entry points that are neither hooked nor listed with a reason."""
    return sorted(allocating(names) - hooks - set(exempted))
