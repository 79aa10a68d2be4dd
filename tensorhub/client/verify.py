"""Checking what a pull read against its sources' chunk checksums.

A source's checksums (``tensorhub.integrity``) are per chunk of *its* bytes
(its held regions back to back), which need not line up with the reader's
chunks: a reader's chunk may take bytes from several holders, and a holder's
chunk may be spread over several reader chunks (or reader tensors).

    reader chunk lands ──▶ its READs' pieces, filed by (holder, holder chunk)
                                │ every byte of a holder chunk landed from that holder
                                ▼
                      CRC-32 of the destination pieces in the holder's order:
                      each piece's CRC taken on a helper thread the moment its
                      READ landed, then joined (crc32_combine)
                                │
              ok: reader chunks waiting only on checked holder chunks are settled
              bad: the holder is reported and excluded; the reader chunks that took
                   bytes of that holder chunk are read again from another holder

A reader chunk is *settled* (reported to the server, served to others) only
once every holder chunk it read from is checked, or cannot be: a holder chunk
the read set does not cover whole (a TP slice reads part of it), one whose
bytes came from two holders, or a source without checksums. Two fallbacks
cover most of those bytes, each checking the bytes in the reader's memory
whatever holder they came from, so a mismatch names no culprit: the reader
chunks involved are read again (checked three times at most, then the pull
fails with IntegrityError):

* a holder chunk whose bytes came from two holders is checked, once every READ
  has landed, from the reader's memory in the holder's order (its segment
  table says where each byte landed; ``settle_rest``);
* a reader chunk with bytes from a source without checksums is checked whole
  against a holder cut exactly like the reader (a relay of the same layout),
  if one lists that chunk with its checksum.

What no check covers is counted as unverified. Checks need the destination
in host memory (DRAM).

Why each READ is checksummed as it lands, not each holder chunk once complete:
the check reads every landed byte once more, and from memory it competes with
the copy itself for bandwidth (on the reference machine a 32 MiB chunk's check
cost a pull ~20% of its throughput; the copy and the CRC shared ~12 GB/s). A
checked pull cuts its READs to ``READ_PIECE_BYTES`` (``pieces``) and each
piece is checked while it is still in the cache it was just copied through.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from isal.isal_zlib import crc32_combine  # the CRC of a + b from those of a and b, in O(log |b|)

from tensorhub.client.inorder import InOrderWorker, Job
from tensorhub.client.readlayout import ReadLayout, split
from tensorhub.client.rpc import RemoteReplica
from tensorhub.client.transfer import Transfer
from tensorhub.integrity import crc32

log = logging.getLogger(__name__)

_Key = tuple[str, int]  # (replica id, holder chunk)
_WHOLE = "#whole"  # key (_WHOLE, reader chunk): the chunk checked whole against a holder cut like the reader
_WHOLE_TRIES = 3  # a check that names no culprit failing this often fails the pull

# The most bytes one READ of a checked pull moves: small enough that its bytes
# are still in cache when its CRC runs (the reference machine: 32 MiB L3,
# 1 MiB L2 per core), large enough that NIXL's cost per READ stays small.
# Measured there (1 GiB over NIXL shared memory, a READ per piece, its CRC on
# a helper thread, paired against no CRC, 8 reps): `tensorhub bench pull --size 1GiB --reps 12`,
# its checksum rows (docs/benchmarks.md).
READ_PIECE_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A holder chunk whose bytes did not match its publisher's checksum."""

    replica: RemoteReplica
    chunk: int  # of the holder's own chunks
    rereads: frozenset[int]  # reader chunks that took bytes of it: to be read again
    expected: int
    got: int
    whole: bool = False  # checked in the reader's memory: its bytes may come from several holders
    exhausted: bool = False  # whole, and failed too often to read it again

    def reason(self) -> str:
        return (f"integrity: chunk {self.chunk} read from it has CRC-32 {self.got:08x}, its publisher's is "
                f"{self.expected:08x} (memory corrupted or overwritten while published)")


@dataclass(frozen=True, slots=True)
class Coverage:
    """Which of a holder's own chunks a read set covers whole: it follows from
    the two layouts alone, so ``plancache`` keeps it from one pull to the next
    (over the 262,400 runs a TP slice takes of a row-sharded holder, a
    millisecond per holder and pull)."""

    full: np.ndarray  # per own chunk, its bytes
    checkable: np.ndarray  # per own chunk: the read set takes all of it
    same_cut: bool  # its chunk i is the reader's chunk i, byte for byte


