"""Jobs and GPUs in SQL (SQLAlchemy Core: batches of rows per statement, no ORM overhead on
the decision path). Every method is one transaction."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from gpuloom.domain.gpus import GpuInfo, MigInstance
from gpuloom.domain.placement import JobKind, JobSpec, JobState, MigSlot, Slo
from gpuloom.domain.shares import share_of
from gpuloom.domain.training import CheckpointHook
from gpuloom.services.placement.domain import Binding, ExtraGpu, GpuRecord, Job
from gpuloom.services.placement.models import GpuRow, JobRow

JOBS: Table = JobRow.__table__  # type: ignore[assignment]
GPUS: Table = GpuRow.__table__  # type: ignore[assignment]
LIVE_STATES = [JobState.PENDING.value, JobState.BINDING.value, JobState.ASSIGNED.value]


def spec_to_json(spec: JobSpec) -> str:
    share = spec.share
    document = {
        "name": spec.name,
        "kind": spec.kind.value if spec.kind else None,
        "memory_bytes": share.memory_bytes,
        # An MPS share's SM percent and quota; null for whole GPUs and MIG tasks (all of it).
        "share": [share.sm_percent, share.quota.request_percent, share.quota.limit_percent]
        if spec.mps
        else None,
        "whole_gpus": spec.whole_gpus,
        "task_key": spec.task_key,
        "priority": share.priority,
        "slo": [spec.slo.p99_latency_ms, spec.slo.target_requests_per_s],
        "policy": spec.policy,
        "gpu_model": spec.gpu_model,
    }
    if spec.shared_model:  # replicas only: other rows stay as they were
        document["shared_model"] = spec.shared_model
    # Node resources only when asked: rows of jobs that ask none stay as they were.
    if spec.cpu_milli:
        document["cpu_milli"] = spec.cpu_milli
    if spec.host_memory_bytes:
        document["host_memory_bytes"] = spec.host_memory_bytes
    if spec.mig_slices:  # MIG batch tasks only: other rows stay as they were
        document["mig_slices"] = spec.mig_slices
        if spec.mig_size:
            document["mig_size"] = spec.mig_size
        document["command"] = list(spec.command)
        document["mig_times"] = [list(pair) for pair in spec.mig_times]
    if spec.checkpoint is not None:  # training jobs with a hook only: other rows stay as they were
        hook = spec.checkpoint
        document["checkpoint"] = [list(hook.command), hook.signal, hook.timeout_s]
    if spec.max_gpus:  # elastic training jobs only: other rows stay as they were
        document["max_gpus"] = spec.max_gpus
    if spec.nodes:  # jobs restricted to nodes only: other rows stay as they were
        document["nodes"] = list(spec.nodes)
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


def spec_from_json(text: str) -> JobSpec:
    d = json.loads(text)
    sm_percent, quota_request, quota_limit = d["share"] or (None, None, None)
    return JobSpec(
        name=d["name"],
        kind=JobKind(d["kind"]) if d["kind"] else None,
        share=share_of(sm_percent, quota_request, quota_limit, d["memory_bytes"], d["priority"]),
        mps=d["share"] is not None,
        whole_gpus=d["whole_gpus"],
        task_key=d["task_key"],
        slo=Slo(*d["slo"]),
        policy=d["policy"],
        gpu_model=d["gpu_model"],
        # Absent from rows written before MIG batches (and from every other job).
        mig_slices=d.get("mig_slices", 0),
        mig_size=d.get("mig_size", 0),
        command=tuple(d.get("command", ())),
        mig_times=tuple((int(size), float(seconds)) for size, seconds in d.get("mig_times", ())),
        shared_model=d.get("shared_model", ""),
        checkpoint=_hook_from_json(d.get("checkpoint")),
        max_gpus=d.get("max_gpus", 0),
        cpu_milli=d.get("cpu_milli", 0),
        host_memory_bytes=d.get("host_memory_bytes", 0),
        nodes=tuple(d.get("nodes", ())),
    )


def _hook_from_json(value: list | None) -> CheckpointHook | None:
    if value is None:  # absent from rows written before checkpoint hooks
        return None
    command, signal_name, timeout_s = value
    return CheckpointHook(tuple(command), signal_name, float(timeout_s))


def _binding_to_json(binding: Binding | None) -> str | None:
    if binding is None:
        return None
    document: dict[str, object] = {
        "gpu_uuid": binding.gpu_uuid,
        "node": binding.node,
        "dispatcher_address": binding.dispatcher_address,
        "rect": list(binding.rect),
        "memory_cap_bytes": binding.share.memory_bytes,
        "token": binding.token,
        "environment": binding.environment,
    }
    mig = binding.mig
    if mig is not None:
        document["mig"] = [
            mig.size,
            mig.first_slice,
            mig.planned_start,
            mig.planned_end,
            mig.instance_uuid,
        ]
    if binding.extra:  # a job on several GPUs: the rest of them
        document["extra"] = [
            [g.gpu_uuid, g.dispatcher_address, g.environment] for g in binding.extra
        ]
    if binding.time_slice_of:
        document["time_slice_of"] = binding.time_slice_of
    if binding.memory_in_turns:
        document["memory_in_turns"] = True
    return json.dumps(document, separators=(",", ":"))


def _binding_from_json(text: str | None, spec: JobSpec) -> Binding | None:
    """A stored binding; its share is the job's, with the memory cap it stores."""
    if text is None:
        return None
    d = json.loads(text)
    d["rect"] = tuple(d["rect"])
    d["share"] = replace(spec.share, memory_bytes=d.pop("memory_cap_bytes"))
    mig = d.pop("mig", None)
    extra = tuple(ExtraGpu(*g) for g in d.pop("extra", ()))
    return Binding(**d, mig=None if mig is None else MigSlot(*mig), extra=extra)


