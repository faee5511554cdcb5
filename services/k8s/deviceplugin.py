"""gpuloom's device plugin (the kubelet's device plugin API v1beta1, over Unix sockets), one per
GPU node, beside the dispatcher.

It serves the extended resource `gpuloom.io/gpu`: every GPU of its node registered with
placement appears as `slots_per_gpu` devices (`<GPU UUID>-<i>`), Unhealthy while placement
counts the GPU lost, so that kube-scheduler counts room on the node and the kubelet calls
`Allocate` for every container that asks for it. Which GPU a container really gets is not the
devices the kubelet picked: it is the assignment placement made for the Pod's job.

`Allocate` carries no Pod, only device ids. The kubelet admits a node's Pods one at a time, so
the Pod being admitted is the one bound by gpuloom (`gpuloom.io/job` written at Bind, by
gpuloom's service account only: the admission webhook refuses it from anyone else) that asks
for as many devices, is Pending and has not had its assignment yet, the earliest bound first.
Its job must be assigned on this node and be the Pod's (`k8s-<its UID>-<n>`, or a replica of
the function the Pod serves). The container then gets:

- the assignment's environment (GPULOOM_DISPATCHER_SOCKET, GPULOOM_ASSIGNMENT_TOKEN,
  GPULOOM_ASSIGNMENT_ID, the dispatcher's address, the MPS variables), read from placement
  here and handed to the kubelet only: the token is never in the Pod spec or the API server;
- the shim, mounted read-only and first in LD_PRELOAD;
- the dispatcher's socket directory (and the MPS pipe directory), mounted at the same paths;
- NVIDIA_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES naming its GPUs (`void`: none, on
  simulated GPUs), for the NVIDIA container runtime.

A MIG Pod's container (its job a MIG batch task, Allocated only once its batch handed it its
instance) gets NVIDIA_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES naming that instance's UUID
and GPULOOM_JOB_ID, and nothing else: no shim, socket or token. Devices of a GPU in MIG mode
are healthy (it takes MIG Pods, not shares).

A call for devices this plugin never offered, or when no Pod waits for them, is refused with
a gRPC error naming why (the kubelet shows it on the Pod); nothing is changed then."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from gpuloom.domain.errors import DomainError
from gpuloom.domain.placement import JobState, JobView
from gpuloom.kube.asks import ALLOCATED, BOUND_AT, FUNCTION, GPU, JOB, pod_ask
from gpuloom.kube.extender import parse_request_id
from gpuloom.kubelet import deviceplugin_pb2 as dp
from gpuloom.kubelet import deviceplugin_pb2_grpc as dp_grpc
from gpuloom.policies.placement import POLICIES
from gpuloom.services.k8s import metrics
from gpuloom.services.k8s.jobs import PlacementJobs
from gpuloom.services.k8s.kubeapi import KubeApi, KubeApiError
from gpuloom.services.k8s.migtasks import instance_of
from gpuloom.tasks import cancel_and_wait

log = structlog.get_logger("gpuloom.k8s")

API_VERSION = "v1beta1"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
SOCKET_VARIABLE = "GPULOOM_DISPATCHER_SOCKET"
TOKEN_VARIABLE = "GPULOOM_ASSIGNMENT_TOKEN"
MPS_PIPE_VARIABLE = "CUDA_MPS_PIPE_DIRECTORY"
MPS_THREADS_VARIABLE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
VISIBLE_VARIABLE = "CUDA_VISIBLE_DEVICES"
NVIDIA_VISIBLE_VARIABLE = "NVIDIA_VISIBLE_DEVICES"
JOB_ID_VARIABLE = "GPULOOM_JOB_ID"


@dataclass(frozen=True, slots=True)
class DevicePluginConfig:
    node: str
    kubelet_dir: str = "/var/lib/kubelet/device-plugins"
    socket_name: str = "gpuloom.sock"
    slots_per_gpu: int = 16
    shim_host_path: str = "/var/lib/gpuloom/shim/libgpuloom.so"
    shim_container_path: str = "/opt/gpuloom/shim/libgpuloom.so"
    scheduler_name: str = "gpuloom"
    refresh_s: float = 5.0

    @property
    def socket(self) -> str:
        return os.path.join(self.kubelet_dir, self.socket_name)

    @property
    def kubelet_socket(self) -> str:
        return os.path.join(self.kubelet_dir, "kubelet.sock")


class Refused(Exception):
    """An Allocate the plugin cannot answer; `code` is the gRPC status it answers with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class DevicePlugin(dp_grpc.DevicePluginServicer):
    def __init__(self, config: DevicePluginConfig, jobs: PlacementJobs, api: KubeApi) -> None:
        self.config = config
        self._jobs = jobs
        self._api = api
        self._devices: dict[str, str] = {}  # device id -> health
        self._changed = asyncio.Condition()
        self._version = 0
        self._allocated: dict[str, tuple[str, ...]] = {}  # Pod UID -> its metric labels
        self._lock = asyncio.Lock()  # one Allocate at a time, as the kubelet sends them

    # ---- the devices ----

    async def refresh(self) -> None:
        """The node's GPUs from placement; the watchers hear of any change."""
        try:
            gpus = await self._jobs.gpus(self.config.node)
        except DomainError as error:
            log.warning("placement not reached; devices kept", error=str(error))
            return
        # A GPU in MIG mode takes no share (not schedulable) but MIG Pods: healthy too.
        devices = {
            f"{g.gpu.gpu_uuid}-{i}": UNHEALTHY
            if g.lost or not (g.schedulable or g.gpu.mig_enabled)
            else HEALTHY
            for g in gpus
            for i in range(self.config.slots_per_gpu)
        }
        if devices != self._devices:
            async with self._changed:
                self._devices = devices
                self._version += 1
                self._changed.notify_all()
            log.info("devices", node=self.config.node, gpus=len(gpus), devices=len(devices))
        await self._forget_ended()

    # ---- the kubelet's calls ----

    async def GetDevicePluginOptions(
        self, request: dp.Empty, context: Any
    ) -> dp.DevicePluginOptions:
        return dp.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=False
        )

    async def ListAndWatch(
        self, request: dp.Empty, context: Any
    ) -> AsyncIterator[dp.ListAndWatchResponse]:
        seen = -1
        while True:
            async with self._changed:
                while self._version == seen:
                    await self._changed.wait()
                seen = self._version
                devices = dict(self._devices)
            yield dp.ListAndWatchResponse(
                devices=[dp.Device(ID=d, health=h) for d, h in sorted(devices.items())]
            )

    async def GetPreferredAllocation(
        self, request: dp.PreferredAllocationRequest, context: Any
    ) -> dp.PreferredAllocationResponse:
        # Not offered (GetDevicePluginOptions): any free device serves, the assignment decides.
        return dp.PreferredAllocationResponse()

    async def PreStartContainer(
        self, request: dp.PreStartContainerRequest, context: Any
    ) -> dp.PreStartContainerResponse:
        return dp.PreStartContainerResponse()

    async def Allocate(self, request: dp.AllocateRequest, context: Any) -> dp.AllocateResponse:
        try:
            async with self._lock:
                answers = [
                    await self._allocate(list(r.devices_ids)) for r in request.container_requests
                ]
        except Refused as refused:
            metrics.ALLOCATIONS.labels("refused").inc()
            log.warning("allocate refused", reason=refused.message)
            await context.abort(refused.code, refused.message)
        metrics.ALLOCATIONS.labels("allocated").inc()
        return dp.AllocateResponse(container_responses=answers)

    # ---- inside ----

    async def _allocate(self, device_ids: list[str]) -> dp.ContainerAllocateResponse:
        if not device_ids:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "Allocate names no device")
        unknown = [d for d in device_ids if d not in self._devices]
        if unknown:
            raise Refused(
                grpc.StatusCode.NOT_FOUND,
                f"device {unknown[0][:100]!r} is not one of the {len(self._devices)} gpuloom "
                f"devices of node {self.config.node}",
            )
        pod = await self._waiting_pod(len(device_ids))
        meta = pod["metadata"]
        name, uid = f"{meta['namespace']}/{meta['name']}", meta["uid"]
        job = await self._job_of(pod, name, uid)
        answer = self._container_answer(job)
        with contextlib.suppress(KubeApiError):  # the in-memory record holds meanwhile
            await self._api.annotate_pod(
                meta["namespace"], meta["name"], {ALLOCATED: f"{time.time():.6f}"}
            )
        labels = self._labels(pod, job)
        self._allocated[uid] = labels
        self._set_metrics(labels, job)
        log.info(
            "allocated",
            pod=name,
            job=job.job_id,
            gpu=job.assignment.gpu_uuid if job.assignment else "",
        )
        return answer

    async def _waiting_pod(self, count: int) -> dict[str, Any]:
        selector = (
            f"spec.nodeName={self.config.node},spec.schedulerName={self.config.scheduler_name}"
        )
        try:
            pods = await self._api.list_pods(field_selector=selector)
        except KubeApiError as error:
            raise Refused(
                grpc.StatusCode.UNAVAILABLE, f"cannot list the node's Pods: {error}"
            ) from None
        waiting = []
        for pod in pods:
            meta = pod.get("metadata") or {}
            annotations = meta.get("annotations") or {}
            if (
                not annotations.get(JOB)
                or ALLOCATED in annotations
                or meta.get("uid") in self._allocated
                or (pod.get("status") or {}).get("phase", "Pending") != "Pending"
                or meta.get("deletionTimestamp")
            ):
                continue
            try:
                asked = pod_ask(pod, POLICIES).gpus
            except DomainError:
                continue
            if asked == count:
                waiting.append((annotations.get(BOUND_AT, ""), meta.get("name", ""), pod))
        if not waiting:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no Pod bound by gpuloom on node {self.config.node} waits for {count} "
                f"{GPU} device(s): a Pod needs gpuloom's scheduler (its namespace labelled for "
                "gpuloom's webhook) and its job assigned here",
            )
        return min(waiting, key=lambda entry: (entry[0], entry[1]))[2]

    async def _job_of(self, pod: Mapping[str, Any], name: str, uid: str) -> JobView:
        annotations = pod["metadata"].get("annotations") or {}
        job_id = annotations[JOB]
        try:
            job = await self._jobs.get(job_id)
        except DomainError as error:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION, f"Pod {name}'s job {job_id}: {error}"
            ) from None
        parsed = parse_request_id(job.request_id)
        owned = (parsed is not None and parsed[0] == uid) or (
            bool(job.function) and job.function == annotations.get(FUNCTION)
        )
        if not owned:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"job {job_id} is not Pod {name}'s")
        if job.state is not JobState.ASSIGNED or job.assignment is None:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Pod {name}'s job {job_id} is {job.state.value}, not assigned",
            )
        if job.assignment.node != self.config.node:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Pod {name}'s job {job_id} is assigned on node {job.assignment.node}, not "
                f"{self.config.node}",
            )
        if job.spec.is_mig_batch:
            if not instance_of(job):
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Pod {name}'s MIG job {job_id} has not been handed its instance yet",
                )
            return job
        environment = job.assignment.environment
        if not environment.get(SOCKET_VARIABLE) or not environment.get(TOKEN_VARIABLE):
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"placement told no assignment token for job {job_id}: it tells it to the "
                "job's submitter only, and the device plugin's token is not that submitter's "
                "(give it a token of the k8s process's submitter: `gpuloom credentials init "
                "--kubernetes`, docs/deploy.md)",
            )
        return job

    def _container_answer(self, job: JobView) -> dp.ContainerAllocateResponse:
        assert job.assignment is not None
        if job.spec.is_mig_batch:
            return self._mig_answer(job)
        env = dict(job.assignment.environment)
        share = job.spec.share
        if job.spec.mps and share.sm_percent < 100 and MPS_THREADS_VARIABLE not in env:
            env[MPS_THREADS_VARIABLE] = str(share.sm_percent)
        env[JOB_ID_VARIABLE] = job.job_id
        env["LD_PRELOAD"] = self.config.shim_container_path
        env[NVIDIA_VISIBLE_VARIABLE] = env.get(VISIBLE_VARIABLE) or "void"
        mounts = [
            dp.Mount(
                container_path=self.config.shim_container_path,
                host_path=self.config.shim_host_path,
                read_only=True,
            )
        ]
        directories = {os.path.dirname(env[SOCKET_VARIABLE])}
        if env.get(MPS_PIPE_VARIABLE):
            directories.add(env[MPS_PIPE_VARIABLE])
        mounts += [
            dp.Mount(container_path=d, host_path=d, read_only=True) for d in sorted(directories)
        ]
        return dp.ContainerAllocateResponse(envs=env, mounts=mounts)

    @staticmethod
    def _mig_answer(job: JobView) -> dp.ContainerAllocateResponse:
        """A MIG Pod's container: its instance, by the UUID its dispatcher created it with,
        and its job; no shim, socket or token (a MIG instance is isolated by the GPU, and its
        task never registers with the dispatcher)."""
        instance = instance_of(job)
        env = {
            VISIBLE_VARIABLE: instance,
            NVIDIA_VISIBLE_VARIABLE: instance,
            JOB_ID_VARIABLE: job.job_id,
        }
        return dp.ContainerAllocateResponse(envs=env)

    def _labels(self, pod: Mapping[str, Any], job: JobView) -> tuple[str, ...]:
        meta = pod["metadata"]
        ask = pod_ask(pod, POLICIES)
        gpu = job.assignment.gpu_uuid if job.assignment else ""
        return (meta["namespace"], meta["name"], ask.container, job.job_id, gpu, self.config.node)

    @staticmethod
    def _set_metrics(labels: tuple[str, ...], job: JobView) -> None:
        share = job.spec.share
        metrics.POD_INFO.labels(*labels).set(1)
        metrics.POD_SM_PERCENT.labels(*labels).set(share.sm_percent)
        metrics.POD_QUOTA_PERCENT.labels(*labels).set(share.quota.request_percent)
        cap = job.assignment.memory_cap_bytes if job.assignment else 0
        metrics.POD_MEMORY_CAP.labels(*labels).set(cap)
        slot = job.assignment.mig if job.assignment else None
        metrics.POD_MIG_SLICES.labels(*labels).set(slot.size if slot else 0)

    async def _forget_ended(self) -> None:
        """Drop the records (and metric series) of the Pods that ended or left the node."""
        if not self._allocated:
            return
        selector = (
            f"spec.nodeName={self.config.node},spec.schedulerName={self.config.scheduler_name}"
        )
        try:
            pods = await self._api.list_pods(field_selector=selector)
        except KubeApiError:
            return
        running = {
            p["metadata"].get("uid")
            for p in pods
            if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        }
        for uid in [u for u in self._allocated if u not in running]:
            labels = self._allocated.pop(uid)
            for gauge in metrics.POD_GAUGES:
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels)


