"""A pull's destination: checked against the manifest (or allocated), and
registered with NIXL; registrations of recent ``into`` buffers are cached so
that pulling into the same buffers again skips re-registration."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping

import torch

from tensorhub.manifest import DTYPES, Manifest
from tensorhub.regions import Region
from tensorhub.shard import Entry, Part
from tensorhub.transport import NixlAgent, Registration

_CACHE_SIZE = 2  # registrations of recent ``into`` destinations kept for reuse


def destination_parts(manifest: Manifest, into: Mapping[str, Entry] | None, *, model: str,
                      version: int) -> list[Part]:
    """The parts to fill: ``into``'s, checked region by region before any byte
    moves (InvalidRequest / ManifestMismatch), or new whole tensors."""
    if into is not None:
        return manifest.parts(into, model=model, version=version)
    return [Part(t.name, t.shape, Region(), torch.empty(t.shape, dtype=DTYPES[t.dtype])) for t in manifest.tensors]


def result_tensors(parts: list[Part]) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """What a PullResult shows: the local tensor per name (a list where a name has several)."""
    out: dict[str, list[torch.Tensor]] = {}
    for p in parts:
        out.setdefault(p.name, []).append(p.tensor)
    return {name: ts[0] if len(ts) == 1 else ts for name, ts in out.items()}


class Destinations:
    """Registrations of pull destinations. Thread-safe."""

    def __init__(self, nixl: NixlAgent) -> None:
        self._nixl = nixl
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, tuple[list[torch.Tensor], Registration]] = OrderedDict()

    @staticmethod
    def _key(parts: list[Part]) -> tuple:
        return tuple((p.tensor.data_ptr(), p.nbytes) for p in parts)

    def register(self, parts: list[Part], *, cache: bool) -> Registration:
        """Register the parts' memory. ``cache``: the caller's own buffers, likely
        pulled into again; the entry holds the tensors, so their memory cannot
        be freed and reused while registered."""
        tensors = [p.tensor for p in parts]
        if not cache:
            return self._nixl.register(tensors)
        key = self._key(parts)
        with self._lock:
            hit = self._cache.pop(key, None)
            if hit is None:
                hit = (tensors, self._nixl.register(tensors))
            self._cache[key] = hit
            while len(self._cache) > _CACHE_SIZE:
                _, (_, old) = self._cache.popitem(last=False)
                self._nixl.deregister(old)
            return hit[1]

    def release(self, registration: Registration, *, cached: bool) -> None:
        if not cached:
            self._nixl.deregister(registration)

    def uncache(self, parts: list[Part]) -> None:
        """Forget a cached registration: the memory is about to be registered as a replica."""
        with self._lock:
            hit = self._cache.pop(self._key(parts), None)
        if hit is not None:
            self._nixl.deregister(hit[1])

    def close(self) -> None:
        with self._lock:
            for _, registration in self._cache.values():
                self._nixl.deregister(registration)
            self._cache.clear()
