"""The simulated backend: GPU info per model, reported usage and processes, MIG lifecycle."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from gpuloom.domain.errors import FailedPrecondition, InvalidArgument, NotFound
from gpuloom.domain.gpus import GIB, GpuInfo, MigInstance
from gpuloom.services.dispatcher.gpu import GpuBackend, SimulatedBackend
from gpuloom.services.dispatcher.gpu.backend import GpuProcess, GpuUsage
from gpuloom.services.dispatcher.gpu.simulated import FLEET_ID_FILE, fleet_id

from .helpers import SleepRecorder


def mig_backend(spec: str = "A100-80GB", **kwargs: object) -> SimulatedBackend:
    return SimulatedBackend(spec, mig_enabled=True, time_scale=0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("model", "memory_gib", "sm_count", "mig_capable"),
    [
        ("A100-40GB", 40, 108, True),
        ("A100-80GB", 80, 108, True),
        ("H100-80GB", 80, 132, True),
        ("H200-141GB", 141, 132, True),
        ("A30-24GB", 24, 56, True),
        ("V100-32GB", 32, 80, False),
        ("T4-16GB", 16, 40, False),
        ("L4-24GB", 24, 58, False),
    ],
)
def test_info_per_model(model: str, memory_gib: int, sm_count: int, mig_capable: bool) -> None:
    backend = SimulatedBackend(f"2x{model.lower()}")
    assert backend.gpu(1) == GpuInfo(
        index=1,
        gpu_uuid=f"SIM-{model}-1",
        node="",
        model=model,
        memory_bytes=memory_gib * GIB,
        sm_count=sm_count,
        mig_capable=mig_capable,
        mig_enabled=False,
    )


def test_gpus_in_index_order_with_stable_uuids() -> None:
    spec = "A100-80GB,2xT4-16GB"
    first, again = SimulatedBackend(spec), SimulatedBackend(spec)
    uuids = [g.gpu_uuid for g in first.gpus()]
    assert uuids == ["SIM-A100-80GB-0", "SIM-T4-16GB-1", "SIM-T4-16GB-2"]
    assert [g.gpu_uuid for g in again.gpus()] == uuids
    assert [g.index for g in first.gpus()] == [0, 1, 2]


def test_each_data_directory_gets_its_own_fleet_id_and_keeps_it(tmp_path: Path) -> None:
    """Dispatchers with one simulated GPU each (one per container) must not share a UUID:
    placement keys GPUs by UUID alone. The id is made once per data directory and read back,
    so a restarted dispatcher's reservations still match its GPU."""
    first, second = fleet_id(tmp_path / "a"), fleet_id(tmp_path / "b")
    assert first != second and len(first) == 8
    assert fleet_id(tmp_path / "a") == first
    uuids = {SimulatedBackend("A100-80GB", fleet_id=f).gpu(0).gpu_uuid for f in (first, second)}
    assert uuids == {f"SIM-A100-80GB-0-{first}", f"SIM-A100-80GB-0-{second}"}
    assert mig_backend(fleet_id=first).gpu(0).gpu_uuid == f"SIM-A100-80GB-0-{first}"


@pytest.mark.parametrize("text", ["", "xyz", "0A1B2C3D", "0a1b2c3d0", "../etc"])
def test_a_damaged_fleet_id_file_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    (tmp_path / FLEET_ID_FILE).write_text(text)
    with pytest.raises(ValueError, match=f"{FLEET_ID_FILE} must hold 8 lowercase hex digits"):
        fleet_id(tmp_path)
    assert (tmp_path / FLEET_ID_FILE).read_text() == text  # left as it was


def test_is_a_gpu_backend() -> None:
    backend = SimulatedBackend("T4-16GB")
    assert isinstance(backend, GpuBackend)
    assert backend.name == "simulated"


def test_mig_enabled_applies_to_mig_capable_gpus_only() -> None:
    backend = SimulatedBackend("A30-24GB,T4-16GB", mig_enabled=True)
    assert [g.mig_enabled for g in backend.gpus()] == [True, False]


@pytest.mark.parametrize("index", [-1, 2, 64])
def test_unknown_index_is_not_found(index: int) -> None:
    backend = SimulatedBackend("2xT4-16GB")
    for call in (backend.gpu, backend.usage, backend.processes, backend.mig_instances):
        with pytest.raises(NotFound, match=f"no GPU with index {index}; the simulated fleet has 2"):
            call(index)


def test_bad_construction() -> None:
    with pytest.raises(ValueError, match="unknown GPU model 'Z9'"):
        SimulatedBackend("Z9")
    with pytest.raises(ValueError, match="at least one GPU"):
        SimulatedBackend([])
    with pytest.raises(ValueError, match="time_scale"):
        SimulatedBackend("T4-16GB", time_scale=-1)


def test_usage_is_what_was_reported() -> None:
    backend = SimulatedBackend("2xL4-24GB")
    assert backend.usage(0) == GpuUsage(utilization_percent=0.0, memory_used_bytes=0)
    backend.report_usage(1, 62.5, 3 * GIB)
    assert backend.usage(1) == GpuUsage(62.5, 3 * GIB)
    assert backend.usage(0) == GpuUsage(0.0, 0)


