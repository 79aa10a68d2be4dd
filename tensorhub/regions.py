"""Regions: which part of a manifest tensor a holder holds or a reader wants.

A region is a *box* (one ``start:stop`` per dimension) or a *flat* element
range of the row-major tensor (how ZeRO-3 partitions a parameter); ``Region()``
is the whole tensor. Local memory holds a region contiguously, row-major.

Everything the data path and the server need reduces a region to *runs*:
element ranges that are contiguous both in the full tensor and in local memory.

    Region ──runs(shape)──▶ Runs(start, length, offset)     (numpy, in elements)
    runs(reader) ∩ runs(holder) ──overlap()──▶ what the holder can give the reader,
                                              with the offsets on both sides
    runs of every holder ──gaps()──▶ the elements nobody holds (visibility)

A row slice is one run; a column slice of an [R, C] matrix is R runs. So runs
are made only where bytes move (the reader's layout, one holder at a time).
Everything that only asks *which* elements (the server's coverage, visibility,
retention and overlap checks) works on boxes instead, whose number grows with
regions, not rows:

    Region ──boxes(shape)──▶ disjoint boxes          (1 for a box, ≤ 2·ndim−1 for a flat range)
    intersect(a, b) ─▶ box | None     subtract(a, b) ─▶ ≤ 2·ndim disjoint boxes
    box_gaps(shape, boxes) ─▶ disjoint boxes nobody covers (visibility, "missing")
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

Bounds = tuple[tuple[int, int], ...]

# Region.runs keeps results of at most this many runs (``_kept_runs``: the
# last 4,096 of them, 4,096 x 64 runs x 24 bytes = 6 MiB at most).
_KEPT_MAX_RUNS = 64


@dataclass(frozen=True, slots=True)
class Region:
    """``box``: one (start, stop) per dimension; ``flat``: (start, stop) over the
    row-major elements; neither: the whole tensor."""

    box: Bounds | None = None
    flat: tuple[int, int] | None = None

    @property
    def whole(self) -> bool:
        return self.box is None and self.flat is None

    def bounds(self, shape: tuple[int, ...]) -> Bounds:
        """The box this region spans (the whole tensor for ``Region()``)."""
        return self.box if self.box is not None else tuple((0, d) for d in shape)

    def problem(self, shape: tuple[int, ...]) -> str | None:
        """Why this region does not fit a tensor of ``shape``, or None."""
        if self.box is not None and self.flat is not None:
            return "a region is a box or a flat range, not both"
        if self.flat is not None:
            a, b = self.flat
            n = math.prod(shape)
            if not 0 <= a < b <= n:
                return f"flat range [{a}:{b}) is empty, inverted or outside [0:{n})"
        elif self.box is not None:
            if len(self.box) != len(shape):
                return f"box has {len(self.box)} dimension(s), the tensor {len(shape)} {list(shape)}"
            for dim, ((a, b), size) in enumerate(zip(self.box, shape)):
                if not 0 <= a < b <= size:
                    return f"dimension {dim}: [{a}:{b}) is empty, inverted or outside [0:{size})"
        return None

    def numel(self, shape: tuple[int, ...]) -> int:
        if self.flat is not None:
            return self.flat[1] - self.flat[0]
        return math.prod(b - a for a, b in self.bounds(shape))

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of a tensor that holds exactly this region."""
        if self.flat is not None:
            return (self.numel(shape),)
        return tuple(b - a for a, b in self.bounds(shape))

    def run_count(self, shape: tuple[int, ...]) -> int:
        """len(self.runs(shape)) without building them (1 for an empty tensor)."""
        if self.box is None or math.prod(shape) == 0 or not shape:
            return 1
        box = self.box
        j = len(shape) - 1
        while j > 0 and box[j] == (0, shape[j]):
            j -= 1
        return math.prod(b - a for a, b in box[:j])

    def runs(self, shape: tuple[int, ...]) -> Runs:
        """The region as contiguous element runs of the full tensor, in local
        order. Read-only arrays: results of few runs are kept and shared (a
        pull asks for every tensor's runs several times: checking ``into``,
        laying out the read set, each holder's table)."""
        shape = tuple(shape)
        if self.run_count(shape) <= _KEPT_MAX_RUNS:
            return _kept_runs(self, shape)
        return _read_only(self._runs(shape))

    def _runs(self, shape: tuple[int, ...]) -> Runs:
        if self.flat is not None:
            a, b = self.flat
            return Runs.of(np.array([a], np.int64), np.array([b - a], np.int64))
        box = self.bounds(shape)
        if math.prod(shape) == 0:
            return Runs.of(np.zeros(0, np.int64), np.zeros(0, np.int64))
        if not box:  # a scalar
            return Runs.of(np.array([0], np.int64), np.array([1], np.int64))
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        # Trailing dimensions the box covers whole merge into one run with the
        # last partial one; the dimensions before it repeat the run.
        j = len(shape) - 1
        while j > 0 and box[j] == (0, shape[j]):
            j -= 1
        starts = np.array([box[j][0] * strides[j]], np.int64)
        for i in range(j - 1, -1, -1):
            a, b = box[i]
            starts = (np.arange(a, b, dtype=np.int64)[:, None] * strides[i] + starts[None, :]).ravel()
        length = (box[j][1] - box[j][0]) * strides[j]
        return Runs.of(starts, np.full(len(starts), length, np.int64))

    def first_element(self, shape: tuple[int, ...]) -> int:
        """The row-major index of the region's first element (its corner), without its runs."""
        if self.flat is not None:
            return self.flat[0]
        if self.box is None:
            return 0
        index = 0
        for (a, _), d in zip(self.box, shape):
            index = index * d + a
        return index

    def boxes(self, shape: tuple[int, ...]) -> list[Bounds]:
        """The region as disjoint boxes: itself for a box, at most 2·ndim−1
        for a flat range (a partial row, whole rows, a partial row, recursively)."""
        if self.flat is None:
            return [self.bounds(tuple(shape))]
        return flat_boxes(tuple(shape), *self.flat)

    def overlaps(self, other: Region, shape: tuple[int, ...]) -> bool:
        return any(intersect(a, b) is not None for a in self.boxes(shape) for b in other.boxes(shape))

    def describe(self) -> str:
        if self.flat is not None:
            return f"flat[{self.flat[0]}:{self.flat[1]}]"
        if self.box is not None:
            return "[" + ", ".join(f"{a}:{b}" for a, b in self.box) + "]"
        return "whole"

    # ------------------------------------------------------------ constructors

    @classmethod
    def of(cls, shape: tuple[int, ...], *, rows: tuple[int, int] | None = None,
           cols: tuple[int, int] | None = None, box: Bounds | None = None,
           flat: tuple[int, int] | None = None) -> Region:
        """At most one of ``rows`` (dim 0), ``cols`` (dim 1), ``box`` or ``flat``."""
        given = [k for k, v in (("rows", rows), ("cols", cols), ("box", box), ("flat", flat)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"give one of rows, cols, box or flat, not {' and '.join(given)}")
        if rows is not None:
            if not shape:
                raise ValueError("rows= needs a tensor with at least one dimension")
            return cls(box=((int(rows[0]), int(rows[1])), *((0, d) for d in shape[1:])))
        if cols is not None:
            if len(shape) < 2:
                raise ValueError(f"cols= needs a tensor with at least two dimensions, not {list(shape)}")
            return cls(box=((0, shape[0]), (int(cols[0]), int(cols[1])), *((0, d) for d in shape[2:])))
        if box is not None:
            return cls(box=tuple((int(a), int(b)) for a, b in box))
        if flat is not None:
            return cls(flat=(int(flat[0]), int(flat[1])))
        return cls()


@dataclass(frozen=True, slots=True)
class Runs:
    """Element runs: ``start`` in the full tensor, ``length``, and ``offset`` in
    local memory (runs are stored back to back in local order)."""

    start: np.ndarray
    length: np.ndarray
    offset: np.ndarray

    @classmethod
    def of(cls, start: np.ndarray, length: np.ndarray) -> Runs:
        offset = np.zeros(len(length), np.int64)
        if len(length) > 1:
            np.cumsum(length[:-1], out=offset[1:])
        return cls(start, length, offset)

    def __len__(self) -> int:
        return len(self.start)


def _read_only(runs: Runs) -> Runs:
    for a in (runs.start, runs.length, runs.offset):
        a.flags.writeable = False
    return runs


@functools.lru_cache(maxsize=4096)
def _kept_runs(region: Region, shape: tuple[int, ...]) -> Runs:
    return _read_only(region._runs(shape))


@dataclass(frozen=True, slots=True)
class Overlap:
    """Elements two regions share: ``start`` in the full tensor, ``length``, the
    local offsets ``a`` and ``b`` on either side, and the index of the run each
    piece lies in on either side (``a_run``, ``b_run``)."""

    start: np.ndarray
    length: np.ndarray
    a: np.ndarray
    b: np.ndarray
    a_run: np.ndarray
    b_run: np.ndarray


def overlap(a: Runs, b: Runs) -> Overlap:
    """Intersect two run lists (each sorted by start and non-overlapping, as a
    region's runs are once sorted: ``runs()`` yields them in row-major order)."""
    a_end, b_end = a.start + a.length, b.start + b.length
    lo = np.searchsorted(b_end, a.start, side="right")  # first b run ending after a's start
    hi = np.searchsorted(b.start, a_end, side="left")  # b runs starting before a's end
    counts = np.maximum(hi - lo, 0)
    total = int(counts.sum())
    if total == 0:
        empty = np.zeros(0, np.int64)
        return Overlap(empty, empty, empty, empty, empty, empty)
    ai = np.repeat(np.arange(len(a.start)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    bi = np.arange(total) - first + np.repeat(lo, counts)
    start = np.maximum(a.start[ai], b.start[bi])
    end = np.minimum(a_end[ai], b_end[bi])
    keep = end > start
    start, end, ai, bi = start[keep], end[keep], ai[keep], bi[keep]
    return Overlap(start, end - start, a.offset[ai] + (start - a.start[ai]), b.offset[bi] + (start - b.start[bi]),
                   ai, bi)


def gaps(numel: int, runs: list[Runs]) -> list[tuple[int, int]]:
    """Element ranges of a tensor of ``numel`` elements that no run covers."""
    if numel == 0:
        return []
    if not runs:
        return [(0, numel)]
    start = np.concatenate([r.start for r in runs])
    end = start + np.concatenate([r.length for r in runs])
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    out: list[tuple[int, int]] = []
    if len(start) == 0 or start[0] > 0:
        out.append((0, int(start[0]) if len(start) else numel))
    holes = np.nonzero(start[1:] > reach[:-1])[0]
    out.extend((int(reach[i]), int(start[i + 1])) for i in holes)
    if len(reach) and reach[-1] < numel:
        out.append((int(reach[-1]), numel))
    return out


# ---------------------------------------------------------------- box algebra


def flat_boxes(shape: tuple[int, ...], a: int, b: int) -> list[Bounds]:
    """The row-major element range [a, b) of a tensor of ``shape`` as disjoint boxes."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [((a, b),)] if shape else [()]
    inner = math.prod(shape[1:])
    rest = tuple((0, d) for d in shape[1:])
    r0, o0 = divmod(a, inner)
    r1, o1 = divmod(b, inner)
    if r0 == r1:
        return [((r0, r0 + 1), *box) for box in flat_boxes(shape[1:], o0, o1)]
    out: list[Bounds] = []
    if o0:
        out += [((r0, r0 + 1), *box) for box in flat_boxes(shape[1:], o0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, r1), *rest))
    if o1:
        out += [((r1, r1 + 1), *box) for box in flat_boxes(shape[1:], 0, o1)]
    return out


def intersect(a: Bounds, b: Bounds) -> Bounds | None:
    """The box both boxes span, or None when they share no element."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def subtract(a: Bounds, b: Bounds) -> list[Bounds]:
    """``a`` without ``b``, as at most 2·ndim disjoint boxes: along each
    dimension in turn, the slabs of ``a`` below and above ``b``, with the
    dimensions already cut narrowed to ``b``."""
    if intersect(a, b) is None:
        return [a]
    out: list[Bounds] = []
    core = list(a)
    for d, ((a0, a1), (b0, b1)) in enumerate(zip(a, b)):
        if a0 < b0:
            out.append((*core[:d], (a0, b0), *core[d + 1:]))
        if b1 < a1:
            out.append((*core[:d], (b1, a1), *core[d + 1:]))
        core[d] = (max(a0, b0), min(a1, b1))
    return out


def cut_out(left: list[Bounds], boxes: list[Bounds]) -> list[Bounds]:
    """What is left of the disjoint boxes ``left`` once ``boxes`` are cut out
    of it, as disjoint boxes: each box cut out of every piece in turn."""
    for box in boxes:
        left = [piece for rest in left for piece in subtract(rest, box)]
        if not left:
            break
    return left


def box_gaps(shape: tuple[int, ...], boxes: list[Bounds]) -> list[Bounds]:
    """Disjoint boxes of a tensor of ``shape`` that no box in ``boxes`` covers
    (empty when they cover it all)."""
    if math.prod(shape) == 0:
        return []
    return cut_out([tuple((0, d) for d in shape)], sorted(set(boxes)))


def describe_box(shape: tuple[int, ...], box: Bounds) -> str:
    """A box in words: rows where it spans whole rows, else its bounds."""
    if len(box) == 1:
        return f"elements {box[0][0]}:{box[0][1]}"
    if box and all(bd == (0, d) for bd, d in zip(box[1:], shape[1:])):
        return f"rows {box[0][0]}:{box[0][1]}"
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def describe_elements(shape: tuple[int, ...], a: int, b: int) -> str:
    """A flat element range in words, as rows where it is whole rows."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 0
    if row and a % row == 0 and b % row == 0:
        return f"rows {a // row}:{b // row}"
    return f"elements {a}:{b}"
