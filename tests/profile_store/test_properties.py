"""Property tests: whatever valid profile goes in comes back unchanged, through every layer."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.convert import profiles as convert
from gpuloom.domain import profiles as d
from gpuloom.domain.validation import MAX_SM_USAGE, validate_profile
from gpuloom.services.profile_store.cache import InProcessCache
from gpuloom.services.profile_store.core import ProfileStore
from gpuloom.services.profile_store.models import Base
from gpuloom.services.profile_store.repository import ProfileRepository
from gpuloom.services.profile_store.settings import ProfileStoreSettings
from gpuloom.services.profile_store.storage import create_engine

names = st.text(
    alphabet=st.characters(
        min_codepoint=33, max_codepoint=0x2FFF, exclude_categories=("Cc", "Cs", "Zs", "Zl", "Zp")
    ),
    min_size=1,
    max_size=40,
)
non_negative = st.floats(min_value=0, max_value=1e12, allow_nan=False)
positive = st.floats(min_value=1e-9, max_value=1e9, allow_nan=False)
dims = st.builds(d.Dim3, st.integers(1, 2**31 - 1), st.integers(1, 65_535), st.integers(1, 65_535))
blocks = st.builds(d.Dim3, st.integers(1, 1024), st.integers(1, 1024), st.integers(1, 64))


@st.composite
def kernel_stats(draw: st.DrawFn, kernel_id: int) -> d.KernelStats:
    p50, p95 = sorted((draw(non_negative), draw(non_negative)))
    return d.KernelStats(
        kernel_id, draw(names), draw(dims), draw(blocks), draw(st.integers(1, 10**9)),
        draw(non_negative), p50, p95, draw(non_negative),
        draw(st.integers(0, MAX_SM_USAGE)), draw(st.sampled_from(d.KernelBound)),
    )  # fmt: skip


@st.composite
def kernel_profiles(draw: st.DrawFn) -> d.KernelProfile:
    ids = draw(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=8, unique=True))
    return d.KernelProfile(
        draw(names), draw(names), draw(st.integers(1, 1000)),
        tuple(draw(kernel_stats(i)) for i in ids),
    )  # fmt: skip


@st.composite
def throughput_profiles(draw: st.DrawFn) -> d.ThroughputProfile:
    cells = draw(
        st.lists(
            st.tuples(st.integers(1, 100), st.floats(0.5, 100)), min_size=1, max_size=8, unique=True
        )
    )
    points = []
    for sm, quota in cells:
        p50, p99 = sorted((draw(non_negative), draw(non_negative)))
        points.append(d.ThroughputPoint(sm, quota, draw(non_negative), p50, p99))
    return d.ThroughputProfile(draw(names), draw(names), tuple(points))


mig_profiles = st.builds(
    d.MigProfile,
    key=names,
    gpu_model=names,
    times=st.lists(st.sampled_from([1, 2, 3, 4, 7]), min_size=1, max_size=5, unique=True).flatmap(
        lambda sizes: st.tuples(*(st.builds(d.MigTime, st.just(s), positive) for s in sizes))
    ),
)
job_profiles = st.builds(
    d.JobProfile,
    key=names,
    gpu_model=names,
    minibatch_time_s=positive,
    peak_memory_bytes=st.integers(0, 2**63 - 1),
    gpu_utilization_percent=st.floats(0, 100),
    solo_throughput=non_negative,
    colocated=st.lists(names, max_size=4, unique=True).flatmap(
        lambda keys: st.tuples(
            *(st.builds(d.ColocatedThroughput, st.just(k), non_negative) for k in keys)
        )
    ),
)
profiles = st.one_of(kernel_profiles(), throughput_profiles(), mig_profiles, job_profiles)


@given(profiles)
def test_generated_profiles_are_valid(profile: d.Profile) -> None:
    validate_profile(profile)


@given(profiles, st.integers(1, 2**63 - 1))
def test_protobuf_codec_round_trips(profile: d.Profile, version: int) -> None:
    moment = datetime(2026, 11, 21, 5, 1, 2, 345678, tzinfo=UTC)
    stamped = replace(profile, version=version, updated_at=moment)
    codec = convert.ProtobufCodec()
    assert codec.decode(profile.KIND, codec.encode(stamped)) == stamped


@settings(max_examples=30, deadline=None)
@given(st.lists(profiles, min_size=1, max_size=4))
async def test_store_returns_what_was_put_on_sqlite(tmp_path_factory, batch) -> None:
    folder = tmp_path_factory.mktemp("db")
    engine = create_engine(ProfileStoreSettings(database_url=f"sqlite:///{folder / 'p.db'}"))
    # The schema itself is checked against the migrations elsewhere; create_all is faster here.
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    store = ProfileStore(
        ProfileRepository(engine), InProcessCache(100, 60), convert.ProtobufCodec()
    )
    try:
        latest = {}
        for profile in batch:
            latest[d.profile_id(profile)] = await store.put(profile)
        for pid, stored in latest.items():
            assert await store.get(pid) == stored  # through the cache
            assert await ProfileRepository(engine).get(pid) == stored  # straight from the database
    finally:
        await engine.dispose()
