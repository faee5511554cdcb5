"""Spatial harvesting live: policy composed told to run MPS (GPULOOM_DISPATCHER_MPS=on, a fake
control daemon) or not (auto, the default), real processes under the C shim on the fake
driver's MPS GPU, kernel tables with SM usage and bound classes from a real profile store. The
holder loops a long compute kernel back to back (no gap to fill, never idle for long); with
MPS on the filler's short memory-bound kernels go beside it, granted by the engine's spatial
rule, and co-run on the fake GPU; without, the rule is never asked. The figures printed are in
docs/benchmarks.md ("Spatial harvesting live")."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import AsyncIterator

import pytest

from gpuloom.v1 import profile_store_pb2
from gpuloom.v1 import profile_store_pb2_grpc as store_grpc
from tests.dispatcher.test_mps import CONTROL
from tests.profile_store.conftest import store_app, stub  # noqa: F401  (fixtures)
from tests.shim.conftest import Runner
from tests.shim.test_fikit_live import Fikit, LiveWithProfiles, _kernel, profiled  # noqa: F401

MPS = {"GPULOOM_FAKE_CUDA_MPS": "1"}
HOLD = ("k_hold", 5000, 40, "compute")  # 5 ms on 40% of the SMs
FILL = ("k_fill", 150, 4, "memory")  # 150 us on 4%: beside it the holder's predicted
# slowdown is 1 + 0.5 * 4/100 (of the A100's 108 SMs, 4 of them) < the default 1.03
SECONDS = 2.0


def _stats(name: str, us: int, percent: int, bound: str, sms: int) -> profile_store_pb2.KernelStats:
    stats = _kernel(name, us, 0.0)  # back to back
    stats.sm_usage = max(1, sms * percent // 100)
    stats.bound = profile_store_pb2.KernelBound.Value(f"KERNEL_BOUND_{bound.upper()}")
    return stats


async def _put(store: store_grpc.ProfileStoreStub, model: str, sms: int) -> None:
    for key, kernel in (("hold", HOLD), ("fill", FILL)):
        await store.PutKernelProfile(
            profile_store_pb2.PutKernelProfileRequest(
                profile=profile_store_pb2.KernelProfile(
                    meta=profile_store_pb2.ProfileMeta(key=key, gpu_model=model),
                    measured_runs=10,
                    kernels=[_stats(*kernel, sms)],
                )
            )
        )


@pytest.fixture(params=["on", "auto"], ids=["mps-on", "mps-default"])
async def harvesting(
    request: pytest.FixtureRequest,
    profiled: LiveWithProfiles,  # noqa: F811
    stub: store_grpc.ProfileStoreStub,  # noqa: F811
) -> AsyncIterator[Fikit]:
    async with profiled(policy="composed", mps=request.param, mps_control=CONTROL) as live:
        gpu = live.live.dispatcher.core.gpu
        await _put(stub, gpu.model, gpu.sm_count)
        kept = await stub.GetKernelProfile(
            profile_store_pb2.GetProfileRequest(key="hold", gpu_model=gpu.model)
        )
        assert kept.kernels[0].sm_usage > 0, "the store must keep what the rule reads"
        yield live


def _loop(kernel: tuple[str, int, int, str]) -> list[str]:
    name = kernel[0]
    module = ",".join(f"{n}:{u}:{p}:{b}" for n, u, p, b in (HOLD, FILL))
    return ["module", module, "loop", str(SECONDS), name, "1"]


async def test_the_fillers_kernels_go_beside_the_holders_only_under_mps(
    harvesting: Fikit, run: Runner
) -> None:
    mps = harvesting.live.dispatcher.mps is not None
    engine = harvesting.live.dispatcher.engine
    holder = harvesting.env(await harvesting.token("hold", 1), **MPS)
    filler = harvesting.env(await harvesting.token("fill", 8), **MPS)
    holding = asyncio.create_task(run.run_async(*_loop(HOLD), env=holder, timeout=30))
    await asyncio.sleep(0.3)
    filled = await run.run_async(*_loop(FILL), env=filler, timeout=30)
    held = await holding
    assert held.returncode == 0 and filled.returncode == 0, (held.stderr, filled.stderr)
    stats = engine.fikit_stats()
    runs = run.engine_runs()
    hold = [(s, e) for _, name, s, e in runs if name == HOLD[0]]
    fill = [(s, e) for _, name, s, e in runs if name == FILL[0]]
    beside = sum(1 for s, e in fill if any(hs <= s and e <= he for hs, he in hold))
    holder_ms = statistics.mean(e - s for s, e in hold) / 1e6
    print(f"mps {mps}: harvested {stats.harvested}, of {len(fill)} fill kernels {beside} ran "
          f"inside a holder kernel; holder kernels {len(hold)}, mean {holder_ms:.3f} ms "
          f"(alone 5)")  # fmt: skip
    if not mps:  # the default: the rule is never asked
        assert stats.harvested == 0, stats
        return
    # The rule granted fill kernels, and they ran inside the holder's kernels on the fake GPU.
    assert stats.harvested > 10, stats
    assert beside > 10
    # Memory beside compute on 4% of the SMs: the holder's kernels stay near their 5 ms.
    assert holder_ms < 5 * 1.2
