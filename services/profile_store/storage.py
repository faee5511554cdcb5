"""Database engine set-up and schema migration for the profile store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from gpuloom.services.profile_store.settings import ProfileStoreSettings

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def database_url(settings: ProfileStoreSettings, data_dir: Path) -> str:
    if settings.database_url:
        return settings.database_url
    data_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite+aiosqlite:///{(data_dir / 'profiles.db').resolve()}"


def create_engine(settings: ProfileStoreSettings, data_dir: Path = Path(".gpuloom")) -> AsyncEngine:
    url = database_url(settings, data_dir)
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("postgresql") and settings.database_schema:
        kwargs["connect_args"] = {"server_settings": {"search_path": settings.database_schema}}
    if url.startswith("postgresql"):
        kwargs.update(pool_size=10, max_overflow=10)
    engine = create_async_engine(url, **kwargs)
    if url.startswith("sqlite"):
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers proceed while a write is in progress; the timeout absorbs short lock waits.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def _upgrade(connection: Connection, schema: str) -> None:
    if schema:
        connection.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    config = alembic_config()
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


async def migrate(engine: AsyncEngine, schema: str = "") -> None:
    """Bring the schema to the newest alembic revision (idempotent, safe to run concurrently)."""
    async with engine.begin() as connection:
        await connection.run_sync(_upgrade, schema)
