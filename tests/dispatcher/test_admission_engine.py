"""Both halves of one admission engine (services/dispatcher/admission_engine.py) at once, as
policy composed uses them: a process in the FIKIT half and the lease half on one region, one
doorbell, one thread; what it writes into its lease words changes no other process's grants."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from gpuloom.policies.fikit.core import FikitConfig
from gpuloom.services.dispatcher.admission_engine import AdmissionEngine, DeskEventKind
from gpuloom.shimwire import AdmissionState, DeskPort, FikitPost, FikitRole
from tests.dispatcher.test_arbiter import FILL_SHORT, FILL_TABLE, HOLDER_TABLE, US, Task
from tests.dispatcher.test_leasedesk import MS, NATIVE_BIT
from tests.polling import holds_within


@pytest.fixture
def engine() -> Iterator[AdmissionEngine]:
    config = FikitConfig(gap_threshold_ns=100 * US, idle_margin_ns=200 * US)
    engine = AdmissionEngine(config, beat_s=0.01)
    yield engine
    engine.stop()


class Composed(Task):
    """A FIKIT task whose region is in the lease half too (a composed shim), asking for its
    level's leases through the same doorbell."""

    def __init__(self, engine: AdmissionEngine, priority: int) -> None:
        super().__init__(engine, priority, FILL_TABLE)
        self.lease_slot = engine.add_leased(self.fd)
        self.leases = DeskPort(self.mapping, engine.doorbell_fd)

    def give_terms(self, engine: AdmissionEngine) -> None:
        now = time.monotonic()
        engine.set_terms(self.lease_slot, 10 * MS, 1.0, 2 * MS, 1.0, 60.0, now + 60)


def test_one_thread_one_doorbell_serve_a_processs_kernels_and_leases(
    engine: AdmissionEngine,
) -> None:
    holder, composed = Task(engine, 0, HOLDER_TABLE), Composed(engine, 5)
    try:
        composed.give_terms(engine)
        assert holds_within(lambda: composed.port.role is FikitRole.FILL)
        epoch = composed.region.epoch
        composed.leases.post()  # its level's lease, on the engine's doorbell
        assert holds_within(lambda: composed.region.epoch != epoch)
        assert composed.region.lease_id & NATIVE_BIT
        assert composed.region.state is AdmissionState.LEASED
        seq = composed.port.post(FILL_SHORT, FikitPost.REQUEST)  # then its kernel
        assert composed.port.wait_grant(seq, 1.0)  # the holder is idle: fill goes
        (event,) = engine.take()
        assert event.kind is DeskEventKind.RENEWED and event.slot == composed.lease_slot
        # One round serves both halves: their round counts move together, under one lock.
        before = engine.fikit_stats().rounds
        leases = engine.lease_stats().rounds
        after = engine.fikit_stats().rounds
        assert before <= leases <= after
    finally:
        holder.close()
        composed.close()


def test_garbage_in_a_composed_processs_lease_words_changes_no_others_grants(
    engine: AdmissionEngine,
) -> None:
    holder, bad = Task(engine, 0, HOLDER_TABLE), Composed(engine, 5)
    good = Composed(engine, 5)
    try:
        bad.give_terms(engine)
        good.give_terms(engine)
        assert holds_within(lambda: good.port.role is FikitRole.FILL)
        epoch = bad.region.epoch
        bad.leases.post(report_lease_id=3, gpu_time_ns=10**19)  # an implausible report
        assert holds_within(lambda: engine.lease_stats().invalid_writes == 1)
        for _ in range(100):  # then unknown flags, in a flood: its own words only
            bad.leases.post(flags=0xFFFF_FFFF)
        assert holds_within(lambda: engine.lease_stats().invalid_writes >= 2)
        assert bad.region.epoch == epoch  # no lease for garbage
        good_epoch = good.region.epoch
        good.leases.post()
        assert holds_within(lambda: good.region.epoch != good_epoch)
        assert good.region.lease_id & NATIVE_BIT
        seq = good.port.post(FILL_SHORT, FikitPost.REQUEST)
        assert good.port.wait_grant(seq, 1.0)
        assert holder.port.role is FikitRole.HOLDER
        kinds = [(e.slot, e.kind, e.invalid) for e in engine.take()]
        assert (good.lease_slot, DeskEventKind.RENEWED, False) in kinds
        assert {e for e in kinds if e[0] == bad.lease_slot} == {
            (bad.lease_slot, DeskEventKind.FORWARDED, True)
        }
    finally:
        for task in (holder, bad, good):
            task.close()
