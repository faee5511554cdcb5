"""Placement's GPU inventory: the registered GPUs and the `Fleet` of their free space,
registration and heartbeats as they change it, and the ListGpus view.

It knows no jobs: the core ends the jobs of a GPU it marks lost, and decides again when it
reports capacity back. Shares reserved on a dispatcher directly (not by placement), as its
registration and heartbeats report them, sit in the fleet as allocations no job owns
(`direct_id`), so that jobs are not placed into space that is taken. The models a GPU's model
store holds, as its dispatcher reports them, sit in the fleet as the GPU's store (their bytes
used once; replicas of them charged less there). Every change is made under the core's lock (one
writer of fleet and database at a time); reads are lock-free.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from gpuloom.domain.errors import FailedPrecondition, InvalidArgument, NotFound
from gpuloom.domain.gpus import GpuInfo
from gpuloom.domain.placement import JobSpec
from gpuloom.policies.placement import GRID_AREA, Allocation, Fleet, GpuState, Rect
from gpuloom.policies.placement.fleet import InvalidStateError
from gpuloom.policies.placement.model import gang_member_id
from gpuloom.services.placement.domain import GpuRecord, Job, validate_address
from gpuloom.services.placement.paging import decode_text, encode_token
from gpuloom.services.placement.repository import PlacementRepository

log = structlog.get_logger("gpuloom.placement")

MAX_PAGE_GPUS = 10_000
MAX_STORE_MODELS = 256  # what one dispatcher's model store holds at most

# The models a GPU's store holds: (name, device bytes), sorted by name.
StoreModels = tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class GpuView:
    """A GPU for ListGpus: the record plus what the fleet holds on it."""

    record: GpuRecord
    schedulable: bool
    memory_reserved_bytes: int
    area_reserved_percent: float
    jobs: int
    direct_reservations: int


class Inventory:
    def __init__(self, repository: PlacementRepository) -> None:
        self._repo = repository
        self.fleet = Fleet()
        self._gpus: dict[str, GpuRecord] = {}
        self._gpu_keys: list[tuple[str, str]] | None = None  # (node, uuid), sorted: ListGpus
        self._max_memory: dict[str, int] = {}  # model -> largest GPU memory ("" = any model)
        # GPUs whose dispatcher failed a bind or a MIG run: no new work until its next heartbeat.
        self.suspended: set[str] = set()
        # GPU -> the fleet ids of the direct reservations its dispatcher reported last.
        self._direct: dict[str, frozenset[str]] = {}
        # GPU -> the models its store holds, as its dispatcher reported them last.
        self._stores: dict[str, StoreModels] = {}
        # GPUs loaded at start and not heard from since -> until when they may stay silent.
        self._awaited: dict[str, float] = {}

    def load(
        self,
        records: Sequence[GpuRecord],
        holding: Mapping[str, Sequence[Allocation]],
        now: float,
        grace_s: float = 0.0,
    ) -> None:
        """At start: the stored GPUs with the allocations their jobs hold. Each may stay
        silent for `grace_s` (or a heartbeat timeout, if longer) before it counts as lost: its
        dispatcher may be starting again too, after this service (a whole host restarted)."""
        for record in records:
            record.last_heartbeat = now
            self._gpus[record.info.gpu_uuid] = record
            self._awaited[record.info.gpu_uuid] = now + grace_s
            self.fleet.add_gpu(gpu_state(record, holding.get(record.info.gpu_uuid, ())))
            self._note_memory(record.info)

    def __contains__(self, gpu_uuid: str) -> bool:
        return gpu_uuid in self._gpus

    def record(self, gpu_uuid: str) -> GpuRecord:
        return self._gpus[gpu_uuid]

    def records(self) -> Iterable[GpuRecord]:
        return self._gpus.values()

    def holds_shares(self, gpu_uuid: str) -> bool:
        """Whether MPS or whole-GPU jobs hold capacity on the GPU."""
        return bool(self.fleet.slot(gpu_uuid).allocations)

    # ---- registration and heartbeats (under the core's lock) ----

    async def register(self, info: GpuInfo, dispatcher_address: str, now: float) -> bool:
        """Add or refresh a GPU, recorded; returns whether it was registered before."""
        info.validate()
        validate_address("dispatcher_address", dispatcher_address)
        old = self._gpus.get(info.gpu_uuid)
        record = GpuRecord(
            info=info,
            dispatcher_address=dispatcher_address,
            registered_at=now if old is None else old.registered_at,
            last_heartbeat=now,
        )
        reshaped = old is not None and (
            (
                old.info.node,
                old.info.model,
                old.info.memory_bytes,
                old.info.node_cpu_milli,
                old.info.node_memory_bytes,
            )
            != (
                info.node,
                info.model,
                info.memory_bytes,
                info.node_cpu_milli,
                info.node_memory_bytes,
            )
        )
        if old is None:
            self.fleet.add_gpu(gpu_state(record, []))
        elif reshaped:
            self._replace_gpu(old, record)
        try:
            await self._repo.save_gpu(record)
        except BaseException:  # not recorded: the fleet goes back to what it was
            if old is None:
                self.fleet.remove_gpu(info.gpu_uuid)
            elif reshaped:
                self._replace_gpu(record, old)
            raise
        self._gpus[info.gpu_uuid] = record
        self._awaited.pop(info.gpu_uuid, None)
        if old is None or old.info.node != info.node:
            self._gpu_keys = None
        self.fleet.set_schedulable(info.gpu_uuid, takes_shares(record))
        self.suspended.discard(info.gpu_uuid)
        self._note_memory(info)
        return old is not None

    def _replace_gpu(self, old: GpuRecord, new: GpuRecord) -> None:
        """The same GPU registered with another node, model or memory: its jobs stay on it
        if they still fit, otherwise the registration is refused and nothing changes."""
        models = self._counted(old.info.gpu_uuid)
        held = self.fleet.remove_gpu(old.info.gpu_uuid)
        try:
            self.fleet.add_gpu(gpu_state(new, list(held), models))
        except ValueError as error:
            self.fleet.add_gpu(gpu_state(old, list(held), models))
            raise FailedPrecondition(
                f"GPU {new.info.gpu_uuid} holds jobs that would not fit it as registered now "
                f"({error}); end them first"
            ) from None

    def refresh(
        self, gpu_uuid: str, utilization_percent: float, memory_used_bytes: int, now: float
    ) -> GpuRecord:
        """A heartbeat's figures (lock-free: only the record's own fields change)."""
        record = self._gpus.get(gpu_uuid)
        if record is None:
            raise NotFound(f"GPU {gpu_uuid!r} is not registered: register it first")
        # NaN: the driver cannot tell (NVML with MIG on); anything else must be a percentage.
        if not math.isnan(utilization_percent) and not 0 <= utilization_percent <= 100:
            raise InvalidArgument(
                "utilization_percent", f"must be within 0..100, got {utilization_percent}"
            )
        record.last_heartbeat = now
        self._awaited.pop(gpu_uuid, None)
        record.utilization_percent = utilization_percent
        record.memory_used_bytes = memory_used_bytes
        return record

    def is_down(self, record: GpuRecord) -> bool:
        """Lost, or skipped after a failure until its next heartbeat."""
        return record.lost or record.info.gpu_uuid in self.suspended

    async def revive(self, record: GpuRecord) -> None:
        """A lost or suspended GPU's dispatcher is alive again: it takes work again."""
        gpu_uuid = record.info.gpu_uuid
        if record.lost:
            await self._repo.set_gpu_lost(gpu_uuid, False)
            record.lost = False
            log.info("GPU is back", gpu=gpu_uuid, node=record.info.node)
        self.suspended.discard(gpu_uuid)
        self.fleet.set_schedulable(gpu_uuid, takes_shares(record))

    def silent(self, now: float, timeout_s: float) -> list[GpuRecord]:
        """GPUs not lost yet that have been silent for too long (`is_silent`)."""
        return [r for r in self._gpus.values() if self.is_silent(r, now, timeout_s)]

    def is_silent(self, record: GpuRecord, now: float, timeout_s: float) -> bool:
        """Not lost yet, and its last heartbeat older than the timeout; a GPU not heard from
        since this service started is given until the end of its start-up grace as well."""
        if record.lost or now - record.last_heartbeat <= timeout_s:
            return False
        grace_until = self._awaited.get(record.info.gpu_uuid)
        return grace_until is None or now > grace_until

    def awaited(self, gpu_uuid: str) -> bool:
        """Whether the GPU has not been heard from since this service started."""
        return gpu_uuid in self._awaited

    async def mark_lost(self, record: GpuRecord) -> None:
        await self._repo.set_gpu_lost(record.info.gpu_uuid, True)
        record.lost = True
        self.fleet.set_schedulable(record.info.gpu_uuid, False)

    def suspend(self, gpu_uuid: str) -> None:
        """No new job on this GPU until its dispatcher shows it is alive again."""
        if gpu_uuid in self.fleet:
            self.fleet.set_schedulable(gpu_uuid, False)
            self.suspended.add(gpu_uuid)

    def direct_changed(self, gpu_uuid: str, direct: Sequence[Allocation]) -> bool:
        """Whether `direct` differs from what the GPU's dispatcher reported last (lock-free;
        an assignment id keeps its request, the dispatcher refuses another under it)."""
        return frozenset(a.allocation_id for a in direct) != self._direct.get(gpu_uuid, frozenset())

    def set_direct(self, gpu_uuid: str, direct: Sequence[Allocation]) -> None:
        """Make the GPU's direct reservations in the fleet the ones `direct` lists (its
        dispatcher's last report). One that does not fit beside the rest (a dispatcher that
        overcommits its GPU) is left out, with a warning."""
        old = self._direct.get(gpu_uuid, frozenset())
        new = {a.allocation_id: a for a in direct}
        for gone in old - new.keys():
            self.fleet.release(gone)
        added = [a for a_id, a in sorted(new.items()) if a_id not in old]
        if added:
            record = self._gpus[gpu_uuid]
            schedulable = self.fleet.slot(gpu_uuid).schedulable
            models = self._counted(gpu_uuid)
            held = list(self.fleet.remove_gpu(gpu_uuid))
            for candidate in added:
                try:  # the fleet takes a GPU whole: try it with the candidate, then take it back
                    self.fleet.add_gpu(gpu_state(record, [*held, candidate], models))
                except (InvalidStateError, ValueError) as error:
                    log.warning(
                        "a direct reservation does not fit beside the rest: not counted",
                        gpu=gpu_uuid,
                        reservation=candidate.allocation_id,
                        error=str(error),
                    )
                    continue
                held = list(self.fleet.remove_gpu(gpu_uuid))
            self.fleet.add_gpu(gpu_state(record, held, models))
            self.fleet.set_schedulable(gpu_uuid, schedulable)
        self._direct[gpu_uuid] = frozenset(new)

    def models_changed(self, gpu_uuid: str, models: StoreModels) -> bool:
        """Whether the store's models differ from what its dispatcher reported last, or some of
        them are not counted yet (they did not fit beside placement's jobs then)."""
        return models != self._stores.get(gpu_uuid, ()) or models != self._counted(gpu_uuid)

    def set_models(self, gpu_uuid: str, models: StoreModels) -> None:
        """Make the GPU's store in the fleet the models its dispatcher reports (checked with
        `check_store`). Those that do not fit beside the jobs placement bound there (bound
        but not yet reserved: their Reserve will fail) are left out, with a warning, and
        counted once they fit, at a later heartbeat."""
        self._stores[gpu_uuid] = models
        try:
            self.fleet.set_models(gpu_uuid, models)
            return
        except InvalidStateError:
            pass
        counted: list[tuple[str, int]] = []
        for model in models:
            try:
                self.fleet.set_models(gpu_uuid, [*counted, model])
            except InvalidStateError as error:
                log.warning(
                    "a model the GPU's store holds does not fit beside placement's jobs: "
                    "not counted yet",
                    gpu=gpu_uuid,
                    model=model[0],
                    error=str(error),
                )
                continue
            counted.append(model)
        self.fleet.set_models(gpu_uuid, counted)

    def _counted(self, gpu_uuid: str) -> StoreModels:
        return tuple(sorted(self.fleet.slot(gpu_uuid).models.items()))

    # ---- questions ----

    def check_spec(self, spec: JobSpec) -> None:
        """Refuse an MPS or whole-GPU job the registered fleet can never run (nothing is known
        before the first GPU registers): a GPU model no GPU has, more GPUs than any node has
        (of its models), an elastic range beyond the largest node, more memory than any GPU,
        more CPU or host memory than any node."""
        if not self._gpus:
            return
        models = spec.gpu_models
        known = self.fleet.models()  # a few models, whatever the number of GPUs
        for model in models:
            if model not in known:
                raise InvalidArgument(
                    "spec.gpu_model",
                    f"unknown GPU model {model!r}; the fleet has {', '.join(sorted(known))}",
                )
        self.check_memory(spec)
        fleet = self.fleet
        for count, field, asked in (
            (spec.whole_gpus, "spec.resources.whole_gpus", f"{spec.whole_gpus} GPUs on one node"),
            (
                spec.max_gpus,
                "spec.max_gpus",
                f"an elastic range up to {spec.max_gpus} GPUs of one node",
            ),
        ):
            if count <= 1:
                continue
            most = fleet.max_gpus_per_node(spec.gpu_model)
            if count > most:
                of_model = f" of model {spec.gpu_model}" if models else ""
                raise InvalidArgument(
                    field, f"{asked}: no node has that many GPUs{of_model} (the most: {most})"
                )
        nodes = fleet.nodes.values()
        for name, asked, figure in (
            ("spec.cpu_milli", spec.cpu_milli, "cpu_milli"),
            ("spec.host_memory_bytes", spec.host_memory_bytes, "memory_bytes"),
        ):
            if not asked:  # the common case costs nothing per node
                continue
            has = max(getattr(n, figure) for n in nodes)
            if asked > has:
                raise InvalidArgument(
                    name, f"{asked} is more than any node of the fleet has (the most: {has})"
                )

    def check_memory(self, spec: JobSpec) -> None:
        """A job asking for more memory than any registered GPU (of its models) can never run."""
        sizes = [self._max_memory.get(m) for m in spec.gpu_models or ("",)]
        largest = max((size for size in sizes if size is not None), default=None)
        if largest is not None and spec.share.memory_bytes > largest:
            of_model = f" {spec.gpu_model}" if spec.gpu_model else ""
            raise InvalidArgument(
                "spec.resources.memory_bytes",
                f"{spec.share.memory_bytes} bytes is more than any{of_model} GPU in the fleet has "
                f"(largest: {largest} bytes)",
            )

    def page(self, node: str, page_size: int, page_token: str) -> tuple[list[GpuView], str]:
        """ListGpus: GPUs by (node, uuid), optionally of one node."""
        if page_size > MAX_PAGE_GPUS:
            raise InvalidArgument("page_size", f"must be at most {MAX_PAGE_GPUS}, got {page_size}")
        limit = page_size or 1000
        if self._gpu_keys is None:
            self._gpu_keys = sorted((r.info.node, r.info.gpu_uuid) for r in self._gpus.values())
        keys = self._gpu_keys
        start = 0
        if page_token:
            after = tuple(decode_text(page_token).split("\x1f"))
            if len(after) != 2:
                raise InvalidArgument("page_token", "is not a token this service handed out")
            start = bisect.bisect_right(keys, after)
        page: list[tuple[str, str]] = []
        more = False
        for key in itertools.islice(keys, start, None):
            if node and key[0] != node:
                continue
            if len(page) == limit:
                more = True
                break
            page.append(key)
        views = [self._view(gpu_uuid) for _, gpu_uuid in page]
        token = encode_token("\x1f".join(page[-1])) if more else ""
        return views, token

    def views(self) -> list[GpuView]:
        """Every registered GPU, in no particular order."""
        return [self._view(gpu_uuid) for gpu_uuid in self._gpus]

    def _view(self, gpu_uuid: str) -> GpuView:
        slot = self.fleet.slot(gpu_uuid)
        direct = sum(1 for a_id in self._direct.get(gpu_uuid, ()) if a_id in slot.allocations)
        return GpuView(
            record=self._gpus[gpu_uuid],
            schedulable=slot.schedulable,
            memory_reserved_bytes=slot.memory_used,
            area_reserved_percent=100.0 * slot.area_used / GRID_AREA,
            jobs=len(slot.allocations) - direct,
            direct_reservations=direct,
        )

    def _note_memory(self, info: GpuInfo) -> None:
        for model in ("", info.model):
            self._max_memory[model] = max(self._max_memory.get(model, 0), info.memory_bytes)


