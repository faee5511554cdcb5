import itertools

import pytest

from gpuloom.domain.mig_geometry import (
    A30,
    A100,
    B200,
    GEOMETRIES,
    H100,
    MigGeometry,
    Placement,
    UnknownGpuError,
    get_geometry,
)


def tree_cuts(gpu: MigGeometry, node: int = 0) -> list[frozenset[Placement]]:
    """The instance sets reached by splitting tree nodes from the root down."""
    here = [frozenset({gpu.tree[node].placement})]
    children = gpu.tree[node].children
    if not children:
        return here
    below = itertools.product(*(tree_cuts(gpu, child) for child in children))
    return here + [frozenset().union(*parts) for parts in below]


@pytest.mark.parametrize(("gpu", "count"), [(A30, 5), (A100, 19), (H100, 19), (B200, 19)])
def test_valid_partition_counts_match_nvidia(gpu: MigGeometry, count: int) -> None:
    assert len(gpu.partitions) == count
    assert len(set(gpu.partitions)) == count


@pytest.mark.parametrize("gpu", [A30, A100, H100])
def test_partitions_are_disjoint_legal_and_cover_every_slice(gpu: MigGeometry) -> None:
    for partition in gpu.partitions:
        assert all(p in gpu.placements for p in partition)
        covered = [s for p in partition for s in p.slices]
        assert sorted(covered) == list(range(gpu.slice_count))


@pytest.mark.parametrize("gpu", [A30, A100, H100])
def test_repartitioning_tree_reaches_exactly_the_valid_partitions(gpu: MigGeometry) -> None:
    # Section 3.2 of the paper: nodes from different branches combine into valid partitions.
    assert set(tree_cuts(gpu)) == {frozenset(p) for p in gpu.partitions}


@pytest.mark.parametrize("gpu", [A30, A100, H100])
def test_tree_children_split_their_parent(gpu: MigGeometry) -> None:
    for number, node in enumerate(gpu.tree):
        for child in node.children:
            assert gpu.tree[child].parent == number
            assert child > number  # breadth-first: parents come first
            assert set(gpu.tree[child].placement.slices) <= set(node.placement.slices)


def test_seven_slice_tree_runs_three_slice_tasks_on_the_first_half_before_splitting() -> None:
    four = next(n for n in A100.tree if n.placement == A100.placement(4, 0))
    assert [A100.tree[c].placement for c in four.children] == [A100.placement(3, 0)]


def test_three_slices_at_slice_0_block_slice_3() -> None:
    # No valid partition puts an instance on S3 next to 3g@0.
    three = A100.placement(3, 0)
    assert list(three.slices) == [0, 1, 2, 3]
    assert three.overlaps(A100.placement(1, 3))
    assert not A100.placement(3, 4).overlaps(three)


def test_sizes() -> None:
    assert A30.sizes == (1, 2, 4)
    assert A100.sizes == H100.sizes == (1, 2, 3, 4, 7)


def test_reconfiguration_times_come_from_table_1_and_can_be_overridden() -> None:
    assert (A100.create_s(7), A100.destroy_s(7)) == (0.24, 0.22)
    assert (H100.create_s(4), H100.destroy_s(4)) == (0.38, 0.26)
    assert (A30.create_s(1), A30.destroy_s(1)) == (0.11, 0.10)
    faster = A100.with_reconfig_times(create_s={7: 0.05})
    assert faster.create_s(7) == 0.05
    assert faster.create_s(1) == A100.create_s(1)
    assert A100.create_s(7) == 0.24  # the original is untouched
    with pytest.raises(ValueError, match="no instance size 5"):
        A100.with_reconfig_times(create_s={5: 0.1})
    with pytest.raises(ValueError, match=">= 0"):
        A100.with_reconfig_times(destroy_s={1: -0.1})


def test_lookup_by_name() -> None:
    assert get_geometry("a100") is A100
    assert set(GEOMETRIES) == {"A30", "A100", "H100", "B200"}
    assert B200.partitions == H100.partitions
    with pytest.raises(UnknownGpuError, match="V100"):
        get_geometry("V100")


def test_illegal_placements_are_refused() -> None:
    assert not A30.is_legal(2, 1)  # the two middle slices cannot form an instance
    assert not A100.is_legal(4, 3)
    with pytest.raises(ValueError, match="no 2-slice instance at slice 1"):
        A30.placement(2, 1)