def _job_values(job: Job) -> dict[str, object]:
    return {
        "job_id": job.job_id,
        "request_id": job.request_id,
        "spec": spec_to_json(job.spec),
        "task_key": job.spec.task_key,
        "function": job.function,
        "state": job.state.value,
        "revision": job.revision,
        "pending_reason": job.pending_reason,
        "message": job.message,
        "policy": job.policy,
        "submitted_at": job.submitted_at,
        "updated_at": job.updated_at,
        "started_at": job.started_at,
        "exit_code": job.exit_code,
        "gpu_uuid": job.binding.gpu_uuid if job.binding else None,
        "binding": _binding_to_json(job.binding),
        "owner": job.owner,
    }


def _job_from_row(row: object) -> Job:
    r = row._mapping  # type: ignore[attr-defined]
    spec = spec_from_json(r["spec"])
    return Job(
        job_id=r["job_id"],
        request_id=r["request_id"],
        spec=spec,
        state=JobState(r["state"]),
        submitted_at=r["submitted_at"],
        updated_at=r["updated_at"],
        revision=r["revision"],
        pending_reason=r["pending_reason"],
        message=r["message"],
        policy=r["policy"],
        binding=_binding_from_json(r["binding"], spec),
        exit_code=r["exit_code"],
        function=r["function"],
        started_at=r["started_at"],
        owner=r["owner"],
    )


@dataclass(frozen=True, slots=True)
class JobFilter:
    states: tuple[JobState, ...] = ()
    task_key: str = ""
    gpu_uuid: str = ""
    function: str = ""
    owner: str | None = None  # None: every submitter's jobs


