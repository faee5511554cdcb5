"""Alembic environment of the placement service. The service passes an open connection in
config.attributes; run by hand, alembic connects to GPULOOM_PLACEMENT_DATABASE_URL instead."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from gpuloom.services.common.database import run_migrations, run_migrations_by_hand
from gpuloom.services.placement.models import VERSION_TABLE, Base

# Serialises concurrent migrators on PostgreSQL (distinct from the profile store's lock).
MIGRATION_LOCK_ID = 0x67706C6163656D  # "gplacem"


def run_with(connection: Connection) -> None:
    # Only our tables: placement may share a database with the profile store.
    run_migrations(connection, Base.metadata, MIGRATION_LOCK_ID, VERSION_TABLE, "placement_")


given = context.config.attributes.get("connection")
if given is not None:
    run_with(given)
else:
    from gpuloom.services.placement.settings import PlacementSettings
    from gpuloom.services.placement.storage import create_engine

    asyncio.run(run_migrations_by_hand(create_engine(PlacementSettings()), run_with))
