"""State files that hold secrets (assignment tokens): readable by the service's user only.

Files are 0600 in 0700 directories whatever the umask, and are replaced by an atomic rename so
that a crash leaves the old or the new content, never half of one.
"""

from __future__ import annotations

import os
from pathlib import Path

FILE_MODE = 0o600
DIRECTORY_MODE = 0o700


def private_directory(path: Path) -> Path:
    """Create `path` (and its parents) if missing and make it 0700; an existing directory
    left open by an older version is closed too."""
    path.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
    os.chmod(path, DIRECTORY_MODE)
    return path


def make_private(path: Path) -> None:
    """Narrow an existing file to 0600 (one written by an older version)."""
    os.chmod(path, FILE_MODE)


def write_private(path: Path, content: str) -> None:
    """Write `content` to `path` atomically, 0600, flushed to disk before the rename."""
    temporary = path.with_name(path.name + ".tmp")
    # O_NOFOLLOW: a link planted in place of the temporary file is refused, not followed.
    descriptor = os.open(
        temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE
    )
    with os.fdopen(descriptor, "w") as file:
        os.fchmod(file.fileno(), FILE_MODE)  # the umask, or a leftover temporary, may differ
        file.write(content)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def create_private_file(path: Path) -> None:
    """Create `path` empty and 0600 if it does not exist (SQLite then keeps its mode, and gives
    it to its -wal and -shm files); make an existing one 0600."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
    os.close(descriptor)
    make_private(path)
