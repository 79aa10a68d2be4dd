"""What of a version no holder covers yet, per *group* of tensors cut alike.

Visibility, the "not complete" message, retention and the choice of sources
for a reader all ask: which elements do these holders leave out? A version of
10^5 tensors with hundreds of holders cannot afford to ask it tensor by tensor.
But the tensors of a model fall into a few groups: same shape, and every holder
so far cuts them the same way (an FSDP rank takes the same rows of all the
[2048, 7168] tensors; a TP worker the same columns of every expert's down_proj).
So the answer is kept per group, and per group as a shared *class* (the boxes
still uncovered of a tensor of that shape):

    Grouping (per version)   tensor ──of[t]──▶ group; refined by each publish so that
                             every holder's regions are alike within a group
    Coverage (per question)  group ──of[g]──▶ class ──▶ (shape, uncovered boxes); 0: nothing left
    add(holder):             per group its region (the same for all the group's tensors),
                             box algebra once per distinct (class, region) pair

Adding a holder costs its number of groups (tens), not its regions or rows.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from tensorhub.regions import Bounds, Region, cut_out, intersect
from tensorhub.regiontable import RegionTable, Shapes, unique_rows

_Shape = tuple[int, ...]
_TABLES_KEPT = 8192  # region tables a grouping remembers (refined by, keyed): 1,536 a step at paper scale
_WHOLE = -1  # a holder's "region" of a group when it holds every tensor whole
_NONE = -2  # ... when it holds nothing of it


class Grouping:
    """Groups of a version's tensors that every holder published so far cuts alike."""

    def __init__(self, shapes: Shapes) -> None:
        self.shapes = shapes
        self.epoch = 0  # bumped by every refinement: per-holder keys of older epochs are stale
        n = len(shapes.ndim)
        self.of = np.zeros(n, np.int64)
        self.rep = np.zeros(0, np.int64)
        self.sizes = np.zeros(0, np.int64)
        # Tables already refined by (kept alive here, so their ids stay theirs), and
        # their keys for this epoch: relays of one cut share one table (service.py).
        self._refined: dict[int, RegionTable] = {}
        self._keys: dict[int, tuple[RegionTable | None, HolderKeys]] = {}
        self.covers_memo: dict = {}  # ``covers``' answers for this epoch, by the set of keys asked about
        self.complete_memo: dict = {}  # ``coverage_of``'s complete answers for this epoch, by the keys' prefix
        # The holders that last completed a version of this grouping, added one by one (``KnownCover``):
        # the next version from the same tables is complete once they all published it again.
        self.known_cover: KnownCover | None = None
        if n:
            _, self.of = unique_rows(np.column_stack([shapes.ndim, shapes.dims]))
            self._set_reps()

    def _set_reps(self) -> None:
        rep = np.full(int(self.of.max()) + 1 if len(self.of) else 0, -1, np.int64)
        rep[self.of[::-1]] = np.arange(len(self.of))[::-1]  # the first tensor of each group
        self.rep = rep
        self.sizes = np.bincount(self.of, minlength=len(rep))  # tensors per group

    @property
    def count(self) -> int:
        return len(self.rep)

    def refine(self, table: RegionTable | None) -> None:
        """Split groups so that ``table``'s regions are alike within each."""
        if table is None or not len(self.of) or id(table) in self._refined:
            return  # a table refines once: later splits keep its regions alike within groups
        if len(self._refined) >= _TABLES_KEPT:
            # A grouping outlives versions (State._groupings): tables published
            # whole every version (no layout named) would pile up. Forgotten, a
            # table refines again when it comes back, splitting nothing.
            self._refined.clear()
            self._keys.clear()
        self._refined[id(table)] = table
        key = region_keys(table, len(self.of))
        _, of = unique_rows(np.column_stack([self.of, key]))
        if int(of.max()) + 1 > self.count:
            self.of = of
            self._set_reps()
            self.epoch += 1
            self._keys.clear()

    def keys(self, table: RegionTable | None) -> HolderKeys:
        """``HolderKeys(table, self)``, kept per table for this epoch."""
        kept = self._keys.get(id(table))
        if kept is None or kept[0] is not table:
            if len(self._keys) >= _TABLES_KEPT:
                self._keys.clear()
            kept = self._keys[id(table)] = (table, HolderKeys(table, self))
        return kept[1]

    def members(self, group: int) -> np.ndarray:
        return np.flatnonzero(self.of == group)


