"""Training introspection without a process: the memory sample ring (the Python writer mirrors
shim/src/memcap.c; tests/shim/test_training.py runs the C one), validation of what a shim
writes, and cycle detection on the held series."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.domain.training import TrainingCycle
from gpuloom.services.dispatcher.introspection import (
    MAX_SAMPLE_BYTES,
    IntrospectionConfig,
    MemoryTrace,
    TrainingIntrospector,
    low_point_threshold,
)
from gpuloom.shimwire import (
    OFF_MS_HEAD,
    OFF_MS_RING,
    REGION_BYTES,
    REGION_SAMPLES,
    SampleCursor,
    SamplePort,
    read_sample_ring,
)

MS = 1_000_000
MIB = 1 << 20
START = 10**12  # a CLOCK_MONOTONIC-like origin (ns)


class Clock:
    def __init__(self, now_ns: int = START) -> None:
        self.now_ns = now_ns

    def __call__(self) -> int:
        return self.now_ns


def training_loop(
    port: SamplePort,
    clock: Clock,
    introspector: TrainingIntrospector,
    cursor: SampleCursor,
    ring: bytearray,
    seconds: float,
    period_ms: int = 100,
    layers: int = 8,
) -> None:
    """A training loop's allocations, written as the shim would, read every 25 ms."""
    low, step = 64 * MIB, 16 * MIB
    end = clock.now_ns + int(seconds * 1e9)
    read_at = clock.now_ns
    while clock.now_ns < end:
        start = clock.now_ns
        for i in range(2 * layers):  # up over 20 ms, down over 20 ms, then 60 ms at the floor
            clock.now_ns = start + i * 2_500_000
            held = low + step * (i + 1 if i < layers else 2 * layers - i - 1)
            port.sample(held, clock.now_ns)
            if clock.now_ns >= read_at:
                introspector.feed("job", *read_sample_ring(ring, cursor))
                read_at = clock.now_ns + 25 * MS
        clock.now_ns = start + period_ms * MS
        introspector.feed("job", *read_sample_ring(ring, cursor))


def test_the_ring_is_read_once_and_the_latest_entry_again() -> None:
    ring, cursor = bytearray(REGION_BYTES), SampleCursor()
    port = SamplePort(ring, period_ns=MS)
    assert read_sample_ring(ring, cursor) == ([], 0)
    for i in range(5):
        port.sample(i * 10, START + i * MS)
    assert read_sample_ring(ring, cursor) == ([(START + i * MS, i * 10) for i in range(5)], 0)
    port.sample(99, START + 4 * MS + 10)  # the same period: the latest entry's bytes change
    assert read_sample_ring(ring, cursor) == ([(START + 4 * MS, 99)], 0)
    for i in range(REGION_SAMPLES + 20):  # laps the reader: the oldest 20 new ones are lost
        port.sample(i, START + (10 + i) * MS)
    samples, lost = read_sample_ring(ring, cursor)
    assert len(samples) == REGION_SAMPLES and lost == 20
    assert samples[-1] == (START + (10 + REGION_SAMPLES + 19) * MS, REGION_SAMPLES + 19)


def test_implausible_samples_are_dropped_and_counted() -> None:
    trace = MemoryTrace(IntrospectionConfig())
    now = START + 1000 * MS
    accepted, rejected = trace.add(
        [
            (START, 10),
            (0, 5),  # no time
            (now + 10**9, 5),  # from the future
            (START + MS, MAX_SAMPLE_BYTES + 1),  # larger than any GPU
            (START - MS, 7),  # back in time
            (START + 2 * MS, 20),
            (START + 2 * MS, 30),  # the latest entry again, updated
        ],
        now,
    )
    assert (accepted, rejected) == (2, 4)
    assert len(trace) == 2 and trace.latest_bytes == 30


def test_the_held_series_is_a_step_function_up_to_now() -> None:
    trace = MemoryTrace(IntrospectionConfig(sample_period_s=1e-3))
    trace.add([(START, 1), (START + 3 * MS, 5)], START + 6 * MS)
    times, values = trace.held_series(START + 6 * MS)
    assert list(values) == [1, 1, 1, 5, 5, 5, 5]
    assert times[0] == pytest.approx(START / 1e9) and times[-1] == pytest.approx(START / 1e9 + 6e-3)


