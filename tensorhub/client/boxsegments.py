"""What a holder's regions give of a reader's parts, computed from boxes
instead of element runs (``ReadLayout.holder_table``'s fast path).

Intersecting run lists (``regions.overlap``) costs a dozen numpy passes over
every run of the read set for every holder: for the TP=8 slice of one MoE
layer, 262,400 runs and ~9 ms per holder here. Where both sides are boxes of a
tensor seen as [rows, columns] (vLLM's slices, FSDP rows, whole tensors: what
models are made of), their intersection is a box, and its segments follow from
its corners: one per row, or one for the whole box when it spans whole rows.
Every segment is contiguous in the tensor and in both sides' row-major local
memory, exactly as ``overlap``'s pieces are; ``holder_table`` joins
neighbours that continue each other the same way for both.

    parts' boxes ──┐
                   ├─ pairs of one tensor ─▶ intersection box ─▶ per row (or whole) segment:
    held boxes ────┘                                            (part, held, offset in each, elements)

A box of a tensor of more than 2 dimensions (fused experts ``[E, 2I, H]``,
``[E, H, I]``) is seen in the ``[rows, columns]`` view of its tensor (rows: the
leading dimensions flattened) as a few boxes of that view, one per index of
the leading dimensions before the last partial one (``_view_boxes``): a TP
slice of every expert's rows is one box per expert, a column slice or an
expert range one box. Each keeps the element offset it starts at in its
region's local memory (``base``), so segments come out as for 2 dimensions.

A flat range (a ZeRO-3 partition) is a few boxes (``Region.boxes``: a partial
row, whole rows, a partial row), each starting where the ones before it end in
the range's local memory, and takes the same path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tensorhub.regions import Region


@dataclass(frozen=True, slots=True)
class Boxes:
    """Regions as boxes of their tensor seen as [rows, columns] (a 1-D tensor is
    one row; a scalar one element; more dimensions: the leading ones flattened
    into rows): rows ``r0:r1`` and columns ``c0:c1``. A region of more than 2
    dimensions, or a flat range, may give several; ``index`` is the region
    each comes from and ``base`` the element offset it starts at in that
    region's local memory.
    ``ok`` is False where no region was given (the reader's parts as element
    runs) and for an empty tensor: one entry, with ``index``."""

    tensor: np.ndarray
    r0: np.ndarray
    r1: np.ndarray
    c0: np.ndarray
    c1: np.ndarray
    ok: np.ndarray
    index: np.ndarray
    base: np.ndarray

    @classmethod
    def of(cls, regions: list[tuple[int, Region | None]], shapes: list[tuple[int, ...]]) -> Boxes:
        rows = np.zeros((len(regions), 8), np.int64)
        more: list[np.ndarray] = []  # the second and later boxes of a region, after the first ones
        for i, (t, region) in enumerate(regions):
            shape = shapes[t]
            if region is None or math.prod(shape) == 0:
                rows[i] = (t, 0, 0, 0, 0, 0, i, 0)
                continue
            # A flat range is a few boxes, in its (row-major) order: each starts
            # where the ones before it end in the range's local memory.
            parts, base = [], 0
            for box in region.boxes(shape):
                view = _view_boxes(shape, box)
                view[:, 7] += base
                base += math.prod(b - a for a, b in box)
                parts.append(view)
            view = np.concatenate(parts) if len(parts) > 1 else parts[0]
            view[:, 0], view[:, 6] = t, i
            rows[i] = view[0]
            if len(view) > 1:
                more.append(view[1:])
        if more:
            rows = np.concatenate([rows, *more])
        return cls(*(rows[:, k] for k in range(5)), rows[:, 5].astype(bool), rows[:, 6], rows[:, 7])

    def regions_without_box(self) -> np.ndarray:
        """The regions (indices into what ``of`` was given) that are no box."""
        return np.unique(self.index[~self.ok])


def _view_boxes(shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> np.ndarray:
    """A box of a tensor as boxes of its [rows, columns] view, in its local
    (row-major) order: rows (tensor, r0, r1, c0, c1, 1, region, base) with
    tensor and region left 0. One box up to 2 dimensions. From 3 on, the
    leading dimensions after the last partial one (before the columns) are
    whole, so they merge into one row range per index of the dimensions
    before it, as ``Region.runs`` merges whole trailing dimensions."""
    if len(shape) <= 2:
        if len(shape) == 2:
            (r0, r1), (c0, c1) = box
        elif len(shape) == 1:
            (r0, r1), (c0, c1) = (0, 1), box[0]
        else:
            r0, r1, c0, c1 = 0, 1, 0, 1
        return np.array([(0, r0, r1, c0, c1, 1, 0, 0)], np.int64)
    lead = shape[:-1]
    strides = [math.prod(lead[d + 1:]) for d in range(len(lead))]  # rows per step of each leading dimension
    j = len(lead) - 1
    while j > 0 and box[j] == (0, lead[j]):
        j -= 1
    first = np.zeros(1, np.int64)
    for d in range(j):  # every index of the dimensions before j, row-major
        a, b = box[d]
        first = (first[:, None] + np.arange(a, b, dtype=np.int64)[None, :] * strides[d]).ravel()
    r0 = first + box[j][0] * strides[j]
    height = (box[j][1] - box[j][0]) * strides[j]
    c0, c1 = box[-1]
    out = np.zeros((len(r0), 8), np.int64)
    out[:, 1], out[:, 2], out[:, 3], out[:, 4], out[:, 5] = r0, r0 + height, c0, c1, 1
    out[:, 7] = np.arange(len(r0), dtype=np.int64) * (height * (c1 - c0))
    return out


def columns(shapes: list[tuple[int, ...]]) -> np.ndarray:
    """Per tensor, the columns of its [rows, columns] view."""
    return np.array([shape[-1] if shape else 1 for shape in shapes], np.int64)


def pairs(parts: Boxes, held: Boxes, pi: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (part box, held box) pairs, of boxes ``pi`` and ``hi``, of one tensor
    whose rows may meet, held box by held box. Parts sorted by (tensor, first
    row) and keyed tensor * span + row: those before ``lo`` end (running
    maximum of their last row) before the held box starts, those from ``hi`` on
    start after it ends. Not every pair of one tensor: a fused expert tensor
    relayed cut as the reader cuts it is a box per expert on both sides, and
    all pairs would be experts squared."""
    pi = pi[np.lexsort((parts.r0[pi], parts.tensor[pi]))]
    span = int(max(parts.r1.max(initial=0), held.r1.max(initial=0))) + 1
    starts = parts.tensor[pi] * span + parts.r0[pi]
    ends = np.maximum.accumulate(parts.tensor[pi] * span + parts.r1[pi]) if len(pi) else starts
    key = held.tensor[hi] * span
    lo = np.searchsorted(ends, key + held.r0[hi], side="right")
    count = np.maximum(np.searchsorted(starts, key + held.r1[hi], side="left") - lo, 0)
    h = np.repeat(hi, count)
    p = pi[np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count) + np.repeat(lo, count)]
    return p, h