class KnownCover:
    """A set of holders' keys (one epoch of one grouping) whose union covered a
    version: the trainer's shards of the step before. Any version whose
    counting holders include them all is complete, whatever else it holds or
    in whatever order they came, so a republish from the same tables is only
    noted (``State._refresh``), not added group by group (at 256 ranks, 70 ms
    of the server's step). ``coverage``: that version's complete coverage,
    shared (nothing changes a complete coverage)."""

    __slots__ = ("coverage", "epoch", "ids", "keys")

    def __init__(self, keys: Sequence[HolderKeys], coverage: Coverage) -> None:
        assert coverage.complete and all(k.epoch == coverage.epoch for k in keys)
        self.epoch = coverage.epoch
        self.keys = tuple(keys)  # kept alive: their ids stay theirs
        self.ids = frozenset(id(k) for k in self.keys)
        self.coverage = coverage

    def covered_by(self, ids: Collection[int]) -> bool:
        """Whether holders with these keys' ids include every one of the set
        (the length first: a step notes them one by one)."""
        return len(ids) >= len(self.ids) and self.ids <= set(ids)


def region_keys(table: RegionTable, tensors: int) -> np.ndarray:
    """Per tensor an id of the table's regions of it: -1 for none, one id per
    distinct region, and for a tensor held in several regions one id per
    distinct set of them. A trainer's cut holds each tensor it owns in the
    readers' boxes (8 for TP=8), alike for every tensor of a shape: keyed one
    by one, every such tensor would be a group of its own (10^5 groups, each
    a step of Python in every coverage question)."""
    if table.rule_of is not None:  # chunk rules: one region per tensor, alike per (shape, rule)
        return table.rule_of.astype(np.int64) - 1
    key = np.full(tensors, -1, np.int64)
    if not len(table):
        return key
    rows = np.column_stack([table.flat, table.lo, table.hi]).astype(np.int64)
    _, ids = unique_rows(rows)
    key[table.tensor] = ids
    counts = np.bincount(table.tensor, minlength=tensors)
    several = np.flatnonzero(counts > 1)
    if len(several):
        # Each several-region tensor's region ids, sorted, as one row (padded with -1): alike sets, alike rows.
        mine = np.flatnonzero(counts[table.tensor] > 1)
        order = mine[np.lexsort((ids[mine], table.tensor[mine]))]
        tensor_of = table.tensor[order]
        starts = np.r_[0, np.flatnonzero(tensor_of[1:] != tensor_of[:-1]) + 1]
        sets = np.full((len(several), int(counts.max())), -1, np.int64)
        sets[np.repeat(np.arange(len(several)), counts[several]), np.arange(len(order)) - np.repeat(
            starts, counts[several])] = ids[order]
        _, set_ids = unique_rows(sets)
        key[several] = int(ids.max()) + 1 + set_ids
    return key