class PlacementRepository:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._update_job = (
            update(JOBS)
            .where(JOBS.c.job_id == bindparam("b_job_id"))
            # Writes may land out of order (bindings are recorded behind); never go back.
            .where(JOBS.c.revision < bindparam("b_revision"))
            .values(
                {
                    name: bindparam(name)
                    for name in (
                        "state",
                        "revision",
                        "pending_reason",
                        "message",
                        "policy",
                        "updated_at",
                        "started_at",
                        "exit_code",
                        "gpu_uuid",
                        "binding",
                    )
                }
            )
        )

    # ---- jobs ----

    async def write(self, new: Sequence[Job], changed: Sequence[Job]) -> set[str]:
        """Insert new jobs and update changed ones in one transaction. A new job whose
        request id is already taken is not inserted: returns those request ids."""
        async with self._engine.begin() as connection:
            taken: set[str] = set()
            if new:
                dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
                insert = (
                    dialect.insert(JOBS)
                    .on_conflict_do_nothing(index_elements=["request_id"])
                    .returning(JOBS.c.request_id)
                )
                result = await connection.execute(insert, [_job_values(j) for j in new])
                taken = {j.request_id for j in new} - set(result.scalars())
            if changed:
                await connection.execute(self._update_job, self._update_rows(changed))
        return taken

    async def update_jobs(self, jobs: Sequence[Job]) -> None:
        if jobs:
            async with self._engine.begin() as connection:
                await connection.execute(self._update_job, self._update_rows(jobs))

    @staticmethod
    def _update_rows(jobs: Iterable[Job]) -> list[dict[str, object]]:
        rows = []
        for job in jobs:
            values = _job_values(job)
            values["b_job_id"] = values.pop("job_id")
            values["b_revision"] = values["revision"]
            for fixed in ("request_id", "spec", "task_key", "function", "submitted_at", "owner"):
                del values[fixed]
            rows.append(values)
        return rows

    async def get_job(self, job_id: str) -> Job | None:
        async with self._engine.connect() as connection:
            row = (await connection.execute(select(JOBS).where(JOBS.c.job_id == job_id))).first()
        return None if row is None else _job_from_row(row)

    async def jobs_by_request_id(self, request_ids: Sequence[str]) -> dict[str, Job]:
        if not request_ids:
            return {}
        async with self._engine.connect() as connection:
            rows = await connection.execute(
                select(JOBS).where(JOBS.c.request_id.in_(list(request_ids)))
            )
            return {job.request_id: job for job in map(_job_from_row, rows)}

    async def live_jobs(self) -> list[Job]:
        """Every job that is pending or holds capacity, in submission order."""
        async with self._engine.connect() as connection:
            rows = await connection.execute(
                select(JOBS).where(JOBS.c.state.in_(LIVE_STATES)).order_by(JOBS.c.seq)
            )
            return [_job_from_row(row) for row in rows]

    async def list_jobs(
        self, where: JobFilter, limit: int, after_seq: int
    ) -> tuple[list[Job], int | None]:
        """Up to `limit` jobs after position `after_seq`, and the position to continue from
        (None: no more)."""
        query = select(JOBS).where(JOBS.c.seq > after_seq)
        if where.states:
            query = query.where(JOBS.c.state.in_([s.value for s in where.states]))
        if where.owner is not None:
            query = query.where(JOBS.c.owner == where.owner)
        for column, value in (
            (JOBS.c.task_key, where.task_key),
            (JOBS.c.gpu_uuid, where.gpu_uuid),
            (JOBS.c.function, where.function),
        ):
            if value:
                query = query.where(column == value)
        query = query.order_by(JOBS.c.seq).limit(limit + 1)
        async with self._engine.connect() as connection:
            rows = (await connection.execute(query)).all()
        more = len(rows) > limit
        rows = rows[:limit]
        jobs = [_job_from_row(row) for row in rows]
        return jobs, (rows[-1]._mapping["seq"] if more else None)

    # ---- GPUs ----

    async def save_gpu(self, record: GpuRecord) -> None:
        info = record.info
        values = {
            "gpu_uuid": info.gpu_uuid,
            "node": info.node,
            "model": info.model,
            "memory_bytes": info.memory_bytes,
            "sm_count": info.sm_count,
            "mig_capable": info.mig_capable,
            "mig_enabled": info.mig_enabled,
            "mps_enabled": info.mps_enabled,
            "mig_instances": json.dumps(
                [[m.slices, m.first_slice, m.uuid] for m in info.mig_instances]
            ),
            "dispatcher_address": record.dispatcher_address,
            "registered_at": record.registered_at,
            "lost": record.lost,
            "node_cpu_milli": info.node_cpu_milli,
            "node_memory_bytes": info.node_memory_bytes,
        }
        async with self._engine.begin() as connection:
            dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
            insert = dialect.insert(GPUS).values(values)
            changes = {k: v for k, v in values.items() if k != "gpu_uuid"}
            await connection.execute(
                insert.on_conflict_do_update(index_elements=["gpu_uuid"], set_=changes)
            )

    async def set_gpu_lost(self, gpu_uuid: str, lost: bool) -> None:
        async with self._engine.begin() as connection:
            await connection.execute(
                update(GPUS).where(GPUS.c.gpu_uuid == gpu_uuid).values(lost=lost)
            )

    async def gpus(self) -> list[GpuRecord]:
        async with self._engine.connect() as connection:
            rows = await connection.execute(select(GPUS).order_by(GPUS.c.gpu_uuid))
            records = []
            for row in rows:
                r = row._mapping
                info = GpuInfo(
                    gpu_uuid=r["gpu_uuid"],
                    node=r["node"],
                    model=r["model"],
                    memory_bytes=r["memory_bytes"],
                    sm_count=r["sm_count"],
                    mig_capable=r["mig_capable"],
                    mig_enabled=r["mig_enabled"],
                    mig_instances=tuple(MigInstance(*m) for m in json.loads(r["mig_instances"])),
                    mps_enabled=r["mps_enabled"],
                    node_cpu_milli=r["node_cpu_milli"],
                    node_memory_bytes=r["node_memory_bytes"],
                )
                records.append(
                    GpuRecord(
                        info=info,
                        dispatcher_address=r["dispatcher_address"],
                        registered_at=r["registered_at"],
                        last_heartbeat=0.0,
                        lost=r["lost"],
                    )
                )
            return records
