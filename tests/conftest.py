"""Shared fixtures: the real PostgreSQL and Redis the tests run against.

Both default to the local servers (127.0.0.1:5432 database `test` user `postgres`, and
127.0.0.1:6379) and can be pointed elsewhere with GPULOOM_TEST_POSTGRES_URL and
GPULOOM_TEST_REDIS_URL. If either is unreachable, the tests that need it FAIL with a message
saying how to start it; they never skip.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis.asyncio as aioredis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from gpuloom.services.profile_store.settings import ProfileStoreSettings
from gpuloom.services.profile_store.storage import create_engine, migrate

POSTGRES_URL = os.environ.get(
    "GPULOOM_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("GPULOOM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"

START_POSTGRES = (
    "start it with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` "
    "(or `docker run -p 5432:5432 -e POSTGRES_HOST_AUTH_METHOD=trust -e POSTGRES_DB=test "
    "postgres:16`), or point GPULOOM_TEST_POSTGRES_URL at a server"
)
START_REDIS = (
    "start it with `redis-server --daemonize yes --port 6379 --save ''` (or `docker run "
    "-p 6379:6379 redis:7`), or point GPULOOM_TEST_REDIS_URL at a server"
)


# `gpuloom up` makes its credentials (docs/security.md) in $XDG_CONFIG_HOME/gpuloom unless told
# otherwise, and every client reads them from there: the tests' planes and clients share a
# directory of this session's own, never the user's ~/.config.
CONFIG_HOME = tempfile.mkdtemp(prefix="gpuloom-test-config-")
os.environ["XDG_CONFIG_HOME"] = CONFIG_HOME
os.environ.pop("GPULOOM_CREDENTIALS_DIR", None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(CONFIG_HOME, ignore_errors=True)


def admin_token() -> str:
    """The admin token of this session's credentials directory (made by the first `gpuloom
    up` of the session)."""
    return (Path(CONFIG_HOME) / "gpuloom" / "admin.token").read_text().strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="gl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgres"])
async def engine(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    """A migrated, empty database: SQLite in a temp dir, or a fresh schema on real PostgreSQL."""
    if request.param == "sqlite":
        settings = ProfileStoreSettings(database_url=f"sqlite:///{tmp_path / 'profiles.db'}")
        eng = create_engine(settings)
        await migrate(eng)
        yield eng
        await eng.dispose()
    else:
        async with postgres_schema() as (eng, _schema):
            yield eng


@pytest.fixture
async def pg_engine() -> AsyncIterator[AsyncEngine]:
    async with postgres_schema() as (eng, _schema):
        yield eng


class postgres_schema:
    """Create a uniquely named schema, migrate it, and drop it afterwards."""

    def __init__(self) -> None:
        self.schema = f"gpuloom_test_{uuid.uuid4().hex[:12]}"

    async def __aenter__(self) -> tuple[AsyncEngine, str]:
        admin = create_async_engine(POSTGRES_URL)
        try:
            async with admin.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except (OSError, Exception) as error:
            await admin.dispose()
            pytest.fail(
                f"PostgreSQL is not reachable at {POSTGRES_URL} ({error}); {START_POSTGRES}"
            )
        await admin.dispose()
        settings = ProfileStoreSettings(database_url=POSTGRES_URL, database_schema=self.schema)
        self.engine = create_engine(settings)
        await migrate(self.engine, self.schema)
        return self.engine, self.schema

    async def __aexit__(self, *exc: object) -> None:
        await self.engine.dispose()
        admin = create_async_engine(POSTGRES_URL)
        async with admin.begin() as conn:
            await conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        await admin.dispose()


@pytest.fixture
async def redis_url() -> AsyncIterator[str]:
    client = aioredis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        await client.ping()
    except Exception as error:
        pytest.fail(f"Redis is not reachable at {REDIS_URL} ({error}); {START_REDIS}")
    finally:
        await client.aclose()
    yield REDIS_URL


@pytest.fixture
def cache_prefix() -> str:
    """A key prefix of its own for each test, so tests never see each other's entries."""
    return f"gpuloom-test:{uuid.uuid4().hex[:12]}:"


class TcpProxy:
    """A TCP forwarder in front of a real server that a test can stop and start again, to see
    what happens when the server goes away and comes back (without touching the real server)."""

    def __init__(self, target_host: str, target_port: int, path: str = "/0") -> None:
        self.target = (target_host, target_port)
        self.path = path
        self.port = free_port()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}{self.path}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers.update({writer, up_writer})

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()
                self._writers.discard(dst)

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


@pytest.fixture
async def redis_proxy(redis_url: str) -> AsyncIterator[TcpProxy]:
    parsed = urlparse(redis_url)
    proxy = TcpProxy(parsed.hostname or "127.0.0.1", parsed.port or 6379, parsed.path or "/0")
    await proxy.start()
    yield proxy
    if proxy._server is not None:
        await proxy.stop()