def coverage(layout: ReadLayout | None, replica: RemoteReplica, table: dict[str, np.ndarray]) -> Coverage:
    """What ``layout``'s read set covers of ``replica``'s chunks (``table``: its holder table)."""
    chunk_size = replica.chunk_size
    total = int(replica.regions[:, 1].sum()) if len(replica.regions) else 0
    num = -(-total // chunk_size) if chunk_size else 0
    full = np.full(num, chunk_size, np.int64)
    if num:
        full[-1] = total - (num - 1) * chunk_size
    in_set = np.bincount(table["h_off"] // chunk_size, weights=table["length"], minlength=num) if num else full
    return Coverage(full, in_set[:num].astype(np.int64) == full,
                    layout is not None and layout.same_cut(replica, table))


class _Holder:
    """One source's checksums and which of its chunks the read set covers whole."""

    def __init__(self, replica: RemoteReplica, table: dict[str, np.ndarray], cover: Coverage) -> None:
        self.replica = replica
        self.table = table
        self.same_cut = cover.same_cut
        self.chunk_size = replica.chunk_size
        self.full = cover.full
        crcs = replica.chunk_crc32
        self.crcs = crcs if crcs is not None and len(crcs) == len(cover.full) else None
        if self.crcs is None:
            self.checkable = np.zeros(len(cover.full), bool)
            self.all_checkable = self.any_checkable = False
            return
        self.checkable = cover.checkable
        self.all_checkable = bool(self.checkable.all())  # the common case: READs need no filtering
        # False where a TP slice takes part of every chunk of a row-sharded holder
        # (the experts of an MoE layer): its READs are never checked, so ``pieces``
        # leaves them whole.
        self.any_checkable = bool(self.checkable.any())

    def memory(self, chunk: int, reader_chunk_size: int) -> tuple[list[tuple[int, int]], set[int]]:
        """Where the bytes of its ``chunk`` lie in the reader's memory, in its
        order: (address, bytes), and the reader chunks they lie in. The table
        is cut at its chunk boundaries and the reader's."""
        h_off = self.table["h_off"]
        rows = np.flatnonzero(h_off // self.chunk_size == chunk)
        rows = rows[np.argsort(h_off[rows], kind="stable")]
        spans = list(zip(self.table["local"][rows].tolist(), self.table["length"][rows].tolist()))
        return spans, set((self.table["r_off"][rows] // reader_chunk_size).tolist())


class ChunkVerifier:
    """The checks of one pull. Not thread-safe: driven from the pull's thread;
    only the CRC itself runs on the helper thread."""

    def __init__(self, enabled: bool, layout: ReadLayout | None = None) -> None:
        self.enabled = enabled
        self._layout = layout
        self._unverified_in: dict[int, int] = {}  # reader chunk -> its bytes no holder chunk check covered
        self._whole: dict[int, tuple[Job, str, int]] = {}  # reader chunk -> (job, replica id, expected)
        self._by_table: set[_Key] = set()  # running holder chunk checks read from the reader's memory
        self._tries: dict[_Key, int] = {}  # checks that name no culprit -> how often they failed
        self._whole_ok: set[int] = set()  # reader chunks whose whole check passed since they landed
        self._holders: dict[str, _Holder] = {}
        self._pieces: dict[_Key, dict[int, tuple[int, int, int]]] = {}  # h_off -> (local addr, length, reader chunk)
        self._piece_bytes: dict[_Key, int] = {}  # the bytes of a holder chunk's pieces landed so far
        self._readers: dict[_Key, set[int]] = {}  # reader chunks that took bytes of a holder chunk
        self._waits: dict[int, set[_Key]] = {}  # landed reader chunk -> holder chunks not yet checked
        self._checked: set[_Key] = set()
        self._bad: set[_Key] = set()
        self._running: dict[_Key, Job] = {}
        # CRCs taken as READs landed: (replica id, holder offset) -> (local addr, bytes, job, index in its result)
        self._early: dict[tuple[str, int], tuple[int, int, Job, int]] = {}
        self.verified_bytes = 0
        self.unverified_bytes = 0
        self.mismatches: list[Mismatch] = []
        self._worker: InOrderWorker | None = None
        self._ran_at_poll = -1  # the worker's job count when ``poll`` last looked

    def add_holder(self, replica: RemoteReplica, table: dict[str, np.ndarray],
                   cover: Coverage | None = None) -> None:
        """A holder of the pull (``table``: its holder table), and what the
        read set covers of its chunks if known (``coverage``'s answer, kept)."""
        if self.enabled:
            cover = coverage(self._layout, replica, table) if cover is None else cover
            self._holders[replica.source.replica_id] = _Holder(replica, table, cover)

    def refresh(self, replica: RemoteReplica) -> None:
        """A newer resolve's view of a holder: a filling relay that computes its
        checksums as it fills lists more of them now (one per chunk it lists)."""
        holder = self._holders.get(replica.source.replica_id)
        crcs = replica.chunk_crc32
        if holder is not None and holder.crcs is not None and crcs is not None and len(crcs) == len(holder.crcs):
            holder.crcs, holder.replica = crcs, replica  # the bitmap that goes with them

    def checked(self, replica_id: str) -> bool:
        """Whether READs from this holder are checked as they land (``pieces`` cuts them)."""
        holder = self._holders.get(replica_id)
        return self.enabled and holder is not None and holder.any_checkable

    def pieces(self, transfers: list[Transfer]) -> list[Transfer]:
        """The READs to post for ``transfers``: those from a holder with checksums
        cut to ``READ_PIECE_BYTES``, so that each is checked as it lands."""
        if not self.enabled:
            return transfers
        out: list[Transfer] = []
        for t in transfers:
            holder = self._holders.get(t.replica_id)
            checked = holder is not None and holder.any_checkable and t.h_off is not None
            out.extend(split(t, READ_PIECE_BYTES) if checked else [t])
        return out

    def arrived(self, transfer: Transfer) -> None:
        """One READ has landed: take the CRC of its bytes of checkable holder
        chunks now, on the helper thread, while they are still in cache.
        ``landed`` joins these CRCs once a holder chunk is whole."""
        holder = self._holders.get(transfer.replica_id)
        if holder is None or not holder.any_checkable or transfer.h_off is None:
            return
        rid = transfer.replica_id
        # Called for every piece, between two copies on the pull's thread: the
        # common case (every holder chunk checkable, none bad) takes no numpy
        # masks.
        if holder.all_checkable and not self._bad:
            h_off, addr, nbytes = transfer.h_off.tolist(), transfer.local[:, 0].tolist(), transfer.local[:, 1].tolist()
        else:
            own = transfer.h_off // holder.chunk_size
            rows = holder.checkable[own]
            for bad in [j for r, j in self._bad if r == rid]:  # known bad: its bytes are read again elsewhere
                rows &= own != bad
            if not rows.any():
                return
            h_off, addr, nbytes = (transfer.h_off[rows].tolist(), transfer.local[rows, 0].tolist(),
                                   transfer.local[rows, 1].tolist())
        job = self._executor().submit(crcs_in_place, addr, nbytes)
        for i, (h, a, n) in enumerate(zip(h_off, addr, nbytes)):
            self._early[(rid, int(h))] = (int(a), int(n), job, i)  # a piece landed again replaces the old CRC

    @property
    def busy(self) -> bool:
        """Reader chunks landed but not settled yet."""
        return bool(self._waits)

    def landed(self, chunk: int, transfers: Iterable[Transfer]) -> list[int]:
        """Reader ``chunk`` has landed through ``transfers``; the reader chunks settled now."""
        waits: set[_Key] = set()
        for t in transfers:  # a few descriptors each: plain Python beats numpy's cost per call here
            rid = t.replica_id
            holder = self._holders.get(rid)
            if holder is None or not holder.any_checkable or t.h_off is None:
                self._unverify(chunk, t.nbytes)
                continue
            own = t.h_off // holder.chunk_size
            rows = holder.checkable[own]
            if not rows.all():  # a TP slice of a holder's chunks: one sum, not a Python step per run
                self._unverify(chunk, int(t.local[~rows, 1].sum()))
                own, h_off, local = own[rows], t.h_off[rows], t.local[rows]
            else:
                h_off, local = t.h_off, t.local
            for j, h, addr, n in zip(own.tolist(), h_off.tolist(), local[:, 0].tolist(), local[:, 1].tolist()):
                key = (rid, j)
                if key in self._bad:
                    self._unverify(chunk, n)
                    continue
                self._readers.setdefault(key, set()).add(chunk)
                if key in self._checked:
                    continue
                pieces = self._pieces.setdefault(key, {})
                old = pieces.get(h)  # a piece landed again replaces the old one
                pieces[h] = (addr, n, chunk)
                self._piece_bytes[key] = self._piece_bytes.get(key, 0) + n - (old[1] if old else 0)
                waits.add(key)
        for key in waits:  # a holder chunk whose bytes have all landed from it: check it now
            if key not in self._running and self._piece_bytes[key] == self._holders[key[0]].full[key[1]]:
                self._submit(key, self._holders[key[0]])
        self._whole_ok.discard(chunk)
        if chunk in self._unverified_in and self._check_whole(chunk):
            waits.add((_WHOLE, chunk))
        if not waits:
            return [chunk]
        self._waits[chunk] = waits
        return []

    def _unverify(self, chunk: int, nbytes: int) -> None:
        self.unverified_bytes += nbytes
        self._unverified_in[chunk] = self._unverified_in.get(chunk, 0) + nbytes

    def _check_whole(self, chunk: int) -> bool:
        """Check reader ``chunk`` whole against a holder cut like the reader that
        lists it with its checksum (complete, or its bitmap has it); False if none."""
        for rid, holder in self._holders.items():
            if not holder.same_cut or holder.crcs is None or (rid, chunk) in self._bad:
                continue
            source = holder.replica
            if not source.source.complete:
                bitmap = source.bitmap
                if chunk // 8 >= len(bitmap) or not bitmap[chunk // 8] >> (chunk % 8) & 1:
                    continue
            parts = [(a, n, None, 0) for a, n in self._layout.chunk_memory(chunk)]
            self._whole[chunk] = (self._executor().submit(_join, parts), rid, int(holder.crcs[chunk]))
            return True
        return False

    def _executor(self) -> InOrderWorker:
        # Jobs run in the order submitted, so a holder chunk's join (``_join``)
        # finds the CRCs of its pieces, submitted before it, done.
        if self._worker is None:
            self._worker = InOrderWorker("tensorhub-verify")
        return self._worker

    def _submit(self, key: _Key, holder: _Holder) -> None:
        parts: list[tuple[int, int, Job | None, int]] = []
        for h in sorted(self._pieces[key]):
            addr, n, _ = self._pieces[key][h]
            early = self._early.pop((key[0], h), None)
            if early is not None and early[:2] == (addr, n):
                parts.append(early)
            else:  # not taken as it landed (cut otherwise): read it now
                parts.append((addr, n, None, 0))
        self._running[key] = self._executor().submit(_join, parts)

    def poll(self, wait_s: float = 0.0) -> tuple[list[int], list[Mismatch]]:
        """Finished checks: reader chunks settled, and mismatches (their reader
        chunks must be read again, see ``forget``). ``wait_s``: wait this long at
        most for the running checks."""
        if not self._running and not self._whole:
            return [], []
        worker = self._executor()
        if wait_s > 0:
            worker.wait([*self._running.values(), *(w[0] for w in self._whole.values())], wait_s)
        elif worker.ran == self._ran_at_poll:  # called after every READ: nothing ran since the last look
            return [], []
        self._ran_at_poll = worker.ran
        settled: list[int] = []
        bad: list[Mismatch] = []
        for c, (future, rid, expected) in [(c, w) for c, w in self._whole.items() if w[0].done]:
            del self._whole[c]
            waits = self._waits.get(c)
            if waits is None or (_WHOLE, c) not in waits:  # read again meanwhile: a new check follows
                continue
            got = future.result()
            nbytes = self._unverified_in.pop(c, 0)
            if got == expected:
                self.verified_bytes += nbytes
                self.unverified_bytes -= nbytes
                self._whole_ok.add(c)
                self._covered(c, (_WHOLE, c), settled)
            else:
                self.unverified_bytes -= nbytes  # counted again when it lands again
                self.forget(c)
                bad.append(self._unplaced(self._holders[rid].replica, (_WHOLE, c), frozenset({c}), expected, got))
        for key, future in [(k, f) for k, f in self._running.items() if f.done]:
            del self._running[key]
            by_table = key in self._by_table
            self._by_table.discard(key)
            got = future.result()
            holder = self._holders[key[0]]
            expected = int(holder.crcs[key[1]])
            self._pieces.pop(key)
            nbytes = self._piece_bytes.pop(key)
            if got == expected:
                self._checked.add(key)
                self.verified_bytes += nbytes
                for c in self._readers.get(key, ()):
                    self._covered(c, key, settled)
            else:
                rereads = frozenset(self._readers.pop(key, ()))
                for c in rereads:
                    self.forget(c)
                if by_table:  # its bytes came from several holders: which one was wrong is not known
                    bad.append(self._unplaced(holder.replica, key, rereads, expected, got))
                else:
                    self._bad.add(key)
                    bad.append(Mismatch(holder.replica, key[1], rereads, expected, got))
        self.mismatches.extend(bad)
        return settled, bad

    def _covered(self, chunk: int, key: _Key, settled: list[int]) -> None:
        """Reader ``chunk`` no longer waits for check ``key``; settled once it waits for none."""
        waits = self._waits.get(chunk)
        if waits is not None:
            waits.discard(key)
            if not waits:
                del self._waits[chunk]
                settled.append(chunk)

    def _unplaced(self, replica: RemoteReplica, key: _Key, rereads: frozenset[int], expected: int,
                  got: int) -> Mismatch:
        """A mismatch of bytes that came from several holders: nobody is excluded,
        they are read again, ``_WHOLE_TRIES`` times at most."""
        tries = self._tries[key] = self._tries.get(key, 0) + 1
        return Mismatch(replica, key[1], rereads, expected, got, whole=True, exhausted=tries >= _WHOLE_TRIES)

    def forget(self, chunk: int) -> None:
        """Reader ``chunk`` will be read again: it waits for nothing until it lands anew."""
        self._waits.pop(chunk, None)

    def settle_rest(self) -> list[int]:
        """Every READ has landed and every check finished: the holder chunks
        still waited for never landed whole from their holder (their bytes came
        from two holders). Each is checked now from the reader's memory, in its
        holder's order (its reader chunks wait for that: see ``running``),
        unless whole checks of all its reader chunks covered it. Returns the
        reader chunks settled now."""
        rest = []
        for key in sorted({k for waits in self._waits.values() for k in waits if k[0] != _WHOLE}):
            if key in self._running:
                continue
            readers = self._readers.get(key, set())
            if readers and readers <= self._whole_ok:  # their whole checks covered these bytes too
                self._pieces.pop(key, None)
                self.verified_bytes += self._piece_bytes.pop(key, 0)
                for c in readers:
                    self._covered(c, key, rest)
                continue
            spans, spanned = self._holders[key[0]].memory(key[1], self._layout.chunk_size)
            parts = [(addr, n, None, 0) for addr, n in spans]
            self._readers[key] = readers | spanned  # a wrong byte may lie in any of them
            self._by_table.add(key)
            self._running[key] = self._executor().submit(_join, parts)
        return sorted(rest)

    def tensors(self, m: Mismatch) -> list[str]:
        """The reader's tensors that bytes of mismatch ``m`` landed in, in the
        reader's order: exactly those of its holder chunk, or, for a check of
        the reader's memory (``whole``), those of the reader chunks it spans."""
        layout = self._layout
        if layout is None or not layout.parts:
            return []
        holder = self._holders.get(m.replica.source.replica_id)
        if holder is not None and not m.whole:
            rows = holder.table["h_off"] // holder.chunk_size == m.chunk
            starts = holder.table["r_off"][rows].tolist()
            ends = (holder.table["r_off"][rows] + holder.table["length"][rows]).tolist()
        else:
            starts = [c * layout.chunk_size for c in sorted(m.rereads)]
            ends = [a + layout.chunk_bytes(c) for a, c in zip(starts, sorted(m.rereads))]
        names: dict[str, None] = {}
        for a, b in sorted(zip(starts, ends)):
            for p in range(layout._part(a), layout._part(b - 1) + 1):
                names[layout.parts[p].name] = None
        return list(names)

    @property
    def running(self) -> bool:
        return bool(self._running or self._whole)

    def close(self) -> None:
        self._early.clear()
        if self._worker is not None:
            self._worker.close()
            self._worker = None
            self._ran_at_poll = -1


def crcs_in_place(addrs: list[int], nbytes: list[int]) -> list[int]:
    """The CRC-32 of each host memory range (address, length), read in place (no
    copy): what a check takes of each READ as it lands; ``bench pull``'s floor
    rows take the same."""
    return [crc32((ctypes.c_char * n).from_address(a)) for a, n in zip(addrs, nbytes)]


def _join(parts: list[tuple[int, int, Job | None, int]]) -> int:
    """CRC-32 of host memory ranges back to back: (address, length, the job
    that took its CRC as it landed and the index in its result, or None: read
    it now). Runs on the helper thread after those jobs (one worker, in order)."""
    value = 0
    for addr, n, early, i in parts:
        if early is None:
            value = crc32((ctypes.c_char * n).from_address(addr), value)
        else:
            value = crc32_combine(value, early.result()[i], n)
    return value
