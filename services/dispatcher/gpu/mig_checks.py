"""Checks of a new MIG instance against the instances a GPU already has, for the backends."""

from __future__ import annotations

from collections.abc import Iterable

from gpuloom.domain.errors import FailedPrecondition, InvalidArgument
from gpuloom.domain.gpus import GpuModel, MigInstance, mig_profile
from gpuloom.domain.mig_geometry import MigGeometry, Placement


def check_placement(
    model: GpuModel, slices: int, first_slice: int, existing: Iterable[MigInstance]
) -> Placement:
    """The placement, if an instance of `slices` at `first_slice` can be created next to the
    existing ones: InvalidArgument for a size or slice the model lacks, FailedPrecondition for
    an illegal or overlapping placement."""
    geometry = model.geometry()
    mig_profile(model, slices)  # rejects sizes the model lacks
    if not 0 <= first_slice < geometry.slice_count:
        raise InvalidArgument(
            "first_slice",
            f"must be 0..{geometry.slice_count - 1} on {model.name}, got {first_slice}",
        )
    if not geometry.is_legal(slices, first_slice):
        legal = sorted(p.first_slice for p in geometry.placements if p.size == slices)
        raise FailedPrecondition(
            f"{model.name} cannot place a {slices}-slice MIG instance at slice {first_slice}; "
            f"legal first slices: {', '.join(map(str, legal))}"
        )
    placement = geometry.placement(slices, first_slice)
    for instance in existing:
        if placement.overlaps(footprint(geometry, instance)):
            raise FailedPrecondition(
                f"a {slices}-slice MIG instance at slice {first_slice} would overlap "
                f"{instance.profile_name} at slice {instance.first_slice} ({instance.uuid})"
            )
    return placement


def footprint(geometry: MigGeometry, instance: MigInstance) -> Placement:
    """The slices an existing instance blocks."""
    if geometry.is_legal(instance.slices, instance.first_slice):
        return geometry.placement(instance.slices, instance.first_slice)
    # Made outside gpuloom in a way the geometry does not know: assume it blocks its size.
    return Placement(size=instance.slices, first_slice=instance.first_slice, span=instance.slices)