@pytest.mark.parametrize(
    ("utilization", "memory", "field"),
    [
        (100.5, 0, "utilization_percent"),
        (-1, 0, "utilization_percent"),
        (float("nan"), 0, "utilization_percent"),
        (10, -1, "memory_used_bytes"),
        (10, 24 * GIB + 1, "memory_used_bytes"),
    ],
)
def test_impossible_usage_is_refused(utilization: float, memory: int, field: str) -> None:
    backend = SimulatedBackend("L4-24GB")
    with pytest.raises(InvalidArgument) as error:
        backend.report_usage(0, utilization, memory)
    assert error.value.field == field
    assert backend.usage(0) == GpuUsage(0.0, 0)


def test_processes_attach_update_detach() -> None:
    backend = SimulatedBackend("2xT4-16GB")
    backend.attach_process(0, 300, 2 * GIB)
    backend.attach_process(0, 100, GIB)
    backend.attach_process(0, 300, 3 * GIB)  # attaching again updates
    assert backend.processes(0) == [GpuProcess(100, GIB), GpuProcess(300, 3 * GIB)]
    assert backend.processes(1) == []
    backend.detach_process(0, 100)
    assert backend.processes(0) == [GpuProcess(300, 3 * GIB)]
    with pytest.raises(NotFound, match="process 100 is not attached to GPU 0"):
        backend.detach_process(0, 100)
    with pytest.raises(InvalidArgument, match="pid"):
        backend.attach_process(0, 0, 1)
    with pytest.raises(InvalidArgument, match="used_memory_bytes"):
        backend.attach_process(0, 5, -1)


# MIG.


def test_mig_lifecycle_on_a100() -> None:
    backend = mig_backend()
    big = backend.create_mig_instance(0, 3, 4)
    assert big == MigInstance(
        uuid="MIG-SIM-A100-80GB-0-s4-3g",
        slices=3,
        first_slice=4,
        memory_bytes=40 * GIB,
        profile_name="3g.40gb",
    )
    backend.create_mig_instance(0, 2, 2)
    backend.create_mig_instance(0, 1, 1)
    backend.create_mig_instance(0, 1, 0)
    layout = [(i.first_slice, i.profile_name) for i in backend.mig_instances(0)]
    assert layout == [(0, "1g.10gb"), (1, "1g.10gb"), (2, "2g.20gb"), (4, "3g.40gb")]

    backend.destroy_mig_instance(0, big.uuid)
    assert [i.first_slice for i in backend.mig_instances(0)] == [0, 1, 2]
    # The freed slices can be split differently now.
    backend.create_mig_instance(0, 2, 4)
    backend.create_mig_instance(0, 1, 6)
    assert len(backend.mig_instances(0)) == 5


def test_a30_layout() -> None:
    backend = mig_backend("A30-24GB")
    whole = backend.create_mig_instance(0, 4, 0)
    assert (whole.profile_name, whole.memory_bytes) == ("4g.24gb", 24 * GIB)
    with pytest.raises(FailedPrecondition, match="overlap"):
        backend.create_mig_instance(0, 1, 3)


@pytest.mark.parametrize(
    ("slices", "first_slice", "legal"),
    [(2, 1, "0, 2, 4"), (3, 2, "0, 4"), (4, 4, "0"), (7, 1, "0")],
)
def test_illegal_placements(slices: int, first_slice: int, legal: str) -> None:
    backend = mig_backend()
    with pytest.raises(FailedPrecondition, match=f"legal first slices: {legal}$"):
        backend.create_mig_instance(0, slices, first_slice)
    assert backend.mig_instances(0) == []


@pytest.mark.parametrize(
    ("slices", "first_slice", "field"),
    [
        (5, 0, "slices"),
        (0, 0, "slices"),
        (-1, 0, "slices"),
        (8, 0, "slices"),
        (1, 7, "first_slice"),
    ],
)
def test_bad_sizes(slices: int, first_slice: int, field: str) -> None:
    backend = mig_backend()
    with pytest.raises(InvalidArgument) as error:
        backend.create_mig_instance(0, slices, first_slice)
    assert error.value.field == field


def test_the_3_slice_instance_at_0_blocks_slice_3() -> None:
    backend = mig_backend("H100-80GB")
    backend.create_mig_instance(0, 3, 0)
    with pytest.raises(FailedPrecondition, match=r"overlap 3g\.40gb at slice 0"):
        backend.create_mig_instance(0, 1, 3)
    backend.create_mig_instance(0, 3, 4)  # the other half is free


@pytest.mark.parametrize(("slices", "first_slice"), [(7, 0), (4, 0), (2, 2), (1, 2)])
def test_overlaps_are_refused(slices: int, first_slice: int) -> None:
    backend = mig_backend()
    existing = backend.create_mig_instance(0, 2, 2)
    with pytest.raises(FailedPrecondition, match=existing.uuid):
        backend.create_mig_instance(0, slices, first_slice)
    assert backend.mig_instances(0) == [existing]


