"""Prometheus metrics of the dispatchers (labelled by GPU, since `gpuloom up` runs several)."""

from __future__ import annotations

import prometheus_client

LEASES_GRANTED = prometheus_client.Counter(
    "gpuloom_dispatcher_leases_granted_total", "Time leases granted", ["gpu"]
)
LEASE_WAIT = prometheus_client.Histogram(
    "gpuloom_dispatcher_lease_wait_seconds",
    "Time from a lease request to its grant",
    ["gpu"],
    buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
QUEUE_DEPTH = prometheus_client.Gauge(
    "gpuloom_dispatcher_queue_depth", "Clients waiting for a lease", ["gpu"]
)
CLIENT_USED = prometheus_client.Gauge(
    "gpuloom_dispatcher_client_used_ratio",
    "GPU time charged to a client in the current window, as a fraction of the window",
    ["gpu", "assignment"],
)
CLIENT_QUOTA = prometheus_client.Gauge(
    "gpuloom_dispatcher_client_quota_ratio",
    "A client's time quota as a fraction of the window",
    ["gpu", "assignment", "bound"],
)
LEVEL_USED = prometheus_client.Gauge(
    "gpuloom_dispatcher_level_used_ratio",
    "Policy composed: GPU time charged to the clients of a priority level in the current window,"
    " as a fraction of the window (a level's sole client with a 100% limit holds an open-ended"
    " lease and is charged when it ends)",
    ["gpu", "priority"],
)
QUOTA_RESERVED = prometheus_client.Gauge(
    "gpuloom_dispatcher_quota_reserved_ratio",
    "Sum of the time-quota requests of the GPU's reservations (a time-slice group counted once),"
    " as a fraction of the window",
    ["gpu"],
)
QUOTA_USED = prometheus_client.Gauge(
    "gpuloom_dispatcher_quota_used_ratio",
    "GPU time charged to all clients in the current window, as a fraction of the window",
    ["gpu"],
)
MEMORY_RESERVED = prometheus_client.Gauge(
    "gpuloom_dispatcher_memory_reserved_bytes",
    "Sum of the memory caps of the GPU's reservations",
    ["gpu"],
)
CONNECTIONS = prometheus_client.Gauge(
    "gpuloom_dispatcher_connections", "Open shim channel connections", ["gpu"]
)
CONNECTIONS_CLOSED = prometheus_client.Counter(
    "gpuloom_dispatcher_connections_closed_total",
    "Shim channel connections closed, by reason",
    ["gpu", "reason"],
)
REFUSALS_UNLOGGED = prometheus_client.Counter(
    "gpuloom_dispatcher_refusals_unlogged_total",
    "Shim channel refusals (at accept, or of a connection's registration or messages) not "
    "logged: past the rate each local user is logged at (they are counted in "
    "connections_refused_total / connections_closed_total all the same)",
    ["gpu"],
)
MEASUREMENT_RECORDS = prometheus_client.Counter(
    "gpuloom_dispatcher_measurement_records_total",
    "Kernel measurement records received from shims",
    ["gpu"],
)
FIKIT_EVENTS = prometheus_client.Counter(
    "gpuloom_dispatcher_fikit_events_total",
    "FIKIT arbiter events: requests, grants, unknown_kernels (not in the task's profile: no "
    "gap filling for them), invalid_writes (shim-written words rejected), role_races, arms "
    "(fills decided in advance for the holder's next launch), fired (arms a holder's launch "
    "fired: the filler released with one wake-up), late_releases (a filler released by an "
    "arm already withdrawn), harvested (fill kernels granted beside the holder's running "
    "kernel by the spatial rule, where the GPU runs MPS); and the decision core's: "
    "granted_window, granted_idle (fill kernels granted inside a holder's gap window, or "
    "while the holder idled), "
    "granted_starved (by the max-wait bound), windows_opened, windows_closed_early (by the "
    "holder's next launch before the predicted end)",
    ["gpu", "event"],
)
DESK_EVENTS = prometheus_client.Counter(
    "gpuloom_dispatcher_lease_desk_events_total",
    "Lease desk events: renewed (leases renewed natively from standing terms), forwarded "
    "(requests left to the token scheduler), invalid_writes (request words rejected), "
    "throttled (requests left unread while their process had too many untaken events)",
    ["gpu", "event"],
)
FIKIT_WAITING = prometheus_client.Gauge(
    "gpuloom_dispatcher_fikit_waiting", "FIKIT processes waiting for a kernel grant", ["gpu"]
)
CONNECTIONS_REFUSED = prometheus_client.Counter(
    "gpuloom_dispatcher_connections_refused_total",
    "Shim channel connections refused at accept: per-uid limit, connection limit, or the last "
    "connections kept for users holding a reservation",
    ["gpu", "reason"],
)

# ---- training introspection and suspend/resume (docs/training.md) ----
MEMORY_SAMPLES = prometheus_client.Counter(
    "gpuloom_dispatcher_memory_samples_total",
    "Memory samples read from the shims' rings: accepted, rejected (implausible: counted and "
    "dropped), overrun (overwritten before they were read)",
    ["gpu", "outcome"],
)
TRAINING_MINIBATCH = prometheus_client.Gauge(
    "gpuloom_dispatcher_training_minibatch_seconds",
    "A training process's mini-batch time as detected from its memory samples (0: none)",
    ["gpu", "assignment"],
)
TRAINING_LOW_MEMORY = prometheus_client.Gauge(
    "gpuloom_dispatcher_training_low_memory_bytes",
    "Device memory a training process holds at its mini-batch cycle's low points",
    ["gpu", "assignment"],
)
SUSPENSIONS = prometheus_client.Counter(
    "gpuloom_dispatcher_suspensions_total",
    "Clients suspended, by how the suspension point was reached: low_point, timeout (no low "
    "point within max_wait_ms), no_cycle (none detected), not_running (no process connected)",
    ["gpu", "outcome"],
)
SUSPEND_MEMORY = prometheus_client.Counter(
    "gpuloom_dispatcher_suspend_memory_total",
    "What became of suspended clients' device memory: released (the driver's checkpoint API "
    "moved it to host memory), resident (kept on the GPU: no API, or the lock or checkpoint "
    "failed), restored (back at resume), restore_failed (not back: still suspended), moved "
    "(restored onto another GPU of the node), move_failed (not: still suspended here)",
    ["gpu", "outcome"],
)
SUSPENDED = prometheus_client.Gauge(
    "gpuloom_dispatcher_suspended_clients", "Clients suspended now", ["gpu"]
)

# ---- the harvest gauge (docs/harvest.md, "The harvest gauge") ----
HARVEST_RATIO = prometheus_client.Gauge(
    "gpuloom_dispatcher_harvest_ratio",
    "FIKIT policies: a lower-priority job's harvest over the last harvest window, estimated: "
    "its throughput over its throughput alone, divided by what time sharing alone could give it "
    "(min(1, (1 - the best priority's busy share) / its busy share alone)); from its launches "
    "and its kernel profile's durations and gaps. Only jobs with a kernel profile, beside a "
    "best priority whose jobs all have one: no sample otherwise",
    ["gpu", "job"],
)
HARVEST_KEPT = prometheus_client.Gauge(
    "gpuloom_dispatcher_harvest_kept_ratio",
    "FIKIT policies: a lower-priority job's throughput over the last harvest window as a share "
    "of its throughput alone, estimated from its launches and its kernel profile (the best-effort "
    "share); no sample where the harvest has none",
    ["gpu", "job"],
)
