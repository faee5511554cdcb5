"""SQL engines and alembic migrations shared by the services that keep state in a database
(the profile store and placement): PostgreSQL for deployments, SQLite as the embedded default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import event, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from gpuloom.private_files import create_private_file

# Accepted URL schemes and the async driver each one is served by.
_DRIVER_FOR_SCHEME = {
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
    "postgresql+asyncpg": "postgresql+asyncpg",
    "sqlite": "sqlite+aiosqlite",
    "sqlite+aiosqlite": "sqlite+aiosqlite",
}
SCHEMA_PATTERN = r"^([a-z_][a-z0-9_]{0,62})?$"


def async_database_url(url: str) -> str:
    """The URL with its async driver; ValueError for anything but PostgreSQL or SQLite."""
    if not url:
        return url
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _DRIVER_FOR_SCHEME:
        raise ValueError("must be a postgresql://... or sqlite:///... URL")
    return f"{_DRIVER_FOR_SCHEME[scheme]}://{rest}"


def embedded_url(data_dir: Path, filename: str) -> str:
    """The embedded default: a SQLite file in the data directory, 0600 (placement's holds the
    assignment tokens; the directory stays open: the dispatchers' sockets live under it)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / filename
    create_private_file(path)
    return f"sqlite+aiosqlite:///{path.resolve()}"


def open_engine(url: str, schema: str = "") -> AsyncEngine:
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("postgresql"):
        kwargs.update(pool_size=10, max_overflow=10)
        if schema:
            kwargs["connect_args"] = {"server_settings": {"search_path": schema}}
    engine = create_async_engine(url, **kwargs)
    if url.startswith("sqlite"):
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    return engine


class DatabaseUnreachable(OSError):
    """The database cannot be reached at start-up; the message names it and its setting."""


async def ensure_reachable(engine: AsyncEngine, variable: str) -> None:
    """Connect once, so that a service that cannot reach its database says which database
    (its URL without the password) and which variable sets it, instead of a bare
    "[Errno 111] Connect call failed"."""
    try:
        async with engine.connect():
            pass
    except (OSError, DBAPIError) as error:
        url = engine.url.render_as_string(hide_password=True)
        raise DatabaseUnreachable(
            f"cannot reach the database {url} (set by {variable}): {error}"
        ) from error


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers proceed while a write is in progress; the timeout absorbs short lock waits.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def alembic_config(migrations: Path) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations))
    return config


def head_revision(migrations: Path) -> str:
    """The newest revision of the alembic migrations in `migrations`."""
    return ScriptDirectory.from_config(alembic_config(migrations)).get_current_head() or ""


async def migrate(engine: AsyncEngine, migrations: Path, schema: str = "") -> None:
    """Bring the schema to the newest alembic revision in `migrations` (idempotent, safe to
    run concurrently: each env.py takes an advisory lock on PostgreSQL)."""

    def upgrade(connection: Connection) -> None:
        if schema:
            connection.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
        config = alembic_config(migrations)
        config.attributes["connection"] = connection
        command.upgrade(config, "head")

    async with engine.begin() as connection:
        await connection.run_sync(upgrade)


def run_migrations(
    connection: Connection,
    metadata: Any,
    lock_id: int,
    version_table: str = "alembic_version",
    only_tables_starting: str = "",
) -> None:
    """The body of a migrations env.py: apply the revisions over `connection`, serialised on
    PostgreSQL by an advisory lock (several replicas may start at once). With
    `only_tables_starting`, autogenerate looks at those tables only (a shared database)."""
    from alembic import context

    def include_name(name: str | None, kind: str, _parent: object) -> bool:
        return kind != "table" or (name or "").startswith(only_tables_starting)

    context.configure(
        connection=connection,
        target_metadata=metadata,
        compare_type=True,
        version_table=version_table,
        include_name=include_name,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(text(f"SELECT pg_advisory_xact_lock({lock_id})"))
        context.run_migrations()


async def run_migrations_by_hand(engine: AsyncEngine, run: Any) -> None:
    """alembic run from the command line: connect with the service's settings and `run`."""
    async with engine.connect() as connection:
        await connection.run_sync(run)
        await connection.commit()
    await engine.dispose()
