"""Prometheus metrics of the placement service."""

from __future__ import annotations

import prometheus_client

# From a submission's arrival to its decision being written (placed or pending): what a
# decision costs, queueing for the next batch included, the dispatcher's bind excluded.
DECISION_LATENCY = prometheus_client.Histogram(
    "gpuloom_placement_decision_seconds",
    "Time from a submission's arrival to its decision being durable",
    buckets=(
        0.0005,
        0.001,
        0.0015,
        0.002,
        0.0025,
        0.003,
        0.004,
        0.005,
        0.0075,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        1.0,
    ),
)
PENDING_TRIES = prometheus_client.Counter(
    "gpuloom_placement_pending_tries_total",
    "Placements tried for pending jobs when capacity freed (only those the freed GPU may take)",
)
BIND_FAILURES = prometheus_client.Counter(
    "gpuloom_placement_bind_failures_total", "Reservations a dispatcher refused or never answered"
)
JOBS_LOST = prometheus_client.Counter(
    "gpuloom_placement_jobs_lost_total", "Jobs lost because their GPU stopped sending heartbeats"
)
MIG_BATCHES = prometheus_client.Counter(
    "gpuloom_placement_mig_batches_total", "MIG batches planned over the fleet"
)
MIG_RUNS = prometheus_client.Counter(
    "gpuloom_placement_mig_runs_total", "RunMigBatch calls started on dispatchers"
)
MIG_RUNS_FAILED = prometheus_client.Counter(
    "gpuloom_placement_mig_runs_failed_total",
    "MIG runs a dispatcher refused, or whose stream broke",
)

# Refreshed by the core every heartbeat check (a second or two), not at each change.
JOBS = prometheus_client.Gauge(
    "gpuloom_placement_jobs",
    "Live jobs by state: pending (waiting for capacity; MIG batch tasks included), binding, "
    "assigned",
    ["state"],
)
GPU_AREA_RESERVED = prometheus_client.Gauge(
    "gpuloom_placement_gpu_area_reserved_ratio",
    "Reserved part of a GPU's (time quota x SM) rectangle: placement's jobs and the shares "
    "reserved on its dispatcher directly",
    ["node", "gpu"],
)
GPU_MEMORY_RESERVED = prometheus_client.Gauge(
    "gpuloom_placement_gpu_memory_reserved_bytes",
    "Memory reserved on a GPU: placement's jobs and the shares reserved on its dispatcher directly",
    ["node", "gpu"],
)

# Gandiva's live mechanisms for training jobs (services/placement/training.py).
TRAINING_SWITCHES = prometheus_client.Counter(
    "gpuloom_placement_training_switches_total",
    "SuspendClient / ResumeClient calls placement made for time-slicing, by call",
    ["call"],
)
TRAINING_PACKINGS = prometheus_client.Counter(
    "gpuloom_placement_training_packings_total",
    "Packing trials started, and those undone (their measured gain was below time-slicing's)",
    ["outcome"],
)
TRAINING_MIGRATIONS = prometheus_client.Counter(
    "gpuloom_placement_training_migrations_total",
    "Training-job migrations by outcome: moved, hook_failed (the checkpoint hook failed or timed "
    "out: the job stays where it is), move_failed (a move without a hook through the driver's "
    "checkpoint API failed: the job stays suspended where it was, then resumed), abandoned (the "
    "job ended, or the target refused)",
    ["outcome"],
)
TRAINING_SUSPEND_MEMORY = prometheus_client.Gauge(
    "gpuloom_placement_training_suspend_memory_gpus",
    "GPUs holding training jobs, by what their dispatcher's suspension does with a job's "
    "memory: freed (the driver's checkpoint API; time-sliced jobs take the memory in turns) or "
    "resident (no checkpoint API: time-sliced jobs must fit together)",
    ["memory"],
)
TRAINING_PREEMPTIONS = prometheus_client.Counter(
    "gpuloom_placement_training_preemptions_total",
    "Head-of-queue preemptions taken live: the head joined a later job's time-slice group, "
    "which stays suspended until the head ends",
)
TRAINING_RESIZES = prometheus_client.Counter(
    "gpuloom_placement_training_resizes_total",
    "Grow-shrink: elastic training jobs restarted on more GPUs (grow) or fewer (shrink); a "
    "failed one counts as a migration with outcome hook_failed",
    ["reason"],
)
TRAINING_SLICES = prometheus_client.Counter(
    "gpuloom_placement_training_slices_total",
    "Over-subscription: pending training jobs time-sliced into a full GPU's round-robin",
)
