"""Many held regions as one table of numbers: what a replica holds when it holds
10^5 tensor slices (a TP=8 worker of a MoE model).

A list of ``(tensor, Region)`` costs hundreds of bytes per region in Python and
tens on the wire; the server keeps one per replica and sends it to every
reader. A ``RegionTable`` keeps the same regions as numpy columns, and its wire
form (``HeldRegions`` in the proto) as packed varints that are 0 for a whole
dimension:

    [(tensor, Region), ...] ──from_held──▶ RegionTable ──to_packed──▶ tensor_step, cut, flat
                                 ▲             │                      (about 6 bytes a region)
                                 └──held()─────┘◀──from_packed──────── (checked: problem())

``cut`` lists, per region and per dimension of its tensor, the start and the
distance from the stop to the dimension's end; a flat region lists its element
range the same way against the tensor's element count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tensorhub.manifest import Manifest, itemsize
from tensorhub.regions import Region

Held = tuple[int, Region]


@dataclass(frozen=True, slots=True)
class Shapes:
    """A manifest's shapes as arrays: ``dims`` (T, D) padded with 1 to the
    manifest's largest rank D, ``ndim``, ``numel`` and ``itemsize`` per tensor."""

    dims: np.ndarray
    ndim: np.ndarray
    numel: np.ndarray
    itemsize: np.ndarray

    @classmethod
    def of(cls, manifest: Manifest) -> Shapes:
        tensors = manifest.tensors
        width = max((len(t.shape) for t in tensors), default=0) or 1
        dims = np.ones((len(tensors), width), np.int64)
        ndim = np.zeros(len(tensors), np.int64)
        sizes: dict[str, int] = {}
        items = np.zeros(len(tensors), np.int64)
        for i, t in enumerate(tensors):
            n = len(t.shape)
            if n:
                dims[i, :n] = t.shape
            ndim[i] = n
            items[i] = sizes[t.dtype] if t.dtype in sizes else sizes.setdefault(t.dtype, itemsize(t.dtype))
        return cls(dims, ndim, dims.prod(axis=1), items)

    @property
    def width(self) -> int:
        return self.dims.shape[1]


