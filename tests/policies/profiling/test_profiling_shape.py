"""The SMs a launch shape asks for (gpuloom/policies/profiling/shape.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuloom.domain.gpus import MODELS
from gpuloom.domain.profiles import Dim3
from gpuloom.policies.profiling.shape import blocks_per_sm, sm_usage

H100 = MODELS["H100-80GB"]
T4 = MODELS["T4-16GB"]
L4 = MODELS["L4-24GB"]

models = st.sampled_from(list(MODELS.values()))
grids = st.builds(Dim3, st.integers(1, 2**31 - 1), st.integers(1, 65_535), st.integers(1, 65_535))


@st.composite
def launchable_blocks(draw: st.DrawFn) -> Dim3:
    """Every block that can launch: at most 1024 threads in all, z at most 64."""
    x = draw(st.integers(1, 1024))
    y = draw(st.integers(1, 1024 // x))
    return Dim3(x, y, draw(st.integers(1, min(64, 1024 // (x * y)))))


blocks = launchable_blocks()


@pytest.mark.parametrize(
    ("model", "block", "resident"),
    [
        (H100, Dim3(256), 8),  # 64 warps per SM / 8 warps per block
        (H100, Dim3(1024), 2),
        (H100, Dim3(32), 32),  # 64 warps would fit, 32 block slots do not
        (H100, Dim3(48), 32),  # 48 threads take 2 whole warps: 32 by warps, 32 slots
        (H100, Dim3(16, 16, 2), 4),  # 512 threads: 16 warps
        (T4, Dim3(1024), 1),  # 1024 threads per SM
        (T4, Dim3(32), 16),  # 16 block slots
        (L4, Dim3(256), 6),  # 48 warps per SM / 8
        (L4, Dim3(96), 16),  # 48 / 3
    ],
)
def test_blocks_per_sm_from_threads_and_block_slots(model, block, resident) -> None:
    assert blocks_per_sm(block, model) == resident


def test_sm_usage_divides_the_grid_by_what_one_sm_holds_and_caps_at_the_sms() -> None:
    assert sm_usage(Dim3(8), Dim3(256), H100) == 1
    assert sm_usage(Dim3(9), Dim3(256), H100) == 2
    assert sm_usage(Dim3(4, 4, 2), Dim3(128), H100) == 2  # 32 blocks, 16 per SM
    assert sm_usage(Dim3(132 * 8), Dim3(256), H100) == 132
    assert sm_usage(Dim3(132 * 8 + 1), Dim3(256), H100) == 132  # a second wave: every SM
    assert sm_usage(Dim3(41), Dim3(1024), T4) == 40


def test_a_graphs_entry_has_no_shape_and_unknown_usage() -> None:
    assert sm_usage(Dim3(0, 0, 0), Dim3(0, 0, 0), H100) == 0


@pytest.mark.parametrize(
    ("grid", "block", "problem"),
    [
        (Dim3(0), Dim3(256), "grid 0x1x1"),
        (Dim3(4), Dim3(256, 0, 1), "block 256x0x1"),
        (Dim3(4), Dim3(0, 0, 0), "block 0x0x0"),  # half a graph's shape is no shape
        (Dim3(4), Dim3(1024, 2), "2048 threads, at most 1024"),
    ],
)
def test_a_shape_that_cannot_launch_is_refused(grid, block, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        sm_usage(grid, block, H100)


@given(models, grids, blocks)
def test_within_one_and_the_sm_count(model, grid, block) -> None:
    assert 1 <= sm_usage(grid, block, model) <= model.sm_count


@given(models, grids, blocks, st.integers(1, 10_000))
def test_more_blocks_never_ask_for_fewer_sms(model, grid, block, more) -> None:
    bigger = Dim3(min(grid.x + more, 2**31 - 1), grid.y, grid.z)
    assert sm_usage(bigger, block, model) >= sm_usage(grid, block, model)


@given(models, grids, blocks, st.integers(1, 1024))
def test_bigger_blocks_never_ask_for_fewer_sms(model, grid, block, more) -> None:
    threads = block.x * block.y * block.z
    wider = Dim3(block.x * (threads + more) // threads, block.y, block.z)
    if wider.x * wider.y * wider.z <= 1024:
        assert blocks_per_sm(wider, model) <= blocks_per_sm(block, model)
        assert sm_usage(grid, wider, model) >= sm_usage(grid, block, model)


@given(models, blocks)
def test_a_full_wave_takes_every_sm_and_one_sms_worth_less_one_sm_fewer(model, block) -> None:
    wave = model.sm_count * blocks_per_sm(block, model)
    assert sm_usage(Dim3(wave), block, model) == model.sm_count
    assert sm_usage(Dim3(wave - blocks_per_sm(block, model)), block, model) == model.sm_count - 1
