"""SQL tables of the placement service. The schema is owned by the alembic migrations in
migrations/versions/ (their own version table, so placement can share a database with the
profile store); a test checks that these models and the migrations agree."""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Float, Index, Integer, MetaData, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "pk": "pk_%(table_name)s",
}
VERSION_TABLE = "placement_alembic_version"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class GpuRow(Base):
    __tablename__ = "placement_gpus"

    gpu_uuid: Mapped[str] = mapped_column(String(128), primary_key=True)
    node: Mapped[str] = mapped_column(String(253))
    model: Mapped[str] = mapped_column(String(128))
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    sm_count: Mapped[int] = mapped_column(Integer)
    mig_capable: Mapped[bool] = mapped_column(Boolean)
    mig_enabled: Mapped[bool] = mapped_column(Boolean)
    mps_enabled: Mapped[bool] = mapped_column(Boolean)
    # [[slices, first_slice, uuid], ...] as JSON: read and written whole, never queried.
    mig_instances: Mapped[str] = mapped_column(Text)
    dispatcher_address: Mapped[str] = mapped_column(String(300))
    registered_at: Mapped[float] = mapped_column(Float)
    lost: Mapped[bool] = mapped_column(Boolean)
    # The node's CPU (milli) and memory for jobs as registered with this GPU; 0: not reported.
    node_cpu_milli: Mapped[int] = mapped_column(BigInteger, server_default="0")
    node_memory_bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")


class JobRow(Base):
    """One row per job, rewritten on each change of state. `seq` orders listings."""

    __tablename__ = "placement_jobs"
    __table_args__ = (
        Index("ix_placement_jobs_state", "state"),
        Index("ix_placement_jobs_task_key", "task_key"),
        Index("ix_placement_jobs_function", "function"),
        Index("ix_placement_jobs_gpu_uuid", "gpu_uuid"),
        Index("ix_placement_jobs_owner", "owner"),
    )

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(64), unique=True)
    request_id: Mapped[str] = mapped_column(String(128), unique=True)
    # The JobSpec as canonical JSON: compared whole for idempotent submissions.
    spec: Mapped[str] = mapped_column(Text)
    task_key: Mapped[str] = mapped_column(String(256))
    function: Mapped[str] = mapped_column(String(256))
    state: Mapped[str] = mapped_column(String(16))
    revision: Mapped[int] = mapped_column(BigInteger)
    pending_reason: Mapped[str] = mapped_column(Text)
    message: Mapped[str] = mapped_column(Text)
    policy: Mapped[str] = mapped_column(String(64))
    submitted_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    exit_code: Mapped[int] = mapped_column(Integer)
    # When it became ASSIGNED; 0: never (yet).
    started_at: Mapped[float] = mapped_column(Float, server_default="0")
    gpu_uuid: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # The Binding (rectangle, token, environment) as JSON; NULL while the job holds nothing.
    binding: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The submitter's name (services/common/auth.py); "" when placement takes no tokens.
    owner: Mapped[str] = mapped_column(String(128), server_default="")
