"""State files holding secrets are the service user's alone."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpuloom.services.common.database import embedded_url


def test_the_embedded_database_file_is_private(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        url = embedded_url(tmp_path, "placement.db")
    finally:
        os.umask(previous)
    path = tmp_path / "placement.db"
    assert url.endswith(str(path.resolve()))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
