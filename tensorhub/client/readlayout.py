"""The reader's bytes, and what each holder can give of them.

The reader's *read set* is a list of parts (a region of a manifest tensor, in
local memory); laid back to back they form the reader's byte space, cut into
chunks of ``chunk_size``. A chunk is the unit of planning, completion and
(when the reader serves) of what it reports to the server: chunk i of the
reader is chunk i of the replica it serves.

    read parts ──────────┐
                         ├─ overlap() per held region ─▶ HolderMap: segments (reader offset,
    holder's held regions┘   split at chunk boundaries     length, local addr, remote addr),
                             (and the holder's own, when    only those it has landed
                             it is still filling)
                                                            │
    planner ranks the holders of a chunk ─▶ transfers(): the first gives what it has,
                                            the next what is still missing, ...

Every segment lies inside one read part and one held region, so addresses on
both sides are plain offsets.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from tensorhub.client.boxsegments import Boxes, box_segments, columns
from tensorhub.client.rpc import RemoteReplica
from tensorhub.client.transfer import Transfer
from tensorhub.manifest import Manifest, itemsize
from tensorhub.regions import Region, Runs, describe_elements, overlap
from tensorhub.transport.memory import MemoryRegion

# Columns of a segment table; the first four move together when a segment is cut.
_SHIFTING = ("r_off", "h_off", "local", "remote")
_FIXED = ("local_dev", "remote_dev")


@dataclass(frozen=True, slots=True)
class ReadPart:
    """One region the reader wants: manifest tensor ``tensor``, in local memory."""

    name: str
    tensor: int
    shape: tuple[int, ...]
    runs: Runs | None  # None: made from ``region`` if ever needed (the box path needs none)
    itemsize: int
    memory: MemoryRegion
    region: Region | None = None  # the region ``runs`` come from: given, holder tables take the box path

    @property
    def nbytes(self) -> int:
        return self.memory.size

    def element_runs(self) -> Runs:
        return self.runs if self.runs is not None else self.region.runs(self.shape)


class HolderMap:
    """The segments of the reader's bytes one holder can give now, sorted by
    reader offset and cut at the reader's chunk boundaries."""

    def __init__(self, replica: RemoteReplica, cols: dict[str, np.ndarray], chunk_size: int, num_chunks: int) -> None:
        self.replica = replica
        self.cols = cols
        self.chunk = cols["r_off"] // chunk_size
        self._bounds = np.searchsorted(self.chunk, np.arange(num_chunks + 1))
        self.covered = np.bincount(self.chunk, weights=cols["length"], minlength=num_chunks).astype(np.int64)
        # Per chunk, this holder's segments of it: READ descriptors when read exactly (planner rule 5)
        self.segments = np.diff(self._bounds)

    @property
    def replica_id(self) -> str:
        return self.replica.source.replica_id

    def rows(self, chunk: int) -> slice:
        return slice(int(self._bounds[chunk]), int(self._bounds[chunk + 1]))