class HolderKeys:
    """A holder's regions per group of a ``Grouping`` (of one epoch): for each
    group the table rows of its representative tensor, and as boxes (``lo``,
    ``hi``: G x D, the group's box where it holds one box of it, else empty)."""

    def __init__(self, table: RegionTable | None, grouping: Grouping) -> None:
        self.epoch = grouping.epoch
        self.table = table
        self.numel: np.ndarray | None = None  # group_numel's, once asked
        self.elements: int | None = None  # held_elements', once asked
        self.sizes = grouping.sizes
        shapes = grouping.shapes
        if table is None:
            self.first = np.full(grouping.count, _WHOLE, np.int64)
            self.several: dict[int, np.ndarray] = {}
            self.lo = np.zeros_like(shapes.dims[grouping.rep])
            self.hi = shapes.dims[grouping.rep].copy()
            self.odd: dict[int, list[Bounds]] = {}
            return
        n = len(grouping.of)
        pos = np.full(n, _NONE, np.int64)
        pos[table.tensor[::-1]] = np.arange(len(table))[::-1]
        self.first = pos[grouping.rep]
        counts = np.bincount(table.tensor, minlength=n)[grouping.rep]
        self.several = _rows_of_reps(table, grouping, np.flatnonzero(counts > 1))
        held = self.first >= 0
        self.lo = np.zeros_like(shapes.dims[grouping.rep])
        self.hi = np.zeros_like(self.lo)  # an empty box where it holds nothing
        self.lo[held], self.hi[held] = table.lo[self.first[held]], table.hi[self.first[held]]
        # Groups where its regions are not one box (a flat range, several regions): listed as boxes.
        self.odd = {}
        for g in set(self.several) | {int(g) for g in np.flatnonzero(held & table.flat[np.maximum(self.first, 0)])}:
            shape = _shape(shapes, int(grouping.rep[g]))
            self.odd[g] = [b for row in self.rows(g) or [] for b in _row_boxes(row, shape)]
            self.hi[g] = self.lo[g]

    def rows(self, group: int) -> list[np.ndarray] | None:
        """The key rows (flat, lo..., hi...) of the holder's regions of ``group``; None: whole."""
        k = int(self.first[group])
        if k == _WHOLE:
            return None
        if k == _NONE:
            return []
        t = self.table
        assert t is not None
        at = self.several.get(group, (k,))
        return [np.concatenate([[int(t.flat[j])], t.lo[j], t.hi[j]]).astype(np.int64) for j in at]


def _rows_of_reps(table: RegionTable, grouping: Grouping, groups: np.ndarray) -> dict[int, np.ndarray]:
    """Per group of ``groups``, the table rows of its representative tensor (ascending)."""
    if not len(groups):
        return {}
    group_of = np.full(len(grouping.of), -1, np.int64)
    group_of[grouping.rep[groups]] = groups
    rows = np.flatnonzero(group_of[table.tensor] >= 0)
    rows = rows[np.argsort(group_of[table.tensor[rows]], kind="stable")]
    split = np.flatnonzero(np.diff(group_of[table.tensor[rows]])) + 1
    return {int(group_of[table.tensor[part[0]]]): part for part in np.split(rows, split)}


class Coverage:
    """What a set of holders leaves uncovered, per group of ``grouping``."""

    def __init__(self, grouping: Grouping) -> None:
        self.grouping = grouping
        self.epoch = grouping.epoch
        self._classes: list[tuple[_Shape, tuple[Bounds, ...]]] = [((), ())]  # class 0: covered
        self._ids: dict[tuple[_Shape, tuple[Bounds, ...]], int] = {}
        self._steps: dict[tuple[int, bytes], int] = {}
        shapes = grouping.shapes
        of = []
        for t in grouping.rep:
            shape = _shape(shapes, int(t))
            of.append(self._intern(shape, (tuple((0, d) for d in shape),)) if all(shape) else 0)  # empty: covered
        self.of = np.asarray(of, np.int64)

    def add(self, keys: HolderKeys) -> None:
        """Count a holder's regions (its keys for this grouping's epoch) as covered."""
        assert keys.epoch == self.epoch, "holder keys of another epoch"
        first = keys.first
        if (first == _WHOLE).all():
            self.of[:] = 0
            return
        for g in np.flatnonzero((self.of != 0) & (first != _NONE)):
            rows = keys.rows(int(g))
            if rows is None:
                self.of[g] = 0
                continue
            for row in rows:
                self.of[g] = self._step(int(self.of[g]), row)

    def _step(self, cls: int, row: np.ndarray) -> int:
        if cls == 0:
            return 0
        key = (cls, row.tobytes())
        done = self._steps.get(key)
        if done is None:
            shape, left = self._classes[cls]
            rest = cut_out(list(left), _row_boxes(row, shape))
            done = self._steps[key] = self._intern(shape, tuple(sorted(rest)))
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

    def missing(self, shown: int) -> tuple[list[tuple[int, Bounds]], int]:
        """The first ``shown`` uncovered (tensor, box) pairs, and how many there are."""
        open_ = np.flatnonzero(self.of)
        if not len(open_):
            return [], 0
        sizes = np.bincount(self.grouping.of, minlength=self.grouping.count)
        total = sum(int(sizes[g]) * len(self._classes[int(self.of[g])][1]) for g in open_)
        tensors = np.flatnonzero(self.of[self.grouping.of] != 0)
        out: list[tuple[int, Bounds]] = []
        for t in tensors[:shown]:
            for box in self._classes[int(self.of[self.grouping.of[t]])][1]:
                if len(out) == shown:
                    return out, total
                out.append((int(t), box))
        return out, total

    def touches_holes(self, keys: HolderKeys) -> bool:
        """Whether any region of the holder has an element nobody covers."""
        for g in np.flatnonzero(self.of):
            rows = keys.rows(int(g))
            shape, left = self._classes[int(self.of[g])]
            mine = [tuple((0, d) for d in shape)] if rows is None else [b for r in rows for b in _row_boxes(r, shape)]
            if any(intersect(a, b) is not None for a in mine for b in left):
                return True
        return False


