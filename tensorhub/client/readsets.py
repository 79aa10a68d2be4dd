"""A pull's destination, checked, and its read layout, kept from one pull to the next.

An RL reader pulls version after version into the same buffers. Checking
them against the manifest (``Manifest.parts``: every region, size, dtype and
overlap) and laying out the read set (``ReadLayout``: every part's box) gives
the same answer each time, and for the TP=8 slice of one MoE layer (384
shards) took 11 ms of a 45 ms pull (``tensorhub bench pull --layout moe
--reader-slice tp8 --trainer-cut``, docs/history/pull.md). Both are kept here,
by contents, never by the ``into`` mapping's identity (a caller may change it
between pulls):

    into ──▶ key: the manifest's fingerprint, then per entry its name, full shape
             and region, and its local tensor's address, dtype, shape, strides, device
               │ seen: that pull's checked parts, holding this pull's tensors
               │ new:  Manifest.parts checks them (InvalidRequest / ManifestMismatch)
               ▼
    the parts' registered memory ──▶ ReadLayout, kept with the parts while that
                                     memory and the chunk size are the same

Only checks that passed are kept: a bad ``into`` is checked, and refused,
every time.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from tensorhub.client.lru import Lru
from tensorhub.client.readlayout import ReadLayout, ReadPart
from tensorhub.manifest import Manifest, itemsize
from tensorhub.shard import Entry, Part, Shard
from tensorhub.transport.memory import MemoryRegion

_KEPT = 4  # destinations kept (a rollout pulls into one; a few for tests and side buffers)


@dataclass(slots=True)
class _Seen:
    parts: list[Part]  # checked, in manifest order
    order: list[int]  # per part, the position of its tensor among the key's tensors
    # ((chunk size, the parts' memory), the layout made for them): one value, so
    # that a thread never sees one pull's layout beside another's memory
    layout: tuple[tuple, ReadLayout] | None = None


@dataclass(frozen=True, slots=True)
class ReadSet:
    """This pull's checked parts, and where their layout is kept (None: nowhere)."""

    parts: list[Part]
    seen: _Seen | None = None


def _key(manifest: Manifest, into: Mapping[str, Entry]) -> tuple[Hashable, list[torch.Tensor]] | None:
    """What the check and the layout of ``into`` depend on, and its local
    tensors in the key's order; None for an entry of a kind ``Manifest.parts``
    refuses (it is checked, and refused, every time)."""
    out: list[Hashable] = [manifest.fingerprint]
    tensors: list[torch.Tensor] = []
    for name, value in into.items():
        if isinstance(value, (torch.Tensor, Shard)):
            items: Sequence = (value,)
        elif isinstance(value, Sequence) and value and all(isinstance(v, Shard) for v in value):
            items = value
        else:
            return None
        for item in items:
            t = item if isinstance(item, torch.Tensor) else item.tensor
            where = None if t is item else (item.full_shape, item.region)
            out.append((name, where, t.data_ptr(), t.dtype, t.shape, t.stride(), t.device))
            tensors.append(t)
    return tuple(out), tensors


def _positions(parts: list[Part], tensors: list[torch.Tensor]) -> list[int]:
    """Per part, where its tensor (the very object) lies among ``tensors``."""
    at: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        at.setdefault(id(t), []).append(i)
    return [at[id(p.tensor)].pop(0) for p in parts]


class ReadSets:
    """A Hub's checked destinations and their read layouts. Thread-safe."""

    def __init__(self) -> None:
        self._seen: Lru[_Seen] = Lru(_KEPT)

    def parts(self, manifest: Manifest, into: Mapping[str, Entry], *, model: str, version: int) -> ReadSet:
        """``into`` checked against ``manifest`` (``Manifest.parts``), as parts in manifest order."""
        keyed = _key(manifest, into)
        if keyed is None:
            return ReadSet(manifest.parts(into, model=model, version=version))
        key, tensors = keyed
        seen = self._seen.get(key)
        if seen is None:
            parts = manifest.parts(into, model=model, version=version)
            seen = _Seen(parts, _positions(parts, tensors))
            self._seen.put(key, seen)
            return ReadSet(parts, seen)
        # The same check passed before: its parts, each holding the tensor given
        # now (the very tensors of then, usually: nothing to make).
        now = [tensors[i] for i in seen.order]
        if any(p.tensor is not t for p, t in zip(seen.parts, now)):
            return ReadSet([Part(p.name, p.full_shape, p.region, t) for p, t in zip(seen.parts, now)], seen)
        return ReadSet(list(seen.parts), seen)

    def layout(self, read_set: ReadSet, manifest: Manifest, regions: list[MemoryRegion],
               chunk_size: int) -> ReadLayout:
        """The read layout of ``read_set``'s parts in their registered memory ``regions``."""
        seen = read_set.seen
        laid_out = (chunk_size, regions)
        made = seen.layout if seen is not None else None
        if made is not None and made[0] == laid_out:
            return made[1]
        layout = read_layout(manifest, read_set.parts, regions, chunk_size)
        if seen is not None:
            seen.layout = (laid_out, layout)
        return layout


def read_layout(manifest: Manifest, parts: list[Part], regions: list[MemoryRegion], chunk_size: int) -> ReadLayout:
    """The read set of ``parts``, each in its registered memory region."""
    index = manifest.index()
    return ReadLayout(manifest, [
        ReadPart(p.name, index[p.name], p.full_shape, None, itemsize(manifest.tensors[index[p.name]].dtype), memory,
                 p.region)
        for p, memory in zip(parts, regions)
    ], chunk_size)
