"""What of a version no holder covers yet, kept per tensor as a shared *class*.

Visibility, the "not complete" message and retention all ask the same thing:
which elements of which tensors do the holders leave out? With 10^5 tensors
and hundreds of holders, asking it region by region in Python costs seconds
per publish. But the tensors of a model fall into a few kinds (same shape, cut
the same way by the same ranks), so the answer is shared: each tensor points
at a class, the boxes still uncovered of a tensor of that shape, and adding a
holder moves every tensor it touches to the class its region leaves, computed
once per distinct (class, region) pair:

    tensor ──of[t]──▶ class id ──▶ (shape, uncovered boxes)      class 0: nothing left
    add(table):  unique (class, region) rows ─▶ box algebra once each ─▶ of[t] = new class

The work per holder is numpy over its regions plus box algebra per distinct
pair, so it grows with regions, never with rows.
"""

from __future__ import annotations

import numpy as np

from tensorhub.regions import Bounds, Region, intersect, subtract
from tensorhub.regiontable import RegionTable, Shapes

_Shape = tuple[int, ...]


class Coverage:
    def __init__(self, shapes: Shapes) -> None:
        self.shapes = shapes
        self._classes: list[tuple[_Shape, tuple[Bounds, ...]]] = [((), ())]  # class 0: covered
        self._ids: dict[tuple[_Shape, tuple[Bounds, ...]], int] = {}
        self._steps: dict[tuple[int, bytes], int] = {}
        self.of = np.zeros(len(shapes.ndim), np.int64)
        rows = np.column_stack([shapes.ndim, shapes.dims])
        if len(rows):
            uniq, inverse = unique_rows(rows)
            ids = []
            for row in uniq:
                shape = tuple(int(d) for d in row[1:1 + int(row[0])])
                whole = tuple((0, d) for d in shape)
                ids.append(self._intern(shape, (whole,)) if all(shape) else 0)  # an empty tensor is covered
            self.of = np.asarray(ids, np.int64)[inverse]

    # ------------------------------------------------------------ adding holders

    def add_whole(self) -> None:
        self.of[:] = 0

    def add(self, table: RegionTable | None) -> None:
        """Count a holder's regions as covered (None: it holds every tensor whole)."""
        if table is None:
            self.add_whole()
            return
        n = len(table)
        if not n:
            return
        # A replica may hold several regions of one tensor: apply them in rounds,
        # each round at most one region per tensor.
        order = np.argsort(table.tensor, kind="stable")
        t = table.tensor[order]
        first = np.flatnonzero(np.r_[True, t[1:] != t[:-1]])
        rank = np.arange(n) - np.repeat(first, np.diff(np.r_[first, n]))
        for r in range(int(rank.max()) + 1):
            self._apply(table, order[rank == r])

    def _apply(self, table: RegionTable, sel: np.ndarray) -> None:
        tensors = table.tensor[sel]
        cls = self.of[tensors]
        live = cls != 0
        sel, tensors, cls = sel[live], tensors[live], cls[live]
        if not len(sel):
            return
        keys = np.column_stack([cls, table.flat[sel], table.lo[sel], table.hi[sel]]).astype(np.int64)
        uniq, inverse = unique_rows(keys)
        after = np.fromiter((self._step(row) for row in uniq), np.int64, len(uniq))
        self.of[tensors] = after[inverse]

    def _step(self, row: np.ndarray) -> int:
        key = (int(row[0]), row[1:].tobytes())
        done = self._steps.get(key)
        if done is None:
            shape, left = self._classes[key[0]]
            cut = _region_boxes(row, shape)
            for box in cut:
                left = tuple(piece for rest in left for piece in subtract(rest, box))
            done = self._steps[key] = self._intern(shape, tuple(sorted(left)))
        return done

    def _intern(self, shape: _Shape, left: tuple[Bounds, ...]) -> int:
        if not left:
            return 0
        key = (shape, left)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._classes)
            self._classes.append(key)
        return found

    # ------------------------------------------------------------ asking

    @property
    def complete(self) -> bool:
        return not self.of.any()

    def holes(self, tensor: int) -> tuple[Bounds, ...]:
        """The boxes of ``tensor`` nobody covers."""
        return self._classes[int(self.of[tensor])][1]

    def missing(self, shown: int) -> tuple[list[tuple[int, Bounds]], int]:
        """The first ``shown`` uncovered (tensor, box) pairs, and how many there are."""
        open_ = np.flatnonzero(self.of)
        counts = np.fromiter((len(left) for _, left in self._classes), np.int64, len(self._classes))
        total = int(counts[self.of[open_]].sum())
        out: list[tuple[int, Bounds]] = []
        for t in open_:
            for box in self.holes(int(t)):
                if len(out) == shown:
                    return out, total
                out.append((int(t), box))
        return out, total

    def touches_holes(self, table: RegionTable | None) -> bool:
        """Whether any region of ``table`` (None: every tensor whole) has an element nobody covers."""
        if table is None:
            return not self.complete
        cls = self.of[table.tensor]
        live = cls != 0
        if not live.any():
            return False
        keys = np.column_stack([cls[live], table.flat[live], table.lo[live], table.hi[live]]).astype(np.int64)
        for row in unique_rows(keys)[0]:
            shape, left = self._classes[int(row[0])]
            if any(intersect(a, b) is not None for a in _region_boxes(row, shape) for b in left):
                return True
        return False


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(rows, axis=0, return_inverse=True)``, through a lexsort of
    the columns: np.unique compares rows as opaque bytes, 50x slower at 10^5."""
    if not len(rows):
        return rows, np.zeros(0, np.int64)
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    new = np.r_[True, (ordered[1:] != ordered[:-1]).any(axis=1)]
    inverse = np.empty(len(rows), np.int64)
    inverse[order] = np.cumsum(new) - 1
    return ordered[new], inverse


def _region_boxes(row: np.ndarray, shape: _Shape) -> list[Bounds]:
    """The boxes of a key row (class, flat, lo..., hi...) of a tensor of ``shape``."""
    width = (len(row) - 2) // 2
    lo, hi = row[2:2 + width], row[2 + width:]
    if row[1]:
        return Region(flat=(int(lo[0]), int(hi[0]))).boxes(shape)
    return [tuple((int(a), int(b)) for a, b in zip(lo[:len(shape)], hi[:len(shape)]))]
