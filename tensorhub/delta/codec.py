"""Delta of one version against an earlier one: encode on the publisher, patch on the reader.

Between two RL steps most bf16 weights do not change at all. A delta holds only
the elements whose bits changed, in *full-tensor* coordinates, so that any
reader holding the earlier version in any layout can patch its own region:

    publisher: parts of v + the same parts of u ──encode()──▶ Delta (3 tensors, on the parts' device)
    reader:    Delta + its destination holding u ──patch()───▶ its destination holds v

Coordinates. Each tensor's row-major elements fall into blocks of ``BLOCK``
(65,536) elements. A publisher lists, per block its region touches and where
something changed, one or more entries:

* *sparse*: the changed elements' offsets in the block (``int16``, read as
  unsigned) and their new values: ``2 + itemsize`` bytes per changed element;
* *bitmap*: where the publisher's part of the block is contiguous and more
  than about 1 in 16 of its elements changed, a bit per element and the changed
  values (``itemsize + 1/8`` bytes per changed element, plus 1/8 per element);
* *dense*: a contiguous full-tensor range and all its new values, where most
  of it changed (then either of the others would cost more than the values).

An unchanged block has no entry: at 2% of bf16 elements changed a delta is
about 4% of the bytes. Values are raw bits, so patching is exact for every
dtype of 1, 2, 4 or 8 bytes.

The three tensors (a delta is published as a model of its own: ``DELTA_NAMES``):

* ``index``, int64 ``[entries + 1, 7]``: row 0 the header ``(MAGIC, entries,
  positions, value bytes, BLOCK, from_version, to_version)``, then one row per
  entry: ``(tensor, block, kind, start, count, pos_offset, val_offset)``
  (a bitmap entry: ``count`` elements from ``start``, ``pos_offset`` of them
  changed, its bits at ``val_offset`` and its values after them, aligned);
* ``positions``, int16: the sparse entries' offsets, back to back;
* ``values``, uint8: every entry's new values (and bitmaps), aligned to 16 bytes
  wherever an itemsize could change.

Nothing here does I/O; ``tensorhub.client.delta`` publishes and pulls deltas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tensorhub.errors import InvalidRequest
from tensorhub.regions import Region

BLOCK = 1 << 16
MAGIC = 0x7448_4454  # "tHDT"
DELTA_NAMES = ("index", "positions", "values")
_PIECE = 64 * BLOCK  # local elements compared at once (bounds the temporary index tensors)
_ALIGN = 16
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# index columns
TENSOR, BLK, KIND, START, COUNT, POS, VAL = range(7)
SPARSE, DENSE, BITMAP = 0, 1, 2
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)  # bit i of a byte: element i


@dataclass(frozen=True, slots=True)
class DeltaPart:
    """One region of one manifest tensor: ``tensor`` holds ``region`` of a
    tensor of ``full_shape`` contiguously (a publisher's part, or a reader's destination)."""

    tensor_index: int
    full_shape: tuple[int, ...]
    region: Region
    tensor: torch.Tensor


@dataclass(frozen=True, slots=True)
class Delta:
    index: torch.Tensor
    positions: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.index, self.positions, self.values))

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(zip(DELTA_NAMES, (self.index, self.positions, self.values)))

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> Delta:
        return cls(*(tensors[name] for name in DELTA_NAMES))

    def header(self) -> tuple[int, int, int, int, int, int, int]:
        return tuple(int(x) for x in self.index[0].tolist())  # type: ignore[return-value]

    def check(self, from_version: int, to_version: int) -> str | None:
        """Why this is not a well-formed delta from ``from_version`` to ``to_version``, or None."""
        if self.index.dtype != torch.int64 or self.index.dim() != 2 or self.index.shape[1] != 7:
            return f"index is {self.index.dtype}{list(self.index.shape)}, not int64 [n, 7]"
        magic, entries, positions, nbytes, block, u, v = self.header()
        if magic != MAGIC or block != BLOCK:
            return f"header {magic:#x}/{block} is not a delta's ({MAGIC:#x}/{BLOCK})"
        if (u, v) != (from_version, to_version):
            return f"it is a delta from version {u} to {v}, not {from_version} to {to_version}"
        if entries != self.index.shape[0] - 1 or positions > self.positions.numel() or nbytes > self.values.numel():
            return "its header does not match its tensors' sizes"
        return None


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as signed integers of the same size, flat (a view)."""
    size = tensor.element_size()
    if size not in _INT:
        raise InvalidRequest(f"deltas handle elements of 1, 2, 4 or 8 bytes, not {tensor.dtype} ({size} bytes)")
    if not tensor.is_contiguous():
        raise InvalidRequest(f"a delta needs contiguous tensors; got a {tensor.dtype}{list(tensor.shape)} with "
                             f"strides {tensor.stride()}")
    return tensor.reshape(-1).view(_INT[size])


