"""The per-model indexes that make a decision cheap with thousands of GPUs (`ModelIndex`), and the
memory classes they file GPUs by."""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field

from gpuloom.policies.placement.fleet.records import (
    _remove,
)
from gpuloom.policies.placement.maxrects import (
    Box,
)


@dataclass(slots=True, eq=False)
class ModelIndex:
    """The schedulable GPUs of one model, indexed for the policies (read-only for them)."""

    model: str
    gpu_ids: set[str] = field(default_factory=set)  # all of the model, schedulable or not
    rects: list[tuple[int, str, Box]] = field(default_factory=list)
    by_free: dict[int, list[tuple[int, str]]] = field(default_factory=dict)  # by memory class
    by_id: list[str] = field(default_factory=list)
    max_memory: int = -1  # of the schedulable GPUs; -1: to be computed


def memory_class(memory_free: int) -> int:
    """GPUs in class c have 2**(c-1) <= free memory < 2**c bytes (class 0: none free)."""
    return memory_free.bit_length()


def memory_classes(index: ModelIndex, need: int) -> list[int]:
    """The classes that may hold `need` bytes, most memory first; all but the last surely do."""
    least = memory_class(need)
    return sorted((c for c in index.by_free if c >= least), reverse=True)


def _free(index: ModelIndex, key: tuple[int, str], memory_free: int) -> None:
    insort(index.by_free.setdefault(memory_class(memory_free), []), key)


def _unfree(index: ModelIndex, key: tuple[int, str], memory_free: int) -> None:
    c = memory_class(memory_free)
    keys = index.by_free[c]
    _remove(keys, key)
    if not keys:
        del index.by_free[c]


def _has_shape(
    rects: list[tuple[int, str, Box]], w: int, h: int, among: set[str] | None = None
) -> bool:
    """Whether a free box of at least w x h is in `rects` (on one of the GPUs `among`, when
    given)."""
    for i in range(bisect_left(rects, (w * h,)), len(rects)):
        _, gpu_id, box = rects[i]
        if box[2] - box[0] >= w and box[3] - box[1] >= h and (among is None or gpu_id in among):
            return True
    return False
