"""Initial schema: profile headers and one table family per profile kind.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _profile_fk(table: str) -> sa.Column:
    return sa.Column(
        "profile_id",
        sa.Integer(),
        sa.ForeignKey("profiles.id", ondelete="CASCADE", name=f"fk_{table}_profile_id_profiles"),
        nullable=False,
    )


def upgrade() -> None:
    op.create_table(
        "profiles",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("key", sa.String(256), nullable=False),
        sa.Column("gpu_model", sa.String(128), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("deleted", sa.Boolean(), nullable=False),
        sa.Column("entries", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_profiles"),
        sa.UniqueConstraint("kind", "key", "gpu_model", name="uq_profiles_kind"),
    )
    op.create_table(
        "kernel_profiles",
        _profile_fk("kernel_profiles"),
        sa.Column("measured_runs", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("profile_id", name="pk_kernel_profiles"),
    )
    op.create_table(
        "kernel_stats",
        _profile_fk("kernel_stats"),
        sa.Column("kernel_id", sa.String(16), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(8192), nullable=False),
        sa.Column("grid_x", sa.BigInteger(), nullable=False),
        sa.Column("grid_y", sa.Integer(), nullable=False),
        sa.Column("grid_z", sa.Integer(), nullable=False),
        sa.Column("block_x", sa.Integer(), nullable=False),
        sa.Column("block_y", sa.Integer(), nullable=False),
        sa.Column("block_z", sa.Integer(), nullable=False),
        sa.Column("sample_count", sa.BigInteger(), nullable=False),
        sa.Column("mean_duration_ns", sa.Float(), nullable=False),
        sa.Column("p50_duration_ns", sa.Float(), nullable=False),
        sa.Column("p95_duration_ns", sa.Float(), nullable=False),
        sa.Column("mean_gap_after_ns", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("profile_id", "kernel_id", name="pk_kernel_stats"),
    )
    op.create_table(
        "throughput_points",
        _profile_fk("throughput_points"),
        sa.Column("sm_percent", sa.Integer(), nullable=False),
        sa.Column("quota_percent", sa.Float(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("requests_per_s", sa.Float(), nullable=False),
        sa.Column("p50_latency_ms", sa.Float(), nullable=False),
        sa.Column("p99_latency_ms", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint(
            "profile_id", "sm_percent", "quota_percent", name="pk_throughput_points"
        ),
    )
    op.create_table(
        "mig_times",
        _profile_fk("mig_times"),
        sa.Column("slices", sa.Integer(), nullable=False),
        sa.Column("exec_time_s", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("profile_id", "slices", name="pk_mig_times"),
    )
    op.create_table(
        "job_profiles",
        _profile_fk("job_profiles"),
        sa.Column("minibatch_time_s", sa.Float(), nullable=False),
        sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("gpu_utilization_percent", sa.Float(), nullable=False),
        sa.Column("solo_throughput", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("profile_id", name="pk_job_profiles"),
    )
    op.create_table(
        "job_colocations",
        _profile_fk("job_colocations"),
        sa.Column("with_task_key", sa.String(256), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("throughput", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("profile_id", "with_task_key", name="pk_job_colocations"),
    )


def downgrade() -> None:
    for table in (
        "job_colocations",
        "job_profiles",
        "mig_times",
        "throughput_points",
        "kernel_stats",
        "kernel_profiles",
        "profiles",
    ):
        op.drop_table(table)