@dataclass(frozen=True, slots=True)
class RegionTable:
    """``tensor`` (n,), ``flat`` (n,) bool, ``lo``/``hi`` (n, D): a box's bounds
    per dimension (1 past a tensor's rank: 0:1), or a flat range in column 0."""

    tensor: np.ndarray
    flat: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    # Set when the table came from chunk rules: per manifest tensor its rule id
    # (0: not held). Tensors of one shape and one rule hold the same box.
    rule_of: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tensor)

    # ------------------------------------------------------------ building

    @classmethod
    def from_held(cls, held: list[Held], shapes: Shapes) -> RegionTable:
        n, width = len(held), shapes.width
        tensor = np.fromiter((i for i, _ in held), np.int64, n)
        flat = np.zeros(n, bool)
        lo = np.zeros((n, width), np.int64)
        hi = np.ones((n, width), np.int64)
        for k, (index, region) in enumerate(held):
            if region.flat is not None:
                flat[k] = True
                lo[k, 0], hi[k, 0] = region.flat
            elif region.box is not None:
                for d, (a, b) in enumerate(region.box[:width]):
                    lo[k, d], hi[k, d] = a, b
            elif 0 <= index < len(shapes.dims):
                hi[k] = shapes.dims[index]
        return cls(tensor, flat, lo, hi)

    @classmethod
    def from_packed(cls, tensor_step: np.ndarray, cut: np.ndarray, flat_at: np.ndarray,
                    shapes: Shapes) -> RegionTable:
        """ValueError when the columns do not fit together or name unknown
        tensors; the bounds themselves are checked by ``problem()``."""
        n = len(tensor_step)
        tensor = np.cumsum(np.asarray(tensor_step, np.int64))
        if n and (tensor.min() < 0 or tensor.max() >= len(shapes.ndim)):
            bad = int(tensor[(tensor < 0) | (tensor >= len(shapes.ndim))][0])
            raise ValueError(f"a held region names tensor #{bad}; the manifest has {len(shapes.ndim)}")
        flat = np.zeros(n, bool)
        flat_at = np.asarray(flat_at, np.int64)
        if len(flat_at) and (flat_at.min() < 0 or flat_at.max() >= n):
            raise ValueError(f"flat region position outside the {n} held regions")
        flat[flat_at] = True
        ndim = np.where(flat, 1, shapes.ndim[tensor])
        cut = np.asarray(cut, np.int64)
        if int(2 * ndim.sum()) != len(cut):
            raise ValueError(f"{len(cut)} cuts for {n} held regions of {int(ndim.sum())} dimensions in all")
        width = shapes.width
        base = np.zeros(n, np.int64)
        if n > 1:
            np.cumsum(2 * ndim[:-1], out=base[1:])
        size = np.where(flat[:, None], 1, shapes.dims[tensor])
        size[flat, 0] = shapes.numel[tensor[flat]]
        lo = np.zeros((n, width), np.int64)
        hi = np.ones((n, width), np.int64)
        for d in range(width):
            has = ndim > d
            lo[has, d] = cut[base[has] + 2 * d]
            hi[has, d] = size[has, d] - cut[base[has] + 2 * d + 1]
        return cls(tensor, flat, lo, hi)

    def to_packed(self, shapes: Shapes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tensor_step, cut, flat positions): the columns of ``HeldRegions``."""
        n, width = len(self), shapes.width
        step = np.diff(self.tensor, prepend=0)
        ndim = np.where(self.flat, 1, shapes.ndim[self.tensor])
        size = np.where(self.flat[:, None], 1, shapes.dims[self.tensor])
        size[self.flat, 0] = shapes.numel[self.tensor[self.flat]]
        pairs = np.stack([self.lo, size - self.hi], axis=2).reshape(n, 2 * width)
        keep = np.arange(2 * width)[None, :] < 2 * ndim[:, None]
        return step, pairs[keep], np.flatnonzero(self.flat)

    def compact(self) -> RegionTable:
        """The same table in 32-bit columns where the numbers fit (what the
        server keeps per replica: 21 bytes a 2-D region instead of 41)."""
        small = np.iinfo(np.int32).max
        if len(self) and max(int(self.hi.max()), int(self.tensor.max())) > small:
            return self
        return RegionTable(self.tensor.astype(np.int32), self.flat, self.lo.astype(np.int32),
                           self.hi.astype(np.int32), self.rule_of)

    # ------------------------------------------------------------ reading

    def region(self, k: int, shapes: Shapes) -> Region:
        index = int(self.tensor[k])
        if self.flat[k]:
            return Region(flat=(int(self.lo[k, 0]), int(self.hi[k, 0])))
        n = int(shapes.ndim[index])
        box = tuple(zip(self.lo[k, :n].tolist(), self.hi[k, :n].tolist()))
        return Region() if box == tuple((0, int(d)) for d in shapes.dims[index, :n]) else Region(box=box)

    def held(self, shapes: Shapes) -> list[Held]:
        return [(int(self.tensor[k]), self.region(k, shapes)) for k in range(len(self))]

    def numel(self) -> np.ndarray:
        """Elements of each region."""
        span = self.hi.astype(np.int64) - self.lo
        return np.where(self.flat, span[:, 0], row_products(span))

    def nbytes(self, shapes: Shapes) -> np.ndarray:
        return self.numel() * shapes.itemsize[self.tensor]

    def whole(self, shapes: Shapes) -> np.ndarray:
        """Which regions span their whole tensor."""
        return self.numel() == shapes.numel[self.tensor]

    def suspect_overlaps(self) -> np.ndarray:
        """The tensors (manifest indices, sorted) that may hold two regions
        meeting each other: those with a flat range among several regions
        (left to the exact check) and those with two boxes that intersect.
        Every pair of a tensor's boxes is compared at once, grouped by the
        tensor's number of regions: a trainer's cut holds each tensor it owns
        in one box per reader (8 for TP=8), and one Python sweep per tensor
        was most of the server's time on such a publish."""
        if len(self) < 2:
            return np.zeros(0, np.int64)
        order = np.argsort(self.tensor, kind="stable")
        tensors, starts, counts = np.unique(self.tensor[order], return_index=True, return_counts=True)
        multi = counts > 1
        flat_in = np.zeros(len(tensors), bool)
        np.logical_or.at(flat_in, np.searchsorted(tensors, self.tensor[self.flat]), True)
        suspect = multi & flat_in
        lo, hi = self.lo[order], self.hi[order]
        for count in np.unique(counts[multi & ~flat_in]):
            groups = np.flatnonzero((counts == count) & ~flat_in)
            rows = starts[groups][:, None] + np.arange(count)  # (groups, count) rows of each tensor
            a, b = np.triu_indices(int(count), k=1)  # every pair once
            ra, rb = rows[:, a], rows[:, b]  # (groups, pairs)
            meet = ((lo[ra] < hi[rb]) & (lo[rb] < hi[ra])).all(axis=2).any(axis=1)
            suspect[groups[meet]] = True
        return tensors[suspect].astype(np.int64)

    def problem(self, shapes: Shapes) -> tuple[int, str] | None:
        """The first region that does not fit its tensor, and why; None when all fit."""
        if not len(self):
            return None
        numel = shapes.numel[self.tensor]
        size = np.where(self.flat[:, None], 1, shapes.dims[self.tensor])
        size[:, 0] = np.where(self.flat, numel, size[:, 0])
        bad = ((self.lo < 0) | (self.lo >= self.hi) | (self.hi > size)).any(axis=1)
        if not bad.any():
            return None
        k = int(np.flatnonzero(bad)[0])
        index = int(self.tensor[k])
        shape = tuple(int(d) for d in shapes.dims[index, :int(shapes.ndim[index])])
        if self.flat[k]:
            region = Region(flat=(int(self.lo[k, 0]), int(self.hi[k, 0])))
        else:
            n = len(shape)
            region = Region(box=tuple(zip(self.lo[k, :n].tolist(), self.hi[k, :n].tolist())))
        return k, region.problem(shape) or f"region {region.describe()} does not fit {list(shape)}"