def group_numel(keys: HolderKeys) -> np.ndarray:
    """Elements the holder has of one tensor of each group (per group); kept on the keys."""
    if keys.numel is None:
        span = np.maximum(keys.hi - keys.lo, 0).astype(np.int64)
        out = span.prod(axis=1)
        for g, boxes in keys.odd.items():
            out[g] = sum(int(np.prod([b - a for a, b in box])) for box in boxes)
        keys.numel = out
    return keys.numel


def coverage_of(grouping: Grouping, keys: Sequence[HolderKeys]) -> Coverage:
    """What the holders (``keys``, in the order to add them) leave uncovered;
    adding stops once nothing is. A version's visibility is asked again at
    every withdrawal, of much the same holders: a complete answer is kept per
    grouping epoch by the keys that completed it, and is shared (nothing
    changes a complete coverage), so asking again costs a few lookups."""
    memo = grouping.complete_memo
    if memo.get("epoch") != grouping.epoch or len(memo) > _COVERS_KEPT:
        memo.clear()
        memo["epoch"] = grouping.epoch
    prefix: tuple[int, ...] = ()
    for k in keys[:_PREFIX_KEPT]:
        prefix += (id(k),)
        hit = memo.get(prefix)
        if hit is not None:
            return hit[0]
    coverage = Coverage(grouping)
    for n, k in enumerate(keys, 1):
        coverage.add(k)
        if coverage.complete:
            if n <= _PREFIX_KEPT:
                memo[prefix[:n]] = (coverage, tuple(keys[:n]))  # the keys kept alive: their ids stay theirs
            break
    return coverage


_PREFIX_KEPT = 32  # the longest run of holders whose complete coverage ``coverage_of`` remembers


def held_elements(keys: HolderKeys) -> int:
    """Elements the holder has of the whole version; kept on the keys."""
    if keys.elements is None:
        keys.elements = int((group_numel(keys) * keys.sizes).sum())
    return keys.elements


def covering_prefix(grouping: Grouping, base: list[HolderKeys], more: Sequence[HolderKeys]) -> int | None:
    """The fewest of ``more``, in order, that with ``base`` cover every tensor;
    None when all of them do not. Element counts give a first candidate (no
    fewer can cover), summed block by block (a few dozen of a thousand holders
    are most often enough: ``more`` may compute its keys on demand); boxes
    check it, then a galloping search past it."""
    if any(k.table is None for k in base):  # a holder of every tensor whole: the common case, O(1)
        return 0
    rep_numel = grouping.shapes.numel[grouping.rep]
    have = sum((group_numel(k) for k in base), np.zeros(grouping.count, np.int64))
    n = len(more)
    start = 0 if (have >= rep_numel).all() else None
    done, block = 0, 16
    while start is None and done < n:
        keys = [more[i] for i in range(done, min(n, done + block))]
        whole = next((i for i, k in enumerate(keys) if k.table is None), None)
        if whole is not None:  # no search past a whole holder
            keys = keys[:whole + 1]
            n = done + whole + 1
        running = have + np.cumsum(np.stack([group_numel(k) for k in keys]), axis=0)
        enough = np.flatnonzero((running >= rep_numel).all(axis=1))
        if len(enough):
            start = done + int(enough[0]) + 1
        have, done, block = running[-1], done + len(keys), block * 2
    if start is None:
        start = n

    def ok(p: int) -> bool:
        return covers(grouping, base + [more[i] for i in range(p)])

    if ok(start):
        return start
    if start >= n or not ok(n):
        return None
    lo, step = start, 1  # ok(lo) is False
    while True:
        hi = min(lo + step, n)
        if ok(hi):
            break
        lo, step = hi, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def covers(grouping: Grouping, holders: list[HolderKeys]) -> bool:
    """Whether the holders cover every tensor. The answer depends only on which
    distinct regions they hold, and holders cut alike share their keys (the
    relays of one TP rank, every version's trainer rank r): kept per set of
    keys for the grouping's epoch, so the thousand readers of a version, each
    asking about its own few holders, pay the box algebra once per distinct set."""
    distinct = list({id(k): k for k in holders}.values())
    memo = grouping.covers_memo
    if memo.get("epoch") != grouping.epoch:
        memo.clear()
        memo["epoch"] = grouping.epoch
    key = frozenset(id(k) for k in distinct)
    hit = memo.get(key)
    if hit is not None:
        return hit[0]
    result = _covers(grouping, distinct)
    if len(memo) > _COVERS_KEPT:
        memo.clear()
        memo["epoch"] = grouping.epoch
    memo[key] = (result, tuple(distinct))  # the keys kept alive: their ids stay theirs
    return result


