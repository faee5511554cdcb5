"""Database engine set-up and schema migration for the placement service."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncEngine

from gpuloom.services.common import database
from gpuloom.services.placement.settings import PlacementSettings

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def create_engine(settings: PlacementSettings, data_dir: Path = Path(".gpuloom")) -> AsyncEngine:
    url = settings.database_url or database.embedded_url(data_dir, "placement.db")
    return database.open_engine(url, settings.database_schema)


async def migrate(engine: AsyncEngine, schema: str = "") -> None:
    """Bring the schema to the newest alembic revision (idempotent, safe to run concurrently)."""
    await database.migrate(engine, MIGRATIONS, schema)
