"""Settings of the dispatchers (environment variables GPULOOM_DISPATCHER_*)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuloom.policies.admission.composed import IDLE_BACKLOG_NS as COMPOSED_IDLE_BACKLOG_NS
from gpuloom.policies.arguments import parse_policy_args
from gpuloom.policies.fikit.core import FikitConfig
from gpuloom.policies.harvest import HarvestConfig
from gpuloom.policies.tokens.model import TokenConfig
from gpuloom.policies.tokens.registry import POLICIES
from gpuloom.services.common.server import DEFAULT_MAX_MESSAGE_BYTES
from gpuloom.services.dispatcher.gpu.simulated import parse_fleet_spec
from gpuloom.services.dispatcher.mps import parse_control
from gpuloom.services.dispatcher.placement_link import check_advertise_host

# Not a token policy: kernels are admitted one by one by the native FIKIT arbiter.
FIKIT_POLICY = "fikit"
# The default (gpuloom/policies/admission/composed.py): the FIKIT arbiter between priority
# levels, spatio-temporal leases (quotas, SM partitions) within each level.
COMPOSED_POLICY = "composed"
# The policies whose shares are SM partitions (FaST-GShare's spatio-temporal rectangles): their
# GPUs run an MPS control daemon (services/dispatcher/mps.py) when MPS is on. Not the default,
# composed (docs/harvest.md, "MPS or time slices"): measured live under MPS its gap fills and
# idle-backlog grants run beside the holder's kernels and slow them (high-priority mean 1.51x
# alone, 1.09-1.20x without MPS), the simulator's harvest moves by at most 0.019 without it,
# the FIKIT paper (3.1) runs without MPS, and MPS couples the clients' GPU faults. Its SM
# percents only say which leases of a level may be held together. Not fikit, fifo, exclusive.
# Composed runs MPS only where told (GPULOOM_DISPATCHER_MPS=on: "auto" is off for it), and then
# its engine also admits fill kernels beside the holder's running one (spatial harvesting).
SM_PARTITION_POLICIES = frozenset({"spatiotemporal"})
# The FIKIT arbiter's defaults in the dispatcher: the core's, with a 50 us fill guard (a real
# filler launches tens of us after its grant; the simulator's grant is instant, its guard 0).
DISPATCHER_FIKIT = FikitConfig(fill_guard_ns=50_000)


@dataclass(frozen=True, slots=True)
class PolicyArguments:
    fikit: FikitConfig
    tokens: TokenConfig
    harvest: HarvestConfig  # the spatial rule's knobs (asked only where composed runs MPS)


class DispatcherSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPULOOM_DISPATCHER_", extra="ignore")

    # The dispatcher of GPU i listens on port + i (50060, 50061, ...).
    port: int = Field(default=50060, ge=0, le=65535)
    # Which GPUs this process serves: "all", or indexes such as "0" or "0,2".
    gpus: str = Field(default="all", pattern=r"^(all|\d{1,3}(,\d{1,3})*)$")
    # "auto": NVML when it finds a GPU, otherwise the simulated fleet below.
    backend: Literal["auto", "nvml", "simulated"] = "auto"
    # The simulated fleet: "4xA100-80GB", "A100-80GB,H100-80GB,2xA30-24GB", ...
    sim_gpus: str = "4xA100-80GB"
    # Unix sockets of the shim channels; empty: GPULOOM_DATA_DIR/dispatcher.
    socket_dir: Path | None = None
    node: str = Field(default_factory=socket.gethostname, min_length=1, max_length=253)
    policy: str = COMPOSED_POLICY
    window_ms: float = Field(default=1000.0, gt=0, le=60_000)
    # The knobs of the admission policies (docs/configuration.md, "Policy arguments"):
    # "fikit.FIELD=VALUE,tokens.FIELD=VALUE" or the same as JSON, FIELD a field of FikitConfig
    # or TokenConfig; what is not named keeps DISPATCHER_FIKIT's and TokenConfig's defaults.
    policy_args: str = ""
    # Where FIKIT kernel tables (kernel profiles) come from; empty: none (no gap filling).
    profile_store_address: str = ""
    max_frame_bytes: int = Field(default=1 << 20, ge=4096, le=64 << 20)
    register_timeout_s: float = Field(default=1.0, gt=0, le=300)
    max_connections_per_uid: int = Field(default=64, ge=1, le=65536)
    max_message_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=64 * 1024, le=1 << 30)
    # The profiler that measurement sessions come from; empty: none (measure-mode records are
    # then kept in a bounded buffer and not forwarded).
    profiler_address: str = ""
    profiler_poll_s: float = Field(default=1.0, gt=0, le=60)
    # The placement service this dispatcher registers its GPU with and sends heartbeats to;
    # empty: none (the dispatcher serves whoever calls it, and registers nowhere).
    placement_address: str = ""
    # The host placement dials to reach this dispatcher (its port is added); empty: the bind
    # host, or this machine's host name when the bind host is 0.0.0.0 or ::.
    advertise_host: str = ""
    # What the node offers jobs besides GPUs, told to placement at registration: CPU in
    # thousandths of a core and memory in bytes; not set: read from the host (the CPUs this
    # process may use, /proc/meminfo's MemTotal). 0 offers none (jobs asking for it go elsewhere).
    node_cpu_milli: int | None = Field(default=None, ge=0, le=1 << 32)
    node_memory_bytes: int | None = Field(default=None, ge=0, le=1 << 50)
    # MPS for the SM_PARTITION_POLICIES (spatiotemporal): "auto" runs the control daemon on real
    # GPUs (not on simulated ones), "on" on every GPU (tests: with a fake control program), "off"
    # never (SM percents are then bookkeeping only). The default policy, composed, runs one only
    # with "on" (an opt-in: its engine then harvests beside the holder's kernels too;
    # docs/deploy.md, "MPS"); fikit, fifo and exclusive never do: their contexts time-slice.
    mps: Literal["auto", "on", "off"] = "auto"
    # The MPS control program (split like a shell command line).
    mps_control: str = "nvidia-cuda-mps-control"
    # Where each GPU's MPS pipe and log directories go (DIR/gpu-N/pipe, DIR/gpu-N/log); empty:
    # GPULOOM_DATA_DIR/dispatcher/mps. The pipe directory must stay under 80 characters.
    mps_dir: Path | None = None
    mps_start_timeout_s: float = Field(default=5.0, gt=0, le=300)
    # The model store (docs/dispatcher.md, "Model sharing"): LoadModel reads weights files only
    # from inside this directory; empty: LoadModel is refused (FAILED_PRECONDITION).
    models_dir: Path | None = None
    # The CUDA driver library the store's process opens (a name or a path); the dispatcher
    # opens it too for the checkpoint API (suspension that frees memory).
    cuda_library: str = Field(default="libcuda.so.1", min_length=1, max_length=4096)
    # Suspension frees the client's GPU memory through the driver's checkpoint API (lock +
    # checkpoint; restore + unlock at resume; docs/training.md); off, or without the API, the
    # memory stays resident. The lock waits this long for the process's calls in flight.
    suspend_release_memory: bool = True
    suspend_lock_timeout_ms: int = Field(default=10_000, ge=0, le=3_600_000)
    # Training introspection (docs/training.md): the shortest interval between two memory
    # samples a shim writes (0: none, and no cycle is detected); how far back and how often the
    # dispatcher looks for each process's mini-batch cycle.
    training_sample_us: int = Field(default=1000, ge=0, le=1_000_000)
    training_window_s: float = Field(default=10.0, gt=0, le=3600)
    training_analyze_ms: float = Field(default=1000.0, ge=10, le=3_600_000)
    # The harvest gauge (docs/harvest.md, "The harvest gauge"): under policies fikit and
    # composed, each lower-priority job's harvest estimated over consecutive windows this long
    # (the dispatcher reads the launch counts every 0.5 s, so at least 1 s).
    harvest_window_s: float = Field(default=10.0, ge=1, le=3600)
    # SuspendClient waits this long for a low-memory point when the request names no bound.
    suspend_max_wait_ms: float = Field(default=2000.0, gt=0, le=600_000)

    @field_validator("training_sample_us")
    @classmethod
    def _sample_period(cls, period: int) -> int:
        if 0 < period < 100:
            raise ValueError("0 (no sampling) or at least 100 us (a ring holds 224 samples)")
        return period

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        known = {*POLICIES, FIKIT_POLICY, COMPOSED_POLICY}
        if name not in known:
            raise ValueError(f"unknown policy; known: {', '.join(sorted(known))}")
        return name

    @field_validator("advertise_host")
    @classmethod
    def _advertise_host(cls, host: str) -> str:
        return check_advertise_host(host)

    @field_validator("mps_control")
    @classmethod
    def _mps_control(cls, command: str) -> str:
        parse_control(command)  # raises ValueError saying what is wrong
        return command

    @field_validator("sim_gpus")
    @classmethod
    def _fleet_spec(cls, spec: str) -> str:
        parse_fleet_spec(spec)  # raises ValueError naming the bad entry
        return spec

    @model_validator(mode="after")
    def _policy_args(self) -> DispatcherSettings:
        self.policy_arguments()  # raises ValueError naming the bad argument
        return self

    def policy_arguments(self) -> PolicyArguments:
        """The FIKIT arbiter's and the token scheduler's configurations: the dispatcher's
        defaults with what GPULOOM_DISPATCHER_POLICY_ARGS sets."""
        parsed = parse_policy_args(
            self.policy_args,
            {
                "fikit": DISPATCHER_FIKIT,
                "tokens": TokenConfig(window_s=self.window_ms / 1e3),
                "harvest": HarvestConfig(),
            },
            fixed={"tokens.window_s": "GPULOOM_DISPATCHER_WINDOW_MS"},
        )
        fikit = parsed["fikit"]
        if self.policy == COMPOSED_POLICY:
            # As the composed policy runs its core: at least its idle backlog (docs/harvest.md).
            backlog = max(fikit.idle_backlog_ns, COMPOSED_IDLE_BACKLOG_NS)
            fikit = replace(fikit, idle_backlog_ns=backlog)
        arguments = PolicyArguments(fikit=fikit, tokens=parsed["tokens"], harvest=parsed["harvest"])
        if arguments.tokens.lease_max_s > arguments.tokens.window_s:
            raise ValueError(
                f"policy arguments: tokens.lease_max_s ({arguments.tokens.lease_max_s}) must not "
                f"exceed the window (GPULOOM_DISPATCHER_WINDOW_MS={self.window_ms:g})"
            )
        return arguments

    def runs_mps(self, gpu_uuid: str) -> bool:
        """Whether the dispatcher of this GPU supervises an MPS control daemon."""
        if self.policy == COMPOSED_POLICY:
            return self.mps == "on"
        if self.policy not in SM_PARTITION_POLICIES or self.mps == "off":
            return False
        return self.mps == "on" or gpu_uuid.startswith(("GPU-", "MIG-"))

    def harvests(self, gpu_uuid: str) -> bool:
        """Whether this GPU's admission engine asks the spatial rule: policy composed on a GPU
        that runs MPS (its kernels of several processes then co-run)."""
        return self.policy == COMPOSED_POLICY and self.runs_mps(gpu_uuid)

    def gpu_indexes(self, available: int) -> list[int]:
        """The GPU indexes to serve out of `available`; ValueError names a missing one."""
        if self.gpus == "all":
            return list(range(available))
        indexes = sorted({int(part) for part in self.gpus.split(",")})
        missing = [i for i in indexes if i >= available]
        if missing:
            raise ValueError(
                f"GPULOOM_DISPATCHER_GPUS names GPU {missing[0]}, but there are {available}"
            )
        return indexes
