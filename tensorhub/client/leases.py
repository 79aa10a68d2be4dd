"""The read leases of one pull: which lease covers which holder.

A pull reads a holder's memory only under a read lease on its replica: the
holder's unpublish waits for the lease (the contract), so the memory stays as
published while READs of it fly. Leases are kept until the pull ends.

    resolve(lease=True) ──▶ upfront lease (every holder it listed)
                                │ the first round that reads uses it, if it
                                │ covers that round's holders; else it is let go
                                ▼
    round's holders not covered ──▶ take() ──▶ covering: replica id ──▶ Lease
                                                   │ renewed when half its TTL is left
                                                   ▼
    holder withdrawn, the listed ones can give the rest ──▶ take_over(), release(gone)
    pull ends ──▶ release_all()

``PullJob`` decides when; this class keeps the bookkeeping, so that no lease
is lost track of (a leaked lease holds a holder's unpublish for a TTL).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from tensorhub.client.rpc import Resolved
from tensorhub.errors import TensorHubError

log = logging.getLogger(__name__)


class LeaseService(Protocol):
    """The reference server's lease calls (``ReferenceClient``)."""

    def acquire_lease(self, agent_id: str, replica_ids: list[str]) -> tuple[str, list[str], float]: ...

    def renew_lease(self, agent_id: str, lease_id: str) -> float: ...

    def release_lease_async(self, agent_id: str, lease_id: str) -> None: ...


class Lease:
    """A read lease on some sources of a pull. Renewed before it runs out;
    ``expiry`` is local and conservative (taken before the request was sent)."""

    def __init__(self, rpc: LeaseService, agent_id: str, replica_ids: list[str],
                 taken: Resolved | None = None) -> None:
        self._rpc, self._agent_id = rpc, agent_id
        if taken is not None:  # leased together with the resolve
            self.lease_id, self.ttl_s, sent = taken.lease_id, taken.lease_ttl_s, taken.lease_sent_at
            self.granted = set(replica_ids)
        else:
            sent = time.monotonic()
            self.lease_id, granted, self.ttl_s = rpc.acquire_lease(agent_id, replica_ids)
            self.granted = set(granted)
        self.expiry = sent + self.ttl_s
        self._lock = threading.Lock()

    def valid_until(self) -> float:
        with self._lock:
            if self.expiry - time.monotonic() < self.ttl_s / 2:
                sent = time.monotonic()
                self.ttl_s = self._rpc.renew_lease(self._agent_id, self.lease_id)
                self.expiry = sent + self.ttl_s
            return self.expiry

    def renewal_due(self) -> float:
        """When ``valid_until`` renews it next (half its TTL before its expiry)."""
        with self._lock:
            return self.expiry - self.ttl_s / 2

    def release(self) -> None:
        try:
            self._rpc.release_lease_async(self._agent_id, self.lease_id)
        except Exception as e:  # noqa: BLE001  the lease expires by itself
            log.debug("release lease: %s", e)


class PullLeases:
    """Every read lease one pull holds, and which of them covers each holder."""

    def __init__(self, rpc: LeaseService, agent_id: str) -> None:
        self._rpc, self._agent_id = rpc, agent_id
        self.upfront: Resolved | None = None  # a resolve whose lease the next round uses
        self._leases: list[Lease] = []
        self._covering: dict[str, Lease] = {}  # replica id -> the lease that covers it

    def covers(self, replica_id: str) -> bool:
        return replica_id in self._covering

    def covering(self, replica_id: str) -> Lease | None:
        return self._covering.get(replica_id)

    def forget(self, replica_id: str) -> None:
        """Stop reading ``replica_id`` under its lease (it could not be renewed,
        or a READ finished after it ran out): the next round leases it anew."""
        self._covering.pop(replica_id, None)

    def upfront_covers(self, uncovered: list[str]) -> bool:
        """Whether the resolve's lease (if one is kept) covers the holders a round
        reads from. It may not: it was taken before holders seen since (a peer
        that joined while this reader waited for its seed's chunks), and those are
        not withdrawn, so the round leases anew."""
        return self.upfront is None or set(uncovered) <= set(self._upfront_ids())

    def _upfront_ids(self) -> list[str]:
        """Every holder the kept resolve listed: its lease covers them all."""
        return sorted(r.source.replica_id for r in self.upfront.replicas) if self.upfront else []

    def drop_upfront(self) -> None:
        """Release a lease taken with a resolve that no round used."""
        if self.upfront is not None:
            Lease(self._rpc, self._agent_id, [], self.upfront).release()
            self.upfront = None

    def take(self, uncovered: list[str]) -> set[str]:
        """Lease the holders a round reads that no lease covers yet: the kept
        resolve's lease if there is one (it covers every holder that resolve
        returned: all are this pull's to let go), else a new one. Returns the
        replica ids granted; the rest were withdrawn since the plan."""
        ids = self._upfront_ids() if self.upfront else uncovered
        lease = Lease(self._rpc, self._agent_id, ids, self.upfront)
        self.upfront = None
        self._leases.append(lease)
        for rid in lease.granted:
            self._covering.setdefault(rid, lease)
        return lease.granted

    def take_over(self, complete: list[str]) -> bool:
        """Lease the complete listed holders no lease covers yet, before withdrawn
        ones are let go; False when one of them was withdrawn meanwhile."""
        uncovered = [rid for rid in complete if rid not in self._covering]
        if not uncovered:
            return True
        lease = Lease(self._rpc, self._agent_id, uncovered)
        self._leases.append(lease)
        for rid in lease.granted:
            self._covering[rid] = lease
        return set(uncovered) <= lease.granted

    def release(self, gone: set[str], listed: set[str]) -> None:
        """Release the leases that cover ``gone``; what else they covered and is
        still ``listed`` is leased anew first (no READ in flight is on ``gone``)."""
        for lease in {id(self._covering[rid]): self._covering[rid] for rid in gone}.values():
            keep = [rid for rid, held in self._covering.items() if held is lease and rid not in gone and rid in listed]
            if keep:
                renewed = Lease(self._rpc, self._agent_id, keep)
                self._leases.append(renewed)
                for rid in renewed.granted:
                    self._covering[rid] = renewed
            for rid in [rid for rid, held in self._covering.items() if held is lease]:
                del self._covering[rid]
            self._leases.remove(lease)
            lease.release()

    def still_leased(self, replica_id: str) -> bool:
        """Whether the read lease on ``replica_id`` is still good now, renewing
        it if due. A READ seen finished only after its lease ran out may have
        been served from memory its holder reused meanwhile: on a slow link the
        bytes leave the holder as the link takes them (the fault campaign's
        slow readers caught a trainer's next version this way, by checksums;
        a relay without checksums would have handed the bytes on)."""
        lease = self._covering.get(replica_id)
        if lease is None:
            return False
        seen = time.monotonic()  # the READ finished before this
        try:
            # A renewal the server grants now proves the lease held when the READ finished.
            until = lease.valid_until()
        except TensorHubError:  # the server cannot say: the lease as last known
            until = lease.expiry
        return until > seen

    def release_all(self) -> None:
        """The pull is over: let every lease go (they expire by themselves if
        the server does not hear of it)."""
        self.drop_upfront()
        for lease in self._leases:
            lease.release()
        self._leases.clear()
        self._covering.clear()
