"""Placement's tables: the alembic migrations create exactly the modelled schema, and they can
share a database with the profile store (own tables, own version table)."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from gpuloom.services.placement.models import VERSION_TABLE, Base
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.services.placement.storage import create_engine, migrate
from gpuloom.services.profile_store import storage as profile_storage
from gpuloom.services.profile_store.settings import ProfileStoreSettings
from tests.conftest import POSTGRES_URL
from tests.placement.conftest import PostgresSchema


async def test_migrations_create_exactly_the_modelled_schema_beside_the_profile_store() -> None:
    schema = PostgresSchema()
    store = profile_storage.create_engine(
        ProfileStoreSettings(database_url=POSTGRES_URL, database_schema=schema.name)
    )
    placement = create_engine(
        PlacementSettings(database_url=POSTGRES_URL, database_schema=schema.name)
    )
    try:
        await profile_storage.migrate(store, schema.name)
        await migrate(placement, schema.name)
        await migrate(placement, schema.name)  # idempotent

        def differences(connection) -> list:  # type: ignore[no-untyped-def]
            context = MigrationContext.configure(
                connection,
                opts={
                    "compare_type": True,
                    "version_table": VERSION_TABLE,
                    "include_name": lambda name, kind, _p: (
                        kind != "table" or name.startswith("placement_")
                    ),
                },
            )
            return compare_metadata(context, Base.metadata)

        def tables(connection) -> set[str]:  # type: ignore[no-untyped-def]
            return set(inspect(connection).get_table_names())

        async with placement.connect() as conn:
            assert await conn.run_sync(differences) == []
            names = await conn.run_sync(tables)
        assert {"placement_jobs", "placement_gpus", VERSION_TABLE, "alembic_version"} <= names
        assert "profiles" in names
    finally:
        await store.dispose()
        await placement.dispose()
        await schema.drop()