_COVERS_KEPT = 4096  # distinct holder sets remembered per grouping epoch


def _covers(grouping: Grouping, holders: list[HolderKeys]) -> bool:
    """``covers``, computed: per group, the holders' boxes on a grid of their own
    boundaries (coordinate compression), with a difference array; no order, no
    remainders, a few numpy calls per group."""
    if not holders:
        return len(grouping.of) == 0
    lo = np.stack([k.lo for k in holders])  # H x G x D
    hi = np.stack([k.hi for k in holders])
    shapes = grouping.shapes
    for g in range(grouping.count):
        shape = _shape(shapes, int(grouping.rep[g]))
        if not all(shape):
            continue
        width = len(shape)
        glo, ghi = lo[:, g, :width], hi[:, g, :width]
        keep = (ghi > glo).all(axis=1) if width else np.ones(len(holders), bool)
        extra = [b for k in holders for b in k.odd.get(g, ())]
        if extra:
            glo = np.concatenate([glo[keep], np.array([[a for a, _ in b] for b in extra], np.int64).reshape(-1, width)])
            ghi = np.concatenate([ghi[keep], np.array([[b for _, b in x] for x in extra], np.int64).reshape(-1, width)])
        else:
            glo, ghi = glo[keep], ghi[keep]
        if not len(glo):
            return False
        if width and not _grid_covered(shape, glo, ghi):
            return False
    return True


def _grid_covered(shape: _Shape, lo: np.ndarray, hi: np.ndarray) -> bool:
    cuts = [np.unique(np.concatenate([[0, n], lo[:, d], hi[:, d]])) for d, n in enumerate(shape)]
    a = [np.searchsorted(cuts[d], lo[:, d]) for d in range(len(shape))]
    b = [np.searchsorted(cuts[d], hi[:, d]) for d in range(len(shape))]
    grid = np.zeros([len(c) for c in cuts], np.int64)
    for corner in range(1 << len(shape)):  # +1 / -1 at the box's 2^D corners
        at = tuple(b[d] if corner >> d & 1 else a[d] for d in range(len(shape)))
        np.add.at(grid, at, -1 if corner.bit_count() % 2 else 1)
    for d in range(len(shape)):
        grid = np.cumsum(grid, axis=d)
    return bool((grid[tuple(slice(0, len(c) - 1) for c in cuts)] > 0).all())


def _shape(shapes: Shapes, t: int) -> _Shape:
    return tuple(int(d) for d in shapes.dims[t, :int(shapes.ndim[t])])


def _row_boxes(row: np.ndarray, shape: _Shape) -> list[Bounds]:
    """The boxes of a key row (flat, lo..., hi...) of a tensor of ``shape``."""
    width = (len(row) - 1) // 2
    lo, hi = row[1:1 + width], row[1 + width:]
    if row[0]:
        return Region(flat=(int(lo[0]), int(hi[0]))).boxes(shape)
    return [tuple((int(a), int(b)) for a, b in zip(lo[:len(shape)], hi[:len(shape)]))]
