"""The reference server's soft state: who holds which regions of which version,
and who reads.

Everything here can be rebuilt from the agents (they re-register after a server
restart), so nothing is persisted. All methods run on the server's single
asyncio event loop, so no locks are needed. Raises ``StateError`` with a gRPC
status name; the service layer turns it into the RPC status.

A replica holds a *shard*: a list of (tensor index, region). A version is
*visible* (listed as such, ``latest``, resolvable) only while the union of the
regions of its live complete replicas covers every element of every tensor.
That is cached per version and recomputed whenever a replica comes, completes
or goes; waiters of ``wait_for_version`` are woken when it flips.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tensorhub.chunks import bitmap_count, bitmap_empty, bitmap_full, bitmap_set_many
from tensorhub.manifest import Manifest
from tensorhub.regions import Bounds, Region, describe_box, intersect
from tensorhub.regiontable import RegionTable, Shapes, shapes_of, whole_table
from tensorhub.server.config import ServerConfig
from tensorhub.server.coverage import (
    Coverage,
    Grouping,
    HolderKeys,
    KnownCover,
    coverage_of,
    covering_prefix,
    covers,
    held_elements,
)
from tensorhub.status import AgentView, ControlView, HubStatus, LeaseView, ModelView, ReplicaView, VersionView
from tensorhub.topology import Labels, Reliability

GROUP_ROUNDS_KEPT = 64  # per group: rounds older than this are forgotten
MAX_GROUP_MEMBERS = 1024  # members of one group remembered (a group is an engine: 8 or 16 workers)
MAX_GROUPS_KEPT = 65536  # groups whose members are remembered (group_sources)
# Readers (groups) whose holder agents' rank keys are kept across versions (_agent_rank_keys):
# about 100 B a holder, so 256 readers of 1,280 holders keep about 33 MB at most.
_RANK_KEYS_KEPT = 256
MISSING_SHOWN = 8  # missing regions named in a "not complete" message

Held = tuple[int, Region]  # (index of the tensor in the manifest, region)



class StateError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # a grpc.StatusCode name, e.g. "NOT_FOUND"


# ---------------------------------------------------------------- held regions


def check_held(manifest: Manifest, held: list[Held] | RegionTable) -> RegionTable:
    """The held regions, checked against the manifest (StateError
    INVALID_ARGUMENT naming the tensor and region) and normalized: a region
    spanning its whole tensor becomes the whole tensor. Empty means every tensor whole."""
    tensors = manifest.tensors
    shapes = shapes_of(manifest)
    if isinstance(held, RegionTable):
        table = held
    elif not held:
        return whole_table(shapes)
    else:
        for index, region in held:
            if not 0 <= index < len(tensors):
                raise StateError("INVALID_ARGUMENT", f"held region {region.describe()} names tensor #{index}; "
                                 f"the manifest has {len(tensors)}")
            if region.box is not None and len(region.box) != len(tensors[index].shape):
                spec = tensors[index]
                raise StateError("INVALID_ARGUMENT", f"held region {region.describe()} of {spec.name!r} "
                                 f"{list(spec.shape)}: {region.problem(spec.shape)}")
        table = RegionTable.from_held(held, shapes)
    bad = table.problem(shapes)
    if bad is not None:
        k, problem = bad
        spec = tensors[int(table.tensor[k])]
        raise StateError("INVALID_ARGUMENT", f"held region {table.region(k, shapes).describe()} of {spec.name!r} "
                         f"{list(spec.shape)}: {problem}")
    whole = table.whole(shapes)
    if whole.any():  # normalized to the whole tensor's box
        flat, lo, hi = table.flat.copy(), table.lo.copy(), table.hi.copy()
        flat[whole], lo[whole], hi[whole] = False, 0, shapes.dims[table.tensor[whole]]
        table = RegionTable(table.tensor, flat, lo, hi)
    for index in table.suspect_overlaps():  # the exact sweep only where two regions may meet
        at = np.flatnonzero(table.tensor == index)
        regions = [table.region(int(k), shapes) for k in at]
        clash = _first_clash(regions, tensors[int(index)].shape)
        if clash is not None:
            raise StateError("INVALID_ARGUMENT",
                             f"held region {regions[clash].describe()} of {tensors[int(index)].name!r} overlaps "
                             "another region this replica holds of the same tensor")
    return table.compact()


def _first_clash(regions: list[Region], shape: tuple[int, ...]) -> int | None:
    """The index of a region that overlaps an earlier one, or None. A sweep
    along dimension 0: only boxes whose row ranges meet are compared."""
    boxes = sorted((box[0] if box else (0, 1), k, box) for k, r in enumerate(regions) for box in r.boxes(shape))
    open_: list[tuple[int, int, Bounds]] = []  # (row stop, region, box) of boxes still in reach
    for (row_start, _), k, box in boxes:
        open_ = [o for o in open_ if o[0] > row_start]
        if any(j != k and intersect(box, other) is not None for _, j, other in open_):
            return k
        open_.append((box[0][1] if box else 1, k, box))
    return None


def held_bytes(manifest: Manifest, held: RegionTable) -> np.ndarray:
    """Bytes of each held region (its memory region's size)."""
    return held.nbytes(shapes_of(manifest))


# ---------------------------------------------------------------- records


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
    held: RegionTable | None  # normalized by check_held, in memory order; None when every tensor whole
    shapes: Shapes  # of the version's manifest (shared)
    chunk_size: int  # chunks cover the held regions' bytes back to back
    num_chunks: int
    retained: bool = False  # a copy kept only to keep a retained version pullable
    trainer_cut: bool = False  # a trainer rank's copy of its readers' cut, beside its shards
    withdrawn: bool = False
    # A reader reported it failed while its holder is alive and others lease it:
    # hidden like a withdrawn replica, its leases kept until they end (see report_lost).
    lost: bool = False
    wire_held: bytes = b""  # the service's wire form of ``held`` (a serialized ReplicaInfo field)

    @property
    def whole(self) -> bool:
        """Holds every tensor whole."""
        return self.held is None

    def held_list(self) -> list[Held]:
        """(tensor index, region) per held region, in memory order."""
        table = self.held if self.held is not None else whole_table(self.shapes)
        return table.held(self.shapes)

    def held_count(self) -> int:
        """Held regions; 0 for a replica of every tensor whole (as on the wire)."""
        return 0 if self.held is None else len(self.held)
    wire_info: Any = None  # opaque: the service's cached wire form of the replica's unchanging fields
    chunk_crc32: Any = None  # opaque: the publisher's per-chunk CRC-32 (wire form), returned with Resolve
    deltas: Any = ()  # opaque: names of the delta models that hold its changes from an earlier version
    # When its holder last said it holds it (publish, chunk report, a heartbeat
    # listing it). No read lease on it outlives this by more than one lease TTL:
    # a holder cut off from the server mid-unpublish stops listing it, so after
    # one TTL it knows every reader has stopped, whatever the server renewed.
    confirmed_at: float = 0.0
    leases: set[str] = field(default_factory=set)
    drained: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class Version:
    manifest: Manifest
    fingerprint: str
    replicas: dict[str, Replica] = field(default_factory=dict)
    # Agent id -> its replicas' ids in this version: a publish checks the agent's
    # own (one live replica per agent), not every holder's (1,280 at paper scale).
    by_agent: dict[str, list[str]] = field(default_factory=dict)
    # id(held) -> (that table, the ids of the replicas holding it, withdrawn ones
    # left out): the relays of one TP rank share a table, and one of them
    # withdrawn while another counts changes nothing covered (State._refresh, ``removed``).
    alike: dict[int, tuple[RegionTable | None, dict[str, None]]] = field(default_factory=dict)
    visible: bool = False  # the live complete replicas cover every element
    coverage: Coverage | None = None  # of the complete live replicas, while not visible (see State._refresh)
    # Keys of complete holders noted but not yet added to ``coverage``: republishes of the
    # tables that last completed a version (``KnownCover``), added only if that set is not reached
    noted: dict[int, HolderKeys] = field(default_factory=dict)
    grouping: Grouping | None = None  # tensors every replica so far cuts alike (coverage.py), set by publish
    wire_manifest: Any = None  # cached protobuf form, filled in by the service
    # Reader agent id -> (live holders, their fixed keys) as of State._holders_changed == ranked_at: State._ranking.
    ranked: dict[str, tuple[list[Replica], list[int]]] = field(default_factory=dict)
    ranked_at: int = -1
    # Layout key (ReplicaInfo.layout) -> the replica laid out so, for readers that name
    # the holders they read before (ResolveRequest.named_layouts): the service indexes
    # the replicas published since (``unindexed``) when such a reader asks.
    laid_out: dict[bytes, Replica] = field(default_factory=dict)
    unindexed: list[Replica] = field(default_factory=list)
    # ``filling_relays`` and ``relays``, kept as replicas come, change and go (``counted``):
    # every Resolve asks them for its pace, and counting 1,000 replicas each time was O(n^2) a step
    _filling: int = 0
    _relays: int = 0

    def counted(self, replica: Replica, sign: int) -> None:
        """Add (``sign`` 1) or take away (-1) ``replica``'s part in the counts,
        as it stands: called before and after each change of its
        ``complete``, ``withdrawn`` or ``lost``, and as it joins or leaves ``replicas``."""
        if not replica.withdrawn and not replica.lost:
            self._filling += sign * (not replica.complete)
            self._relays += sign * (not replica.origin)

    def filling_relays(self) -> int:
        """Replicas of this version still filling (relays mid-pull), not withdrawn or lost."""
        return self._filling

    def relays(self) -> int:
        """Replicas of this version that readers made (not a trainer's), not withdrawn or lost."""
        return self._relays

    def missing(self) -> tuple[list[tuple[int, Bounds]], int]:
        """The first (tensor, box) nobody complete holds, and how many there are:
        worked out when asked (a message, a status), not at every publish."""
        assert not self.noted, "State.worked_out first: holders noted in passing are not in the coverage"
        return self.coverage.missing(MISSING_SHOWN) if self.coverage is not None else ([], 0)

    def describe_missing(self) -> str:
        missing, count = self.missing()
        if not count:
            return "nothing"
        parts = []
        for index, box in missing:
            spec = self.manifest.tensors[index]
            parts.append(f"{spec.name} {describe_box(spec.shape, box)}")
        more = count - len(missing)
        return ", ".join(parts) + (f" (and {more} more)" if more > 0 else "")


@dataclass(slots=True)
class Lease:
    lease_id: str
    agent_id: str
    replica_ids: list[str]
    expires_at: float
    # Other members of the owner's group reading under it (``ResolveRequest.members``):
    # they may renew it and report its holders lost; only the owner releases it.
    sharers: frozenset[str] = frozenset()


class State:
    def __init__(self, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig()
        self.instance_id = uuid.uuid4().hex
        self.started_at = time.monotonic()
        self.agent_ttl_s = self.config.agent_ttl_s
        self.lease_ttl_s = self.config.lease_ttl_s
        self.retain = self.config.retain  # the latest K visible versions of every model stay pullable
        self.agents: dict[str, Agent] = {}
        self.models: dict[str, dict[int, Version]] = {}
        self.replicas: dict[str, Replica] = {}
        self.leases: dict[str, Lease] = {}
        self.control = ControlView()  # what the control plane sent (the service counts it)
        self._whole_tables: dict[int, tuple[RegionTable, bool]] = {}  # every_tensor_whole
        # (model, manifest fingerprint) -> the grouping its versions share, kept past
        # the versions themselves: when every holder of v withdrew before v+1 is
        # published, v+1 still finds its holders' tables refined and keyed.
        self._groupings: dict[tuple[str, str], Grouping] = {}
        self.leases_of: dict[str, int] = {}  # agent id -> read leases it holds (a pull in flight when > 0)
        self.groups: dict[str, dict[int, int]] = {}
        self.group_members: dict[str, set[str]] = {}  # "model\0group" -> member agents (group_sources)
        # Set (and replaced) whenever some version's visibility flips.
        self._visibility_changed = asyncio.Event()
        # (model, version) -> entry whose visibility withdrawals made together left to
        # recompute once (``withdrawals_together``); None outside such a block.
        self._pending: dict[tuple[str, int], Version] | None = None
        # No agent or lease expires before this (a lower bound: renewals only push
        # expiry later), so expire() on every RPC costs one comparison until then.
        self._next_expiry = -math.inf
        # Bumped whenever who is a live holder may have changed (a replica
        # published, withdrawn or removed; an agent registered, perhaps with new
        # labels, or expired): ``sources`` keeps each reader's ranking until then.
        self._holders_changed = 0
        # Each reader's rank keys of holder agents (``_agent_rank_keys``), kept across
        # versions until an agent registers (perhaps with new labels).
        self._rank_keys: dict[tuple[str, str], _ReaderRankKeys] = {}

    # ------------------------------------------------------------ agents

    def register_agent(self, agent_id: str, name: str, labels: Labels, reliability: Reliability) -> None:
        agent = Agent(agent_id, name, labels, reliability, time.monotonic() + self.agent_ttl_s)
        self.agents[agent_id] = agent
        self._holders_changed += 1
        self._rank_keys.clear()
        self._next_expiry = min(self._next_expiry, agent.expires_at)

    def heartbeat(self, agent_id: str, held: Iterable[str] = ()) -> bool:
        """Keep the agent alive; ``held``: the replicas it still holds (each
        confirmed: see ``Replica.confirmed_at``)."""
        agent = self.agents.get(agent_id)
        if agent is None:
            return False
        now = time.monotonic()
        agent.expires_at = now + self.agent_ttl_s
        for rid in held:
            replica = self.replicas.get(rid)
            if replica is not None and replica.agent_id == agent_id:
                replica.confirmed_at = now
        return True

    def heard_from(self, agent_id: str, within_s: float) -> bool:
        """Whether the agent heartbeated (or registered) in the last ``within_s``."""
        agent = self.agents.get(agent_id)
        return agent is not None and agent.expires_at - self.agent_ttl_s >= time.monotonic() - within_s

    def registered(self, agent_id: str) -> Agent:
        """The agent, or FAILED_PRECONDITION when it is not registered (expired, or the server restarted)."""
        return self._agent(agent_id)

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
        held: RegionTable | list[Held],
        chunk_size: int,
        memory: Any,
        complete: bool,
        bitmap: bytes,
        origin: bool,
        retained: bool = False,
        total_bytes: int | None = None,
        trainer_cut: bool = False,
    ) -> Replica:
        """Record a replica holding ``held`` (as returned by ``check_held``; a
        list of (tensor, region) is checked here); ``total_bytes``: its bytes,
        when the caller has counted them."""
        self._agent(agent_id)
        if not isinstance(held, RegionTable):
            held = check_held(manifest, held)
        if chunk_size <= 0:
            raise StateError("INVALID_ARGUMENT", f"chunk_size {chunk_size} must be positive")
        fingerprint = manifest.fingerprint
        entry = self.models.get(model, {}).get(version)
        if entry is not None and entry.replicas and entry.fingerprint != fingerprint:
            raise StateError(
                "ALREADY_EXISTS",
                f"{model!r} version {version} is already held with manifest "
                f"{entry.fingerprint[:12]} ({len(entry.manifest.tensors)} tensors); this publish has "
                f"{fingerprint[:12]} ({len(manifest.tensors)} tensors). Publish it as a new version.",
            )
        existing = self.replicas.get(replica_id)
        if existing is not None and (existing.agent_id, existing.model, existing.version) != (agent_id, model, version):
            raise StateError("ALREADY_EXISTS", f"replica id {replica_id!r} is taken by another replica")
        if entry is not None:
            for other in (entry.replicas[rid] for rid in entry.by_agent.get(agent_id, ())):
                # One live replica per agent and version; a retained copy may sit
                # beside the replica it replaces while that one drains, and a
                # trainer rank's cut beside its shards (Hub.publish(cut=...)).
                if (other.agent_id == agent_id and other.replica_id != replica_id and not other.withdrawn
                        and not (retained or other.retained) and other.trainer_cut == trainer_cut):
                    raise StateError(
                        "ALREADY_EXISTS",
                        f"agent {self.agents[agent_id].name!r} already publishes {model!r} version {version} "
                        f"as replica {other.replica_id}; unpublish it first",
                    )
        if entry is None or not entry.replicas:
            entry = Version(manifest, fingerprint)
            versions = self.models.setdefault(model, {})
            # The grouping of earlier versions with this manifest, shared: the next
            # version's holders are most often the same tables (the steady state),
            # which then refine nothing and have their keys. A grouping finer than
            # a version needs is still right (its groups are cut alike by every
            # holder it saw).
            entry.grouping = self._groupings.pop((model, fingerprint), None) or Grouping(shapes_of(manifest))
            self._groupings[(model, fingerprint)] = entry.grouping
            if len(self._groupings) > _GROUPINGS_KEPT:
                self._groupings.pop(next(iter(self._groupings)))
            versions[version] = entry
        if total_bytes is None:  # the service passes what it checked the memory against
            total_bytes = int(held_bytes(manifest, held).sum())
        num_chunks = -(-total_bytes // chunk_size)
        bits = bitmap_full(num_chunks) if complete else bitmap_empty(num_chunks)
        if not complete:
            bits[: len(bitmap)] = bitmap[: len(bits)]
        shapes = shapes_of(entry.manifest)
        whole = self.every_tensor_whole(held, shapes)
        replica = Replica(replica_id, agent_id, model, version, memory, complete, bits, origin,
                          None if whole else held, shapes, chunk_size, num_chunks, retained, trainer_cut)
        replica.confirmed_at = time.monotonic()
        if existing is not None:  # idempotent re-publish keeps the reads in flight
            replica.leases = existing.leases
        if not replica.leases:
            replica.drained.set()
        if existing is None:
            entry.by_agent.setdefault(agent_id, []).append(replica_id)
        else:
            _unlist_alike(entry, existing)
            if entry.replicas.get(replica_id) is existing:
                entry.counted(existing, -1)
        entry.counted(replica, 1)
        entry.alike.setdefault(id(replica.held), (replica.held, {}))[1][replica_id] = None
        entry.replicas[replica_id] = replica
        self.replicas[replica_id] = replica
        if len(entry.unindexed) < 4 * len(entry.replicas) + 64:  # else nobody names holders: no index kept
            entry.unindexed.append(replica)
        self._holders_changed += 1
        if trainer_cut:  # never counted for coverage (``_counts``): no refinement, no refresh
            return replica
        _grouping(entry).refine(replica.held)  # its cuts split the groups they differ in
        if complete or existing is not None:  # a replaced replica may have held more
            self._refresh(entry, added=replica if existing is None else None)
        return replica

    def every_tensor_whole(self, held: RegionTable, shapes: Shapes) -> bool:
        """Every tensor whole, in manifest order: what an empty held list means on
        the wire. Kept per table: a trainer rank publishes the same table every
        version, and the check walks every tensor (a millisecond at 10^5)."""
        kept = self._whole_tables.get(id(held))
        if kept is not None and kept[0] is held:
            return kept[1]
        whole = (len(held) == len(shapes.ndim) and bool((held.tensor == np.arange(len(held))).all())
                 and bool(held.whole(shapes).all()))
        if len(self._whole_tables) >= 4096:
            self._whole_tables.clear()
        self._whole_tables[id(held)] = (held, whole)  # the table kept alive: its id stays its own
        return whole

    def report_chunks(self, agent_id: str, replica_id: str, chunks: np.ndarray | list[int], complete: bool,
                      chunk_crc32: list[int] | None = None) -> None:
        """``chunks``: the chunk numbers that landed (an array: a relay's
        complete report lists thousands). ``chunk_crc32``: one per chunk, for a
        replica that computes its checksums as it fills (it announced a table
        of them, zeros for the chunks it has not landed); set together with the
        bitmap, so a reader never sees a chunk without its checksum."""
        replica = self._own_replica(agent_id, replica_id)
        if chunk_crc32 and len(replica.chunk_crc32 or ()) != replica.num_chunks:
            raise StateError("FAILED_PRECONDITION", f"replica {replica_id} announced no checksums to update")
        chunks = np.asarray(chunks, dtype=np.int64)
        outside = chunks[(chunks < 0) | (chunks >= replica.num_chunks)]
        if outside.size:
            raise StateError("INVALID_ARGUMENT", f"chunk {int(outside[0])} outside [0, {replica.num_chunks})")
        replica.confirmed_at = time.monotonic()
        if chunk_crc32:
            for c, crc in zip(chunks.tolist(), chunk_crc32):
                replica.chunk_crc32[c] = crc
            replica.wire_info = None  # the service's cached wire form carries them
        bitmap_set_many(replica.bitmap, chunks)
        if complete and not replica.complete:
            if bitmap_count(replica.bitmap) != replica.num_chunks:
                raise StateError(
                    "FAILED_PRECONDITION",
                    f"replica {replica_id} reported complete with {bitmap_count(replica.bitmap)} of "
                    f"{replica.num_chunks} chunks",
                )
            entry = self.models[replica.model][replica.version]
            entry.counted(replica, -1)
            replica.complete = True
            entry.counted(replica, 1)
            self._refresh(entry, added=replica)

    # ------------------------------------------------------------ retention

    def _reliable(self, replica: Replica) -> bool:
        agent = self.agents.get(replica.agent_id)
        return agent is not None and agent.reliability is Reliability.RELIABLE

    def _retained_versions(self, model: str) -> list[int]:
        return self.visible_versions(model)[-self.retain:] if self.retain > 0 else []

    def needs_retention(self, agent_id: str, replica_id: str) -> bool:
        """True when withdrawing this replica would leave some element it holds
        of a retained version (one of the model's latest K visible) without a
        reliable complete holder. Spot replicas never count as the retained copy."""
        replica = self._own_replica(agent_id, replica_id)
        if replica.withdrawn or not replica.complete or not self._reliable(replica):
            return False
        # Withdrawals made together may have left this version's visibility to recompute: a
        # stale one only says visible where the exact one may not, so "not among the latest K"
        # holds for the exact one too once the model's other versions are exact.
        self._settle(replica.model, keep=replica.version)
        if replica.version not in self._retained_versions(replica.model):
            return False
        self._settle(replica.model)
        if replica.version not in self._retained_versions(replica.model):
            return False
        if replica.trainer_cut:  # a copy beside the rank's shards: they are what a version keeps
            return False
        entry = self.models[replica.model][replica.version]
        if self._alike_counts(entry, replica, reliable=True):  # another reliable holder of the same regions
            return False
        others = [r for r in entry.replicas.values()
                  if r is not replica and self._counts(r) and self._reliable(r)]
        return _coverage(entry, others).touches_holes(_keys(entry, replica))

    def releasable(self, agent_id: str) -> list[str]:
        """The agent's retained copies whose version fell out of the latest K:
        at least K visible versions are newer. (A version that is not visible
        for a while, e.g. while the shards re-register after a server restart,
        keeps its retained copies.)"""
        out = []
        for r in self.replicas.values():
            if r.agent_id == agent_id and r.retained and not r.withdrawn:
                newer = [v for v in self.visible_versions(r.model) if v > r.version]
                if len(newer) >= self.retain:
                    out.append(r.replica_id)
        return out

    def withdraw(self, agent_id: str, replica_id: str) -> Replica:
        """Stop handing the replica out; in-flight leases may still read it."""
        replica = self._own_replica(agent_id, replica_id)
        key = (replica.model, replica.version)
        entry = self.models[key[0]][key[1]]
        entry.counted(replica, -1)
        replica.withdrawn = True
        _unlist_alike(entry, replica)  # counts no more
        self._holders_changed += 1
        if not replica.leases:
            replica.drained.set()
        self._refresh(entry, removed=replica, key=key)
        return replica

    @contextlib.contextmanager
    def withdrawals_together(self) -> Iterator[None]:
        """Withdrawals made inside recompute each version's visibility once, as the
        block ends (nothing runs in between: no await inside). A trainer's step
        withdraws its ranks' 512 replicas of one version in one Batch, and each,
        alone, recomputed the version's coverage over every holder left (~1,500
        relays at 1,024 GPUs). ``needs_retention`` inside sees every version
        exactly as it would after the withdrawals before it (``_settle``)."""
        if self._pending is not None:  # already inside one
            yield
            return
        self._pending = {}
        try:
            yield
        finally:
            pending, self._pending = self._pending, None
            for (model, version), entry in pending.items():
                if self.models.get(model, {}).get(version) is entry:
                    self._refresh(entry)

    def _settle(self, model: str, keep: int | None = None) -> None:
        """Recompute now the visibility of ``model``'s versions that withdrawals
        made together left pending (but ``keep``'s)."""
        if not self._pending:
            return
        for key in [k for k in self._pending if k[0] == model and k[1] != keep]:
            entry = self._pending.pop(key)
            if self.models.get(model, {}).get(key[1]) is entry:
                self._refresh(entry)

    def remove_replica(self, replica_id: str) -> None:
        replica = self.replicas.pop(replica_id, None)
        if replica is None:
            return
        # A withdrawn replica counts for nothing already (``_counts``, ``_live``): the
        # version's coverage was recomputed without it then, and need not be again
        # (at 1,280 holders each recompute is ~8 ms, and every step withdraws them all).
        counted = not replica.withdrawn
        self._holders_changed += 1
        versions = self.models.get(replica.model, {})
        entry = versions.get(replica.version)
        if entry is not None:
            if entry.replicas.pop(replica_id, None) is replica:
                entry.counted(replica, -1)
            _unlist_alike(entry, replica)
            mine = entry.by_agent.get(replica.agent_id, [])
            if replica_id in mine:
                mine.remove(replica_id)
                if not mine:
                    del entry.by_agent[replica.agent_id]
            if counted:
                self._refresh(entry, removed=replica)
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

    # ------------------------------------------------------------ visibility

    def _live(self, replica: Replica) -> bool:
        return not replica.withdrawn and replica.agent_id in self.agents

    def _counts(self, replica: Replica) -> bool:
        """Whether the replica counts for coverage (visibility, retention, a
        resolve's covering search): live and complete, and not a trainer's cut.
        A cut is the version once more beside the rank's shards, which are
        published with it and cover the version by themselves; kept out, its
        regions (each tensor the rank owns, in its readers' boxes) do not split
        the groups of alike tensors by owner, which at 256 ranks made thousands
        of groups for every coverage question to walk."""
        return replica.complete and not replica.trainer_cut and self._live(replica)

    def _refresh(self, entry: Version, *, added: Replica | None = None, removed: Replica | None = None,
                 key: tuple[str, int] | None = None) -> None:
        """Recompute whether the version is visible. ``added``: the only change
        is this replica becoming a complete holder, so a visible version stays
        visible and the coverage kept so far only needs its regions (one
        publish costs its own regions, not all the holders' again).
        ``removed``: the only change is this replica no longer counting
        (withdrawn, lost); where another counting replica holds the same
        table, the distinct regions held are the same and nothing changes.
        ``key`` (the version's (model, version)): inside ``withdrawals_together``
        a removal is only noted, and the version recomputed once as the block ends."""
        if added is not None and entry.visible:
            return
        if removed is not None and entry.visible and self._alike_counts(entry, removed):
            return
        if removed is not None and key is not None and self._pending is not None:
            self._pending[key] = entry  # withdrawals made together: recomputed once, as their block ends
            return
        grouping = _grouping(entry)
        if added is not None and self._noted(entry, grouping, added):
            return
        holders = [r for r in entry.replicas.values() if self._counts(r)]
        if (added is not None and entry.coverage is not None and entry.coverage.grouping is grouping
                and entry.coverage.epoch == grouping.epoch):
            entry.coverage.add(_keys(entry, added))  # (nothing is noted while a coverage is kept)
        else:
            entry.coverage = _coverage(entry, holders)  # every holder, the noted ones included
        entry.noted.clear()
        complete = entry.coverage.complete
        if complete and added is not None and not added.trainer_cut:
            # These holders cover a version: the next one from the same tables is complete when they are back
            grouping.known_cover = KnownCover([_keys(entry, r) for r in holders], entry.coverage)
        cuts = [] if complete and holders else [
            r for r in entry.replicas.values() if r.trainer_cut and r.complete and self._live(r)]
        if added is None and cuts and not complete:
            # Shards withdrawn while cuts stand (not a publish: the version's own
            # shards may still be on their way): what shards and cuts cover
            # together, on a grouping of this question's own, so that the
            # groups the cuts split stay out of the one later versions share.
            entry.coverage = _coverage_apart(entry, holders + cuts)
        self._set_visible(entry, entry.coverage.complete and bool(holders or cuts))

    def _set_visible(self, entry: Version, visible: bool) -> None:
        """Record whether ``entry`` is visible, waking the waiters on a change."""
        if visible != entry.visible:
            entry.visible = visible
            self._visibility_changed.set()
            self._visibility_changed = asyncio.Event()

    def _noted(self, entry: Version, grouping: Grouping, added: Replica) -> bool:
        """The steady state's shortcut for ``_refresh(added=)``: ``added`` holds
        a table of the set that last completed a version (``KnownCover``: the
        trainer's shards republished from the same buffers). Its keys are noted,
        not added; once every table of the set is back the version is visible
        with that set's complete coverage. Only while every holder so far was
        noted (no coverage kept): a version worked out in full goes on the long
        way. False (nothing noted): add it as usual."""
        known = grouping.known_cover
        if known is None or known.epoch != grouping.epoch or entry.coverage is not None:
            return False  # (a coverage kept: holders were added the long way, and so is this one)
        keys = _keys(entry, added)
        if id(keys) not in known.ids:
            return False
        # Every noted holder still counts: one that stops (withdrawn, lost, replaced, its agent gone)
        # has the version worked out in full, noted ones included, and the notes cleared.
        entry.noted[id(keys)] = keys
        if not known.covered_by(entry.noted.keys()):
            return True
        entry.coverage, entry.noted = known.coverage, {}
        self._set_visible(entry, True)
        return True

    def _alike_counts(self, entry: Version, removed: Replica, *, reliable: bool = False) -> bool:
        """Whether another replica holding ``removed``'s table counts for coverage
        (and is ``reliable``, if asked), and ``removed`` did (complete, not a
        cut: cuts play no part in the coverage of holders alone)."""
        if not removed.complete or removed.trainer_cut:
            return False
        _, ids = entry.alike.get(id(removed.held), (None, {}))
        return any(rid != removed.replica_id and (r := entry.replicas.get(rid)) is not None and self._counts(r)
                   and (not reliable or self._reliable(r)) for rid in ids)

    def visible_versions(self, model: str) -> list[int]:
        """Versions whose live complete replicas cover every element, ascending."""
        return sorted(v for v, entry in self.models.get(model, {}).items() if entry.visible)

    def latest_visible(self, model: str) -> int | None:
        return max((v for v, entry in self.models.get(model, {}).items() if entry.visible), default=None)

    async def wait_for_version(self, model: str, at_least: int, timeout_s: float) -> int | None:
        """The highest visible version once it is >= ``at_least``; None after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            latest = self.latest_visible(model)
            if latest is not None and latest >= at_least:
                return latest
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            changed = self._visibility_changed  # taken after the check: no wake-up is lost
            with contextlib.suppress(asyncio.TimeoutError):  # the loop answers "not found"
                await asyncio.wait_for(changed.wait(), timeout=remaining)

    # ------------------------------------------------------------ readers

    def relays_pulling(self, model: str, version: int) -> int:
        """How many relays pull ``version`` now or are about to (the server's
        pace for them: ``pacing.server_pace_s``): its filling replicas, and the
        relays of the version before that have not withdrawn it yet (in an RL
        run's step each engine withdraws its previous replica as it resolves
        the next version, so the first engines to resolve see the rest coming)."""
        versions = self.models.get(model, {})
        entry, before = versions.get(version), versions.get(version - 1)
        return (entry.filling_relays() if entry is not None else 0) + (before.relays() if before is not None else 0)

    def resolve(self, model: str, version: int | None, group: str = "", group_round: int = 0,
                reader: str = "") -> tuple[int, Version]:
        """The version to read (``version``, or the latest visible one) and its
        entry. A version that is not visible is NOT_FOUND, except to ``reader``
        in the middle of pulling it (see ``_mid_pull``)."""
        if model not in self.models:
            raise StateError("NOT_FOUND", f"model {model!r} is unknown: nothing of it was published")
        if group:
            rounds = self.groups.setdefault(f"{model}\0{group}", {})
            fixed = rounds.get(group_round)
            if fixed is not None:
                version = fixed
        if version is None:
            version = self.latest_visible(model)
            if version is None:
                raise StateError("NOT_FOUND", f"model {model!r} has no complete version: no version's complete "
                                              "replicas cover every tensor")
        entry = self.models[model].get(version)
        if entry is not None and not entry.visible and reader and self._mid_pull(entry, reader):
            return version, entry
        if entry is None or not entry.visible:
            pullable = self.visible_versions(model) or "none"
            if entry is None or not any(r.complete and self._live(r) for r in entry.replicas.values()):
                raise StateError("NOT_FOUND",
                                 f"{model!r} version {version} has no complete replica; pullable versions: {pullable}")
            raise StateError("NOT_FOUND", f"{model!r} version {version} is not complete: no complete holder has "
                                          f"{self.worked_out(entry).describe_missing()}; pullable versions: {pullable}")
        if group:
            rounds[group_round] = version
            for old in sorted(rounds)[:-GROUP_ROUNDS_KEPT]:
                del rounds[old]
        return version, entry

    def _mid_pull(self, entry: Version, reader: str) -> bool:
        """Whether ``reader`` is in the middle of pulling ``entry``'s version: it
        holds a read lease on one of its replicas, or fills one of its own. Such a
        reader keeps being told who holds what of it after the version stops
        being visible (its last complete holder withdrawn: a retained copy let go
        once newer versions came, still read under the leases it has), so it sees
        its peers' chunks land and reads them from them. Found by ``tensorhub
        bench rl`` (elastic): joiners of a version the trainer stepped past were
        answered NOT_FOUND mid-pull, stopped seeing each other's progress, and
        read nearly all of it from the trainer, one patience timeout at a time.
        Only on this rare path: a scan of the leases."""
        if any(r.agent_id == reader and not r.complete and not r.withdrawn for r in entry.replicas.values()):
            return True
        return any(lease.agent_id == reader and any(rid in entry.replicas for rid in lease.replica_ids)
                   for lease in self.leases.values())

    def group_sources(self, model: str, entry: Version, reader_agent_id: str, group: str,
                      k: int = 0, others: Iterable[str] = ()) -> list[Replica]:
        """``sources`` for a member of ``group`` (the workers of one engine): one
        list for the whole group, ranked for the group (as a reader whose id is
        the group's) and without the replicas of any of its members (they load
        the same version at once, each its own slices: not each other's
        sources). Made when the first member asks and kept while nobody
        publishes, withdraws, registers or expires, so the other members' asks
        cost a lookup: one ranking and one coverage search per engine, not per
        worker. Members are learnt from their asks and from ``others`` (those a
        member asks for: ``ResolveRequest.members``); a new member makes it anew."""
        members = self.group_members.get(f"{model}\0{group}")
        if members is None:
            if len(self.group_members) >= MAX_GROUPS_KEPT:  # the oldest group first (engines come and go)
                del self.group_members[next(iter(self.group_members))]
            members = self.group_members[f"{model}\0{group}"] = set()
        if reader_agent_id not in members or not members.issuperset(others):
            members.add(reader_agent_id)
            members.update(others)
            while len(members) > MAX_GROUP_MEMBERS:
                members.pop()
        key = f"\0group\0{group}\0{len(members)}"
        if entry.ranked_at != self._holders_changed:
            entry.ranked.clear()
            entry.ranked_at = self._holders_changed
        kept = entry.ranked.get(key + "\0sources")
        if kept is None:
            kept = (self.sources(entry, key, k, exclude=frozenset(members), near=reader_agent_id,
                                 salt=f"group:{group}"), [])
            entry.ranked[key + "\0sources"] = kept
        return kept[0]

    def sources(self, entry: Version, reader_agent_id: str, k: int = 0, exclude: frozenset[str] = frozenset(),
                near: str = "", salt: str = "") -> list[Replica]:
        """The live holders a reader is told of: the ``k`` best for it (0: the
        server's ``max_sources``) plus what it takes to cover the version, best
        first: ``planner.best_holders``, computed here without building a
        planner ``Source`` and calling a key function per holder (every resolve
        ranks every holder of the version: at 1,000 agents and 100 holders that
        was 40% of a resolve's Python). ``tests/core/test_bench_server.py``
        holds the two equal."""
        k = min(k or self.config.max_sources, self.config.max_sources)
        live, fixed = self._ranking(entry, reader_agent_id, k, exclude, near, salt)
        if fixed is None or len(live) <= k:
            return list(live)
        # The one part of the key that changes between two resolves: the holder's reads in flight.
        keys = [key | len(r.leases) << 32 for key, r in zip(fixed, live)]
        order = sorted(range(len(live)), key=keys.__getitem__)
        chosen = [live[i] for i in order[:k]]
        grouping = _grouping(entry)
        base = [_keys(entry, r) for r in chosen if self._counts(r)]
        rest = [live[i] for i in order[k:] if self._counts(live[i])]
        # The fewest more holders, best first, that make the answer cover the
        # version (all of them when nothing covers it); and every trainer's cut
        # (out of the search, ``_counts``): the contiguous copy readers prefer.
        extra = covering_prefix(grouping, base, _LazyKeys(entry, rest))
        cuts = [live[i] for i in order[k:] if live[i].trainer_cut and live[i].complete]
        return chosen + rest[:len(rest) if extra is None else extra] + cuts

    def _ranking(self, entry: Version, reader_agent_id: str, k: int, exclude: frozenset[str] = frozenset(),
                 near: str = "", salt: str = "") -> tuple[list[Replica], list[int] | None]:
        """The version's live holders other than the reader (None for the keys
        when they are ``k`` or fewer: all of them are returned), and the part of
        ``best_holders``' key for each that stays put while nobody publishes,
        withdraws, registers or expires (``_holders_changed``), packed in one
        int: (tier, spot, origin, -, crc32(holder's agent id, crc32(reader id + "/"))),
        with bits 32-63 left for the holder's reads in flight. Kept per reader
        of a version with more holders than a resolve returns (a list of
        holders and one of ints: about 5 KiB a reader at 100 holders), so
        most resolves only add the reads in flight and sort."""
        if entry.ranked_at != self._holders_changed:
            entry.ranked.clear()  # every reader's ranking is stale
            entry.ranked_at = self._holders_changed
        cached = entry.ranked.get(reader_agent_id)
        if cached is not None:
            return cached
        agents = self.agents
        live = [r for r in entry.replicas.values()
                if not r.withdrawn and r.agent_id in agents and r.agent_id != reader_agent_id
                and r.agent_id not in exclude]
        if len(live) <= k:
            return live, None
        reader = self._agent_rank_keys(near or reader_agent_id, salt or reader_agent_id)
        fixed = []
        for r in live:
            key = reader.by_agent.get(r.agent_id)
            if key is None:
                key = reader.by_agent[r.agent_id] = self._agent_rank_key(reader, r.agent_id)
            fixed.append(key | r.origin << 64)
        entry.ranked[reader_agent_id] = (live, fixed)
        return live, fixed

    def _agent_rank_keys(self, near: str, salt: str) -> _ReaderRankKeys:
        """The agent part of ``_ranking``'s keys for one reader (``near``: whose
        labels rank; ``salt``: whose spread of equal holders), per holder agent:
        (tier, spot, -, -, crc32(holder's agent id, crc32(salt + "/"))). It depends
        on agents alone, not on a version, so it is kept across versions until an
        agent registers (an expired one is no holder: ``_ranking`` skips it): the
        next version's holders are most often the same agents (the steady state),
        and ranking them costs a lookup each instead of a CRC and a label comparison."""
        kept = self._rank_keys.get((near, salt))
        if kept is None:
            while len(self._rank_keys) >= _RANK_KEYS_KEPT:  # the oldest reader first
                del self._rank_keys[next(iter(self._rank_keys))]
            reader = self.agents.get(near)
            # CRC-32 is affine in its start value: crc32(d, s) == crc32(d) ^ crc32(z, s) ^ crc32(z)
            # for z = len(d) zero bytes, so a holder's id costs one CRC and a reader one per id length.
            kept = self._rank_keys[(near, salt)] = _ReaderRankKeys(reader.labels if reader else Labels(),
                                                                   zlib.crc32(f"{salt}/".encode()))
        return kept

    def _agent_rank_key(self, reader: _ReaderRankKeys, agent_id: str) -> int:
        rid = agent_id.encode()  # by agent: the same holders rank alike in every version
        zeros = bytes(len(rid))
        spread = zlib.crc32(zeros, reader.seed) ^ zlib.crc32(zeros)
        agent = self.agents[agent_id]
        spot = agent.reliability is Reliability.SPOT
        return reader.labels.tier(agent.labels) << 66 | spot << 65 | zlib.crc32(rid) ^ spread

    @staticmethod
    def _covers(entry: Version, holders: list[Replica]) -> bool:
        return bool(holders) and covers(_grouping(entry), [_keys(entry, r) for r in holders])

    def acquire_lease(self, agent_id: str, replica_ids: list[str], sharers: frozenset[str] = frozenset()) -> Lease:
        self._agent(agent_id)
        now = time.monotonic()
        # A holder silent about the replica for a whole TTL is not leased: its readers must have stopped.
        # One pass for the grant and its expiry (``_lease_expiry``): a group's answer leases hundreds.
        granted, confirmed, replicas, agents = [], now, self.replicas, self.agents
        for rid in replica_ids:
            r = replicas.get(rid)
            if r is not None and not r.withdrawn and r.agent_id in agents and r.confirmed_at + self.lease_ttl_s > now:
                granted.append(rid)
                confirmed = min(confirmed, r.confirmed_at)
        lease = Lease(uuid.uuid4().hex, agent_id, granted, confirmed + self.lease_ttl_s, sharers)
        self.leases[lease.lease_id] = lease
        self.leases_of[agent_id] = self.leases_of.get(agent_id, 0) + 1
        self._next_expiry = min(self._next_expiry, lease.expires_at)
        for rid in granted:
            replica = self.replicas[rid]
            replica.leases.add(lease.lease_id)
            replica.drained.clear()
        return lease

    def renew_lease(self, agent_id: str, lease_id: str) -> None:
        lease = self.leases.get(lease_id)
        if lease is None or (lease.agent_id != agent_id and agent_id not in lease.sharers):
            raise StateError("NOT_FOUND", f"read lease {lease_id!r} is unknown or expired")
        now = time.monotonic()
        lease.expires_at = self._lease_expiry(lease.replica_ids, now)
        if lease.expires_at <= now:  # a holder went silent a TTL ago: its readers must have stopped
            self.release_lease(lease_id)
            raise StateError("NOT_FOUND", f"read lease {lease_id!r} expired: a holder it covers went silent")

    def _lease_expiry(self, replica_ids: Iterable[str], now: float) -> float:
        """One TTL from now, but never past one TTL after any covered holder
        last confirmed its replica (``Replica.confirmed_at``)."""
        expiry = now + self.lease_ttl_s
        for rid in replica_ids:
            replica = self.replicas.get(rid)
            if replica is not None:
                expiry = min(expiry, replica.confirmed_at + self.lease_ttl_s)
        return expiry

    def release_lease(self, lease_id: str) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return
        left = self.leases_of.pop(lease.agent_id, 1) - 1
        if left > 0:
            self.leases_of[lease.agent_id] = left
        for rid in lease.replica_ids:
            replica = self.replicas.get(rid)
            if replica is not None:
                replica.leases.discard(lease_id)
                if not replica.leases:
                    replica.drained.set()
                    if replica.lost:
                        self.remove_replica(rid)

    def report_lost(self, replica_id: str) -> None:
        """A reader saw the source fail. No reader is sent to it any more; if
        its agent is alive it will notice at its next publish or heartbeat
        (and announce it again).

        While its agent is alive and leases on it are out, it stays, hidden,
        until they end: its holder's unpublish waits for them. A READ given up
        on (a stalled link) can still be served later (NIXL 1.5 closes a
        remote's UCX endpoint without cancelling what it has in flight), and
        the holder must not have reused the memory by then. Before, one
        reader's report let the holder's unpublish return at once, under
        every other reader's lease too."""
        replica = self.replicas.get(replica_id)
        if replica is None:
            return
        if replica.leases and replica.agent_id in self.agents:
            if not replica.lost:
                self.models[replica.model][replica.version].counted(replica, -1)
                replica.lost = replica.withdrawn = True
                _unlist_alike(self.models[replica.model][replica.version], replica)
                self._holders_changed += 1
                self._refresh(self.models[replica.model][replica.version], removed=replica)
            return
        for lease_id in list(replica.leases):
            lease = self.leases.get(lease_id)
            if lease is not None and replica_id in lease.replica_ids:
                lease.replica_ids.remove(replica_id)
        replica.leases.clear()
        replica.drained.set()
        self.remove_replica(replica_id)

    def reader_cuts(self, model: str, fingerprint: str) -> tuple[int, list[tuple[RegionTable | None, int]]] | None:
        """The read sets of the readers of ``model``: the distinct held regions
        of the live relays (not published by their producer, not retained
        copies) of the newest version with manifest ``fingerprint`` that has
        any, each once with the number of relays that hold it, most readers
        first (None: every tensor whole). None when no such version has a
        relay. Many relays share one read set (worker w of every engine)."""
        for version, entry in sorted(self.models.get(model, {}).items(), reverse=True):
            if entry.fingerprint != fingerprint:
                continue
            counts: dict[bytes, list] = {}
            # Relays publishing the same chunk rules share one table (``ReferenceService._held_of``):
            # its bytes are joined once per table, not once per relay (a TP worker's table of
            # Kimi-K2 is megabytes; 1,024 relays made this 0.65 s a call).
            keys: dict[int, bytes] = {}
            for r in entry.replicas.values():
                if r.origin or r.retained or not self._live(r):
                    continue
                key = keys.get(id(r.held))
                if key is None:
                    key = keys[id(r.held)] = b"whole" if r.held is None else b"/".join(
                        np.ascontiguousarray(a).tobytes() for a in (r.held.tensor, r.held.flat, r.held.lo, r.held.hi))
                found = counts.setdefault(key, [r.held, 0])
                found[1] += 1
            if counts:  # dicts keep the order first seen; sorted() keeps it among equals
                return version, sorted(((held, n) for held, n in counts.values()), key=lambda c: -c[1])
        return None

    # ------------------------------------------------------------ expiry

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now < self._next_expiry:
            return
        for lease in [l for l in self.leases.values() if l.expires_at <= now]:
            self.release_lease(lease.lease_id)
        for agent in [a for a in self.agents.values() if a.expires_at <= now]:
            del self.agents[agent.agent_id]
            self._holders_changed += 1
            for replica in [r for r in self.replicas.values() if r.agent_id == agent.agent_id]:
                self.report_lost(replica.replica_id)  # refreshes the version's visibility
            for lease in [l for l in self.leases.values() if l.agent_id == agent.agent_id]:
                self.release_lease(lease.lease_id)
        self._next_expiry = min((x.expires_at for x in (*self.leases.values(), *self.agents.values())),
                                default=math.inf)


    # ------------------------------------------------------------ operators

    def describe(self, model: str = "") -> HubStatus:
        """A snapshot for ``tensorhub status``: every agent and read lease, and
        the versions of ``model`` (empty: of every model) with their replicas."""
        now = time.monotonic()
        agents = tuple(AgentView(agent_id=a.agent_id, name=a.name, labels=a.labels, reliability=a.reliability,
                                 expires_in_s=a.expires_at - now) for a in self.agents.values())
        models = []
        for name in sorted(self.models) if not model else [model] if model in self.models else []:
            versions = []
            for version, entry in sorted(self.models[name].items()):
                replicas = tuple(ReplicaView(
                    replica_id=r.replica_id, agent_id=r.agent_id, complete=r.complete,
                    chunks_present=r.num_chunks if r.complete else bitmap_count(r.bitmap), num_chunks=r.num_chunks,
                    origin=r.origin, retained=r.retained, withdrawn=r.withdrawn, held_regions=r.held_count(),
                    held_bytes=int(held_bytes(entry.manifest, r.held).sum()) if r.held is not None
                    else entry.manifest.total_bytes,
                    active_reads=len(r.leases), trainer_cut=r.trainer_cut) for r in entry.replicas.values())
                versions.append(VersionView(
                    version=version, visible=entry.visible, fingerprint=entry.fingerprint,
                    tensors=len(entry.manifest.tensors), total_bytes=entry.manifest.total_bytes,
                    missing=self._missing(entry), replicas=replicas))
            models.append(ModelView(model=name, versions=tuple(versions)))
        leases = tuple(LeaseView(lease_id=lease.lease_id, agent_id=lease.agent_id,
                                 replica_ids=tuple(lease.replica_ids), expires_in_s=lease.expires_at - now)
                       for lease in self.leases.values()
                       if not model or any((r := self.replicas.get(rid)) is not None and r.model == model
                                           for rid in lease.replica_ids))
        return HubStatus(instance_id=self.instance_id, uptime_s=now - self.started_at, agents=agents,
                         models=tuple(models), leases=leases,
                         control=replace(self.control, calls=dict(self.control.calls)))

    def worked_out(self, entry: Version) -> Version:
        """``entry`` with its coverage counting every holder: those noted in
        passing (``_noted``) are added, by working the version out in full."""
        if entry.noted:
            self._refresh(entry)
        return entry

    def _missing(self, entry: Version) -> str:
        if entry.visible:
            return ""
        if not any(r.complete and self._live(r) for r in entry.replicas.values()):
            return "everything: no complete replica yet"
        return self.worked_out(entry).describe_missing()


# ---------------------------------------------------------------- coverage


_GROUPINGS_KEPT = 64  # (model, manifest) pairs whose grouping outlives their versions


def _unlist_alike(entry: Version, replica: Replica) -> None:
    """Take ``replica`` out of ``entry.alike`` (its table's list)."""
    table, ids = entry.alike.get(id(replica.held), (None, None))
    if ids is not None and table is replica.held:
        ids.pop(replica.replica_id, None)
        if not ids:
            del entry.alike[id(replica.held)]


def _grouping(entry: Version) -> Grouping:
    if entry.grouping is None:
        entry.grouping = Grouping(shapes_of(entry.manifest))
    return entry.grouping


def _keys(entry: Version, replica: Replica) -> HolderKeys:
    """The replica's regions per group, kept while the grouping does not change."""
    return _grouping(entry).keys(replica.held)


@dataclass(slots=True)
class _ReaderRankKeys:
    """One reader's ranking inputs (``State._agent_rank_keys``): its labels, its
    spread's CRC seed, and the agent part of each holder agent's key so far."""

    labels: Labels
    seed: int
    by_agent: dict[str, int] = field(default_factory=dict)


class _LazyKeys(Sequence):
    """The holders' ``_keys``, each computed when first asked for: a search for
    the few that cover a version looks at the first dozens of a thousand."""

    def __init__(self, entry: Version, holders: list[Replica]) -> None:
        self._entry, self._holders = entry, holders
        self._keys: list[HolderKeys] = []

    def __len__(self) -> int:
        return len(self._holders)

    def __getitem__(self, i):  # an int index (covering_prefix asks one by one)
        while len(self._keys) <= i:
            self._keys.append(_keys(self._entry, self._holders[len(self._keys)]))
        return self._keys[i]


def _coverage_apart(entry: Version, holders: list[Replica]) -> Coverage:
    """``_coverage`` on a grouping refined by ``holders`` alone, not the version's."""
    grouping = Grouping(shapes_of(entry.manifest))
    for r in holders:
        grouping.refine(r.held)
    coverage = Coverage(grouping)
    for r in holders:
        coverage.add(grouping.keys(r.held))
    return coverage


def _coverage(entry: Version, holders: list[Replica]) -> Coverage:
    """What the holders leave uncovered of the version.

    Holders cut alike share one region table (the relays of one TP rank), and
    a second holder of a table covers nothing the first did not: each distinct
    table counts once, the largest first. A version's coverage is recomputed
    on every withdrawal (1,280 per step at paper scale): after the trainer's
    256 shards go, the 8 TP ranks' relay tables cover it in 8 additions, where
    adding holders as they came walked the shards' hundreds first."""
    grouping = _grouping(entry)
    tables = {id(r.held): r.held for r in holders}
    return coverage_of(grouping, sorted((grouping.keys(t) for t in tables.values()), key=held_elements, reverse=True))
