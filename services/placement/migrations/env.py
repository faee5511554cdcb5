"""Alembic environment of the placement service. The service passes an open connection in
config.attributes; run by hand, alembic connects to GPULOOM_PLACEMENT_DATABASE_URL instead."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from gpuloom.services.placement.models import VERSION_TABLE, Base

# Serialises concurrent migrators on PostgreSQL (distinct from the profile store's lock).
MIGRATION_LOCK_ID = 0x67706C6163656D  # "gplacem"


def run_with(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        compare_type=True,
        version_table=VERSION_TABLE,
        # Only our tables: placement may share a database with the profile store.
        include_name=lambda name, kind, _parent: kind != "table" or name.startswith("placement_"),
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(text(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_ID})"))
        context.run_migrations()


async def run_from_settings() -> None:
    from gpuloom.services.placement.settings import PlacementSettings
    from gpuloom.services.placement.storage import create_engine

    engine = create_engine(PlacementSettings())
    async with engine.connect() as connection:
        await connection.run_sync(run_with)
        await connection.commit()
    await engine.dispose()


given = context.config.attributes.get("connection")
if given is not None:
    run_with(given)
else:
    asyncio.run(run_from_settings())