# ---------------------------------------------------------------- chunk rules

# A rule (dim, parts, part): the tensor cut along ``dim`` into ``parts`` chunks as
# ``torch.chunk`` cuts it (chunks of ceil(size / parts)), and chunk ``part`` of it.
# (0, 1, 0) is the whole tensor. An FSDP rank's rows of every tensor, or a TP
# worker's rows, columns or whole copies, are a few rules shared by 10^5 tensors.
Rule = tuple[int, int, int]
MAX_RULES = 255  # rule ids are one byte per tensor


def chunk_bounds(size: np.ndarray, parts: np.ndarray, part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    step = -(-size // parts)
    start = part * step
    return start, np.minimum(start + step, size)


def rules_of(table: RegionTable, shapes: Shapes) -> tuple[list[Rule], np.ndarray] | None:
    """The table as chunk rules: (rules, one byte per manifest tensor: 0 not
    held, k for rules[k - 1]); None when it is not that (a flat region, two
    cut dimensions, an uneven cut, tensors out of manifest order, or more
    than ``MAX_RULES`` rules)."""
    n = len(table)
    if not n or table.flat.any() or (np.diff(table.tensor) <= 0).any():
        return None
    dims = shapes.dims[table.tensor]
    lo, hi = table.lo.astype(np.int64), table.hi.astype(np.int64)
    cut = (lo != 0) | (hi != dims)
    if (cut.sum(axis=1) > 1).any():
        return None
    rows = np.arange(n)
    d = cut.argmax(axis=1)
    size, a, b = dims[rows, d], lo[rows, d], hi[rows, d]
    whole = ~cut.any(axis=1)
    step = np.where(whole, size, b - a)
    parts = np.where(whole, 1, -(-size // np.maximum(step, 1)))
    part = np.where(whole, 0, a // np.maximum(step, 1))
    d = np.where(whole, 0, d)
    start, stop = chunk_bounds(size, parts, part)
    for k in np.flatnonzero((start != np.where(whole, 0, a)) | (stop != np.where(whole, size, b))):
        found = _last_chunk(int(size[k]), int(a[k]), int(b[k]))  # torch.chunk's last piece may be short
        if found is None:
            return None
        parts[k], part[k] = found
    keys = np.column_stack([d, parts, part])
    uniq, inverse = unique_rows(keys)
    if len(uniq) > MAX_RULES:
        return None
    rule_of = np.zeros(len(shapes.ndim), np.uint8)
    rule_of[table.tensor] = inverse + 1
    return [tuple(int(x) for x in row) for row in uniq], rule_of


def _last_chunk(size: int, a: int, b: int) -> tuple[int, int] | None:
    """(parts, part) whose chunk is [a, b) when b is the end: chunks of some
    c dividing a, with c >= b - a."""
    if b != size or a == 0:
        return None
    for k in range(1, a + 1):
        if a % k:
            continue
        c = a // k
        if c < b - a:
            return None
        parts = -(-size // c)
        if -(-size // parts) == c:
            return parts, k
    return None


def table_of_rules(rules: list[Rule], rule_of: np.ndarray, shapes: Shapes) -> RegionTable:
    """The inverse of ``rules_of``; ValueError for an unknown rule id, a
    dimension past a tensor's rank or an empty chunk."""
    if len(rule_of) != len(shapes.ndim):
        raise ValueError(f"rule_of names {len(rule_of)} tensors; the manifest has {len(shapes.ndim)}")
    tensor = np.flatnonzero(rule_of).astype(np.int64)
    ids = rule_of[tensor].astype(np.int64) - 1
    if len(ids) and ids.max() >= len(rules):
        raise ValueError(f"rule id {int(ids.max()) + 1} of {len(rules)} rules")
    table_rules = np.array(rules, np.int64).reshape(-1, 3)
    if len(table_rules) and ((table_rules[:, 1] < 1) | (table_rules[:, 2] < 0) | (table_rules[:, 0] < 0)).any():
        raise ValueError("a rule has no parts, a negative part or a negative dimension")
    every = len(tensor) == len(rule_of)  # every tensor held (an FSDP rank): no gather by index
    dims = shapes.dims if every else shapes.dims[tensor]
    ndim = shapes.ndim if every else shapes.ndim[tensor]
    if len(table_rules) == 1:  # one rule for all (an FSDP rank's 1/n of each tensor): scalars, no per-row take
        d, parts, part = (int(v) for v in table_rules[0])
        if d >= 1 and parts > 1 and (ndim <= d).any():
            raise ValueError("a rule cuts a dimension past its tensor's rank")
        d = min(d, dims.shape[1] - 1)
        size = dims[:, d]
        step = -(-size // parts)
        start = step * part
        stop = np.minimum(start + step, size)
        if (start >= stop).any() and (size > 0).all():
            raise ValueError("a rule names an empty chunk of a tensor")
        lo = np.zeros_like(dims)
        hi = dims.copy()
        lo[:, d], hi[:, d] = start, stop
        return RegionTable(tensor, np.zeros(len(tensor), bool), lo, hi, np.asarray(rule_of, np.uint8))
    d, parts, part = (table_rules[ids, k] for k in range(3))
    if ((d >= np.maximum(ndim, 1)) & (parts > 1)).any():
        raise ValueError("a rule cuts a dimension past its tensor's rank")
    rows = np.arange(len(tensor))
    d = np.minimum(d, dims.shape[1] - 1)
    size = dims[rows, d]
    start, stop = chunk_bounds(size, parts, part)
    if (start >= stop).any() and (size > 0).all():
        raise ValueError("a rule names an empty chunk of a tensor")
    lo = np.zeros_like(dims)
    hi = dims.copy()
    lo[rows, d], hi[rows, d] = start, stop
    return RegionTable(tensor, np.zeros(len(tensor), bool), lo, hi, np.asarray(rule_of, np.uint8))


def row_products(a: np.ndarray) -> np.ndarray:
    """``a.prod(axis=1)`` for a few columns, a multiply per column: numpy's
    reduction along a short axis is 6x slower at 10^5 rows (a Kimi-K2 held
    table: 70k rows, counted on every publish)."""
    if a.shape[1] == 0:
        return np.ones(len(a), a.dtype)
    out = a[:, 0].copy()
    for c in range(1, a.shape[1]):
        out *= a[:, c]
    return out


_DENSE_PER_ROW = 4  # packed keys spanning at most this many values a row are counted in a table, not sorted


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(rows, axis=0, return_inverse=True)`` for integer rows:
    np.unique compares rows as opaque bytes, 50x slower at 10^5. The columns
    are packed into one integer (mixed radix, the first column most
    significant: the same order) where they fit, and the distinct keys found
    by a table of the keys' range when it is small (a publish's coverage
    groups: 70k tensors, a few thousand groups, 10 ms -> well under 1 ms),
    else by a 1-D sort; else a lexsort of the columns."""
    if not len(rows):
        return rows, np.zeros(0, np.int64)
    n, width = rows.shape
    columns = [rows[:, c].astype(np.int64) for c in range(width)]  # reductions along axis 0: 20x slower
    lo = [int(col.min()) for col in columns]
    radix = [int(col.max()) - low + 1 for col, low in zip(columns, lo)]
    if math.prod(radix) < 1 << 62:
        key = np.zeros(n, np.int64)
        for c in range(width):
            key *= radix[c]
            key += columns[c] - lo[c]
        total = math.prod(radix)
        if total <= _DENSE_PER_ROW * n + 1024:
            first = np.full(total, n, np.int64)
            first[key[::-1]] = np.arange(n)[::-1]  # a repeated key keeps the last write: its first row
            present = first < n
            ids = np.cumsum(present) - 1
            return rows[first[present]], ids[key]
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        return rows[first], inverse.reshape(-1).astype(np.int64)
    return _unique_rows_sorted(rows)


def _unique_rows_sorted(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``unique_rows`` through a lexsort of the columns (any integer rows)."""
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    new = np.r_[True, (ordered[1:] != ordered[:-1]).any(axis=1)]
    inverse = np.empty(len(rows), np.int64)
    inverse[order] = np.cumsum(new) - 1
    return ordered[new], inverse


def memory_gaps(addr: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Each region's address less the previous one's end (its own address for
    the first): 0 for regions back to back, so a packed varint of 1 byte."""
    addr = np.asarray(addr, np.int64)
    prev_end = np.concatenate([[0], addr[:-1] + np.asarray(size, np.int64)[:-1]])
    return addr - prev_end


def memory_addrs(gaps: np.ndarray, size: np.ndarray) -> np.ndarray:
    """The inverse of ``memory_gaps``."""
    gaps = np.asarray(gaps, np.int64)
    size = np.asarray(size, np.int64)
    if not len(gaps):
        return gaps
    # addr[k] = gaps[k] + addr[k-1] + size[k-1]  =>  addr = cumsum(gaps) + cumsum(size) shifted by one
    shifted = np.concatenate([[0], np.cumsum(size[:-1])])
    return np.cumsum(gaps) + shifted



_SHAPES: dict[int, tuple[Manifest, Shapes]] = {}
_SHAPES_KEPT = 16


def shapes_of(manifest: Manifest) -> Shapes:
    """``Shapes.of(manifest)``, kept for the last few manifests (by identity:
    the server and the client keep one Manifest object per version)."""
    kept = _SHAPES.get(id(manifest))
    if kept is not None and kept[0] is manifest:
        return kept[1]
    shapes = Shapes.of(manifest)
    if len(_SHAPES) >= _SHAPES_KEPT:
        _SHAPES.pop(next(iter(_SHAPES)))
    _SHAPES[id(manifest)] = (manifest, shapes)
    return shapes


def whole_table(shapes: Shapes) -> RegionTable:
    """Every tensor whole, in manifest order: what an empty held list means."""
    n = len(shapes.ndim)
    return RegionTable(np.arange(n, dtype=np.int64), np.zeros(n, bool), np.zeros_like(shapes.dims), shapes.dims.copy())
