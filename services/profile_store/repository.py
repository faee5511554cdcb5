"""Persistence of profiles in SQL (PostgreSQL, or SQLite for the embedded default).

Writes are optimistic: each (kind, key, gpu_model) row carries a version that every put and
delete increments. Deletion keeps the row (deleted=True) so versions never go backwards; the
cache relies on that to order its entries.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Table, delete, insert, select, tuple_, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gpuloom.domain.errors import Aborted, InvalidArgument, NotFound
from gpuloom.domain.profiles import (
    ColocatedThroughput,
    Dim3,
    GapPredictorModel,
    JobProfile,
    KernelBound,
    KernelProfile,
    KernelStats,
    MigProfile,
    MigTime,
    Page,
    Profile,
    ProfileFilter,
    ProfileId,
    ProfileKind,
    ProfileSummary,
    ThroughputPoint,
    ThroughputProfile,
    profile_id,
)
from gpuloom.services.profile_store.models import (
    JobColocationRow,
    JobProfileRow,
    KernelProfileRow,
    KernelStatsRow,
    MigTimeRow,
    ProfileRow,
    ThroughputPointRow,
)

PROFILES: Table = ProfileRow.__table__  # type: ignore[assignment]
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100


def _table(row_class: type) -> Table:
    return row_class.__table__  # type: ignore[attr-defined,no-any-return]


@dataclass(frozen=True)
class KindMapping:
    """How one profile kind is spread over its child tables."""

    tables: tuple[Table, ...]
    rows: Callable[[Any], dict[Table, list[dict[str, Any]]]]
    load: Callable[[AsyncConnection, Any], Any]


def _kernel_rows(p: KernelProfile) -> dict[Table, list[dict[str, Any]]]:
    return {
        _table(KernelProfileRow): [
            {"measured_runs": p.measured_runs, "gap_predictor": _predictor_json(p.gap_predictor)}
        ],
        _table(KernelStatsRow): [
            {
                "kernel_id": f"{k.kernel_id:016x}",
                "position": i,
                "name": k.name,
                "grid_x": k.grid.x,
                "grid_y": k.grid.y,
                "grid_z": k.grid.z,
                "block_x": k.block.x,
                "block_y": k.block.y,
                "block_z": k.block.z,
                "sample_count": k.sample_count,
                "mean_duration_ns": k.mean_duration_ns,
                "p50_duration_ns": k.p50_duration_ns,
                "p95_duration_ns": k.p95_duration_ns,
                "mean_gap_after_ns": k.mean_gap_after_ns,
                "sm_usage": k.sm_usage,
                "bound": k.bound.value,
            }
            for i, k in enumerate(p.kernels)
        ],
    }


async def _load_kernel(conn: AsyncConnection, header: Any) -> KernelProfile:
    head = (
        await conn.execute(
            select(KernelProfileRow.measured_runs, KernelProfileRow.gap_predictor).where(
                KernelProfileRow.profile_id == header.id
            )
        )
    ).first()
    rows = await conn.execute(
        select(_table(KernelStatsRow))
        .where(KernelStatsRow.profile_id == header.id)
        .order_by(KernelStatsRow.position)
    )
    kernels = tuple(
        KernelStats(
            kernel_id=int(r.kernel_id, 16),
            name=r.name,
            grid=Dim3(r.grid_x, r.grid_y, r.grid_z),
            block=Dim3(r.block_x, r.block_y, r.block_z),
            sample_count=r.sample_count,
            mean_duration_ns=r.mean_duration_ns,
            p50_duration_ns=r.p50_duration_ns,
            p95_duration_ns=r.p95_duration_ns,
            mean_gap_after_ns=r.mean_gap_after_ns,
            sm_usage=r.sm_usage,
            bound=KernelBound(r.bound),
        )
        for r in rows
    )
    return KernelProfile(
        header.key,
        header.gpu_model,
        head.measured_runs if head else 0,
        kernels,
        gap_predictor=_predictor_from_json(head.gap_predictor) if head else None,
    )


def _predictor_json(predictor: GapPredictorModel | None) -> str | None:
    if predictor is None:
        return None
    return json.dumps(
        {
            "kind": predictor.kind,
            "mae_ns": predictor.mae_ns,
            "candidates_mae_ns": dict(predictor.candidates_mae_ns),
            "model_json": predictor.model_json,
        }
    )


def _predictor_from_json(document: str | None) -> GapPredictorModel | None:
    if document is None:
        return None
    data = json.loads(document)
    return GapPredictorModel(
        data["kind"], data["mae_ns"], data["candidates_mae_ns"], data["model_json"]
    )


def _throughput_rows(p: ThroughputProfile) -> dict[Table, list[dict[str, Any]]]:
    return {
        _table(ThroughputPointRow): [
            {
                "position": i,
                "sm_percent": pt.sm_percent,
                "quota_percent": pt.quota_percent,
                "requests_per_s": pt.requests_per_s,
                "p50_latency_ms": pt.p50_latency_ms,
                "p99_latency_ms": pt.p99_latency_ms,
            }
            for i, pt in enumerate(p.points)
        ]
    }


async def _load_throughput(conn: AsyncConnection, header: Any) -> ThroughputProfile:
    rows = await conn.execute(
        select(_table(ThroughputPointRow))
        .where(ThroughputPointRow.profile_id == header.id)
        .order_by(ThroughputPointRow.position)
    )
    points = tuple(
        ThroughputPoint(
            r.sm_percent, r.quota_percent, r.requests_per_s, r.p50_latency_ms, r.p99_latency_ms
        )
        for r in rows
    )
    return ThroughputProfile(header.key, header.gpu_model, points)


def _mig_rows(p: MigProfile) -> dict[Table, list[dict[str, Any]]]:
    return {
        _table(MigTimeRow): [{"slices": t.slices, "exec_time_s": t.exec_time_s} for t in p.times]
    }


async def _load_mig(conn: AsyncConnection, header: Any) -> MigProfile:
    rows = await conn.execute(
        select(_table(MigTimeRow))
        .where(MigTimeRow.profile_id == header.id)
        .order_by(MigTimeRow.slices)
    )
    return MigProfile(
        header.key, header.gpu_model, tuple(MigTime(r.slices, r.exec_time_s) for r in rows)
    )


def _job_rows(p: JobProfile) -> dict[Table, list[dict[str, Any]]]:
    return {
        _table(JobProfileRow): [
            {
                "minibatch_time_s": p.minibatch_time_s,
                "peak_memory_bytes": p.peak_memory_bytes,
                "gpu_utilization_percent": p.gpu_utilization_percent,
                "solo_throughput": p.solo_throughput,
                "minibatch_cv": p.minibatch_cv,
                "low_memory_points": json.dumps(list(p.low_memory_points_s)),
                "low_memory_bytes": p.low_memory_bytes,
            }
        ],
        _table(JobColocationRow): [
            {"position": i, "with_task_key": c.with_task_key, "throughput": c.throughput}
            for i, c in enumerate(p.colocated)
        ],
    }


async def _load_job(conn: AsyncConnection, header: Any) -> JobProfile:
    stats = (
        await conn.execute(
            select(_table(JobProfileRow)).where(JobProfileRow.profile_id == header.id)
        )
    ).one()
    rows = await conn.execute(
        select(_table(JobColocationRow))
        .where(JobColocationRow.profile_id == header.id)
        .order_by(JobColocationRow.position)
    )
    return JobProfile(
        header.key,
        header.gpu_model,
        minibatch_time_s=stats.minibatch_time_s,
        peak_memory_bytes=stats.peak_memory_bytes,
        gpu_utilization_percent=stats.gpu_utilization_percent,
        solo_throughput=stats.solo_throughput,
        colocated=tuple(ColocatedThroughput(r.with_task_key, r.throughput) for r in rows),
        minibatch_cv=stats.minibatch_cv,
        low_memory_points_s=tuple(json.loads(stats.low_memory_points)),
        low_memory_bytes=stats.low_memory_bytes,
    )


MAPPINGS: dict[ProfileKind, KindMapping] = {
    ProfileKind.KERNEL: KindMapping(
        (_table(KernelProfileRow), _table(KernelStatsRow)), _kernel_rows, _load_kernel
    ),
    ProfileKind.THROUGHPUT: KindMapping(
        (_table(ThroughputPointRow),), _throughput_rows, _load_throughput
    ),
    ProfileKind.MIG: KindMapping((_table(MigTimeRow),), _mig_rows, _load_mig),
    ProfileKind.JOB: KindMapping(
        (_table(JobProfileRow), _table(JobColocationRow)), _job_rows, _load_job
    ),
}


@dataclass(frozen=True, slots=True)
class Lookup:
    """What the database holds for an id: the live profile, or the version of its absence.

    `version` is 0 when no row ever existed; for a deleted profile it is the deletion's version.
    """

    profile: Profile | None
    version: int


class ProfileRepository:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._is_postgres = engine.dialect.name == "postgresql"
        # SQLite allows one writer; serialising writes here avoids lock-upgrade deadlocks.
        self._write_lock: contextlib.AbstractAsyncContextManager[Any] = (
            contextlib.nullcontext() if self._is_postgres else asyncio.Lock()
        )

    async def lookup(self, pid: ProfileId) -> Lookup:
        async with self._engine.connect() as conn:
            header = await self._header(conn, pid)
            if header is None:
                return Lookup(None, 0)
            if header.deleted:
                return Lookup(None, header.version)
            profile = await MAPPINGS[pid.kind].load(conn, header)
            return Lookup(_stamped(profile, header.version, header.updated_at), header.version)

    async def get(self, pid: ProfileId) -> Profile:
        found = await self.lookup(pid)
        if found.profile is None:
            raise NotFound(f"no {pid}")
        return found.profile

    async def put(self, profile: Profile, expected_version: int | None) -> Profile:
        """Insert or replace a profile; returns it with its new version and timestamp."""
        pid = profile_id(profile)
        mapping = MAPPINGS[pid.kind]
        now = datetime.now(UTC)
        async with self._write_lock, self._transaction() as conn:
            header = await self._header(conn, pid, for_update=True)
            live_version = 0 if header is None or header.deleted else header.version
            if expected_version is not None and expected_version != live_version:
                raise _stale(pid, expected_version, live_version)
            values = {"version": 1, "deleted": False, "entries": profile.entries, "updated_at": now}
            if header is None:
                try:
                    row_id = await conn.scalar(
                        insert(PROFILES)
                        .values(kind=pid.kind.value, key=pid.key, gpu_model=pid.gpu_model, **values)
                        .returning(PROFILES.c.id)
                    )
                except IntegrityError:
                    raise Aborted(f"{pid} was created concurrently; read it and retry") from None
            else:
                row_id = header.id
                values["version"] = header.version + 1
                await self._bump(conn, pid, header, values)
                await self._delete_children(conn, mapping, row_id)
            for table, rows in mapping.rows(profile).items():
                if rows:
                    await conn.execute(insert(table), [{"profile_id": row_id, **r} for r in rows])
        return _stamped(profile, values["version"], now)

    async def delete(self, pid: ProfileId, expected_version: int | None) -> int:
        """Delete a live profile; returns the version the deletion was recorded under."""
        mapping = MAPPINGS[pid.kind]
        async with self._write_lock, self._transaction() as conn:
            header = await self._header(conn, pid, for_update=True)
            if header is None or header.deleted:
                raise NotFound(f"no {pid}")
            if expected_version is not None and expected_version != header.version:
                raise _stale(pid, expected_version, header.version)
            values = {
                "version": header.version + 1,
                "deleted": True,
                "entries": 0,
                "updated_at": datetime.now(UTC),
            }
            await self._bump(conn, pid, header, values)
            await self._delete_children(conn, mapping, header.id)
        return int(values["version"])

    async def list(self, where: ProfileFilter, page_size: int, page_token: str) -> Page:
        size = page_size or DEFAULT_PAGE_SIZE
        query = select(PROFILES).where(PROFILES.c.deleted.is_(False))
        if where.kind is not None:
            query = query.where(PROFILES.c.kind == where.kind.value)
        if where.key:
            query = query.where(PROFILES.c.key == where.key)
        if where.gpu_model:
            query = query.where(PROFILES.c.gpu_model == where.gpu_model)
        order = (PROFILES.c.kind, PROFILES.c.key, PROFILES.c.gpu_model)
        if page_token:
            query = query.where(tuple_(*order) > tuple_(*decode_page_token(page_token)))
        query = query.order_by(*order).limit(size + 1)
        async with self._engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        summaries = tuple(
            ProfileSummary(
                ProfileId(ProfileKind(r.kind), r.key, r.gpu_model),
                r.version,
                _utc(r.updated_at),
                r.entries,
            )
            for r in rows[:size]
        )
        more = len(rows) > size
        last = summaries[-1].id if summaries else None
        token = encode_page_token(last) if more and last else ""
        return Page(summaries, token)

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[AsyncConnection]:
        async with self._engine.begin() as conn:
            yield conn

    async def _header(self, conn: AsyncConnection, pid: ProfileId, for_update: bool = False) -> Any:
        query = select(PROFILES).where(
            PROFILES.c.kind == pid.kind.value,
            PROFILES.c.key == pid.key,
            PROFILES.c.gpu_model == pid.gpu_model,
        )
        if for_update and self._is_postgres:
            query = query.with_for_update()
        return (await conn.execute(query)).one_or_none()

    async def _bump(
        self, conn: AsyncConnection, pid: ProfileId, header: Any, values: dict[str, Any]
    ) -> None:
        result = await conn.execute(
            update(PROFILES)
            .where(PROFILES.c.id == header.id, PROFILES.c.version == header.version)
            .values(**values)
        )
        if result.rowcount != 1:
            raise Aborted(f"{pid} was changed concurrently; read it and retry")

    async def _delete_children(
        self, conn: AsyncConnection, mapping: KindMapping, row_id: int
    ) -> None:
        for table in mapping.tables:
            await conn.execute(delete(table).where(table.c.profile_id == row_id))


def _stale(pid: ProfileId, expected: int, current: int) -> Aborted:
    state = f"version {current}" if current else "absent"
    return Aborted(f"stale version for {pid}: expected {expected}, the store has it {state}")


def _utc(moment: datetime) -> datetime:
    # SQLite hands back naive datetimes; everything stored is UTC.
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _stamped(profile: Profile, version: int, updated_at: datetime) -> Profile:
    return replace(profile, version=version, updated_at=_utc(updated_at))


def encode_page_token(last: ProfileId) -> str:
    raw = json.dumps([last.kind.value, last.key, last.gpu_model]).encode()
    return base64.urlsafe_b64encode(raw).decode()


def decode_page_token(token: str) -> Sequence[str]:
    try:
        values = json.loads(base64.urlsafe_b64decode(token.encode()))
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise InvalidArgument("page_token", "is not a token this service issued") from None
    if not (
        isinstance(values, list) and len(values) == 3 and all(isinstance(v, str) for v in values)
    ):
        raise InvalidArgument("page_token", "is not a token this service issued")
    return values
