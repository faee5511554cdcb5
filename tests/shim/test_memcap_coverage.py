"""No allocating entry point of the driver API escapes the memory cap unnoticed: every one in
the cuda.h the shim is built against is hooked (shim/src/hooks.h) or listed, with the reason it
needs no hook, in shim/memcap_entry_points.txt. A new cuda.h with a new allocating function
fails here until someone decides which it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.shim.cuda_entry_points import (
    EXEMPT,
    abi_names,
    allocating,
    cuda_header,
    exempt,
    hooked,
    unaccounted,
)


@pytest.fixture(scope="module")
def names() -> set[str]:
    return abi_names(cuda_header())


def test_every_allocating_entry_point_is_hooked_or_listed_with_its_reason(
    names: set[str],
) -> None:
    missing = unaccounted(names, hooked(), exempt(EXEMPT))
    assert not missing, f"hook these in shim/src/memcap.c or list them with a reason: {missing}"


def test_the_list_names_only_allocating_entry_points_of_this_cuda_h_and_none_hooked(
    names: set[str],
) -> None:
    listed = exempt(EXEMPT)
    assert not set(listed) - names, "listed but not in cuda.h (stale)"
    assert not set(listed) - allocating(names), "listed but not allocating by the rule"
    assert not set(listed) & hooked(), "both hooked and listed as needing no hook"
    assert all(reason for reason in listed.values())


def test_every_hook_is_an_entry_point_of_this_cuda_h(names: set[str]) -> None:
    assert not hooked() - names


def test_the_rule_sees_the_allocators_users_escaped_the_cap_through(names: set[str]) -> None:
    """The rule is a regular expression over names: it must keep seeing the known ways (HAMi's
    users' escapes included), under their exported names (versioned, legacy, per-thread)."""
    known = {
        "cuMemAlloc_v2", "cuMemAlloc", "cuMemAllocPitch", "cuMemAllocPitch_v2",
        "cuMemAllocManaged", "cuMemAllocAsync", "cuMemAllocAsync_ptsz",
        "cuMemAllocFromPoolAsync_ptsz", "cuMemCreate", "cuArrayCreate", "cuArrayCreate_v2",
        "cuArray3DCreate", "cuArray3DCreate_v2", "cuMipmappedArrayCreate",
        "cuGraphAddMemAllocNode", "cuGraphAddNode", "cuGraphAddNode_v2",
        "cuMemPoolSetAttribute", "cuMemPoolTrimTo", "cuIpcOpenMemHandle_v2",
        "cuCtxSetLimit", "cuModuleLoadData",
    }  # fmt: skip
    assert known <= allocating(names), known - allocating(names)


def test_a_new_allocating_function_fails_the_check(tmp_path: Path) -> None:
    header = tmp_path / "cuda.h"
    header.write_text(
        "CUresult CUDAAPI cuMemAlloc(CUdeviceptr *dptr, size_t bytesize);\n"
        "#define cuMemAlloc cuMemAlloc_v2\n"
        "CUresult CUDAAPI cuMemAllocFancy(CUdeviceptr *dptr, size_t bytesize);\n"
        "CUresult CUDAAPI cuStreamQuery(CUstream hStream);\n"
    )
    names = abi_names(header)
    assert names == {"cuMemAlloc_v2", "cuMemAllocFancy", "cuStreamQuery"}
    assert unaccounted(names, {"cuMemAlloc_v2"}, {}) == ["cuMemAllocFancy"]
    assert unaccounted(names, {"cuMemAlloc_v2"}, {"cuMemAllocFancy": "a reason"}) == []


def test_a_list_line_without_a_reason_is_refused(tmp_path: Path) -> None:
    listing = tmp_path / "list.txt"
    listing.write_text("# a comment\ncuMemHostAlloc:   \n")
    with pytest.raises(ValueError, match=r"list\.txt:2"):
        exempt(listing)
