"""Alembic environment. The service passes an open connection in config.attributes; run by hand,
alembic connects to GPULOOM_PROFILE_STORE_DATABASE_URL instead."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from gpuloom.services.common.database import run_migrations, run_migrations_by_hand
from gpuloom.services.profile_store.models import Base

# Serialises concurrent migrators (several store replicas starting at once) on PostgreSQL.
MIGRATION_LOCK_ID = 0x6770756C6F6F6D  # "gpuloom"


def run_with(connection: Connection) -> None:
    run_migrations(connection, Base.metadata, MIGRATION_LOCK_ID)


given = context.config.attributes.get("connection")
if given is not None:
    run_with(given)
else:
    from gpuloom.services.profile_store.settings import ProfileStoreSettings
    from gpuloom.services.profile_store.storage import create_engine

    asyncio.run(run_migrations_by_hand(create_engine(ProfileStoreSettings()), run_with))
