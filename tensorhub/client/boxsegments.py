"""What a holder's regions give of a reader's parts, computed from boxes
instead of element runs (``ReadLayout.holder_table``'s fast path).

Intersecting run lists (``regions.overlap``) costs a dozen numpy passes over
every run of the read set for every holder: for the TP=8 slice of one MoE
layer, 262,400 runs and ~9 ms per holder here. Where both sides are boxes of a
tensor of at most 2 dimensions (vLLM's slices, FSDP rows, whole tensors: what
models are made of), their intersection is a box, and its segments follow from
its corners: one per row, or one for the whole box when it spans whole rows.
Every segment is contiguous in the tensor and in both sides' row-major local
memory, exactly as ``overlap``'s pieces are; ``holder_table`` joins
neighbours that continue each other the same way for both.

    parts' boxes ──┐
                   ├─ pairs of one tensor ─▶ intersection box ─▶ per row (or whole) segment:
    held boxes ────┘                                            (part, held, offset in each, elements)

Tensors with a flat region (ZeRO-3) or more than 2 dimensions keep the run path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tensorhub.regions import Region


@dataclass(frozen=True, slots=True)
class Boxes:
    """Regions as boxes of their tensor seen as [rows, columns] (a 1-D tensor is
    one row; a scalar one element): rows ``r0:r1`` and columns ``c0:c1``.
    ``ok`` is False for a region that is no such box (flat, more than 2
    dimensions, no region given, an empty tensor)."""

    tensor: np.ndarray
    r0: np.ndarray
    r1: np.ndarray
    c0: np.ndarray
    c1: np.ndarray
    ok: np.ndarray

    @classmethod
    def of(cls, regions: list[tuple[int, Region | None]], shapes: list[tuple[int, ...]]) -> Boxes:
        rows = np.zeros((len(regions), 6), np.int64)
        for i, (t, region) in enumerate(regions):
            shape = shapes[t]
            if region is None or region.flat is not None or len(shape) > 2 or math.prod(shape) == 0:
                rows[i] = (t, 0, 0, 0, 0, 0)
                continue
            box = region.bounds(shape)
            if len(shape) == 2:
                (r0, r1), (c0, c1) = box
            elif len(shape) == 1:
                (r0, r1), (c0, c1) = (0, 1), box[0]
            else:
                r0, r1, c0, c1 = 0, 1, 0, 1
            rows[i] = (t, r0, r1, c0, c1, 1)
        return cls(*(rows[:, k] for k in range(5)), rows[:, 5].astype(bool))


def columns(shapes: list[tuple[int, ...]]) -> np.ndarray:
    """Per tensor, the columns of its [rows, columns] view."""
    return np.array([shape[-1] if shape else 1 for shape in shapes], np.int64)


def box_segments(parts: Boxes, held: Boxes, cols: np.ndarray,
                 tensors: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The segments held regions give parts, for the ``tensors`` (a mask per
    tensor) whose regions are all boxes: (part, held region, element offset in
    the part, element offset in the held region, elements), in held region
    order, rows ascending."""
    pi = np.flatnonzero(parts.ok & tensors[parts.tensor])
    hi = np.flatnonzero(held.ok & tensors[held.tensor])
    pi = pi[np.argsort(parts.tensor[pi], kind="stable")]
    pt = parts.tensor[pi]
    lo = np.searchsorted(pt, held.tensor[hi], side="left")
    count = np.searchsorted(pt, held.tensor[hi], side="right") - lo
    h = np.repeat(hi, count)  # every (part, held region) pair of one tensor
    p = pi[np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count) + np.repeat(lo, count)]
    r0, r1 = np.maximum(parts.r0[p], held.r0[h]), np.minimum(parts.r1[p], held.r1[h])
    c0, c1 = np.maximum(parts.c0[p], held.c0[h]), np.minimum(parts.c1[p], held.c1[h])
    meet = (r0 < r1) & (c0 < c1)
    p, h, r0, r1, c0, c1 = p[meet], h[meet], r0[meet], r1[meet], c0[meet], c1[meet]
    width = cols[parts.tensor[p]]
    whole_rows = (c0 == 0) & (c1 == width)  # then both sides hold whole rows: one segment
    a_width, b_width = parts.c1[p] - parts.c0[p], held.c1[h] - held.c0[h]
    a_first = (r0 - parts.r0[p]) * a_width + c0 - parts.c0[p]
    b_first = (r0 - held.r0[h]) * b_width + c0 - held.c0[h]
    per_row = np.where(whole_rows, (r1 - r0) * width, c1 - c0)
    runs = np.where(whole_rows, 1, r1 - r0)
    row = np.arange(int(runs.sum())) - np.repeat(np.cumsum(runs) - runs, runs)  # of its pair's box
    a_off = np.repeat(a_first, runs) + row * np.repeat(a_width, runs)
    b_off = np.repeat(b_first, runs) + row * np.repeat(b_width, runs)
    return np.repeat(p, runs), np.repeat(h, runs), a_off, b_off, np.repeat(per_row, runs)
