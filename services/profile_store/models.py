"""SQLAlchemy tables of the profile store. The schema is owned by the alembic migrations in
migrations/versions/; a test checks that these models and the migrations agree.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class ProfileRow(Base):
    """One row per (kind, key, gpu_model). Deleted profiles keep their row (deleted=True) so
    versions stay monotonic across delete and re-create, which keeps the cache ordering sound."""

    __tablename__ = "profiles"
    __table_args__ = (UniqueConstraint("kind", "key", "gpu_model"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16))
    key: Mapped[str] = mapped_column(String(256))
    gpu_model: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(BigInteger)
    deleted: Mapped[bool] = mapped_column(Boolean, default=False)
    entries: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


def _profile_fk() -> Mapped[int]:
    return mapped_column(ForeignKey("profiles.id", ondelete="CASCADE"), primary_key=True)


class KernelProfileRow(Base):
    __tablename__ = "kernel_profiles"
    profile_id: Mapped[int] = _profile_fk()
    measured_runs: Mapped[int] = mapped_column(Integer)
    # The chosen gap predictor as one JSON document (kind, errors, fitted tables); NULL: none.
    gap_predictor: Mapped[str | None] = mapped_column(Text, nullable=True)


class KernelStatsRow(Base):
    __tablename__ = "kernel_stats"
    profile_id: Mapped[int] = _profile_fk()
    # 64-bit kernel IDs as 16 lower-case hex digits: readable in psql, no sign trouble.
    kernel_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    position: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(8192))
    grid_x: Mapped[int] = mapped_column(BigInteger)
    grid_y: Mapped[int] = mapped_column(Integer)
    grid_z: Mapped[int] = mapped_column(Integer)
    block_x: Mapped[int] = mapped_column(Integer)
    block_y: Mapped[int] = mapped_column(Integer)
    block_z: Mapped[int] = mapped_column(Integer)
    sample_count: Mapped[int] = mapped_column(BigInteger)
    mean_duration_ns: Mapped[float] = mapped_column(Float)
    p50_duration_ns: Mapped[float] = mapped_column(Float)
    p95_duration_ns: Mapped[float] = mapped_column(Float)
    mean_gap_after_ns: Mapped[float] = mapped_column(Float)
    # Rows written before migration 0004 read as unknown: 0 SMs, bound "unknown".
    sm_usage: Mapped[int] = mapped_column(Integer, server_default="0")
    bound: Mapped[str] = mapped_column(String(16), server_default="unknown")


class ThroughputPointRow(Base):
    __tablename__ = "throughput_points"
    profile_id: Mapped[int] = _profile_fk()
    sm_percent: Mapped[int] = mapped_column(Integer, primary_key=True)
    quota_percent: Mapped[float] = mapped_column(Float, primary_key=True)
    position: Mapped[int] = mapped_column(Integer)
    requests_per_s: Mapped[float] = mapped_column(Float)
    p50_latency_ms: Mapped[float] = mapped_column(Float)
    p99_latency_ms: Mapped[float] = mapped_column(Float)


class MigTimeRow(Base):
    __tablename__ = "mig_times"
    profile_id: Mapped[int] = _profile_fk()
    slices: Mapped[int] = mapped_column(Integer, primary_key=True)
    exec_time_s: Mapped[float] = mapped_column(Float)


class JobProfileRow(Base):
    __tablename__ = "job_profiles"
    profile_id: Mapped[int] = _profile_fk()
    minibatch_time_s: Mapped[float] = mapped_column(Float)
    peak_memory_bytes: Mapped[int] = mapped_column(BigInteger)
    gpu_utilization_percent: Mapped[float] = mapped_column(Float)
    solo_throughput: Mapped[float] = mapped_column(Float)
    minibatch_cv: Mapped[float] = mapped_column(Float, server_default="0")
    # Seconds, as a JSON list: read and written whole, never queried.
    low_memory_points: Mapped[str] = mapped_column(Text, server_default="[]")
    low_memory_bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")


class JobColocationRow(Base):
    __tablename__ = "job_colocations"
    profile_id: Mapped[int] = _profile_fk()
    with_task_key: Mapped[str] = mapped_column(String(256), primary_key=True)
    position: Mapped[int] = mapped_column(Integer)
    throughput: Mapped[float] = mapped_column(Float)