def test_a_training_loops_cycle_is_found_from_its_samples() -> None:
    clock = Clock()
    introspector = TrainingIntrospector("t", IntrospectionConfig(), clock, wall=lambda: 5000.0)
    ring, cursor = bytearray(REGION_BYTES), SampleCursor()
    training_loop(SamplePort(ring, MS), clock, introspector, cursor, ring, seconds=3.0)
    cycle = introspector.analyze("job")
    assert cycle is not None and cycle.minibatch_s == pytest.approx(0.1, rel=0.05), cycle
    assert cycle.low_memory_bytes == pytest.approx(64 * MIB, rel=0.05)
    assert cycle.high_memory_bytes > 150 * MIB and cycle.stable
    assert cycle.minibatches >= 20
    assert 5000.0 <= cycle.next_low_point_unix_s <= 5000.0 + 0.1
    # Analysed again with nothing new: the same low points are not counted twice.
    assert introspector.analyze("job").minibatches == cycle.minibatches  # type: ignore[union-attr]
    assert low_point_threshold(cycle) < 64 * MIB + 0.11 * (cycle.high_memory_bytes - 64 * MIB)


def test_a_flat_or_unknown_process_has_no_cycle() -> None:
    clock = Clock()
    introspector = TrainingIntrospector("t", IntrospectionConfig(), clock)
    assert introspector.analyze("nobody") is None
    introspector.feed("flat", [(START + i * MS, 64 * MIB) for i in range(500)])
    clock.now_ns = START + 600 * MS
    cycle = introspector.analyze("flat")
    assert cycle == TrainingCycle(0.0, False, 0, 0, 0.0, cycle.samples, 0)  # type: ignore[union-attr]
    introspector.forget("flat")
    assert introspector.cycle("flat") is None


def test_a_suspended_process_keeps_its_last_cycle() -> None:
    clock = Clock()
    introspector = TrainingIntrospector("t", IntrospectionConfig(), clock)
    ring, cursor = bytearray(REGION_BYTES), SampleCursor()
    training_loop(SamplePort(ring, MS), clock, introspector, cursor, ring, seconds=3.0)
    found = introspector.analyze("job")
    introspector.set_frozen("job", True)
    clock.now_ns += 30 * 10**9  # long flat: no cycle would be found in it
    assert introspector.analyze("job") == found
    introspector.set_frozen("job", False)
    assert introspector.analyze("job").minibatch_s == 0  # type: ignore[union-attr]


@settings(max_examples=200, deadline=None)
@given(
    garbage=st.binary(min_size=REGION_BYTES - OFF_MS_HEAD, max_size=REGION_BYTES - OFF_MS_HEAD),
    reads=st.integers(1, 3),
)
def test_garbage_in_the_ring_never_raises_and_is_never_kept_as_implausible(
    garbage: bytes, reads: int
) -> None:
    ring = bytearray(REGION_BYTES)
    ring[OFF_MS_HEAD:] = garbage
    cursor = SampleCursor()
    clock = Clock(START + 10**12)
    introspector = TrainingIntrospector("t", IntrospectionConfig(), clock)
    for _ in range(reads):
        samples, lost = read_sample_ring(ring, cursor)
        assert len(samples) <= REGION_SAMPLES and lost >= 0
        introspector.feed("x", samples, lost)
        # The shim keeps writing garbage: a new head.
        struct.pack_into(
            "<I",
            ring,
            OFF_MS_HEAD,
            (struct.unpack_from("<I", ring, OFF_MS_HEAD)[0] * 7 + 3) & 0xFFFFFFFF,
        )
    process = introspector._processes.get("x")
    if process is not None:
        times = list(process.trace._times)
        values = list(process.trace._bytes)
        assert times == sorted(times) and all(0 < t <= clock.now_ns + 5 * MS for t in times)
        assert all(0 <= v <= MAX_SAMPLE_BYTES for v in values)
    cycle = introspector.analyze("x")
    assert cycle is None or (math.isfinite(cycle.minibatch_s) and cycle.minibatch_s >= 0)


def test_the_ring_layout_fits_the_region() -> None:
    assert OFF_MS_RING + 16 * REGION_SAMPLES <= REGION_BYTES
    assert np.int64(OFF_MS_RING) % 16 == 0