def allocation(job: Job) -> Allocation:
    """The allocation a placed MPS or whole-GPU job holds on its first GPU (see allocations)."""
    return allocations(job)[0][1]


def allocations(job: Job) -> list[tuple[str, Allocation]]:
    """The rectangle and memory a placed MPS or whole-GPU job holds on each of its GPUs, for
    the fleet: (GPU, allocation). The memory is what it was charged (its cap; less than it
    asked for a replica placed beside its model; taken in turns, the fleet charges its time-slice
    group its largest member's); the node's CPU and host memory are charged
    on the first GPU."""
    binding = job.binding
    assert binding is not None
    spec = job.spec
    held = []
    for i, gpu_uuid in enumerate(binding.gpu_uuids):
        first = i == 0
        held.append(
            (
                gpu_uuid,
                Allocation(
                    allocation_id=job.job_id if first else gang_member_id(job.job_id, i),
                    share=binding.share,
                    task_key=spec.task_key,
                    rect=Rect(*binding.rect),
                    cpu_milli=spec.cpu_milli if first else 0,
                    host_memory_bytes=spec.host_memory_bytes if first else 0,
                    gang="" if first else job.job_id,
                    # Its time-slice group there: the allocation of the group's first job on
                    # that GPU (its GPUs in the same order).
                    slice_of=(
                        gang_member_id(binding.time_slice_of, i)
                        if binding.time_slice_of and not first
                        else binding.time_slice_of
                    ),
                    # Its memory taken in turns with its group's (the fleet spreads the charge).
                    turn_charge_bytes=binding.share.memory_bytes
                    if binding.memory_in_turns
                    else None,
                ),
            )
        )
    return held