def box_segments(parts: Boxes, held: Boxes, cols: np.ndarray,
                 tensors: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The segments held regions give parts, for the ``tensors`` (a mask per
    tensor) whose regions are all boxes: (part, held region, element offset in
    the part, element offset in the held region, elements), in held box
    order, rows ascending; part and held region are the indices ``Boxes.of``
    was given."""
    p, h = pairs(parts, held, np.flatnonzero(parts.ok & tensors[parts.tensor]),
                 np.flatnonzero(held.ok & tensors[held.tensor]))
    r0, r1 = np.maximum(parts.r0[p], held.r0[h]), np.minimum(parts.r1[p], held.r1[h])
    c0, c1 = np.maximum(parts.c0[p], held.c0[h]), np.minimum(parts.c1[p], held.c1[h])
    meet = (r0 < r1) & (c0 < c1)
    p, h, r0, r1, c0, c1 = p[meet], h[meet], r0[meet], r1[meet], c0[meet], c1[meet]
    width = cols[parts.tensor[p]]
    whole_rows = (c0 == 0) & (c1 == width)  # then both sides hold whole rows: one segment
    a_width, b_width = parts.c1[p] - parts.c0[p], held.c1[h] - held.c0[h]
    a_first = parts.base[p] + (r0 - parts.r0[p]) * a_width + c0 - parts.c0[p]
    b_first = held.base[h] + (r0 - held.r0[h]) * b_width + c0 - held.c0[h]
    per_row = np.where(whole_rows, (r1 - r0) * width, c1 - c0)
    runs = np.where(whole_rows, 1, r1 - r0)
    row = np.arange(int(runs.sum())) - np.repeat(np.cumsum(runs) - runs, runs)  # of its pair's box
    a_off = np.repeat(a_first, runs) + row * np.repeat(a_width, runs)
    b_off = np.repeat(b_first, runs) + row * np.repeat(b_width, runs)
    return np.repeat(parts.index[p], runs), np.repeat(held.index[h], runs), a_off, b_off, np.repeat(per_row, runs)
