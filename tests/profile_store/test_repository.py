"""The repository against real databases: SQLite (embedded default) and PostgreSQL."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.ext.asyncio import AsyncEngine

from gpuloom.domain import profiles as d
from gpuloom.domain.errors import Aborted, InvalidArgument, NotFound
from gpuloom.services.common import database
from gpuloom.services.profile_store.models import Base
from gpuloom.services.profile_store.repository import ProfileRepository
from gpuloom.services.profile_store.storage import MIGRATIONS
from tests.profile_store import samples


def _content(profile: d.Profile) -> d.Profile:
    return replace(profile, version=0, updated_at=None)


@pytest.mark.parametrize("make", samples.ALL_KINDS)
async def test_put_then_get_returns_the_same_profile(engine: AsyncEngine, make) -> None:
    repo = ProfileRepository(engine)
    profile = make()
    stored = await repo.put(profile, None)
    assert stored.version == 1 and stored.updated_at is not None
    fetched = await repo.get(d.profile_id(profile))
    assert fetched == stored
    assert _content(fetched) == profile


async def test_versions_increase_and_replace_the_content(engine: AsyncEngine) -> None:
    repo = ProfileRepository(engine)
    first = await repo.put(samples.kernel_profile(n=5), None)
    second = await repo.put(samples.kernel_profile(n=2), None)
    assert (first.version, second.version) == (1, 2)
    fetched = await repo.get(d.profile_id(second))
    assert len(fetched.kernels) == 2 and fetched.version == 2


async def test_expected_version_guards_every_write(engine: AsyncEngine) -> None:
    repo = ProfileRepository(engine)
    profile = samples.mig_profile()
    pid = d.profile_id(profile)
    with pytest.raises(Aborted, match="expected 3"):
        await repo.put(profile, 3)
    assert (await repo.lookup(pid)).version == 0  # nothing written
    assert (await repo.put(profile, 0)).version == 1
    with pytest.raises(Aborted, match="version 1"):
        await repo.put(profile, 0)
    assert (await repo.put(profile, 1)).version == 2
    with pytest.raises(Aborted):
        await repo.delete(pid, 1)
    assert (await repo.get(pid)).version == 2


async def test_delete_hides_the_profile_and_versions_keep_rising(engine: AsyncEngine) -> None:
    repo = ProfileRepository(engine)
    profile = samples.job_profile()
    pid = d.profile_id(profile)
    await repo.put(profile, None)
    assert await repo.delete(pid, None) == 2
    with pytest.raises(NotFound):
        await repo.get(pid)
    with pytest.raises(NotFound):
        await repo.delete(pid, None)
    assert (await repo.list(d.ProfileFilter(), 0, "")).summaries == ()
    # Re-creating counts as "did not exist" for expected_version, but the version goes on.
    recreated = await repo.put(profile, 0)
    assert recreated.version == 3


async def test_list_filters_and_pages_through_everything_once(engine: AsyncEngine) -> None:
    repo = ProfileRepository(engine)
    made = []
    for i in range(7):
        made.append(await repo.put(samples.kernel_profile(key=f"task-{i}"), None))
        made.append(await repo.put(samples.mig_profile(key=f"task-{i}", gpu_model="A30"), None))
    seen: list[d.ProfileId] = []
    token = ""
    pages = 0
    while True:
        page = await repo.list(d.ProfileFilter(), 3, token)
        pages += 1
        seen.extend(s.id for s in page.summaries)
        token = page.next_page_token
        if not token:
            break
    assert sorted(seen, key=str) == sorted((d.profile_id(p) for p in made), key=str)
    assert len(seen) == len(set(seen)) == 14 and pages == 5
    only_mig = await repo.list(d.ProfileFilter(kind=d.ProfileKind.MIG), 100, "")
    assert {s.id.kind for s in only_mig.summaries} == {d.ProfileKind.MIG}
    assert len(only_mig.summaries) == 7
    one = await repo.list(d.ProfileFilter(key="task-3", gpu_model="A30"), 100, "")
    assert [(s.id.key, s.id.gpu_model, s.entries) for s in one.summaries] == [("task-3", "A30", 4)]


@pytest.mark.parametrize("token", ["garbage!", "W10=", "WzEsMiwzXQ=="])
async def test_a_forged_page_token_is_refused(engine: AsyncEngine, token: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        await ProfileRepository(engine).list(d.ProfileFilter(), 10, token)
    assert refused.value.field == "page_token"


async def test_concurrent_conditional_writes_let_exactly_one_win(engine: AsyncEngine) -> None:
    repo = ProfileRepository(engine)
    base = await repo.put(samples.throughput_profile(), None)
    attempts = [repo.put(samples.throughput_profile(), base.version) for _ in range(6)]
    results = await asyncio.gather(*attempts, return_exceptions=True)
    winners = [r for r in results if isinstance(r, d.ThroughputProfile)]
    assert len(winners) == 1 and winners[0].version == base.version + 1
    assert all(isinstance(r, Aborted) for r in results if r not in winners)
    assert (await repo.get(d.profile_id(base))).version == base.version + 1


async def test_migrations_create_exactly_the_modelled_schema(engine: AsyncEngine) -> None:
    def differences(connection) -> list:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        return compare_metadata(context, Base.metadata)

    async with engine.connect() as conn:
        diff = await conn.run_sync(differences)
    assert diff == []


def _migrate_to(revision: str, direction: str):
    def run(connection) -> None:
        config = database.alembic_config(MIGRATIONS)
        config.attributes["connection"] = connection
        getattr(command, direction)(config, revision)

    return run


async def test_kernel_rows_from_before_0004_read_as_unknown_shape(engine: AsyncEngine) -> None:
    """Migration 0004 adds sm_usage and bound; rows written before it read as 0 and unknown,
    and going back down drops the two columns and nothing else."""
    repo = ProfileRepository(engine)
    profile = samples.kernel_profile()
    assert {k.sm_usage for k in profile.kernels} != {0}  # the columns hold something to lose
    await repo.put(profile, None)
    async with engine.begin() as conn:
        await conn.run_sync(_migrate_to("0003", "downgrade"))
    async with engine.begin() as conn:
        await conn.run_sync(_migrate_to("head", "upgrade"))
    fetched = await repo.get(d.profile_id(profile))
    unknown = tuple(replace(k, sm_usage=0, bound=d.KernelBound.UNKNOWN) for k in profile.kernels)
    assert _content(fetched) == replace(profile, kernels=unknown)