class DevicePluginServer:
    """Serves the plugin on its socket in the kubelet's directory, registers it with the
    kubelet, and serves and registers again whenever the kubelet restarts (it empties the
    directory, taking the plugin's socket with it)."""

    def __init__(self, plugin: DevicePlugin) -> None:
        self.plugin = plugin
        self._server: grpc.aio.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._registered = False
        self.registrations = 0

    async def start(self) -> None:
        await self.plugin.refresh()
        await self._register_or_warn()
        self._task = asyncio.create_task(self._watch(), name="device-plugin-watch")

    async def _register_or_warn(self) -> None:
        try:
            await self._serve_and_register()
        except (grpc.RpcError, OSError) as error:
            self._registered = False
            log.warning("kubelet registration failed; trying again", error=str(error))

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        if self._server is not None:
            await self._server.stop(1)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.plugin.config.socket)

    async def _serve_and_register(self) -> None:
        config = self.plugin.config
        if self._server is not None:
            await self._server.stop(0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.socket)
        server = grpc.aio.server()
        dp_grpc.add_DevicePluginServicer_to_server(self.plugin, server)
        server.add_insecure_port(f"unix://{config.socket}")
        await server.start()
        self._server = server
        async with grpc.aio.insecure_channel(f"unix://{config.kubelet_socket}") as channel:
            await dp_grpc.RegistrationStub(channel).Register(
                dp.RegisterRequest(
                    version=API_VERSION,
                    endpoint=config.socket_name,
                    resource_name=GPU,
                    options=dp.DevicePluginOptions(),
                ),
                timeout=10,
            )
        self._registered = True
        self.registrations += 1
        log.info("registered with the kubelet", resource=GPU, socket=config.socket)

    async def _watch(self) -> None:
        config = self.plugin.config
        next_refresh = 0.0
        while True:
            await asyncio.sleep(0.5)
            if not self._registered or not Path(config.socket).exists():
                await self._register_or_warn()
            if time.monotonic() >= next_refresh:
                next_refresh = time.monotonic() + config.refresh_s
                with contextlib.suppress(Exception):
                    await self.plugin.refresh()
