"""Jobs remember who submitted them (the name of the submitter's bearer token).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("placement_jobs") as batch:
        batch.add_column(sa.Column("owner", sa.String(128), nullable=False, server_default=""))
    op.create_index("ix_placement_jobs_owner", "placement_jobs", ["owner"])


def downgrade() -> None:
    op.drop_index("ix_placement_jobs_owner", "placement_jobs")
    with op.batch_alter_table("placement_jobs") as batch:
        batch.drop_column("owner")
