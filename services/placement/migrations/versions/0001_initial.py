"""Initial schema: the GPU inventory and the jobs.

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


def upgrade() -> None:
    op.create_table(
        "placement_gpus",
        sa.Column("gpu_uuid", sa.String(128), nullable=False),
        sa.Column("node", sa.String(253), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sm_count", sa.Integer(), nullable=False),
        sa.Column("mig_capable", sa.Boolean(), nullable=False),
        sa.Column("mig_enabled", sa.Boolean(), nullable=False),
        sa.Column("mps_enabled", sa.Boolean(), nullable=False),
        sa.Column("mig_instances", sa.Text(), nullable=False),
        sa.Column("dispatcher_address", sa.String(300), nullable=False),
        sa.Column("registered_at", sa.Float(), nullable=False),
        sa.Column("lost", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("gpu_uuid", name="pk_placement_gpus"),
    )
    op.create_table(
        "placement_jobs",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("task_key", sa.String(256), nullable=False),
        sa.Column("function", sa.String(256), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("revision", sa.BigInteger(), nullable=False),
        sa.Column("pending_reason", sa.Text(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("policy", sa.String(64), nullable=False),
        sa.Column("submitted_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=False),
        sa.Column("gpu_uuid", sa.String(128), nullable=True),
        sa.Column("binding", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("seq", name="pk_placement_jobs"),
        sa.UniqueConstraint("job_id", name="uq_placement_jobs_job_id"),
        sa.UniqueConstraint("request_id", name="uq_placement_jobs_request_id"),
    )
    op.create_index("ix_placement_jobs_state", "placement_jobs", ["state"])
    op.create_index("ix_placement_jobs_task_key", "placement_jobs", ["task_key"])
    op.create_index("ix_placement_jobs_function", "placement_jobs", ["function"])
    op.create_index("ix_placement_jobs_gpu_uuid", "placement_jobs", ["gpu_uuid"])


def downgrade() -> None:
    op.drop_table("placement_jobs")
    op.drop_table("placement_gpus")
