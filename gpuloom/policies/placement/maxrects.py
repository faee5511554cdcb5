"""The free space of one GPU as FaST-GShare keeps it: a list of maximal free rectangles
(Gu et al., section 3.4.2 and Algorithm 2, after Jylanki's MaxRects 2D bin packer).

A free rectangle is *maximal* when no larger free rectangle contains it. Maximal rectangles
overlap one another, and every rectangle a job could take lies inside one of them, so a search
over the list misses no placement.

- occupy (Algorithm 2, lines 6-25): every maximal rectangle the new allocation intersects is
  replaced by its up-to-four maximal parts outside it (Subdivide); a part inside another
  rectangle of the list is dropped (redundant-rectangle removal).
- vacate ("keep-restructure"): the freed rectangle goes back into the list as a *kept*
  rectangle, so the same shape fits there again exactly (area difference 0), and the maximal
  rectangles that now extend through it are re-derived. The paper only adds the rectangle back;
  re-deriving keeps the list complete, so a job that fits is never turned away.
- rebuild: the GPU as one W x H rectangle minus every allocation, as the paper does when the
  list grows past a threshold and as a restart does. It drops the kept rectangles.

Boxes are (x0, y0, x1, y1) tuples with exclusive ends, in grid steps: plain tuples compare and
hash fast, and these loops run on every decision.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuloom.policies.placement.model import GRID_H, GRID_W, Rect

Box = tuple[int, int, int, int]
FULL: Box = (0, 0, GRID_W, GRID_H)


def box_of(rect: Rect) -> Box:
    return (rect.x, rect.y, rect.x + rect.w, rect.y + rect.h)


def rect_of(box: Box) -> Rect:
    return Rect(box[0], box[1], box[2] - box[0], box[3] - box[1])


def box_area(box: Box) -> int:
    return (box[2] - box[0]) * (box[3] - box[1])


def overlaps(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def inside(a: Box, b: Box) -> bool:
    """a lies within b."""
    return b[0] <= a[0] and b[1] <= a[1] and a[2] <= b[2] and a[3] <= b[3]


def subtract(boxes: list[Box], cut: Box, within: Box | None = None) -> list[Box]:
    """The maximal free boxes once `cut` is taken from the free space whose maximal boxes are
    `boxes`. With `within`, only the result boxes that overlap it (what a release re-derives)."""
    cx0, cy0, cx1, cy1 = cut
    survivors: list[Box] = []
    parts: list[Box] = []
    for box in boxes:
        x0, y0, x1, y1 = box
        if x0 >= cx1 or cx0 >= x1 or y0 >= cy1 or cy0 >= y1:
            survivors.append(box)
            continue
        # Subdivide: the largest part left of, right of, below and above the cut.
        if cx0 > x0:
            parts.append((x0, y0, cx0, y1))
        if cx1 < x1:
            parts.append((cx1, y0, x1, y1))
        if cy0 > y0:
            parts.append((x0, y0, x1, cy0))
        if cy1 < y1:
            parts.append((x0, cy1, x1, y1))
    if not parts:
        return survivors
    if within is not None:
        parts = [p for p in parts if overlaps(p, within)]
    # A survivor is never inside a part (a part lies in a box the list already held, and the
    # list had no box inside another), so only the parts need the redundancy check.
    result = survivors[:]
    for i, p in enumerate(parts):
        px0, py0, px1, py1 = p
        redundant = False
        for q in survivors:
            if q[0] <= px0 and q[1] <= py0 and px1 <= q[2] and py1 <= q[3]:
                redundant = True
                break
        if not redundant:
            for j, q in enumerate(parts):
                # Of two equal parts the first stays.
                if (
                    j != i
                    and q[0] <= px0
                    and q[1] <= py0
                    and px1 <= q[2]
                    and py1 <= q[3]
                    and (p != q or j < i)
                ):
                    redundant = True
                    break
        if not redundant:
            result.append(p)
    return result


def maximal_boxes(used: Iterable[Box], within: Box | None = None) -> list[Box]:
    """The maximal free boxes of a GPU whose allocations take `used` (which must not overlap);
    with `within`, only those that overlap it."""
    boxes = [FULL]
    for box in used:
        boxes = subtract(boxes, box, within)
        if not boxes:
            break
    return boxes


class FreeRects:
    """The free-rectangle list of one GPU: `maximal` (complete, none inside another) and `kept`
    (rectangles of released allocations, free but maybe inside a maximal one). `widest` and
    `tallest` bound what fits at all, so most GPUs that cannot take a job are passed over
    without looking at their rectangles."""

    __slots__ = ("kept", "maximal", "tallest", "widest")

    def __init__(self, maximal: list[Box] | None = None, kept: list[Box] | None = None) -> None:
        self.maximal: list[Box] = [FULL] if maximal is None else maximal
        self.kept: list[Box] = [] if kept is None else kept
        self._bounds()

    def _bounds(self) -> None:
        self.widest = max((b[2] - b[0] for b in self.maximal), default=0)
        self.tallest = max((b[3] - b[1] for b in self.maximal), default=0)

    @classmethod
    def build(cls, used: Iterable[Box]) -> FreeRects:
        return cls(maximal_boxes(used))

    def __len__(self) -> int:
        return len(self.maximal) + len(self.kept)

    def boxes(self) -> list[Box]:
        """Every box a job may be placed in: the maximal ones, then the kept ones."""
        return self.maximal + self.kept if self.kept else self.maximal

    def is_free(self, box: Box) -> bool:
        return any(inside(box, m) for m in self.maximal)

    def occupy(self, box: Box) -> None:
        """Take `box`, which must be free."""
        self.maximal = subtract(self.maximal, box)
        self._bounds()
        if self.kept:
            # A kept box the allocation cuts is dropped: its free parts lie in maximal boxes.
            present = set(self.maximal)
            self.kept = [k for k in self.kept if not overlaps(k, box) and k not in present]

    def vacate(self, box: Box, used: Iterable[Box]) -> None:
        """Give `box` back; `used` are the boxes of the allocations that stay."""
        grown = maximal_boxes(used, within=box)
        # An old maximal box stays maximal unless a re-derived one (through `box`) contains it.
        rest = [m for m in self.maximal if not any(inside(m, g) for g in grown)]
        self.maximal = rest + grown
        self._bounds()
        if box not in grown:
            self.kept.append(box)

    def rebuild(self, used: Iterable[Box]) -> None:
        self.maximal = maximal_boxes(used)
        self.kept = []
        self._bounds()

    def best_fit(self, w: int, h: int) -> Box | None:
        """MRA inside one GPU: the fitting box with the least area (then lowest, then leftmost)."""
        best: tuple[int, int, int] | None = None
        found: Box | None = None
        for box in self.boxes():
            x0, y0, x1, y1 = box
            if x1 - x0 >= w and y1 - y0 >= h:
                key = ((x1 - x0) * (y1 - y0), y0, x0)
                if best is None or key < best:
                    best, found = key, box
        return found

    def first_fit(self, w: int, h: int) -> Box | None:
        """The fitting box with the lowest, then leftmost, corner: its corner is the
        bottom-left-most position where a w x h rectangle fits at all."""
        best: tuple[int, int] | None = None
        found: Box | None = None
        for box in self.maximal:
            x0, y0, x1, y1 = box
            if x1 - x0 >= w and y1 - y0 >= h and (best is None or (y0, x0) < best):
                best, found = (y0, x0), box
        return found

    def fits(self, w: int, h: int) -> bool:
        if w > self.widest or h > self.tallest:
            return False
        return any(b[2] - b[0] >= w and b[3] - b[1] >= h for b in self.maximal)
