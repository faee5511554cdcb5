"""A service whose PostgreSQL cannot be reached at start-up says which database (without its
password) and which variable sets it; it used to say only "[Errno 111] Connect call failed"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuloom.services.placement.app import PlacementApp
from gpuloom.services.placement.settings import PlacementSettings
from gpuloom.services.profile_store.app import ProfileStoreApp
from gpuloom.services.profile_store.settings import ProfileStoreSettings
from tests.conftest import free_port

GPULOOM = str(Path(sys.executable).parent / "gpuloom")


def _closed_port_url() -> str:
    return f"postgresql://gpuloom:s3cret-pw@127.0.0.1:{free_port()}/gpuloom"


def _names_the_database(message: str, variable: str) -> None:
    assert variable in message, message
    assert "gpuloom:***@127.0.0.1:" in message and "/gpuloom" in message, message
    assert "s3cret-pw" not in message, message
    assert "Connect call failed" in message or "refused" in message.lower(), message


async def test_placement_names_its_unreachable_database(tmp_path: Path) -> None:
    settings = PlacementSettings(port=0, database_url=_closed_port_url())
    with pytest.raises(OSError) as raised:
        await PlacementApp.start(settings, "127.0.0.1", tmp_path)
    _names_the_database(str(raised.value), "GPULOOM_PLACEMENT_DATABASE_URL")


async def test_the_profile_store_names_its_unreachable_database(tmp_path: Path) -> None:
    settings = ProfileStoreSettings(port=0, database_url=_closed_port_url())
    with pytest.raises(OSError) as raised:
        await ProfileStoreApp.start(settings, "127.0.0.1", tmp_path)
    _names_the_database(str(raised.value), "GPULOOM_PROFILE_STORE_DATABASE_URL")


def test_gpuloom_serve_says_it_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOOM_")}
    env.update(
        GPULOOM_DATA_DIR=str(tmp_path),
        GPULOOM_METRICS_PORT="0",
        GPULOOM_PLACEMENT_PORT="0",
        GPULOOM_PLACEMENT_DATABASE_URL=_closed_port_url(),
        GPULOOM_INSECURE="true",  # past the credentials check, to the database
    )
    result = subprocess.run(
        [GPULOOM, "serve", "placement"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("Error: cannot start:")]
    _names_the_database(line, "GPULOOM_PLACEMENT_DATABASE_URL")
