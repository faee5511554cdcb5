"""Scenario files of the kernel-level simulator: reading and validating them.

Every key is documented in docs/fikit.md ("Simulator"). A bad file raises ScenarioError with a
one-line message naming the file and the place (a JSON path, or a CSV line and column); no
scenario is half-read.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpuloom.policies.fikit.core import FikitConfig
from gpuloom.policies.harvest import HARVEST_POLICIES
from gpuloom.sim.device import ORION_PROFILE, PROFILE_CLASSES, DeviceConfigError, GpuConfig
from gpuloom.sim.device import parse_gpu as _parse_gpu

CSV_COLUMNS = ("Name", "Profile", "Memory_footprint", "SM_usage")
CSV_DURATION = ("Duration", "Duration(ns)")  # the orion lists say "Duration"; the unit is ns
HostModel = Literal["sync", "async"]
GapModel = Literal["per_kernel_id", "per_position"]


class ScenarioError(ValueError):
    """A scenario that cannot be run; the message names the file and the place."""


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    kernel_id: str  # what the shim would key it by (name + launch shape for the orion lists)
    duration_ns: int
    gap_after_ns: int | None  # None: the gap model draws it
    sm_usage: int | None = None  # SMs its launch shape asks for (None: every SM)
    profile: str = "unknown"  # bound class: compute, memory or unknown (docs/harvest.md)


@dataclass(frozen=True, slots=True)
class TaskSpec:
    name: str
    priority: int
    kernels: tuple[Kernel, ...]
    rate_per_s: float | None  # None: closed loop
    host: HostModel = "sync"
    host_gap_us: float = 20.0
    gap_model: GapModel = "per_kernel_id"
    gap_jitter: float = 0.1
    duration_jitter: float = 0.05
    start_s: float = 0.0
    launch_depth: int = 16
    # Its share (token, fifo and composed admission): SM percent and time quota per window as
    # fractions; quota_request None: the limit (as a reservation without one asks).
    sm_percent: int = 100
    quota_request: float | None = None
    quota_limit: float = 1.0


@dataclass(frozen=True, slots=True)
class Scenario:
    path: str
    seed: int
    duration_s: float
    launch_latency_ns: int
    tasks: tuple[TaskSpec, ...]
    fikit: FikitConfig
    token_policy: str = "spatiotemporal"
    profile_requests: int = 20
    grant_latency_ns: int = 0  # fikit: a granted filler launches this long after its grant
    gpu: GpuConfig = field(default_factory=GpuConfig)
    harvest: str = "spatial"  # composed: the spatial harvesting rule, or "off"


_TOP = {
    "seed",
    "duration_s",
    "launch_latency_us",
    "grant_latency_us",
    "tasks",
    "fikit",
    "token_policy",
    "profile_requests",
    "description",
    "gpu",
    "harvest",
}
_TASK = {
    "name",
    "priority",
    "kernels_csv",
    "kernels",
    "arrival",
    "host",
    "host_gap_us",
    "gap_model",
    "gap_jitter",
    "duration_jitter",
    "start_s",
    "launch_depth",
    "sm_percent",
    "quota_request_percent",
    "quota_limit_percent",
}
_KERNEL = {"name", "duration_us", "gap_after_us", "sm_usage", "profile"}
_FIKIT = {"gap_threshold_us", "idle_margin_us", "idle_backlog_us", "max_wait_us", "fill_guard_us"}


class _Reader:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sms = GpuConfig().sms  # the scenario's GPU, once read

    def fail(self, where: str, message: str) -> ScenarioError:
        return ScenarioError(f"{self.path}: {where}: {message}")

    def keys(self, value: Any, where: str, allowed: set[str], required: set[str]) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, "must be an object")
        for key in value:
            if key not in allowed:
                raise self.fail(f"{where}.{key}", f"unknown field (known: {sorted(allowed)})")
        for key in sorted(required):
            if key not in value:
                raise self.fail(f"{where}.{key}", "missing")
        return value

    def number(
        self,
        value: Any,
        where: str,
        low: float = 0.0,
        high: float = math.inf,
        low_open: bool = False,
    ) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise self.fail(where, f"must be a finite number, got {value!r}")
        if value < low or (low_open and value == low) or value > high:
            bound = f"> {low}" if low_open else f">= {low}"
            tail = f" and <= {high}" if math.isfinite(high) else ""
            raise self.fail(where, f"must be {bound}{tail}, got {value!r}")
        return float(value)

    def integer(self, value: Any, where: str, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.fail(where, f"must be an integer in {low}..{high}, got {value!r}")
        return value

    def csv_kernels(self, value: Any, where: str) -> tuple[Kernel, ...]:
        if not isinstance(value, str) or not value:
            raise self.fail(where, "must be a file path")
        path = Path(value)
        if not path.is_absolute():
            path = self.path.parent / path
        if not path.is_file():
            raise self.fail(where, f"no such file {path}")
        kernels = []
        with path.open(newline="") as handle:
            rows = csv.reader(handle)
            header = next(rows, None)
            if header is None:
                raise ScenarioError(f"{path}: line 1: empty file (from {self.path}: {where})")
            header = [h.strip() for h in header]
            known = set(CSV_COLUMNS) | set(CSV_DURATION)
            for column, name in enumerate(header, 1):
                if name not in known:
                    raise ScenarioError(
                        f"{path}: line 1, column {column}: unknown column {name!r} "
                        f"(known: {', '.join([*CSV_COLUMNS, *CSV_DURATION])})"
                    )
            duration_col = next((header.index(d) for d in CSV_DURATION if d in header), None)
            if "Name" not in header or duration_col is None:
                raise ScenarioError(f"{path}: line 1: needs the columns Name and Duration")
            name_col = header.index("Name")
            shape = [header.index(c) for c in ("Profile", "SM_usage") if c in header]
            profile_col = header.index("Profile") if "Profile" in header else None
            sm_col = header.index("SM_usage") if "SM_usage" in header else None
            for line, row in enumerate(rows, 2):
                if not row:
                    continue
                if len(row) != len(header):
                    raise ScenarioError(
                        f"{path}: line {line}: {len(row)} columns, the header has {len(header)}"
                    )
                raw = row[duration_col].strip()
                try:
                    duration = float(raw)
                except ValueError:
                    duration = math.nan
                if not math.isfinite(duration) or duration < 0:
                    raise ScenarioError(
                        f"{path}: line {line}, column {duration_col + 1}: the duration must be "
                        f"a number >= 0 (ns), got {raw!r}"
                    )
                name = row[name_col].strip()
                # The launch shape stands in for grid/block, as in the shim's kernel ID.
                kernel_id = "|".join([name, *(row[c].strip() for c in shape)])
                profile = "unknown"
                if profile_col is not None:
                    raw = row[profile_col].strip()
                    if raw not in ORION_PROFILE:
                        raise ScenarioError(
                            f"{path}: line {line}, column {profile_col + 1}: unknown profile "
                            f"class {raw!r} (known: 1 compute, 0 memory, -1 unknown)"
                        )
                    profile = ORION_PROFILE[raw]
                sm_usage = None
                if sm_col is not None:
                    raw = row[sm_col].strip()
                    if not raw.isdigit() or int(raw) < 1:
                        raise ScenarioError(
                            f"{path}: line {line}, column {sm_col + 1}: SM_usage must be an "
                            f"integer >= 1, got {raw!r}"
                        )
                    # The orion lists count SMs' worth of blocks: above the GPU's SMs a kernel
                    # runs in waves on every SM.
                    sm_usage = int(raw)
                kernels.append(Kernel(name, kernel_id, round(duration), None, sm_usage, profile))
        if not kernels:
            raise ScenarioError(f"{path}: no kernels (from {self.path}: {where})")
        return tuple(kernels)

    def inline_kernels(self, value: Any, where: str) -> tuple[Kernel, ...]:
        if not isinstance(value, list) or not value:
            raise self.fail(where, "must be a non-empty list of kernels")
        kernels = []
        for i, item in enumerate(value):
            at = f"{where}[{i}]"
            self.keys(item, at, _KERNEL, {"name", "duration_us"})
            name = item["name"]
            if not isinstance(name, str) or not name:
                raise self.fail(f"{at}.name", "must be a non-empty string")
            duration = self.number(item["duration_us"], f"{at}.duration_us")
            gap = item.get("gap_after_us")
            gap_ns = None if gap is None else round(self.number(gap, f"{at}.gap_after_us") * 1e3)
            sm_usage = item.get("sm_usage")
            if sm_usage is not None:
                sm_usage = self.integer(sm_usage, f"{at}.sm_usage", 1, self.sms)
            profile = item.get("profile", "unknown")
            if profile not in PROFILE_CLASSES:
                raise self.fail(
                    f"{at}.profile",
                    f"unknown profile class {profile!r} (known: {', '.join(PROFILE_CLASSES)})",
                )
            kernels.append(Kernel(name, name, round(duration * 1e3), gap_ns, sm_usage, profile))
        return tuple(kernels)

    def task(self, value: Any, where: str) -> TaskSpec:
        self.keys(value, where, _TASK, {"name", "priority", "arrival"})
        name = value["name"]
        if not isinstance(name, str) or not name:
            raise self.fail(f"{where}.name", "must be a non-empty string")
        priority = self.integer(value["priority"], f"{where}.priority", 0, 9)
        has_csv, has_inline = "kernels_csv" in value, "kernels" in value
        if has_csv == has_inline:
            raise self.fail(where, "needs exactly one of kernels_csv and kernels")
        kernels = (
            self.csv_kernels(value["kernels_csv"], f"{where}.kernels_csv")
            if has_csv
            else self.inline_kernels(value["kernels"], f"{where}.kernels")
        )
        arrival = self.keys(
            value["arrival"], f"{where}.arrival", {"rate_per_s", "closed_loop"}, set()
        )
        if len(arrival) != 1:
            raise self.fail(f"{where}.arrival", 'needs exactly one of "rate_per_s", "closed_loop"')
        if "closed_loop" in arrival:
            if arrival["closed_loop"] is not True:
                raise self.fail(f"{where}.arrival.closed_loop", "must be true")
            rate = None
        else:
            rate = self.number(
                arrival["rate_per_s"], f"{where}.arrival.rate_per_s", 0.0, low_open=True
            )
        host = value.get("host", "sync")
        if host not in ("sync", "async"):
            raise self.fail(f"{where}.host", f'must be "sync" or "async", got {host!r}')
        gap_model = value.get("gap_model", "per_kernel_id")
        if gap_model not in ("per_kernel_id", "per_position"):
            raise self.fail(
                f"{where}.gap_model",
                f'must be "per_kernel_id" or "per_position", got {gap_model!r}',
            )
        return TaskSpec(
            name=name,
            priority=priority,
            kernels=kernels,
            rate_per_s=rate,
            host=host,
            host_gap_us=self.number(value.get("host_gap_us", 20.0), f"{where}.host_gap_us"),
            gap_model=gap_model,
            gap_jitter=self.number(value.get("gap_jitter", 0.1), f"{where}.gap_jitter", 0, 10),
            duration_jitter=self.number(
                value.get("duration_jitter", 0.05), f"{where}.duration_jitter", 0, 10
            ),
            start_s=self.number(value.get("start_s", 0.0), f"{where}.start_s"),
            launch_depth=self.integer(
                value.get("launch_depth", 16), f"{where}.launch_depth", 1, 1_000_000
            ),
            **self.share(value, where),
        )

    def share(self, value: dict, where: str) -> dict[str, Any]:
        sm = self.integer(value.get("sm_percent", 100), f"{where}.sm_percent", 1, 100)
        request = value.get("quota_request_percent")
        if request is not None:
            request = self.number(
                request, f"{where}.quota_request_percent", 0.0, 100.0, low_open=True
            )
        limit = self.number(
            value.get("quota_limit_percent", 100.0),
            f"{where}.quota_limit_percent",
            0.0,
            100.0,
            low_open=True,
        )
        if request is not None and request > limit:
            raise self.fail(
                f"{where}.quota_request_percent",
                f"must not exceed quota_limit_percent ({request:g} > {limit:g})",
            )
        return {
            "sm_percent": sm,
            "quota_request": None if request is None else request / 100,
            "quota_limit": limit / 100,
        }

    def fikit(self, value: Any) -> FikitConfig:
        self.keys(value, "$.fikit", _FIKIT, set())
        default = FikitConfig()
        ns = {}
        for key in sorted(_FIKIT):
            field = key.removesuffix("_us") + "_ns"
            if key in value:
                us = self.number(value[key], f"$.fikit.{key}", 0.0, 3.6e9)
                ns[field] = round(us * 1e3)
            else:
                ns[field] = getattr(default, field)
        return FikitConfig(**ns)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; ScenarioError names what is wrong and where."""
    file = Path(path)
    reader = _Reader(file)
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise ScenarioError(f"{file}: no such file") from None
    except OSError as error:
        raise ScenarioError(f"{file}: cannot read it: {error.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ScenarioError(
            f"{file}: line {error.lineno}, column {error.colno}: not JSON: {error.msg}"
        ) from None
    reader.keys(data, "$", _TOP, {"seed", "duration_s", "tasks"})
    try:
        gpu = _parse_gpu(data.get("gpu", {}))
    except DeviceConfigError as error:
        raise ScenarioError(f"{file}: {error}") from None
    reader.sms = gpu.sms
    harvest = data.get("harvest", "spatial")
    if harvest not in HARVEST_POLICIES:
        raise reader.fail("$.harvest", f"unknown harvest policy {harvest!r} (known: off, spatial)")
    seed = reader.integer(data["seed"], "$.seed", 0, 2**63 - 1)
    duration = reader.number(data["duration_s"], "$.duration_s", 0.0, 86_400.0, low_open=True)
    latency = reader.number(data.get("launch_latency_us", 5.0), "$.launch_latency_us", 0, 1e6)
    grant_latency = reader.number(data.get("grant_latency_us", 0.0), "$.grant_latency_us", 0, 1e6)
    tasks_raw = data["tasks"]
    if not isinstance(tasks_raw, list) or not tasks_raw:
        raise reader.fail("$.tasks", "must be a non-empty list")
    if len(tasks_raw) > 64:
        raise reader.fail("$.tasks", "at most 64 tasks (one GPU's admission slots)")
    tasks = tuple(reader.task(t, f"$.tasks[{i}]") for i, t in enumerate(tasks_raw))
    names = [t.name for t in tasks]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise reader.fail(f"$.tasks[{i}].name", f"duplicate task name {name!r}")
    token_policy = data.get("token_policy", "spatiotemporal")
    if token_policy not in ("spatiotemporal", "fifo", "exclusive"):
        raise reader.fail("$.token_policy", f"unknown token policy {token_policy!r}")
    return Scenario(
        path=str(file),
        seed=seed,
        duration_s=duration,
        launch_latency_ns=round(latency * 1e3),
        grant_latency_ns=round(grant_latency * 1e3),
        tasks=tasks,
        fikit=reader.fikit(data.get("fikit", {})),
        token_policy=token_policy,
        gpu=gpu,
        harvest=harvest,
        profile_requests=reader.integer(
            data.get("profile_requests", 20), "$.profile_requests", 1, 10_000
        ),
    )
