"""`gpuloom migrate`: the one-shot job of compose and Kubernetes brings both databases to their
newest revision with the services' own settings, idempotently, and fails in one line."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from gpuloom.services.common.database import head_revision
from gpuloom.services.placement.storage import MIGRATIONS as PLACEMENT_MIGRATIONS
from gpuloom.services.profile_store.storage import MIGRATIONS as STORE_MIGRATIONS
from tests.conftest import POSTGRES_URL, free_port

GPULOOM = str(Path(sys.executable).parent / "gpuloom")
pytestmark = pytest.mark.postgres


def migrate(tmp_path: Path, *args: str, **variables: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOOM_")}
    env.update(GPULOOM_DATA_DIR=str(tmp_path), GPULOOM_LOG_LEVEL="warning", **variables)
    return subprocess.run(
        [GPULOOM, "migrate", *args], env=env, capture_output=True, text=True, timeout=120
    )


async def tables(schema: str) -> set[str]:
    engine = create_async_engine(POSTGRES_URL)
    try:
        async with engine.connect() as connection:
            rows = await connection.execute(
                text("SELECT table_name FROM information_schema.tables WHERE table_schema = :s"),
                {"s": schema},
            )
            return {row[0] for row in rows}
    finally:
        await engine.dispose()


async def drop(*schemas: str) -> None:
    engine = create_async_engine(POSTGRES_URL)
    try:
        async with engine.begin() as connection:
            for schema in schemas:
                await connection.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    finally:
        await engine.dispose()


async def test_migrates_both_databases_then_again_changes_nothing(tmp_path: Path) -> None:
    store, placement = (f"gpuloom_test_{uuid.uuid4().hex[:12]}" for _ in range(2))
    settings = {
        "GPULOOM_PROFILE_STORE_DATABASE_URL": POSTGRES_URL,
        "GPULOOM_PROFILE_STORE_DATABASE_SCHEMA": store,
        "GPULOOM_PLACEMENT_DATABASE_URL": POSTGRES_URL,
        "GPULOOM_PLACEMENT_DATABASE_SCHEMA": placement,
    }
    try:
        first = await asyncio.to_thread(migrate, tmp_path, **settings)
        assert first.returncode == 0, first.stderr
        lines = first.stdout.splitlines()
        assert len(lines) == 2
        assert lines[0].startswith("profile-store: postgresql+asyncpg://")
        assert lines[0].endswith(f"at revision {head_revision(STORE_MIGRATIONS)}")
        assert lines[1].startswith("placement: postgresql+asyncpg://")
        assert lines[1].endswith(f"at revision {head_revision(PLACEMENT_MIGRATIONS)}")
        store_tables, placement_tables = await tables(store), await tables(placement)
        assert {"profiles", "kernel_profiles", "alembic_version"} <= store_tables
        assert any(t.startswith("placement_") for t in placement_tables)
        assert not any(t.startswith("placement_") for t in store_tables)

        again = await asyncio.to_thread(migrate, tmp_path, **settings)
        assert again.returncode == 0, again.stderr
        assert again.stdout == first.stdout
        assert await tables(store) == store_tables
        assert await tables(placement) == placement_tables
    finally:
        await drop(store, placement)


async def test_one_service_only(tmp_path: Path) -> None:
    schema = f"gpuloom_test_{uuid.uuid4().hex[:12]}"
    try:
        result = await asyncio.to_thread(
            migrate,
            tmp_path,
            "placement",
            GPULOOM_PLACEMENT_DATABASE_URL=POSTGRES_URL,
            GPULOOM_PLACEMENT_DATABASE_SCHEMA=schema,
        )
        assert result.returncode == 0, result.stderr
        assert [line.split(":")[0] for line in result.stdout.splitlines()] == ["placement"]
        assert not (tmp_path / "profiles.db").exists()  # the store's embedded default untouched
    finally:
        await drop(schema)


def test_an_unreachable_database_is_one_line_naming_it_and_its_variable(tmp_path: Path) -> None:
    url = f"postgresql://gpuloom:s3cret-pw@127.0.0.1:{free_port()}/gpuloom"
    result = migrate(tmp_path, "placement", GPULOOM_PLACEMENT_DATABASE_URL=url)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    assert line.startswith("Error: cannot migrate: cannot reach the database")
    assert "GPULOOM_PLACEMENT_DATABASE_URL" in line and "s3cret-pw" not in line
    assert result.stdout == ""


def test_bad_settings_and_bad_arguments(tmp_path: Path) -> None:
    bad = migrate(tmp_path, GPULOOM_PROFILE_STORE_DATABASE_URL="mysql://x@y/z")
    assert bad.returncode == 1
    assert "GPULOOM_PROFILE_STORE_DATABASE_URL" in bad.stderr and "Traceback" not in bad.stderr
    usage = migrate(tmp_path, "dispatcher")
    assert usage.returncode == 2
    assert "'dispatcher' is not one of 'profile-store', 'placement'" in usage.stderr
