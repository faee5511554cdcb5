"""Spatial harvesting in the admission engine (shim/src/spatial.c asked by arbiter.c): where
the GPU runs MPS, a filler's request queued behind the holder's running kernel is granted at
once when it fits beside it; with MPS off (the default) it waits for the holder's gaps, and a
clashing, too wide, too long or never-profiled kernel waits either way."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import pytest

from gpuloom.policies.fikit.core import FikitConfig
from gpuloom.policies.harvest import HarvestConfig
from gpuloom.services.dispatcher.admission_engine import AdmissionEngine, KernelTiming
from gpuloom.shimwire import REGION_BYTES, AdmissionRegion, FikitPort, FikitPost, FikitRole
from tests.dispatcher.test_arbiter import MS, US, Task
from tests.polling import holds_within

SMS = 100
S = 1000 * MS
HOLDER_KERNEL = 0x10
# The holder's kernel: 2 s on 40 SMs, compute-bound; the gap after it (10 us) is too short to
# fill, and the idle margin is a minute: FIKIT alone grants no filler while this runs.
HOLDER_TABLE = [KernelTiming(HOLDER_KERNEL, 2 * S, 10 * US, 40, "compute")]
CONFIG = FikitConfig(gap_threshold_ns=100 * US, idle_margin_ns=60 * S)
# The fillers' kernels. The default knobs (max_holder_slowdown 1.03, other_factor 1.5) let a
# kernel of another class beside the holder's take up to 6 SMs of 100.
FITS = KernelTiming(0x21, 100 * MS, None, 5, "memory")
CLASHES = KernelTiming(0x22, 100 * MS, None, 5, "compute")  # compute beside compute
TOO_WIDE = KernelTiming(0x23, 100 * MS, None, 70, "memory")  # 40 + 70 SMs > 100
TOO_LONG = KernelTiming(0x24, 1800 * MS, None, 5, "memory")  # 1.3 * 1.8 s > the 2 s kernel
NEVER_PROFILED = 0x25
FILLERS = (FITS, CLASHES, TOO_WIDE, TOO_LONG)


def engine(mps: bool) -> AdmissionEngine:
    return AdmissionEngine(CONFIG, beat_s=0.01, harvest=HarvestConfig() if mps else None, sms=SMS)


@pytest.fixture(params=[True, False], ids=["mps", "no-mps"])
def setting(request: pytest.FixtureRequest) -> Iterator[tuple[bool, AdmissionEngine]]:
    started = engine(request.param)
    yield request.param, started
    started.stop()


def test_a_filler_that_fits_goes_beside_the_running_holder_kernel_only_under_mps(
    setting: tuple[bool, AdmissionEngine],
) -> None:
    mps, arbiter = setting
    holder = Task(arbiter, 0, HOLDER_TABLE)
    fillers = [Task(arbiter, 5, list(FILLERS)) for _ in range(len(FILLERS) + 1)]
    try:
        assert holds_within(lambda: all(f.port.role is FikitRole.FILL for f in fillers))
        # The holder launches its 2 s kernel (posted as a shim posts while somebody waits).
        holder.port.post(HOLDER_KERNEL, FikitPost.TRACKED)
        kernels = [k.kernel_id for k in FILLERS] + [NEVER_PROFILED]
        asked = [
            (f, f.port.post(k, FikitPost.REQUEST)) for f, k in zip(fillers, kernels, strict=True)
        ]

        def granted(i: int) -> bool:
            port, seq = asked[i][0].port, asked[i][1]
            return (port.granted - seq) & 0xFFFFFFFF < 0x80000000

        # Under MPS the one that fits goes while the holder's kernel runs (it has 2 s to go).
        assert holds_within(lambda: granted(0), timeout_s=1.0) is mps
        # The others wait (for the holder's gaps or idle time: none within this test).
        assert not holds_within(lambda: any(granted(i) for i in range(1, 5)), timeout_s=0.3)
        assert arbiter.fikit_stats().harvested == int(mps)
        assert arbiter.fikit_stats().waiting == 4 + int(not mps)
    finally:
        holder.close()
        for filler in fillers:
            filler.close()


def test_harvesting_pauses_while_the_mps_daemon_is_down() -> None:
    arbiter = engine(mps=True)
    holder = Task(arbiter, 0, HOLDER_TABLE)
    filler = Task(arbiter, 5, [FITS])
    try:
        assert holds_within(lambda: filler.port.role is FikitRole.FILL)
        arbiter.set_harvesting(False)  # the daemon died: nothing co-runs now
        holder.port.post(HOLDER_KERNEL, FikitPost.TRACKED)
        seq = filler.port.post(FITS.kernel_id, FikitPost.REQUEST)
        assert not holds_within(lambda: filler.port.granted == seq, timeout_s=0.3)
        arbiter.set_harvesting(True)  # it runs again
        assert holds_within(lambda: filler.port.granted == seq, timeout_s=1.0)
        assert arbiter.fikit_stats().harvested == 1
    finally:
        arbiter.stop()
        holder.close()
        filler.close()


def test_an_engine_started_without_mps_cannot_harvest() -> None:
    arbiter = engine(mps=False)
    try:
        arbiter.set_harvesting(False)
        with pytest.raises(ValueError, match="without spatial harvesting"):
            arbiter.set_harvesting(True)
    finally:
        arbiter.stop()


def test_harvesting_needs_the_gpus_sm_count() -> None:
    with pytest.raises(ValueError, match="SM count"):
        AdmissionEngine(CONFIG, harvest=HarvestConfig(), sms=0)


def test_a_wide_kernel_counts_only_its_sm_partition() -> None:
    # 70 SMs asked for, but its process's MPS partition is 5% of the 100: it fits beside the
    # holder's 40 (as the simulator's demand, capped by the partition).
    arbiter = engine(mps=True)
    holder = Task(arbiter, 0, HOLDER_TABLE)
    region, fd = AdmissionRegion.create("narrow")
    mapping = mmap.mmap(fd, REGION_BYTES)
    arbiter.add_task(fd, 5, [TOO_WIDE], sm_percent=5)
    port = FikitPort(mapping, arbiter.doorbell_fd, [])
    try:
        assert holds_within(lambda: port.role is FikitRole.FILL)
        holder.port.post(HOLDER_KERNEL, FikitPost.TRACKED)
        seq = port.post(TOO_WIDE.kernel_id, FikitPost.REQUEST)
        assert holds_within(lambda: port.granted == seq, timeout_s=1.0)
        assert arbiter.fikit_stats().harvested == 1
        with pytest.raises(ValueError, match=r"sm_percent must be 1\.\.100"):
            arbiter.add_task(fd, 5, [TOO_WIDE], sm_percent=0)
    finally:
        arbiter.stop()
        port.close()
        holder.close()
        mapping.close()
        region.close()
        os.close(fd)
