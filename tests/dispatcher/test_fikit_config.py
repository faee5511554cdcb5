"""The arbiter's FIKIT configuration from the dispatcher's settings: policy composed runs the
core as gpuloom.policies.admission.composed does (its idle backlog at least), policy fikit
with the dispatcher's FIKIT defaults."""

from __future__ import annotations

from gpuloom.policies.admission.composed import IDLE_BACKLOG_NS
from gpuloom.services.dispatcher.settings import DISPATCHER_FIKIT, DispatcherSettings


def test_composed_lets_a_filler_queue_its_next_kernel_while_the_holder_idles() -> None:
    composed = DispatcherSettings(policy="composed").policy_arguments().fikit
    assert composed.idle_backlog_ns == IDLE_BACKLOG_NS > DISPATCHER_FIKIT.idle_backlog_ns
    fikit = DispatcherSettings(policy="fikit").policy_arguments().fikit
    assert fikit.idle_backlog_ns == DISPATCHER_FIKIT.idle_backlog_ns
    more = DispatcherSettings(policy="composed", policy_args="fikit.idle_backlog_ns=400000")
    assert more.policy_arguments().fikit.idle_backlog_ns == 400_000
