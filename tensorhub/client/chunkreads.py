"""The chunks a pull is reading, and how far each got. No I/O.

    a round plans chunk c ──▶ plan(c: its READs) — whatever failed of c before is forgotten
    a READ of c landed ─────▶ landed(c, source, READ) ──▶ None while others of c are out; once the
                              last one landed: c's bytes per source and its READs (for its check)
    a READ of c failed ─────▶ fail(c): c's other READs still land, and count for nothing
    the round ends ─────────▶ settle(chunks in flight): a failed chunk none of whose READs flies
                              is forgotten, and planned again (whole) next round

A chunk counts once all its READs landed: one that failed in part is read
again whole, never pieced together from two rounds. ``PullJob`` (``puller``)
keeps one across its rounds, beside ``flights.Flights`` (the READs themselves).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from tensorhub.client.transfer import Transfer


class ChunkReads:
    def __init__(self) -> None:
        self._pending: dict[int, int] = {}  # chunk -> its READs not landed yet
        self._failed: set[int] = set()  # chunks with a failed READ, re-planned once none flies
        self._got: dict[int, dict[str, int]] = {}  # bytes per source of chunks not complete
        self._arrived: dict[int, list[Transfer]] = {}  # READs landed of chunks not complete

    def plan(self, reads: Mapping[int, Sequence[Transfer]]) -> None:
        """The chunks of ``reads`` are read anew, by these READs."""
        for chunk, planned in reads.items():
            self._pending[chunk] = len(planned)
            self._failed.discard(chunk)
            self._got.pop(chunk, None)
            self._arrived.pop(chunk, None)

    def fail(self, chunk: int) -> None:
        """A READ of ``chunk`` failed (or was never posted): it is read again."""
        self._failed.add(chunk)

    def failed(self, chunk: int) -> bool:
        return chunk in self._failed

    def landed(self, chunk: int, source: str, transfer: Transfer) -> tuple[dict[str, int], list[Transfer]] | None:
        """A READ of ``chunk`` from ``source`` (an agent name) landed: None while
        others of it are out, else the chunk's bytes per source and its READs."""
        by_source = self._got.setdefault(chunk, {})
        by_source[source] = by_source.get(source, 0) + transfer.nbytes
        self._arrived.setdefault(chunk, []).append(transfer)
        self._pending[chunk] -= 1
        if self._pending[chunk]:
            return None
        del self._pending[chunk]
        return self._got.pop(chunk), self._arrived.pop(chunk, [])

    def settle(self, in_air: Collection[int]) -> None:
        """The round ended: the failed chunks with no READ ``in_air`` are forgotten (planned again)."""
        for chunk in [c for c in self._failed if c not in in_air]:
            self._failed.discard(chunk)
            self._pending.pop(chunk, None)
            self._got.pop(chunk, None)
            self._arrived.pop(chunk, None)
