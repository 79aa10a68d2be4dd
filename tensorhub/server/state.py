"""The reference server's soft state: who holds which version, and who reads.

Everything here can be rebuilt from the agents (they re-register after a server
restart), so nothing is persisted. All methods run on the server's single
asyncio event loop, so no locks are needed. Raises ``StateError`` with a gRPC
status name; the service layer turns it into the RPC status.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tensorhub.chunks import bitmap_count, bitmap_empty, bitmap_full, bitmap_set
from tensorhub.manifest import Manifest
from tensorhub.topology import Labels, Reliability

GROUP_ROUNDS_KEPT = 64  # per group: rounds older than this are forgotten


class StateError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # a grpc.StatusCode name, e.g. "NOT_FOUND"


@dataclass(slots=True)
class Agent:
    agent_id: str
    name: str
    labels: Labels
    reliability: Reliability
    expires_at: float


@dataclass(slots=True)
class Replica:
    replica_id: str
    agent_id: str
    model: str
    version: int
    memory: Any  # opaque to the state: the service's ReplicaMemory message
    complete: bool
    bitmap: bytearray
    origin: bool
    retained: bool = False  # a copy kept only to keep a retained version pullable
    withdrawn: bool = False
    leases: set[str] = field(default_factory=set)
    drained: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class Version:
    manifest: Manifest
    fingerprint: str
    chunk_size: int
    num_chunks: int
    replicas: dict[str, Replica] = field(default_factory=dict)
    wire_manifest: Any = None  # cached protobuf form, filled in by the service


@dataclass(slots=True)
class Lease:
    lease_id: str
    agent_id: str
    replica_ids: list[str]
    expires_at: float


class State:
    def __init__(self, *, agent_ttl_s: float = 10.0, lease_ttl_s: float = 10.0, retain: int = 1) -> None:
        self.instance_id = uuid.uuid4().hex
        self.agent_ttl_s = agent_ttl_s
        self.lease_ttl_s = lease_ttl_s
        self.retain = retain  # the latest K versions of every model stay pullable
        self.agents: dict[str, Agent] = {}
        self.models: dict[str, dict[int, Version]] = {}
        self.replicas: dict[str, Replica] = {}
        self.leases: dict[str, Lease] = {}
        self.groups: dict[str, dict[int, int]] = {}

    # ------------------------------------------------------------ agents

    def register_agent(self, agent_id: str, name: str, labels: Labels, reliability: Reliability) -> None:
        self.agents[agent_id] = Agent(agent_id, name, labels, reliability, time.monotonic() + self.agent_ttl_s)

    def heartbeat(self, agent_id: str) -> bool:
        agent = self.agents.get(agent_id)
        if agent is None:
            return False
        agent.expires_at = time.monotonic() + self.agent_ttl_s
        return True

    def _agent(self, agent_id: str) -> Agent:
        agent = self.agents.get(agent_id)
        if agent is None:
            raise StateError(
                "FAILED_PRECONDITION",
                f"agent {agent_id!r} is not registered (expired, or the server restarted); register again",
            )
        return agent

    # ------------------------------------------------------------ holders

    def publish(
        self,
        *,
        agent_id: str,
        replica_id: str,
        model: str,
        version: int,
        manifest: Manifest,
        chunk_size: int,
        num_chunks: int,
        memory: Any,
        complete: bool,
        bitmap: bytes,
        origin: bool,
        retained: bool = False,
    ) -> Version:
        self._agent(agent_id)
        fingerprint = manifest.fingerprint
        versions = self.models.setdefault(model, {})
        entry = versions.get(version)
        if entry is not None and entry.replicas:
            if entry.fingerprint != fingerprint:
                raise StateError(
                    "ALREADY_EXISTS",
                    f"{model!r} version {version} is already held with manifest "
                    f"{entry.fingerprint[:12]} ({len(entry.manifest.tensors)} tensors); this publish has "
                    f"{fingerprint[:12]} ({len(manifest.tensors)} tensors). Publish it as a new version.",
                )
            if entry.chunk_size != chunk_size:
                raise StateError(
                    "ALREADY_EXISTS",
                    f"{model!r} version {version} uses chunk_size {entry.chunk_size}, not {chunk_size}",
                )
        if entry is None or not entry.replicas:
            entry = Version(manifest, fingerprint, chunk_size, num_chunks)
            versions[version] = entry
        existing = self.replicas.get(replica_id)
        if existing is not None and (existing.agent_id, existing.model, existing.version) != (agent_id, model, version):
            raise StateError("ALREADY_EXISTS", f"replica id {replica_id!r} is taken by another replica")
        for other in entry.replicas.values():
            # One live replica per agent and version; a retained copy may sit
            # beside the replica it replaces while that one drains.
            if (other.agent_id == agent_id and other.replica_id != replica_id and not other.withdrawn
                    and not (retained or other.retained)):
                raise StateError(
                    "ALREADY_EXISTS",
                    f"agent {self.agents[agent_id].name!r} already publishes {model!r} version {version} "
                    f"as replica {other.replica_id}; unpublish it first",
                )
        bits = bitmap_full(num_chunks) if complete else bytearray(bitmap_empty(num_chunks))
        if not complete:
            bits[: len(bitmap)] = bitmap[: len(bits)]
        replica = Replica(replica_id, agent_id, model, version, memory, complete, bits, origin, retained)
        if existing is not None:  # idempotent re-publish keeps the reads in flight
            replica.leases = existing.leases
        if not replica.leases:
            replica.drained.set()
        entry.replicas[replica_id] = replica
        self.replicas[replica_id] = replica
        return entry

    def report_chunks(self, agent_id: str, replica_id: str, chunks: list[int], complete: bool) -> None:
        replica = self._own_replica(agent_id, replica_id)
        entry = self.models[replica.model][replica.version]
        for c in chunks:
            if not 0 <= c < entry.num_chunks:
                raise StateError("INVALID_ARGUMENT", f"chunk {c} outside [0, {entry.num_chunks})")
            bitmap_set(replica.bitmap, c)
        if complete:
            if bitmap_count(replica.bitmap) != entry.num_chunks:
                raise StateError(
                    "FAILED_PRECONDITION",
                    f"replica {replica_id} reported complete with {bitmap_count(replica.bitmap)} of "
                    f"{entry.num_chunks} chunks",
                )
            replica.complete = True

    # ------------------------------------------------------------ retention

    def _reliable(self, replica: Replica) -> bool:
        agent = self.agents.get(replica.agent_id)
        return agent is not None and agent.reliability is Reliability.RELIABLE

    def _retained_versions(self, model: str) -> list[int]:
        return self.pullable_versions(model)[-self.retain:] if self.retain > 0 else []

    def needs_retention(self, agent_id: str, replica_id: str) -> bool:
        """True when withdrawing this replica would leave a retained version
        (one of the model's latest K) without a reliable complete replica.
        Spot replicas never count as the retained copy."""
        replica = self._own_replica(agent_id, replica_id)
        if replica.withdrawn or not replica.complete or not self._reliable(replica):
            return False
        if replica.version not in self._retained_versions(replica.model):
            return False
        others = self.models[replica.model][replica.version].replicas.values()
        return not any(
            r is not replica and r.complete and self._live(r) and self._reliable(r) for r in others
        )

    def releasable(self, agent_id: str) -> list[str]:
        """The agent's retained copies whose version fell out of the latest K."""
        out = []
        for r in self.replicas.values():
            if r.agent_id == agent_id and r.retained and not r.withdrawn:
                if r.version not in self._retained_versions(r.model):
                    out.append(r.replica_id)
        return out

    def withdraw(self, agent_id: str, replica_id: str) -> Replica:
        """Stop handing the replica out; in-flight leases may still read it."""
        replica = self._own_replica(agent_id, replica_id)
        replica.withdrawn = True
        if not replica.leases:
            replica.drained.set()
        return replica

    def remove_replica(self, replica_id: str) -> None:
        replica = self.replicas.pop(replica_id, None)
        if replica is None:
            return
        versions = self.models.get(replica.model, {})
        entry = versions.get(replica.version)
        if entry is not None:
            entry.replicas.pop(replica_id, None)
            if not entry.replicas:
                del versions[replica.version]
        if not versions:
            self.models.pop(replica.model, None)

    def _own_replica(self, agent_id: str, replica_id: str) -> Replica:
        self._agent(agent_id)
        replica = self.replicas.get(replica_id)
        if replica is None:
            raise StateError("NOT_FOUND", f"replica {replica_id!r} is not registered")
        if replica.agent_id != agent_id:
            raise StateError("PERMISSION_DENIED", f"replica {replica_id!r} belongs to another agent")
        return replica

    # ------------------------------------------------------------ readers

    def _live(self, replica: Replica) -> bool:
        agent = self.agents.get(replica.agent_id)
        return not replica.withdrawn and agent is not None

    def pullable_versions(self, model: str) -> list[int]:
        """Versions with at least one live complete replica, ascending."""
        return sorted(
            v for v, entry in self.models.get(model, {}).items()
            if any(r.complete and self._live(r) for r in entry.replicas.values())
        )

    def resolve(self, model: str, version: int | None, group: str = "", group_round: int = 0) -> tuple[int, Version]:
        if model not in self.models:
            raise StateError("NOT_FOUND", f"model {model!r} is unknown: nothing of it was published")
        if group:
            rounds = self.groups.setdefault(f"{model}\0{group}", {})
            fixed = rounds.get(group_round)
            if fixed is not None:
                version = fixed
        if version is None:
            pullable = self.pullable_versions(model)
            if not pullable:
                raise StateError("NOT_FOUND", f"model {model!r} has no complete replica of any version")
            version = pullable[-1]
        entry = self.models[model].get(version)
        if entry is None or not any(r.complete and self._live(r) for r in entry.replicas.values()):
            held = self.pullable_versions(model)
            raise StateError(
                "NOT_FOUND",
                f"{model!r} version {version} has no complete replica; pullable versions: {held or 'none'}",
            )
        if group:
            rounds[group_round] = version
            for old in sorted(rounds)[:-GROUP_ROUNDS_KEPT]:
                del rounds[old]
        return version, entry

    def sources(self, entry: Version, reader_agent_id: str) -> list[Replica]:
        return [r for r in entry.replicas.values() if self._live(r) and r.agent_id != reader_agent_id]

    def acquire_lease(self, agent_id: str, replica_ids: list[str]) -> Lease:
        self._agent(agent_id)
        granted = [rid for rid in replica_ids if (r := self.replicas.get(rid)) is not None and self._live(r)]
        lease = Lease(uuid.uuid4().hex, agent_id, granted, time.monotonic() + self.lease_ttl_s)
        self.leases[lease.lease_id] = lease
        for rid in granted:
            replica = self.replicas[rid]
            replica.leases.add(lease.lease_id)
            replica.drained.clear()
        return lease

    def renew_lease(self, agent_id: str, lease_id: str) -> None:
        lease = self.leases.get(lease_id)
        if lease is None or lease.agent_id != agent_id:
            raise StateError("NOT_FOUND", f"read lease {lease_id!r} is unknown or expired")
        lease.expires_at = time.monotonic() + self.lease_ttl_s

    def release_lease(self, lease_id: str) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return
        for rid in lease.replica_ids:
            replica = self.replicas.get(rid)
            if replica is not None:
                replica.leases.discard(lease_id)
                if not replica.leases:
                    replica.drained.set()

    def report_lost(self, replica_id: str) -> None:
        """A reader saw the source fail. Drop the replica; if its agent is
        alive it will notice at its next publish or heartbeat."""
        replica = self.replicas.get(replica_id)
        if replica is not None:
            for lease_id in list(replica.leases):
                lease = self.leases.get(lease_id)
                if lease is not None and replica_id in lease.replica_ids:
                    lease.replica_ids.remove(replica_id)
            replica.leases.clear()
            replica.drained.set()
            self.remove_replica(replica_id)

    # ------------------------------------------------------------ expiry

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for lease in [l for l in self.leases.values() if l.expires_at <= now]:
            self.release_lease(lease.lease_id)
        for agent in [a for a in self.agents.values() if a.expires_at <= now]:
            del self.agents[agent.agent_id]
            for replica in [r for r in self.replicas.values() if r.agent_id == agent.agent_id]:
                self.report_lost(replica.replica_id)
            for lease in [l for l in self.leases.values() if l.agent_id == agent.agent_id]:
                self.release_lease(lease.lease_id)
