"""A relay's announce sent ahead: in the steady state an engine's step costs
the server two messages, not three, because each worker's announce of the
replica it is about to fill goes with the engine's Resolve.

    update v+1, every worker (``engineshare.exchange``):
        previous replica (v, same staging) ── build ──▶ AheadAnnounce: a reserved replica id,
            the lean announce of v+1 FILLING in that memory (by layout, empty bitmap), how
            its checksums come (derived as chunks land / from the complete holder cut alike /
            none), as its pull of v+1 will announce it if nothing changed
        first worker ── Resolve(withdrawals, announces) ──▶ server: the answer, the withdrawals,
            then each announce as a Publish alone ──▶ taken? per worker ── broadcast ─▶ all
    the pull (``Hub.pull``, serving):
        open_filling(replica id = the reserved one) ── matches(ahead)? ──yes──▶ announced: no round
                                                                    └─no───▶ announced as before (the
                                                                     same replica id: replaces it)
        the pull did not open it (failed, patched from deltas, not serving) ──▶ dropped: a withdraw
            notice, sent before this process publishes again

Nothing here decides what is read: an announce the server did not take, or
one the pull's own would differ from (another layout, other memory, another
chunk size, checksums that came otherwise), leaves the pull announcing as
before. A replica announced ahead holds no chunk until the pull reports
some, so nobody reads its memory early.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from tensorhub.client.holdings import Holdings
    from tensorhub.client.publication import Publication
    from tensorhub.client.rpc import ReferenceClient

Checksums = Literal["derived", "alike", "none"]


@dataclass(frozen=True, slots=True)
class AheadAnnounce:
    """One worker's announce of its next replica, sent with its group's Resolve."""

    model: str
    version: int
    replica_id: str  # reserved: the pull's publication takes it, whatever the server said
    data: bytes  # ``ReferenceClient.ahead_publish``'s message
    checksums: Checksums
    taken: bool | None = None  # whether the server took it (``ResolveResponse.announces``); None: not known


@dataclass(slots=True)
class AheadUse:
    """One pull's part in it: the announce sent ahead for its version (if
    any), and whether the pull's publication took its replica id."""

    announce: AheadAnnounce | None = None
    opened: bool = False


def checksums_of(pub: Publication) -> Checksums:
    """How a filling replica's chunk checksums come (``Holdings.open_filling``):
    computed as its chunks land, copied from a complete holder cut alike, or none."""
    if pub.derives_crc32:
        return "derived"
    return "alike" if pub.chunk_crc32 is not None else "none"


def build(holdings: Holdings, rpc: ReferenceClient, previous: Publication, version: int) -> AheadAnnounce | None:
    """The announce of ``version`` filling ``previous``'s memory, as the next
    serving pull into it will make it; None where it cannot go ahead: not a
    relay's plain replica, or its layout not one this server took from this
    process (it must go lean)."""
    if previous.origin or previous.retained or previous.trainer_cut or previous.deltas or previous.companions:
        return None
    checksums = checksums_of(previous)
    replica_id = holdings.next_replica_id()
    args = holdings.announce_args(previous, bitmap=b"", complete=False)
    crcs = np.zeros(len(previous.chunk_crc32), np.uint32) if checksums == "derived" else None
    args.update(replica_id=replica_id, version=version, chunk_crc32=crcs)
    data = rpc.ahead_publish(checksums_from_alike=checksums == "alike", **args)
    return AheadAnnounce(previous.model, version, replica_id, data, checksums) if data else None


def matches(holdings: Holdings, rpc: ReferenceClient, pub: Publication, ahead: AheadAnnounce) -> bool:
    """Whether ``pub`` (the pull's publication, filling, nothing landed) is
    what ``ahead`` announced: the same replica, layout, memory and chunks, its
    checksums come the same way."""
    if pub.replica_id != ahead.replica_id or (pub.model, pub.version) != (ahead.model, ahead.version) \
            or checksums_of(pub) != ahead.checksums:
        return False
    args = holdings.announce_args(pub, bitmap=b"", complete=False)
    args.update(chunk_crc32=None)  # their values are not compared: how they come is (above)
    mine = rpc.ahead_publish(checksums_from_alike=ahead.checksums == "alike", **args)
    return bool(mine) and rpc.same_announce(mine, ahead.data)
