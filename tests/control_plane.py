"""The whole control plane in the test process, on the embedded default (SQLite, in-process
cache, one simulated GPU): for tests that speak to every service alike."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from gpuloom.services.dispatcher.app import DispatcherApp
from gpuloom.services.dispatcher.settings import DispatcherSettings
from gpuloom.services.placement.app import PlacementApp
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.services.profile_store.settings import ProfileStoreSettings
from gpuloom.services.profiler.app import ProfilerApp
from gpuloom.services.profiler.settings import ProfilerSettings

HOST = "127.0.0.1"


@contextlib.asynccontextmanager
async def control_plane(data_dir: Path) -> AsyncIterator[dict[str, str]]:
    """Yield the address of each service by its full name ("gpuloom.v1.Placement", ...).
    `data_dir` must be short: the dispatcher's Unix socket lives under it."""
    async with contextlib.AsyncExitStack() as stack:
        store = await ProfileStoreApp.start(ProfileStoreSettings(port=0), HOST, data_dir)
        stack.push_async_callback(store.stop, 0)
        store_address = f"{HOST}:{store.port}"
        profiler = await ProfilerApp.start(
            ProfilerSettings(port=0, profile_store_address=store_address), HOST
        )
        stack.push_async_callback(profiler.stop, 0)
        placement = await PlacementApp.start(
            PlacementSettings(port=0, profile_store_address=store_address), HOST, data_dir
        )
        stack.push_async_callback(placement.stop, 0)
        dispatchers = await DispatcherApp.start(
            DispatcherSettings(port=0, backend="simulated", sim_gpus="A100-80GB"), HOST, data_dir
        )
        stack.push_async_callback(dispatchers.stop, 0)
        yield {
            "gpuloom.v1.ProfileStore": store_address,
            "gpuloom.v1.Profiler": f"{HOST}:{profiler.port}",
            "gpuloom.v1.Placement": f"{HOST}:{placement.port}",
            "gpuloom.v1.Dispatcher": f"{HOST}:{dispatchers.dispatchers[0].port}",
        }