def direct_id(gpu_uuid: str, assignment_id: str) -> str:
    """The fleet's id of a share reserved on the GPU's dispatcher directly (assignment ids are
    chosen per dispatcher, so the GPU makes them unique)."""
    return f"direct:{gpu_uuid}:{assignment_id}"


def takes_shares(record: GpuRecord) -> bool:
    """MPS shares and whole-GPU jobs go to live GPUs not in MIG mode (those run MIG batches)."""
    return not record.lost and not record.info.mig_enabled


def gpu_state(
    record: GpuRecord, allocations: Sequence[Allocation], models: StoreModels = ()
) -> GpuState:
    info = record.info
    return GpuState(
        gpu_id=info.gpu_uuid,
        node=info.node,
        model=info.model,
        memory_bytes=info.memory_bytes,
        sm_count=info.sm_count,
        schedulable=takes_shares(record),
        allocations=tuple(allocations),
        models=models,
        node_cpu_milli=info.node_cpu_milli,
        node_memory_bytes=info.node_memory_bytes,
    )


def check_store(models: StoreModels, memory_bytes: int) -> None:
    """A dispatcher's report of its store: at most MAX_STORE_MODELS models, together no larger
    than the GPU (the dispatcher charges them to its memory); InvalidArgument on `models`.
    Each name and size is checked where the report is read (services/placement/convert.py)."""
    if len(models) > MAX_STORE_MODELS:
        raise InvalidArgument(
            "models", f"at most {MAX_STORE_MODELS} models per GPU, got {len(models)}"
        )
    total = sum(nbytes for _, nbytes in models)
    if total > memory_bytes:
        raise InvalidArgument(
            "models",
            f"they hold {total} bytes, more than the GPU's {memory_bytes} bytes of memory",
        )
