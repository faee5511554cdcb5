"""Alembic environment. The service passes an open connection in config.attributes; run by hand,
alembic connects to GPULOOM_PROFILE_STORE_DATABASE_URL instead."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from gpuloom.services.profile_store.models import Base

# Serialises concurrent migrators (several store replicas starting at once) on PostgreSQL.
MIGRATION_LOCK_ID = 0x6770756C6F6F6D  # "gpuloom"


def run_with(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata, compare_type=True)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(text(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_ID})"))
        context.run_migrations()


async def run_from_settings() -> None:
    from gpuloom.services.profile_store.settings import ProfileStoreSettings
    from gpuloom.services.profile_store.storage import create_engine

    engine = create_engine(ProfileStoreSettings())
    async with engine.connect() as connection:
        await connection.run_sync(run_with)
        await connection.commit()
    await engine.dispose()


given = context.config.attributes.get("connection")
if given is not None:
    run_with(given)
else:
    asyncio.run(run_from_settings())
