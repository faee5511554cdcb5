"""Prometheus metrics of gpuloom's Kubernetes components. The device plugin labels every Pod
it gave an assignment by namespace, pod and container, with `assignment` (the job id) to join
the dispatchers' per-assignment series (`gpuloom_dispatcher_client_used_ratio`, ...):

    gpuloom_dispatcher_client_used_ratio
      * on (assignment) group_left (namespace, pod, container) gpuloom_pod_info
"""

from __future__ import annotations

import prometheus_client

POD_LABELS = ["namespace", "pod", "container", "assignment", "gpu", "node"]

POD_INFO = prometheus_client.Gauge(
    "gpuloom_pod_info",
    "A Pod holding a gpuloom assignment on this node (1), by Pod and assignment",
    POD_LABELS,
)
POD_SM_PERCENT = prometheus_client.Gauge(
    "gpuloom_pod_sm_percent", "The SM percent of the Pod's share (100: whole GPUs)", POD_LABELS
)
POD_QUOTA_PERCENT = prometheus_client.Gauge(
    "gpuloom_pod_quota_request_percent",
    "The guaranteed time quota of the Pod's share, percent of the window",
    POD_LABELS,
)
POD_MEMORY_CAP = prometheus_client.Gauge(
    "gpuloom_pod_memory_cap_bytes", "The GPU memory cap of the Pod's assignment", POD_LABELS
)
POD_MIG_SLICES = prometheus_client.Gauge(
    "gpuloom_pod_mig_slices",
    "The slices of the Pod's MIG instance (0: not a MIG Pod)",
    POD_LABELS,
)
POD_GAUGES = (POD_INFO, POD_SM_PERCENT, POD_QUOTA_PERCENT, POD_MEMORY_CAP, POD_MIG_SLICES)
ALLOCATIONS = prometheus_client.Counter(
    "gpuloom_device_plugin_allocations_total",
    "Allocate calls answered, by outcome (allocated, refused)",
    ["outcome"],
)
EXTENDER_CALLS = prometheus_client.Counter(
    "gpuloom_k8s_extender_calls_total",
    "Scheduler extender calls, by verb and outcome",
    ["verb", "outcome"],
)
EXTENDER_SECONDS = prometheus_client.Histogram(
    "gpuloom_k8s_extender_seconds",
    "Time to answer a scheduler extender call",
    ["verb"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
ADMISSIONS = prometheus_client.Counter(
    "gpuloom_k8s_admissions_total",
    "Admission reviews answered, by outcome (allowed, patched, refused)",
    ["outcome"],
)
POD_JOB_ENDS = prometheus_client.Counter(
    "gpuloom_k8s_pod_job_ends_total",
    "Pods' jobs ended by the controller, by why (pod_gone, pod_succeeded, pod_failed)",
    ["why"],
)
FUNCTION_SCALES = prometheus_client.Counter(
    "gpuloom_k8s_function_scales_total",
    "Deployments of auto-scaled functions rescaled to their live replicas",
)