def test_mig_needs_mig_mode_on() -> None:
    backend = SimulatedBackend("A100-80GB", time_scale=0)
    assert backend.mig_instances(0) == []
    with pytest.raises(FailedPrecondition, match="MIG mode is off on GPU 0"):
        backend.create_mig_instance(0, 1, 0)
    backend.set_mig_mode(0, True)
    assert backend.gpu(0).mig_enabled
    backend.create_mig_instance(0, 1, 0)


def test_mig_needs_a_mig_capable_gpu() -> None:
    backend = SimulatedBackend("V100-32GB", mig_enabled=True, time_scale=0)
    with pytest.raises(FailedPrecondition, match="not MIG-capable"):
        backend.set_mig_mode(0, True)
    with pytest.raises(FailedPrecondition, match="not MIG-capable"):
        backend.create_mig_instance(0, 1, 0)
    with pytest.raises(FailedPrecondition, match="not MIG-capable"):
        backend.destroy_mig_instance(0, "MIG-x")
    assert not backend.gpu(0).mig_enabled


def test_mig_mode_off_only_without_instances() -> None:
    backend = mig_backend()
    made = backend.create_mig_instance(0, 7, 0)
    with pytest.raises(FailedPrecondition, match="still has 1 MIG instance"):
        backend.set_mig_mode(0, False)
    assert backend.gpu(0).mig_enabled
    backend.destroy_mig_instance(0, made.uuid)
    backend.set_mig_mode(0, False)
    assert not backend.gpu(0).mig_enabled


def test_destroy_unknown_instance() -> None:
    backend = mig_backend("2xA100-80GB")
    made = backend.create_mig_instance(0, 1, 0)
    with pytest.raises(NotFound, match="GPU 0 has no MIG instance 'MIG-nope'"):
        backend.destroy_mig_instance(0, "MIG-nope")
    with pytest.raises(NotFound):
        backend.destroy_mig_instance(1, made.uuid)  # another GPU's instance
    backend.destroy_mig_instance(0, made.uuid)
    with pytest.raises(NotFound):
        backend.destroy_mig_instance(0, made.uuid)  # already gone


@pytest.mark.parametrize(
    ("model", "slices", "create_s", "destroy_s"),
    [
        ("A100-80GB", 3, 0.20, 0.21),
        ("A100-40GB", 7, 0.24, 0.22),
        ("H100-80GB", 3, 0.33, 0.25),
        ("H200-141GB", 7, 0.42, 0.26),  # the H100's times stand in
        ("A30-24GB", 4, 0.13, 0.10),
    ],
)
def test_reconfiguration_takes_table_1_times(
    sleeps: SleepRecorder, model: str, slices: int, create_s: float, destroy_s: float
) -> None:
    backend = SimulatedBackend(model, mig_enabled=True, sleep=sleeps)
    made = backend.create_mig_instance(0, slices, 0)
    assert sleeps.calls == [pytest.approx(create_s)]
    backend.destroy_mig_instance(0, made.uuid)
    assert sleeps.calls == [pytest.approx(create_s), pytest.approx(destroy_s)]


def test_time_scale(sleeps: SleepRecorder) -> None:
    backend = SimulatedBackend("H100-80GB", mig_enabled=True, time_scale=10, sleep=sleeps)
    backend.create_mig_instance(0, 1, 0)
    assert sleeps.calls == [pytest.approx(1.6)]
    instant = SimulatedBackend("H100-80GB", mig_enabled=True, time_scale=0, sleep=sleeps)
    instant.destroy_mig_instance(0, instant.create_mig_instance(0, 1, 0).uuid)
    assert sleeps.calls == [pytest.approx(1.6)]


def test_refused_requests_take_no_time(sleeps: SleepRecorder) -> None:
    backend = SimulatedBackend("A100-80GB", mig_enabled=True, sleep=sleeps)
    for slices, first_slice in ((2, 1), (5, 0)):
        with pytest.raises((FailedPrecondition, InvalidArgument)):
            backend.create_mig_instance(0, slices, first_slice)
    with pytest.raises(NotFound):
        backend.destroy_mig_instance(0, "MIG-nope")
    assert sleeps.calls == []


def test_concurrent_creations_cannot_both_take_the_same_slices() -> None:
    # Each creation sleeps for real; without serialisation both would pass the overlap check.
    backend = SimulatedBackend("A100-80GB", mig_enabled=True, sleep=lambda s: time.sleep(0.05))
    results: list[object] = []

    def create(slices: int) -> None:
        try:
            results.append(backend.create_mig_instance(0, slices, 0))
        except FailedPrecondition as error:
            results.append(error)

    threads = [threading.Thread(target=create, args=(size,)) for size in (7, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(isinstance(r, MigInstance) for r in results) == 1
    assert sum(isinstance(r, FailedPrecondition) for r in results) == 1
    assert len(backend.mig_instances(0)) == 1


def test_close_is_harmless() -> None:
    backend = SimulatedBackend("T4-16GB")
    backend.close()
    backend.close()
    assert backend.gpu(0).model == "T4-16GB"
