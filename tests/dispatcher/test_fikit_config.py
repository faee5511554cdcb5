"""The arbiter's FIKIT configuration from the dispatcher's settings: policy composed runs the
core as gpuloom.policies.admission.composed does (a 150 us idle backlog at least), policy fikit
with FIKIT's own."""

from __future__ import annotations

from gpuloom.policies.admission.composed import IDLE_BACKLOG_NS
from gpuloom.services.dispatcher.app import fikit_config
from gpuloom.services.dispatcher.settings import DispatcherSettings


def test_composed_lets_a_filler_queue_its_next_kernel_while_the_holder_idles() -> None:
    assert fikit_config(DispatcherSettings(policy="composed")).idle_backlog_ns == IDLE_BACKLOG_NS
    assert fikit_config(DispatcherSettings(policy="fikit")).idle_backlog_ns == 0
    more = DispatcherSettings(policy="composed", fikit_idle_backlog_us=400)
    assert fikit_config(more).idle_backlog_ns == 400_000