def _strides(shape: Sequence[int]) -> list[int]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return out[::-1]


def flat_span(region: Region, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The full-tensor element range ``[a, b)`` of a region that is contiguous in the full tensor, else None."""
    if region.whole:
        return 0, math.prod(shape)
    if region.flat is not None:
        return region.flat
    box = region.bounds(shape)
    strides = _strides(shape)
    first = sum(a * s for (a, _), s in zip(box, strides))
    last = sum((b - 1) * s for (_, b), s in zip(box, strides))
    n = region.numel(shape)
    return (first, last + 1) if last + 1 - first == n else None


def local_to_full(local: torch.Tensor, region: Region, shape: tuple[int, ...]) -> torch.Tensor:
    """Full-tensor flat indices of a region's local flat indices (row-major order is kept)."""
    span = flat_span(region, shape)
    if span is not None:
        return local + span[0]
    box = region.bounds(shape)
    out = torch.zeros_like(local)
    rest = local.clone()
    for (a, b), stride in zip(reversed(box), reversed(_strides(shape))):
        out += (rest % (b - a) + a) * stride
        rest //= b - a
    return out


def full_to_local(full: torch.Tensor, region: Region, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, local flat index) of full-tensor flat indices: which fall in the region, and where."""
    span = flat_span(region, shape)
    if span is not None:
        mask = (full >= span[0]) & (full < span[1])
        return mask, full - span[0]
    box = region.bounds(shape)
    mask = torch.ones_like(full, dtype=torch.bool)
    local = torch.zeros_like(full)
    rest = full.clone()
    step = 1
    for (a, b), d in zip(reversed(box), reversed(shape)):
        coord = rest % d
        rest //= d
        mask &= (coord >= a) & (coord < b)
        local += (coord - a) * step
        step *= b - a
    return mask, local


def _ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The concatenation of ``arange(s, s + c)`` for each (s, c), vectorised."""
    total = int(counts.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=starts.device)
    ends = torch.cumsum(counts, 0)
    begins = ends - counts
    return torch.repeat_interleave(starts - begins, counts, output_size=total) + torch.arange(
        total, device=starts.device)


def _pad(nbytes: int) -> int:
    return -nbytes % _ALIGN


class _Builder:
    """Accumulates entries, positions and value bytes, part by part."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[np.ndarray] = []
        self.positions: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.npos = 0
        self.nval = 0

    def align(self) -> None:
        pad = _pad(self.nval)
        if pad:
            self.values.append(torch.zeros(pad, dtype=torch.uint8, device=self.device))
            self.nval += pad

    def add_values(self, vals: torch.Tensor) -> int:
        at = self.nval
        raw = vals.view(torch.uint8)
        self.values.append(raw)
        self.nval += raw.numel()
        return at

    def add_positions(self, pos: torch.Tensor) -> int:
        at = self.npos
        self.positions.append(pos)
        self.npos += pos.numel()
        return at


def _encode_piece(out: _Builder, ti: int, part: DeltaPart, span: tuple[int, int] | None, new: torch.Tensor,
                  old: torch.Tensor, lo: int, hi: int) -> None:
    changed = torch.nonzero(new[lo:hi] != old[lo:hi]).reshape(-1)
    if changed.numel() == 0:
        return
    local = changed + lo
    full = local_to_full(local, part.region, part.full_shape)
    blocks = torch.div(full, BLOCK, rounding_mode="floor")
    uniq, counts = torch.unique_consecutive(blocks, return_counts=True)
    isz = new.element_size()
    uniq_c, counts_c = uniq.cpu().numpy(), counts.cpu().numpy()
    dense = np.zeros(len(uniq_c), bool)
    bitmap = np.zeros(len(uniq_c), bool)
    if span is not None:  # a contiguous part of a block may go whole, or as a bitmap and its values
        first, last = span[0] + lo, span[0] + hi
        portion = np.minimum((uniq_c + 1) * BLOCK, last) - np.maximum(uniq_c * BLOCK, first)
        cost_sparse = counts_c * (2 + isz)
        cost_bitmap = -(-portion // 8) + _ALIGN + counts_c * isz
        cost_dense = portion * isz
        dense = cost_dense <= np.minimum(cost_sparse, cost_bitmap)
        bitmap = ~dense & (cost_bitmap < cost_sparse)
    sparse_entry = ~dense & ~bitmap
    if sparse_entry.any():
        keep = torch.repeat_interleave(torch.from_numpy(sparse_entry).to(out.device), counts)
        sel_full, sel_local = full[keep], local[keep]
        offs = sel_full - torch.div(sel_full, BLOCK, rounding_mode="floor") * BLOCK
        pos_at = out.add_positions(((offs + 32768) % 65536 - 32768).to(torch.int16))
        val_at = out.add_values(new[sel_local])
        sc = counts_c[sparse_entry]
        before = np.concatenate([[0], np.cumsum(sc)[:-1]])
        rows = np.zeros((len(sc), 7), np.int64)
        rows[:, TENSOR], rows[:, BLK], rows[:, KIND], rows[:, START] = ti, uniq_c[sparse_entry], SPARSE, -1
        rows[:, COUNT], rows[:, POS], rows[:, VAL] = sc, pos_at + before, val_at + before * isz
        out.rows.append(rows)
    for k in np.flatnonzero(dense | bitmap):
        assert span is not None
        a = max(int(uniq_c[k]) * BLOCK, span[0] + lo)
        b = min((int(uniq_c[k]) + 1) * BLOCK, span[0] + hi)
        if dense[k]:
            val_at = out.add_values(new[a - span[0]:b - span[0]])
            out.rows.append(np.array([[ti, uniq_c[k], DENSE, a, b - a, -1, val_at]], np.int64))
            continue
        # BITMAP: a bit per element of [a, b) (set: changed), then the changed values in order
        changed_here = local[(local >= a - span[0]) & (local < b - span[0])]
        flags = torch.zeros(-(-(b - a) // 8) * 8, dtype=torch.uint8, device=out.device)
        flags[changed_here - (a - span[0])] = 1
        packed = (flags.view(-1, 8) * _BIT_WEIGHTS.to(out.device)).sum(dim=1).to(torch.uint8)
        bits_at = out.add_values(packed)
        out.align()
        out.add_values(new[changed_here])
        out.rows.append(np.array([[ti, uniq_c[k], BITMAP, a, b - a, len(changed_here), bits_at]], np.int64))
    out.align()  # values of the next entries start aligned to every itemsize again


class DeltaEncoder:
    """Builds a delta part by part, e.g. while a trainer copies each tensor of
    a step into the buffer that still holds the step before (its old bytes are
    read just before they are overwritten: no copy of the earlier version)."""

    def __init__(self, *, from_version: int, to_version: int) -> None:
        self.from_version, self.to_version = from_version, to_version
        self._out: _Builder | None = None

    def add(self, new_part: DeltaPart, old_part: DeltaPart) -> None:
        """The changes of one part (the same region, shape and dtype in both versions)."""
        if (new_part.tensor_index, new_part.region) != (old_part.tensor_index, old_part.region) or \
                new_part.tensor.shape != old_part.tensor.shape or new_part.tensor.dtype != old_part.tensor.dtype:
            raise InvalidRequest(
                f"the earlier version's parts do not match: tensor {new_part.tensor_index} "
                f"{new_part.region.describe()} {new_part.tensor.dtype}{list(new_part.tensor.shape)} against "
                f"{old_part.region.describe()} {old_part.tensor.dtype}{list(old_part.tensor.shape)}")
        device = new_part.tensor.device
        if old_part.tensor.device != device or (self._out is not None and self._out.device != device):
            raise InvalidRequest(f"a delta's parts must lie on one device, not {device} and "
                                 f"{old_part.tensor.device if old_part.tensor.device != device else self._out.device}")
        if self._out is None:
            self._out = _Builder(device)
        out = self._out
        new, old = bits(new_part.tensor), bits(old_part.tensor)
        span = flat_span(new_part.region, new_part.full_shape)
        out.align()
        n, lo = new.numel(), 0
        while lo < n:
            hi = min(n, lo + _PIECE)
            if span is not None and hi < n:  # end the piece on a block boundary: a block's part goes whole or not
                hi = max(lo + 1, (span[0] + hi) // BLOCK * BLOCK - span[0])
            _encode_piece(out, new_part.tensor_index, new_part, span, new, old, lo, hi)
            lo = hi

    def finish(self) -> Delta:
        out = self._out or _Builder(torch.device("cpu"))
        out.align()
        device = out.device
        rows = np.concatenate(out.rows) if out.rows else np.zeros((0, 7), np.int64)
        header = np.array([[MAGIC, len(rows), out.npos, out.nval, BLOCK, self.from_version, self.to_version]],
                          np.int64)
        index = torch.from_numpy(np.concatenate([header, rows])).to(device)
        # A tensor of no bytes cannot be registered: one padding element each.
        positions = torch.cat(out.positions) if out.positions else torch.zeros(1, dtype=torch.int16, device=device)
        values = torch.cat(out.values) if out.values else torch.zeros(_ALIGN, dtype=torch.uint8, device=device)
        return Delta(index, positions, values)


def encode(new_parts: Sequence[DeltaPart], old_parts: Sequence[DeltaPart], *, from_version: int,
           to_version: int) -> Delta:
    """The delta from ``old_parts`` (version ``from_version``) to ``new_parts``
    (``to_version``): the same regions, shapes and dtypes, part by part.
    Computed on the parts' device (all parts on one device)."""
    if len(new_parts) != len(old_parts):
        raise InvalidRequest(f"a delta needs the same parts of both versions: {len(new_parts)} against "
                             f"{len(old_parts)}")
    encoder = DeltaEncoder(from_version=from_version, to_version=to_version)
    for new_p, old_p in zip(new_parts, old_parts):
        encoder.add(new_p, old_p)
    return encoder.finish()


def patch(delta: Delta, parts: Sequence[DeltaPart]) -> int:
    """Write the delta's new values into ``parts`` (each holding the earlier
    version of its region); returns the elements written. Entries outside
    every part are skipped: a reader patches only its own regions."""
    rows = delta.index[1:].cpu().numpy()
    if len(rows) == 0:
        return 0
    by_tensor: dict[int, list[DeltaPart]] = {}
    for part in parts:
        by_tensor.setdefault(part.tensor_index, []).append(part)
    written = 0
    order = np.argsort(rows[:, TENSOR], kind="stable")
    rows = rows[order]
    cuts = np.flatnonzero(np.diff(rows[:, TENSOR])) + 1
    for group in np.split(rows, cuts):
        for part in by_tensor.get(int(group[0, TENSOR]), ()):
            written += _patch_part(delta, group, part)
    return written


def _patch_part(delta: Delta, rows: np.ndarray, part: DeltaPart) -> int:
    dest = bits(part.tensor)
    device, isz = dest.device, part.tensor.element_size()
    values = delta.values.to(device)
    if values.numel() % isz:
        raise InvalidRequest(f"delta values of {values.numel()} bytes are not whole {isz}-byte elements")
    typed = values.view(_INT[isz])
    written = 0
    sparse = rows[rows[:, KIND] == SPARSE]
    if len(sparse):
        counts = torch.from_numpy(sparse[:, COUNT]).to(device)
        pos = delta.positions.to(device)[_ranges(torch.from_numpy(sparse[:, POS]).to(device), counts)]
        full = torch.repeat_interleave(torch.from_numpy(sparse[:, BLK] * BLOCK).to(device), counts) + (
            pos.to(torch.int64) & 0xFFFF)
        vals = typed[_ranges(torch.from_numpy(sparse[:, VAL] // isz).to(device), counts)]
        mask, local = full_to_local(full, part.region, part.full_shape)
        dest[local[mask]] = vals[mask]
        written += int(mask.sum())
    span = flat_span(part.region, part.full_shape)
    for row in rows[rows[:, KIND] == DENSE]:
        a, n, at = int(row[START]), int(row[COUNT]), int(row[VAL]) // isz
        if span is not None:  # both contiguous: one slice
            lo, hi = max(a, span[0]), min(a + n, span[1])
            if lo < hi:
                dest[lo - span[0]:hi - span[0]] = typed[at + lo - a:at + hi - a]
                written += hi - lo
            continue
        full = torch.arange(a, a + n, device=device)
        mask, local = full_to_local(full, part.region, part.full_shape)
        dest[local[mask]] = typed[at:at + n][mask]
        written += int(mask.sum())
    for row in rows[rows[:, KIND] == BITMAP]:
        a, n, count, at = int(row[START]), int(row[COUNT]), int(row[POS]), int(row[VAL])
        nbits = -(-n // 8)
        packed = values[at:at + nbits]
        flags = (packed.unsqueeze(1) & _BIT_WEIGHTS.to(device)).ne(0).reshape(-1)[:n]
        full = torch.nonzero(flags).reshape(-1) + a
        vals_at = (at + nbits + _pad(at + nbits)) // isz
        vals = typed[vals_at:vals_at + count]
        if full.numel() != count:
            raise InvalidRequest(f"a delta's bitmap entry lists {full.numel()} changes, its row {count}")
        mask, local = full_to_local(full, part.region, part.full_shape)
        dest[local[mask]] = vals[mask]
        written += int(mask.sum())
    return written
