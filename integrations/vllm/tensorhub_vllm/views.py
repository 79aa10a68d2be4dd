"""Which box of a checkpoint tensor a strided view reads, and where the same
view lies in a buffer that holds only that box. Pure arithmetic, no vLLM.

A loader's chain of view ops (``narrow``, ``chunk``, ``view``, ``t``, ...) on a
contiguous tensor of shape ``S`` ends in a view ``(offset, size, stride)`` over
its elements. Element ``i`` of the view is element

    offset + sum_j i_j * stride_j  =  sum_d (start_d + sum_{j -> d} i_j * k_j) * s_d

of the source (``s_d`` the source's row-major strides), where each view
dimension ``j`` steps ``k_j`` along one source dimension ``d``. When every
coordinate stays inside ``[0, S_d)`` that is the element's own index, so the
view reads inside the box ``start_d .. start_d + sum_j (size_j - 1) * k_j`` and,
in a buffer holding that box row-major, it is the view with strides
``k_j * local_stride_d``. A view that wraps across a dimension is not a box:
``BoxView.of`` returns None and the caller reads the whole tensor instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tensorhub.regions import Bounds


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@dataclass(frozen=True, slots=True)
class BoxView:
    """A view of a contiguous tensor that reads inside ``box``.

    ``start``: the view's first element as a source index; ``steps``: per view
    dimension, its size and (source dimension, step along it), or None for a
    size-1 or broadcast dimension."""

    source_shape: tuple[int, ...]
    start: tuple[int, ...]
    steps: tuple[tuple[int, tuple[int, int] | None], ...]
    box: Bounds

    @classmethod
    def of(cls, source_shape: Sequence[int], offset: int, size: Sequence[int],
           stride: Sequence[int]) -> BoxView | None:
        """The box a view ``(offset, size, stride)`` of a contiguous tensor of
        ``source_shape`` reads, or None where it is not a box (it wraps) or is empty."""
        shape = tuple(int(d) for d in source_shape)
        if math.prod(size) == 0 or not shape or not 0 <= offset < math.prod(shape):
            return None
        src = row_major_strides(shape)
        start = tuple((offset // s) % n for s, n in zip(src, shape))
        extent = [0] * len(shape)
        steps: list[tuple[int, tuple[int, int] | None]] = []
        for n, st in zip(size, stride):
            if n == 1 or st == 0:
                steps.append((int(n), None))
                continue
            step = _place(int(n), int(st), shape, src, start, extent)
            if step is None:
                return None
            steps.append((int(n), step))
        if any(a + e >= n for a, e, n in zip(start, extent, shape)):
            return None  # wraps into the next row: not a box
        box = tuple((a, a + e + 1) for a, e in zip(start, extent))
        return cls(shape, start, tuple(steps), box)

    def local(self, box: Bounds) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """``(size, stride, offset)`` of this view in a row-major buffer holding
        ``box`` (which must contain ``self.box``)."""
        local_shape = tuple(b - a for a, b in box)
        strides = row_major_strides(local_shape)
        offset = sum((s - a) * st for s, (a, _), st in zip(self.start, box, strides))
        size = tuple(n for n, _ in self.steps)
        stride = tuple(0 if step is None else step[1] * strides[step[0]] for _, step in self.steps)
        return size, stride, offset


def _place(n: int, st: int, shape: tuple[int, ...], src: tuple[int, ...], start: tuple[int, ...],
           extent: list[int]) -> tuple[int, int] | None:
    """Map one view dimension (size ``n``, stride ``st``) onto the source
    dimension it steps along, growing ``extent``; returns (dimension, step) or
    None. A dimension that runs over whole rows (``view(-1)`` of a row range)
    spans the rows' dimension too."""
    first = None
    while n > 1:
        # The outermost dimension the stride is a whole number of steps of.
        d = next((d for d, (s, dim) in enumerate(zip(src, shape)) if dim > 1 and st % s == 0), None)
        if d is None or st < 0:
            return None
        k = st // src[d]
        first = first or (d, k)
        if start[d] + extent[d] + (n - 1) * k < shape[d]:
            extent[d] += (n - 1) * k
            return first
        if k != 1 or start[d] or extent[d] or n % shape[d]:
            return None  # wraps part way through a row: not a box
        extent[d] = shape[d] - 1  # whole rows of dimension d, then the rows themselves
        n, st = n // shape[d], st * shape[d]
    return first


@dataclass(frozen=True, slots=True)
class Widening:
    """``box`` with its innermost partial dimension taken whole: fewer, longer
    contiguous runs to read, for ``extra`` more bytes (``gap`` between two runs)."""

    box: Bounds
    gap: int  # bytes of the full tensor between two runs of the original box
    extra: int  # bytes the widened box holds beyond the original
    runs_saved: int  # contiguous runs (one READ descriptor each) fewer


def widening(shape: Sequence[int], box: Bounds, itemsize: int) -> Widening | None:
    """The box of a row-major tensor of ``shape`` read as fewer contiguous runs,
    or None where that takes more than its innermost partial dimension (it is
    one run already, or the next dimension out holds a single index). A column
    slice ``(0:R, a:b)`` is R runs (one per row); ``(0:R, 0:C)`` is one."""
    partial = [d for d, ((a, b), n) in enumerate(zip(box, shape)) if b - a < n]
    if not partial:
        return None
    d = partial[-1]
    runs = math.prod(b - a for a, b in box[:d])
    if runs <= 1:
        return None
    wide = (*box[:d], (0, int(shape[d])), *box[d + 1:])
    after = math.prod(b - a for a, b in wide[:partial[-2]]) if len(partial) > 1 else 1
    if after == runs:
        return None
    inner = math.prod(shape[d + 1:]) * itemsize
    gap = (int(shape[d]) - (box[d][1] - box[d][0])) * inner
    return Widening(wide, gap, runs * gap, runs - after)


def contains(outer: Bounds, inner: Bounds) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def overlaps(x: Bounds, y: Bounds) -> bool:
    return all(a < d and c < b for (a, b), (c, d) in zip(x, y))


def merge_boxes(boxes: Sequence[Bounds]) -> list[Bounds]:
    """Disjoint boxes covering ``boxes``: overlapping ones become their bounding
    box (a few elements more read, never fewer), in first-seen order."""
    out: list[Bounds] = []
    for box in boxes:
        while True:
            hit = next((i for i, o in enumerate(out) if overlaps(o, box)), None)
            if hit is None:
                break
            other = out.pop(hit)
            box = tuple((min(a, c), max(b, d)) for (a, b), (c, d) in zip(box, other))
        out.append(box)
    return out