class ReadLayout:
    def __init__(self, manifest: Manifest, parts: list[ReadPart], chunk_size: int) -> None:
        self.manifest = manifest
        self.parts = parts
        self.chunk_size = chunk_size
        sizes = np.array([p.nbytes for p in parts], np.int64)
        self.part_base = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.total_bytes = int(self.part_base[-1])
        self.num_chunks = -(-self.total_bytes // chunk_size)
        # Every tensor's elements laid end to end (the "model space"): the runs of
        # all parts, or of all held regions, then overlap in one vectorised call
        # (for the tensors the box path does not take; made on first use).
        numels = [math.prod(t.shape) for t in manifest.tensors]
        self._tensor_base = np.concatenate([[0], np.cumsum(numels, dtype=np.int64)]).astype(np.int64)
        self._itemsize = np.array([itemsize(t.dtype) for t in manifest.tensors], np.int64)
        self._reader_runs: tuple[Runs, np.ndarray] | None = None
        self._part_addr = np.array([p.memory.addr for p in parts], np.int64)
        self._part_dev = np.array([p.memory.device_id for p in parts], np.int64)
        self._part_tensor = np.array([p.tensor for p in parts], np.int64)
        self._shapes = [tuple(t.shape) for t in manifest.tensors]
        self._cols = columns(self._shapes)
        self._part_boxes = Boxes.of([(p.tensor, p.region) for p in parts], self._shapes)
        sizes = set(self._itemsize[self._part_tensor].tolist())
        self._part_size = sizes.pop() if len(sizes) == 1 else 0  # one dtype size (bf16 weights): no gather

    def _model_space(self, pieces: list[tuple[int, Runs]]) -> tuple[Runs, np.ndarray]:
        """The runs of ``(tensor, runs)`` pieces in model space, sorted, with the
        piece each run belongs to; offsets stay local to the piece."""
        if not pieces:
            empty = np.zeros(0, np.int64)
            return Runs(empty, empty, empty), empty
        start = np.concatenate([r.start + self._tensor_base[t] for t, r in pieces])
        length = np.concatenate([r.length for _, r in pieces])
        offset = np.concatenate([r.offset for _, r in pieces])
        owner = np.repeat(np.arange(len(pieces)), [len(r.start) for _, r in pieces])
        if bool((np.diff(start) >= 0).all()):  # pieces in manifest order: sorted already
            return Runs(start, length, offset), owner
        order = np.argsort(start, kind="stable")
        return Runs(start[order], length[order], offset[order]), owner[order]

    def chunk_bytes(self, chunk: int) -> int:
        return min(self.chunk_size, self.total_bytes - chunk * self.chunk_size)

    def chunk_memory(self, chunk: int) -> list[tuple[int, int]]:
        """The local memory of reader ``chunk``, in order: (address, bytes) per part it spans."""
        a = chunk * self.chunk_size
        b = a + self.chunk_bytes(chunk)
        out = []
        p = self._part(a)
        while a < b:
            end = min(b, int(self.part_base[p + 1]))
            if end > a:
                out.append((int(self._part_addr[p]) + a - int(self.part_base[p]), end - a))
                a = end
            p += 1
        return out

    def signature_arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays that fix what this layout reads and where it lands
        (``plancache.signature``; its parts without a box add their regions)."""
        b = self._part_boxes
        return (self.part_base, self._part_addr, self._part_dev, b.tensor, b.r0, b.r1, b.c0, b.c1, b.ok, b.index,
                b.base)

    def parts_without_box(self) -> list[ReadPart]:
        return [self.parts[i] for i in self._part_boxes.regions_without_box().tolist()]

    def same_cut(self, replica: RemoteReplica, table: dict[str, np.ndarray]) -> bool:
        """Whether ``replica``'s chunks are this read set's chunks, byte for byte
        (it holds exactly these parts in this order, cut at the same size)."""
        return (replica.chunk_size == self.chunk_size and int(table["length"].sum()) == self.total_bytes
                and int(replica.regions[:, 1].sum()) == self.total_bytes
                and bool(np.array_equal(table["r_off"], table["h_off"])))

    # ------------------------------------------------------------ holders

    def holder_map(self, replica: RemoteReplica, table: dict[str, np.ndarray] | None = None) -> HolderMap:
        """What ``replica`` holds of the read set (and, while it fills, has landed).
        ``table``: its ``holder_table``, when the caller kept it from an earlier plan."""
        cols = self.holder_table(replica) if table is None else table
        if not replica.source.complete:
            bits = np.unpackbits(np.frombuffer(replica.bitmap, np.uint8), bitorder="little")
            own = cols["h_off"] // replica.chunk_size
            landed = np.zeros(len(own), bool)
            inside = own < len(bits)
            landed[inside] = bits[own[inside]].astype(bool)
            cols = {k: v[landed] for k, v in cols.items()}
        return HolderMap(replica, cols, self.chunk_size, self.num_chunks)

    def holder_table(self, replica: RemoteReplica) -> dict[str, np.ndarray]:
        """Every segment of the read set ``replica``'s regions cover, cut at the
        reader's chunks and the replica's own; depends only on its regions."""
        held = list(replica.held)
        held_sizes = [region.numel(self._shapes[t]) * int(self._itemsize[t]) for t, region in held]
        held_base = np.concatenate([[0], np.cumsum(held_sizes, dtype=np.int64)]).astype(np.int64)
        p, h, a, b, n = self._segments(held)
        size = self._part_size if self._part_size else self._itemsize[self._part_tensor[p]]
        cols, spare = _table(len(p))
        np.multiply(a, size, out=cols["local"])  # in bytes, then where they lie on each side
        np.add(np.take(self.part_base, p, out=spare), cols["local"], out=cols["r_off"])
        cols["local"] += np.take(self._part_addr, p, out=spare)
        np.multiply(b, size, out=cols["remote"])
        np.add(np.take(held_base, h, out=spare), cols["remote"], out=cols["h_off"])
        cols["remote"] += np.take(replica.regions[:, 0].astype(np.int64), h, out=spare)
        np.multiply(n, size, out=cols["length"])
        np.take(self._part_dev, p, out=cols["local_dev"])
        np.take(replica.regions[:, 2].astype(np.int64), h, out=cols["remote_dev"])
        # a READ descriptor must lie in one registration on either side: join within one part and one held region
        within = np.multiply(p, len(held) + 1, out=spare)
        within += h
        if not bool((np.diff(cols["r_off"]) >= 0).all()):  # sorted already when the parts follow the manifest
            order = np.argsort(cols["r_off"], kind="stable")
            cols, within = {k: v[order] for k, v in cols.items()}, within[order]
        cols = _merge_contiguous(cols, within)
        return _cut_chunks(cols, [("r_off", self.chunk_size), ("h_off", replica.chunk_size)])

    def _segments(self, held: list[tuple[int, Region]]) -> tuple[np.ndarray, ...]:
        """What ``held`` regions give of the read set: (part, held region, element
        offset in the part, in the held region, elements). Tensors whose parts
        name their region from the boxes' corners (``boxsegments``: boxes of any
        number of dimensions, flat ranges as a few boxes), the rest (parts
        given as element runs only) by intersecting element runs."""
        boxes = Boxes.of(held, self._shapes)
        by_box = np.ones(len(self._shapes), bool)
        by_box[self._part_boxes.tensor[~self._part_boxes.ok]] = False
        by_box[boxes.tensor[~boxes.ok]] = False
        out = box_segments(self._part_boxes, boxes, self._cols, by_box)
        rest = [i for i, (t, _) in enumerate(held) if not by_box[t]]
        if not rest:
            return out
        runs, owner = self._model_space([(held[i][0], held[i][1].runs(self._shapes[held[i][0]])) for i in rest])
        if self._reader_runs is None:
            self._reader_runs = self._model_space([(p.tensor, p.element_runs()) for p in self.parts])
        mine, part = self._reader_runs
        keep = ~by_box[self._part_tensor[part]]
        if not keep.all():
            mine, part = Runs(mine.start[keep], mine.length[keep], mine.offset[keep]), part[keep]
        ov = overlap(mine, runs)
        by_run = (part[ov.a_run], np.array(rest, np.int64)[owner[ov.b_run]], ov.a, ov.b, ov.length)
        return tuple(np.concatenate([x, y]) for x, y in zip(out, by_run))

    def holders(self, chunks: list[int], maps: list[HolderMap]) -> dict[int, dict[str, bool]]:
        """The planner's input: per chunk, which holders give all of it (True) or a part."""
        out: dict[int, dict[str, bool]] = {}
        for chunk in chunks:
            need = self.chunk_bytes(chunk)
            out[chunk] = {m.replica_id: bool(m.covered[chunk] >= need) for m in maps if m.covered[chunk] > 0}
        return out

    # ------------------------------------------------------------ transfers

    def transfers(self, chunk: int, ranked: list[HolderMap]) -> list[Transfer] | None:
        """The reads that fill ``chunk``: the first holder gives what it has, each
        next one what is still missing. None if together they miss some bytes."""
        need = self.chunk_bytes(chunk)
        out: list[Transfer] = []
        taken = _no_ranges()  # reader byte ranges already planned
        got = 0
        for holder in ranked:
            rows = holder.rows(chunk)
            cols = {k: v[rows] for k, v in holder.cols.items()}
            if len(taken[0]):
                cols = _subtract(cols, taken)
            if not len(cols["length"]):
                continue
            nbytes = int(cols["length"].sum())
            local = np.stack([cols["local"], cols["length"], cols["local_dev"]], axis=1, dtype=np.uint64,
                             casting="unsafe")  # addresses and sizes are >= 0
            remote = np.stack([cols["remote"], cols["length"], cols["remote_dev"]], axis=1, dtype=np.uint64,
                              casting="unsafe")
            out.append(Transfer(holder.replica_id, local, remote, nbytes, cols["h_off"]))
            got += nbytes
            if got >= need:
                return out
            taken = _union(taken, cols["r_off"], cols["length"])
        return None

    def missing(self, chunks: list[int], maps: list[HolderMap], limit: int = 4) -> str:
        """What no holder in ``maps`` has of ``chunks``, in the manifest's terms:
        gaps of neighbouring chunks joined (a lost shard is one region, not a
        list of its chunks), the first ``limit`` of them."""
        gaps: list[tuple[int, int]] = []
        for chunk in sorted(chunks):
            lo = chunk * self.chunk_size
            hi = lo + self.chunk_bytes(chunk)
            have = _no_ranges()
            for m in maps:
                rows = m.rows(chunk)
                have = _union(have, m.cols["r_off"][rows], m.cols["length"][rows])
            for a, b in _gaps(lo, hi, have):
                if gaps and gaps[-1][1] == a and self._part(a) == self._part(gaps[-1][0]):
                    gaps[-1] = (gaps[-1][0], b)
                else:
                    gaps.append((a, b))
        found = list(dict.fromkeys(self._describe(a, b) for a, b in gaps[: limit + 1]))
        if len(found) > limit:
            return "; ".join(found[:limit]) + " (and more)"
        return "; ".join(found) or "nothing"

    def _part(self, offset: int) -> int:
        return int(np.searchsorted(self.part_base, offset, side="right")) - 1

    def _describe(self, a: int, b: int) -> str:
        """Reader bytes [a, b) as a range of the full tensor where one run holds them."""
        p = int(np.searchsorted(self.part_base, a, side="right")) - 1
        part = self.parts[p]
        ea = (a - int(self.part_base[p])) // part.itemsize
        eb = -(-(min(b, int(self.part_base[p + 1])) - int(self.part_base[p])) // part.itemsize)
        runs = part.element_runs()
        run = int(np.searchsorted(runs.offset, ea, side="right")) - 1
        start, offset, length = int(runs.start[run]), int(runs.offset[run]), int(runs.length[run])
        if eb - offset <= length:  # inside one run: contiguous in the full tensor too
            return f"{part.name} {describe_elements(part.shape, start + ea - offset, start + eb - offset)}"
        return f"{part.name} (elements {ea}:{eb} of the requested region)"


def split(transfer: Transfer, max_bytes: int) -> list[Transfer]:
    """``transfer`` as READs of at most ``max_bytes`` each, in its order; a
    descriptor that crosses a multiple of ``max_bytes`` (counted from the
    transfer's first byte) is cut there. The pieces move the same bytes.

    A checked pull cuts every chunk it reads, between two copies on its
    thread: so a dozen numpy calls for the whole transfer, none per piece."""
    if transfer.nbytes <= max_bytes:
        return [transfer]
    lengths = transfer.local[:, 1].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    # Every segment's first byte after the cut, in the transfer's byte order:
    # the descriptors' own starts and the piece boundaries.
    points = np.union1d(starts[lengths > 0], np.arange(max_bytes, transfer.nbytes, max_bytes, dtype=np.int64))
    row = np.searchsorted(ends, points, side="right")  # the descriptor each segment lies in
    shift = (points - starts[row]).astype(np.uint64)
    length = np.diff(points, append=ends[-1]).astype(np.uint64)
    local = np.asarray(transfer.local, np.uint64)[row]  # copies (fancy indexing)
    remote = np.asarray(transfer.remote, np.uint64)[row]
    local[:, 0] += shift
    remote[:, 0] += shift
    local[:, 1] = remote[:, 1] = length
    h_off = None if transfer.h_off is None else transfer.h_off[row] + shift.astype(np.int64)
    first = np.searchsorted(points, np.arange(0, transfer.nbytes, max_bytes, dtype=np.int64)).tolist()
    bounds = list(zip(first, [*first[1:], len(points)]))
    sizes = [min(max_bytes, transfer.nbytes - at) for at in range(0, transfer.nbytes, max_bytes)]
    return [Transfer(transfer.replica_id, local[a:b], remote[a:b], n, None if h_off is None else h_off[a:b])
            for (a, b), n in zip(bounds, sizes)]


_COLUMNS = ("r_off", "h_off", "length", "local", "remote", "local_dev", "remote_dev")


def _table(n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Empty columns of an ``n``-segment table, and a spare one, in one block:
    a block of megabytes numpy backs with huge pages, where each column on its
    own (a 131,000-segment table: 1 MiB each) cost a page fault per 4 KiB, more
    than the arithmetic that fills it."""
    block = np.empty((len(_COLUMNS) + 1, n), np.int64)
    return dict(zip(_COLUMNS, block)), block[-1]


def _merge_contiguous(cols: dict[str, np.ndarray], within: np.ndarray) -> dict[str, np.ndarray]:
    """Join segments (sorted by ``r_off``) of the same ``within`` group that
    continue one another on both sides, in the reader's byte space, the
    holder's and both memories: where a holder holds a region as the reader
    does (worker k of one engine to worker k of the next, a column slice of
    4,096 rows), its element runs are one contiguous range, moved by one READ
    descriptor, not one per row. Segments of different groups never join, even
    where their memory happens to be adjacent: NIXL finds a descriptor only
    inside one registered region."""
    n = len(cols["length"])
    if n < 2:
        return cols
    joins = within[1:] == within[:-1]
    # The holder's side first: a column slice of row-sharded holders continues
    # on the reader's side at every row and never on the holder's, so it is
    # over after one look (hundreds of thousands of segments, none joined).
    for k in ("remote", "h_off", "r_off", "local"):
        joins &= cols[k][1:] == cols[k][:-1] + cols["length"][:-1]
        if not joins.any():
            return cols
    for k in _FIXED:
        joins &= cols[k][1:] == cols[k][:-1]
    if not joins.any():
        return cols
    first = np.concatenate([[0], np.nonzero(~joins)[0] + 1])
    out = {k: cols[k][first] for k in (*_SHIFTING, *_FIXED)}
    out["length"] = np.add.reduceat(cols["length"], first)
    return out


# Segments crossing a chunk boundary, at most, that ``_cut`` splices in place
# (slice copies per crossing) rather than gathering every column anew: a
# column slice is hundreds of thousands of short segments, a few dozen of
# which cross one of the chunks' boundaries.
_SPLICE_MAX = 256


def _cut_chunks(cols: dict[str, np.ndarray], cuts: list[tuple[str, int]]) -> dict[str, np.ndarray]:
    """Cut segments wherever ``cols[key]`` crosses a multiple of its ``period``
    (the reader's chunks and the holder's): the few that cross, in one splice."""
    cuts = [(key, period) for key, period in cuts if period]
    n = cols["length"]
    cross = np.zeros(len(n), bool)
    for key, period in cuts:
        cross |= cols[key] // period != (cols[key] + n - 1) // period
    rows = np.flatnonzero(cross)
    if not len(rows):
        return cols
    if len(rows) > _SPLICE_MAX:
        for key, period in cuts:
            cols = _cut(cols, key, period)
        return cols
    idx, shift, length, count = [], [], [], []
    for row in rows.tolist():
        size, points = int(n[row]), {0, int(n[row])}
        for key, period in cuts:
            points.update(range(-int(cols[key][row]) % period, size, period))  # its boundaries, from its start
        points = sorted(points)
        count.append(len(points) - 1)
        for a, b in itertools.pairwise(points):
            idx.append(row), shift.append(a), length.append(b - a)
    at, by = np.array(idx, np.int64), np.array(shift, np.int64)
    pieces = {k: cols[k][at] + by for k in _SHIFTING}
    pieces.update({k: cols[k][at] for k in _FIXED})
    pieces["length"] = np.array(length, np.int64)
    return _splice(cols, rows, np.array(count, np.int64), pieces)


def _cut(cols: dict[str, np.ndarray], key: str, period: int) -> dict[str, np.ndarray]:
    """Cut segments where ``cols[key]`` crosses a multiple of ``period``."""
    x, n = cols[key], cols["length"]
    first = x // period
    pieces = (x + n - 1) // period - first + 1
    if not len(x) or bool((pieces == 1).all()):
        return cols
    cross = np.flatnonzero(pieces > 1)
    few = len(cross) <= _SPLICE_MAX
    rows = cross if few else np.arange(len(x))
    count = pieces[rows]
    idx = np.repeat(rows, count)
    j = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    lo = np.maximum(x[idx], (first[idx] + j) * period)
    hi = np.minimum(x[idx] + n[idx], (first[idx] + j + 1) * period)
    shift = lo - x[idx]
    out = {k: cols[k][idx] + shift for k in _SHIFTING}
    out.update({k: cols[k][idx] for k in _FIXED})
    out["length"] = hi - lo
    return _splice(cols, cross, count, out) if few else out


def _splice(cols: dict[str, np.ndarray], rows: np.ndarray, count: np.ndarray,
            pieces: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``cols`` with each row of ``rows`` replaced by its ``count`` rows of ``pieces``."""
    total = len(cols["length"]) + int(count.sum()) - len(rows)
    if set(cols) == set(_COLUMNS) and all(v.dtype == np.int64 for v in cols.values()):
        out, _ = _table(total)  # in one block (see _table): a copy of every column
    else:
        out = {k: np.empty(total, v.dtype) for k, v in cols.items()}
    src = dst = got = 0
    for row, k in zip(rows.tolist(), count.tolist()):
        for key, col in cols.items():
            out[key][dst: dst + row - src] = col[src:row]
            out[key][dst + row - src: dst + row - src + k] = pieces[key][got: got + k]
        dst, src, got = dst + row - src + k, row + 1, got + k
    for key, col in cols.items():
        out[key][dst:] = col[src:]
    return out


Ranges = tuple[np.ndarray, np.ndarray]  # sorted, disjoint [start, end) byte ranges


def _no_ranges() -> Ranges:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)


def _subtract(cols: dict[str, np.ndarray], taken: Ranges) -> dict[str, np.ndarray]:
    """The parts of the segments outside the ``taken`` ranges."""
    ts, te = taken
    s = cols["r_off"]
    e = s + cols["length"]
    nxt = np.searchsorted(te, s, side="right")  # first taken range ending after the segment starts
    clear = (nxt >= len(ts)) | (ts[np.minimum(nxt, len(ts) - 1)] >= e)
    if bool(clear.all()):  # disjoint holders (the usual shard layout): nothing to cut
        return cols
    keep_idx, keep_lo, keep_hi = np.nonzero(clear)[0].tolist(), s[clear].tolist(), e[clear].tolist()
    for i in np.nonzero(~clear)[0].tolist():
        cur, end, k = int(s[i]), int(e[i]), int(nxt[i])
        while cur < end:
            if k < len(ts) and ts[k] < end:
                if ts[k] > cur:
                    keep_idx.append(i), keep_lo.append(cur), keep_hi.append(int(ts[k]))
                cur = max(cur, int(te[k]))
                k += 1
            else:
                keep_idx.append(i), keep_lo.append(cur), keep_hi.append(end)
                cur = end
    idx = np.array(keep_idx, np.int64)
    lo = np.array(keep_lo, np.int64)
    order = np.argsort(lo, kind="stable")
    idx, lo, hi = idx[order], lo[order], np.array(keep_hi, np.int64)[order]
    shift = lo - s[idx]
    out = {k: cols[k][idx] + shift for k in _SHIFTING}
    out.update({k: cols[k][idx] for k in _FIXED})
    out["length"] = hi - lo
    return out


def _union(ranges: Ranges, starts: np.ndarray, lengths: np.ndarray) -> Ranges:
    """``ranges`` joined with the ranges [start, start + length)."""
    lo = np.concatenate([ranges[0], starts])
    hi = np.concatenate([ranges[1], starts + lengths])
    if not len(lo):
        return _no_ranges()
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi)
    first = np.ones(len(lo), bool)
    first[1:] = lo[1:] > reach[:-1]
    heads = np.nonzero(first)[0]
    return lo[heads], np.maximum.reduceat(hi, heads)


def _gaps(lo: int, hi: int, have: Ranges) -> list[tuple[int, int]]:
    out, cur = [], lo
    for a, b in zip(have[0].tolist(), have[1].tolist()):
        if a > cur:
            out.append((cur, min(a, hi)))
        cur = max(cur, b)
    if cur < hi:
        out.append((cur, hi))
    return [(a, b) for a, b in out if b > a]
