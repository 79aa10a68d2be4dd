"""gRPC front of the reference server: validates requests, turns protobuf into
the state's plain types and back. Protobuf stays inside this module and
``tensorhub.client.rpc``."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from tensorhub.chunks import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from tensorhub.manifest import Manifest
from tensorhub.pacing import server_pace_s
from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc
from tensorhub.proto import wire
from tensorhub.regiontable import RegionTable, shapes_of
from tensorhub.server.changes import VersionChanges
from tensorhub.server.metrics import NoMetrics
from tensorhub.server.named import NamedHolders
from tensorhub.server.state import Held, Lease, Replica, State, StateError, check_held, held_bytes
from tensorhub.topology import Labels, Reliability

log = logging.getLogger(__name__)

MAX_NAME = 512
MAX_TENSORS = 1_000_000
MAX_HELD = MAX_TENSORS  # held regions per replica
MAX_DIMS = 64  # of a held box
MAX_NIXL_METADATA = 1 << 20
MAX_DRAIN_S = 3600.0
MAX_KNOWN_MEMORY = 4096  # memory digests a reader may list in one Resolve
MAX_DELTAS = 4096  # delta models one replica names (a relay names one per publisher of the version)
MAX_WAIT_CHANGE_S = 5.0  # a long-poll Resolve waits at most this long (``changes``)
MAX_READER_CUTS = 256  # read sets in one ReaderCuts answer (an engine's TP or EP workers: 8 to 64)
MAX_READER_CUTS_BYTES = 8 << 20  # and at most about this many bytes of them (the client takes 16 MiB)
_FINGERPRINT = re.compile(r"^[0-9a-f]{16,128}$")
RESOLVE_REPLICAS_FIELD = pb.ResolveResponse.DESCRIPTOR.fields_by_name["replicas"].number
RESOLVE_PACKED_FIELD = pb.ResolveResponse.DESCRIPTOR.fields_by_name["packed"].number
RESOLVE_WITHDRAWALS_FIELD = pb.ResolveResponse.DESCRIPTOR.fields_by_name["withdrawals"].number
RESOLVE_ANNOUNCES_FIELD = pb.ResolveResponse.DESCRIPTOR.fields_by_name["announces"].number
_ID = re.compile(r"^[A-Za-z0-9._:@/+-]{1,128}$")

Resp = TypeVar("Resp")


class Invalid(Exception):
    """A request field is missing or malformed."""


def _require_id(value: str, what: str) -> str:
    if not _ID.match(value):
        raise Invalid(f"{what} {value!r} is missing or malformed (1-128 of [A-Za-z0-9._:@/+-])")
    return value


def _left(lease: Lease) -> float:
    """Seconds the lease has left: readers stop reading by then (the TTL, or
    less when a holder it covers has gone silent: ``Replica.confirmed_at``)."""
    return max(0.0, lease.expires_at - time.monotonic())


def _require_model(model: str) -> str:
    if not model or len(model) > MAX_NAME or not model.isprintable():
        raise Invalid(f"model key {model[:80]!r} must be 1-{MAX_NAME} printable characters")
    return model


def _require_version(version: int) -> int:
    if version < 0:
        raise Invalid(f"version {version} is negative; versions are integers >= 0")
    return version


_RULE_TABLES_KEPT = 1024  # distinct held rule sets (an FSDP rank's or a TP worker's, per manifest)
_MANIFESTS_KEPT = 16  # manifests kept checked (by wire digest) and encoded (by fingerprint), each
MAX_SHARED_MEMBERS = 64  # ResolveRequest.members: an engine's workers (TP x PP), a few dozen at most
MAX_BATCH = wire.MAX_BATCH  # 4 * MAX_SHARED_MEMBERS: an engine's workers', a few each
_GROUP_ANSWERS_KEPT = 1024  # encoded holder lists of groups (_group_holders): an engine's, per what it knows
_LAYOUT_NUMBERS_KEPT = 1 << 20  # ReplicaInfo.layout_id: past this many layouts the numbering starts anew
_LAYOUTS_KEPT = 8192  # publish layouts (``_known_layout``): two per agent of a 4,096-agent job
_STATIC_INFOS_KEPT = 8192  # replicas' unchanging wire parts (``_static_info``): two per agent, as the layouts


def _manifest(msg: pb.Manifest, kept: dict[bytes, Manifest] | None = None) -> Manifest:
    """The request's manifest, checked. ``kept``: manifests already checked, by
    a digest of their wire form; each rank of a trainer publishes the same
    one, which for 10^5 tensors takes longer to check than the rest."""
    if kept is not None:
        digest = hashlib.blake2b(msg.SerializeToString(deterministic=True), digest_size=16).digest()
        found = kept.get(digest)
        if found is not None:
            return found
        manifest = _manifest(msg)
        if len(kept) >= _MANIFESTS_KEPT:
            kept.pop(next(iter(kept)))
        kept[digest] = manifest
        return manifest
    if len(msg.tensors) > MAX_TENSORS:
        raise Invalid(f"manifest has {len(msg.tensors)} tensors, more than {MAX_TENSORS}")
    for t in msg.tensors:  # before any arithmetic on them
        if len(t.name) > MAX_NAME or len(t.shape) > MAX_DIMS:
            raise Invalid(f"manifest tensor {t.name[:80]!r}: names take at most {MAX_NAME} characters and shapes "
                          f"at most {MAX_DIMS} dimensions")
    manifest = wire.manifest_from_wire(msg)
    try:
        manifest.validate()
    except ValueError as e:
        raise Invalid(f"bad manifest: {e}") from None
    if msg.fingerprint and msg.fingerprint != manifest.fingerprint:
        raise Invalid("manifest fingerprint does not match its tensor list")
    return manifest


def _pulled(msgs: Any) -> list[tuple[str, bool, int]]:
    """A request's pulled-bytes report (for the metrics), checked."""
    try:
        return wire.pulled_from_wire(msgs)
    except ValueError as e:
        raise Invalid(str(e)) from None


def _labels(msg: pb.Labels) -> Labels:
    labels = wire.labels_from_wire(msg)
    if max(len(labels.host), len(labels.rack), len(labels.zone)) > MAX_NAME:
        raise Invalid(f"labels take at most {MAX_NAME} characters each")
    return labels


def _reliability(value: int) -> Reliability:
    try:
        return wire.reliability_from_wire(value)
    except ValueError as e:
        raise Invalid(str(e)) from None


def _held(manifest: Manifest, request: pb.PublishRequest) -> RegionTable:
    """The request's held regions (a list or packed), checked against the
    manifest; none: every tensor whole."""
    if request.held and request.HasField("held_table"):
        raise Invalid("held and held_table both set: give the held regions one way")
    if request.HasField("held_table"):
        msg = request.held_table
        if len(msg.tensor_step) > MAX_HELD:
            raise Invalid(f"{len(msg.tensor_step)} held regions, more than {MAX_HELD}")
        try:
            held: RegionTable | list[Held] = wire.held_from_wire(msg, shapes_of(manifest))
        except ValueError as e:
            raise Invalid(str(e)) from None
    else:
        if len(request.held) > MAX_HELD:
            raise Invalid(f"{len(request.held)} held regions, more than {MAX_HELD}")
        held = []
        for msg in request.held:
            if len(msg.start) > MAX_DIMS or len(msg.stop) > MAX_DIMS:
                raise Invalid(f"held region of tensor #{msg.tensor} has more than {MAX_DIMS} dimensions")
            try:
                held.append(wire.region_from_wire(msg))
            except ValueError as e:
                raise Invalid(str(e)) from None
    try:
        return check_held(manifest, held)
    except StateError as e:
        raise Invalid(str(e)) from None


def _check_memory(manifest: Manifest, held: RegionTable, mem: pb.ReplicaMemory,
                  whole_model: bool, sizes: np.ndarray | None = None) -> tuple[int, pb.ReplicaMemory]:
    """The held regions' bytes in all, and ``mem`` as the server keeps it
    (packed when its regions are on one device); Invalid unless ``mem`` has
    one region of the right size per held region."""
    if mem.kind not in (pb.MEMORY_KIND_DRAM, pb.MEMORY_KIND_VRAM):
        raise Invalid("memory.kind must be DRAM or VRAM")
    if not mem.nixl_metadata:
        raise Invalid("memory.nixl_metadata is missing")
    if len(mem.nixl_metadata) > MAX_NIXL_METADATA:
        raise Invalid(f"memory.nixl_metadata is {len(mem.nixl_metadata)} bytes, over {MAX_NIXL_METADATA}")
    what = "tensors" if whole_model else "held regions"
    if not mem.packed and len(mem.regions) != len(held):
        raise Invalid(f"{len(mem.regions)} memory regions for {len(held)} {what}")
    if mem.packed and (len(mem.region_gap) > len(held) or (len(held) and not mem.region_gap)):
        raise Invalid(f"{len(mem.region_gap)} memory regions for {len(held)} {what}")
    if sizes is None:
        sizes = held_bytes(manifest, held)
    try:
        regions = wire.memory_regions_from_wire(mem, sizes)
    except ValueError as e:
        raise Invalid(str(e)) from None
    wrong = np.flatnonzero(regions[:, 1] != sizes.astype(np.uint64))
    if len(wrong):
        k = int(wrong[0])
        index = int(held.tensor[k])
        name = manifest.tensors[index].name
        part = held.region(k, shapes_of(manifest))
        of = repr(name) if part.whole else f"{part.describe()} of {name!r}"
        raise Invalid(f"memory region of {of} is {int(regions[k, 1])} bytes, the region is {int(sizes[k])}")
    if not mem.packed and len(regions) and (regions[:, 2] == regions[0, 2]).all():
        mem = wire.memory_packed_to_wire(wire.KIND_BACK[mem.kind], regions[:, 0].astype(np.int64), sizes,
                                         int(regions[0, 2]), mem.nixl_metadata)
    return int(sizes.sum()), mem


def _changing(replica: Replica) -> bytes:
    """The serialized ReplicaInfo fields of a replica that change while it is
    published. A complete replica's depend on its reads in flight alone: kept
    per count (a few bytes each), not built for every holder of every answer."""
    if replica.complete:
        reads = len(replica.leases)
        tail = _COMPLETE_TAILS.get(reads)
        if tail is None:
            tail = pb.ReplicaInfo(state=pb.REPLICA_STATE_COMPLETE, active_reads=reads).SerializeToString()
            if reads < 4096:
                _COMPLETE_TAILS[reads] = tail
        return tail
    return pb.ReplicaInfo(state=pb.REPLICA_STATE_FILLING, chunk_bitmap=bytes(replica.bitmap),
                          active_reads=len(replica.leases)).SerializeToString()


_COMPLETE_TAILS: dict[int, bytes] = {}


def _same_table(replica: Replica, held: RegionTable, wire_held: bytes) -> bool:
    """Whether ``replica`` holds exactly the regions of ``held``, in its order."""
    table = replica.held
    if table is None:
        return False
    if table is held or (wire_held and replica.wire_held == wire_held):
        return True
    return len(table) == len(held) and all(np.array_equal(getattr(table, f), getattr(held, f))
                                           for f in ("tensor", "flat", "lo", "hi"))


def _packable(replica: Replica, number: int, suffix: str) -> tuple[int, int, bytes] | None:
    """A replica's fixed part of a PackedHolders row (layout number, numeric
    suffix, CRCs as little-endian bytes), or None where it needs a message: an
    id that is not "<agent id>.<decimal>", deltas, or CRCs not one per chunk."""
    crcs = replica.chunk_crc32 or []
    if not suffix.isdigit() or str(int(suffix)) != suffix or replica.deltas or \
            (crcs and len(crcs) != replica.num_chunks):
        return None
    return number, int(suffix), np.asarray(crcs, "<u4").tobytes()


class ReferenceService(pb_grpc.ReferenceServiceServicer):
    def __init__(self, state: State, metrics: NoMetrics | None = None) -> None:
        self.state = state
        self.metrics = metrics or NoMetrics()
        self._manifests: dict[bytes, Manifest] = {}  # checked manifests by wire digest (_manifest)
        self._rule_tables: dict[bytes, tuple[RegionTable, np.ndarray, bytes]] = {}  # _held_of
        self._wire_manifests: dict[str, pb.Manifest] = {}  # by fingerprint: a version's manifest, encoded once
        self._group_answers: dict[tuple, tuple] = {}  # _group_holders
        self._static_infos: dict[tuple, tuple] = {}  # _static_info: a replica's unchanging wire parts
        # Checked layouts of earlier publishes, by (agent, wire.publish_layout): _known_layout
        self._layouts: OrderedDict[tuple[str, bytes], tuple[str, int, RegionTable, bytes, int, Any]] = OrderedDict()
        # ReplicaInfo.layout_id: a number per holder layout, named by _numbering (this instance's; it
        # starts anew past _LAYOUT_NUMBERS_KEPT, and readers then learn the new numbers).
        self._layout_numbers: dict[bytes, int] = {}
        self._numbering_generation = 0
        self._numbering = f"{state.instance_id}/0"
        self.changes = VersionChanges()  # what long-poll Resolves wait on
        # Readers that name the holders they read before (the steady state): ``named``
        self._named = NamedHolders(lambda replica: self._wire_info(replica)[2], self.changes)

    def _held_of(self, manifest: Manifest, request: pb.PublishRequest) -> tuple[RegionTable, np.ndarray | None, bytes]:
        """The request's held regions, checked; with their bytes and wire form
        when they came as chunk rules seen before (every worker w of 128
        engines publishes the same rules: checked once, kept as one table)."""
        msg = request.held_table
        if not (request.HasField("held_table") and msg.rules) or request.held:
            return _held(manifest, request), None, b""  # (which refuses held and held_table both set)
        key = hashlib.blake2b(manifest.fingerprint.encode() + msg.SerializeToString(deterministic=True),
                              digest_size=16).digest()
        kept = self._rule_tables.get(key)
        if kept is None:
            try:  # rules (at most MAX_RULES: wire.held_from_wire) make in-bounds, non-empty boxes, one per tensor in manifest order: nothing to normalize
                table = wire.held_from_wire(msg, shapes_of(manifest)).compact()
            except ValueError as e:
                raise Invalid(str(e)) from None
            kept = (table, held_bytes(manifest, table), wire.held_table_field(msg.SerializeToString()))
            if len(self._rule_tables) >= _RULE_TABLES_KEPT:
                self._rule_tables.pop(next(iter(self._rule_tables)))
            self._rule_tables[key] = kept
        return kept

    def _known_layout(self, agent_id: str, request: pb.PublishRequest,
                      manifest: Manifest) -> tuple[RegionTable, bytes, int, Any]:
        """The checked regions and memory of an earlier Publish of this agent that
        had the digest ``request.layout`` (``wire.publish_layout``): the same
        manifest, chunk size, regions and memory, so nothing needs checking again."""
        if request.held or request.HasField("held_table") or request.HasField("memory"):
            raise Invalid("a Publish naming a layout sends no held regions and no memory")
        kept = self._layouts.get((agent_id, request.layout))
        if kept is None or kept[:2] != (manifest.fingerprint, request.chunk_size):
            raise StateError("FAILED_PRECONDITION", "layout unknown: this server instance has no earlier Publish of "
                             "this agent with that layout; send the held regions and memory")
        self._layouts.move_to_end((agent_id, request.layout))
        return kept[2:]

    def _remember_layout(self, agent_id: str, request: pb.PublishRequest, checked: tuple) -> None:
        key = (agent_id, wire.publish_layout(request))
        self._layouts[key] = checked
        self._layouts.move_to_end(key)
        while len(self._layouts) > _LAYOUTS_KEPT:
            self._layouts.popitem(last=False)

    def _alike_checksums(self, model: str, version: int, manifest: Manifest, held: RegionTable, wire_held: bytes,
                         chunk_size: int, num_chunks: int) -> list[int]:
        """The chunk checksums of a complete holder of (model, version) cut
        exactly as ``held`` in ``chunk_size`` chunks (``checksums_from_alike``:
        a relay announced before it read them), as its reader would take them
        from that holder's answer (``Holdings.open_filling``)."""
        entry = self.state.models.get(model, {}).get(version)
        whole = self.state.every_tensor_whole(held, shapes_of(manifest))
        for r in entry.replicas.values() if entry is not None else ():
            if (r.complete and not r.withdrawn and not r.lost and r.chunk_size == chunk_size
                    and r.num_chunks == num_chunks and len(r.chunk_crc32 or ()) == num_chunks
                    and (r.held is None if whole else _same_table(r, held, wire_held))):
                return list(r.chunk_crc32)
        raise StateError("FAILED_PRECONDITION", f"no complete holder of {model!r} version {version} cut as this "
                         "replica has chunk checksums to take (checksums_from_alike); send them")

    def _known_manifest(self, fingerprint: str) -> Manifest:
        """A manifest this server holds, by fingerprint: kept checked ones, or a version's."""
        for manifest in self._manifests.values():
            if manifest.fingerprint == fingerprint:
                return manifest
        for versions in self.state.models.values():
            for entry in versions.values():
                if entry.fingerprint == fingerprint:
                    return entry.manifest
        raise StateError("FAILED_PRECONDITION", f"manifest unknown: this server holds no manifest with fingerprint "
                         f"{fingerprint[:80]!r}; send the manifest itself")

    # ------------------------------------------------------------ plumbing

    async def _run(self, context: grpc.aio.ServicerContext, fn: Callable[[], Awaitable[Resp]]) -> Resp:
        """Run a handler; turn validation and state errors into RPC statuses so
        that a bad request never takes the server down."""
        self.state.expire()
        try:
            return await fn()
        except Invalid as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except StateError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
        raise AssertionError("unreachable")  # abort() raises

    # ------------------------------------------------------------ agents

    async def RegisterAgent(self, request: pb.RegisterAgentRequest, context: Any) -> pb.RegisterAgentResponse:
        async def go() -> pb.RegisterAgentResponse:
            agent_id = _require_id(request.agent_id, "agent_id")
            if len(request.name) > MAX_NAME:
                raise Invalid("agent name too long")
            self.state.register_agent(agent_id, request.name or agent_id, _labels(request.labels),
                                      _reliability(request.reliability))
            return pb.RegisterAgentResponse(
                instance_id=self.state.instance_id,
                agent_ttl_s=self.state.agent_ttl_s,
                lease_ttl_s=self.state.lease_ttl_s,
            )

        return await self._run(context, go)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        async def go() -> pb.HeartbeatResponse:
            agent_id = _require_id(request.agent_id, "agent_id")
            known = self.state.heartbeat(agent_id, request.replica_ids)
            unknown = [
                rid for rid in request.replica_ids
                if (r := self.state.replicas.get(rid)) is None or r.agent_id != agent_id or r.lost
            ]  # a replica reported lost is announced again by a holder that is fine
            return pb.HeartbeatResponse(instance_id=self.state.instance_id, agent_known=known, unknown_replicas=unknown,
                                        release_replicas=self.state.releasable(agent_id) if known else [])

        return await self._run(context, go)

    # ------------------------------------------------------------ holders

    async def Publish(self, request: pb.PublishRequest, context: Any) -> pb.PublishResponse:
        return await self._run(context, lambda: _done(self._publish(request)))

    def _publish(self, request: pb.PublishRequest) -> pb.PublishResponse:
        agent_id = _require_id(request.agent_id, "agent_id")
        replica_id = _require_id(request.replica_id, "replica_id")
        model = _require_model(request.model)
        version = _require_version(request.version)
        if request.HasField("manifest"):
            manifest = _manifest(request.manifest, self._manifests)
        elif request.manifest_fingerprint:
            manifest = self._known_manifest(request.manifest_fingerprint)
        else:
            raise Invalid("manifest is missing")
        if not MIN_CHUNK_SIZE <= request.chunk_size <= MAX_CHUNK_SIZE:
            raise Invalid(f"chunk_size {request.chunk_size} outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
        if request.layout:
            held, wire_held, total, memory = self._known_layout(agent_id, request, manifest)
        else:
            held, sizes, wire_held = self._held_of(manifest, request)
            total, memory = _check_memory(manifest, held, request.memory,
                                          whole_model=not request.held and not request.HasField("held_table"),
                                          sizes=sizes)
        if request.state not in (pb.REPLICA_STATE_FILLING, pb.REPLICA_STATE_COMPLETE):
            raise Invalid("state must be FILLING or COMPLETE")
        num_chunks = -(-total // request.chunk_size)
        if len(request.chunk_bitmap) > -(-num_chunks // 8):
            raise Invalid(f"chunk_bitmap is longer than the replica's {num_chunks} chunks")
        if request.chunk_crc32 and len(request.chunk_crc32) != num_chunks:
            raise Invalid(f"{len(request.chunk_crc32)} chunk checksums for the replica's {num_chunks} chunks")
        if len(request.deltas) > MAX_DELTAS:
            raise Invalid(f"{len(request.deltas)} delta models, more than {MAX_DELTAS}")
        deltas = [_require_model(name) for name in request.deltas]
        if request.trainer_cut and (not request.origin or request.retained):
            raise Invalid("a trainer cut is published by its producer (origin), and is not a retained copy")
        crcs = list(request.chunk_crc32)
        if request.checksums_from_alike:
            if request.state != pb.REPLICA_STATE_FILLING or request.chunk_crc32:
                raise Invalid("checksums_from_alike is for a FILLING replica that sends no chunk_crc32")
            crcs = self._alike_checksums(model, version, manifest, held, wire_held, request.chunk_size, num_chunks)
        replica = self.state.publish(
            agent_id=agent_id,
            replica_id=replica_id,
            model=model,
            version=version,
            manifest=manifest,
            held=held,
            chunk_size=request.chunk_size,
            memory=memory,
            complete=request.state == pb.REPLICA_STATE_COMPLETE,
            bitmap=request.chunk_bitmap,
            origin=request.origin,
            retained=request.retained,
            total_bytes=total,
            trainer_cut=request.trainer_cut,
        )
        # A whole-model replica goes out with an empty held list, to keep Resolve small.
        if replica.held is None:
            replica.wire_held = b""
        else:
            replica.wire_held = wire_held or wire.held_table_field(
                wire.held_to_wire(replica.held, replica.shapes).SerializeToString())
        if request.layout:
            self.state.control.publishes_lean += 1
        else:
            self.state.control.publishes_full += 1
            self._remember_layout(agent_id, request, (manifest.fingerprint, request.chunk_size, held,
                                                      replica.wire_held, total, memory))
        replica.chunk_crc32 = crcs  # readers check what they read against them
        replica.deltas = deltas
        entry = self.state.models[model][version]
        if entry.wire_manifest is None:  # encoded once per manifest, not per version
            entry.wire_manifest = self._wire_manifests.get(entry.fingerprint)
            if entry.wire_manifest is None:
                entry.wire_manifest = wire.manifest_to_wire(entry.manifest)
                if len(self._wire_manifests) >= _MANIFESTS_KEPT:
                    self._wire_manifests.pop(next(iter(self._wire_manifests)))
                self._wire_manifests[entry.fingerprint] = entry.wire_manifest
        self.changes.bump(model, version)
        return pb.PublishResponse(replica_id=replica_id)


    async def ReportChunks(self, request: pb.ReportChunksRequest, context: Any) -> pb.ReportChunksResponse:
        return await self._run(context, lambda: _done(self._report_chunks(request)))

    def _report_chunks(self, request: pb.ReportChunksRequest) -> pb.ReportChunksResponse:
        replica = self.state.replicas.get(request.replica_id)
        if replica is not None and len(request.chunks) > replica.num_chunks:
            raise Invalid(f"{len(request.chunks)} chunks reported; replica {request.replica_id} has "
                          f"{replica.num_chunks}")
        if request.chunk_crc32 and len(request.chunk_crc32) != len(request.chunks):
            raise Invalid(f"{len(request.chunk_crc32)} chunk checksums for {len(request.chunks)} chunks reported")
        was_complete = replica is not None and replica.complete
        self.state.report_chunks(
            _require_id(request.agent_id, "agent_id"),
            _require_id(request.replica_id, "replica_id"),
            np.array(request.chunks, dtype=np.int64),  # one copy in C (list() is a Python step per chunk)
            request.complete,
            list(request.chunk_crc32),
        )
        if replica is not None and replica.complete and not was_complete and not replica.origin:
            self.metrics.served()
        if replica is not None:
            self.changes.bump(replica.model, replica.version)
        return pb.ReportChunksResponse()


    async def Unpublish(self, request: pb.UnpublishRequest, context: Any) -> pb.UnpublishResponse:
        async def go() -> pb.UnpublishResponse:
            replica = self._withdraw(request)
            if replica is None:
                return pb.UnpublishResponse(retain_required=True)
            return await self._drained(replica, request.drain_timeout_s)

        return await self._run(context, go)

    def _withdraw(self, request: pb.UnpublishRequest) -> Replica | None:
        """Withdraw the request's replica (None: nothing withdrawn, it must be retained first)."""
        if not 0 <= request.drain_timeout_s <= MAX_DRAIN_S:
            raise Invalid(f"drain_timeout_s must be within [0, {MAX_DRAIN_S}]")
        agent_id = _require_id(request.agent_id, "agent_id")
        replica_id = _require_id(request.replica_id, "replica_id")
        if not request.force and self.state.needs_retention(agent_id, replica_id):
            return None
        replica = self.state.withdraw(agent_id, replica_id)
        self.changes.bump(replica.model, replica.version)
        return replica

    async def _drained(self, replica: Replica, timeout_s: float) -> pb.UnpublishResponse:
        """Wait for a withdrawn replica's readers (up to ``timeout_s``); drop it once none is left."""
        started = time.monotonic()
        drained = await self._drain(replica, timeout_s)
        return self._unpublished(replica, drained, time.monotonic() - started)

    def _unpublished(self, replica: Replica, drained: bool, waited_s: float) -> pb.UnpublishResponse:
        """A withdrawn replica's end: dropped if no reader is left."""
        self.metrics.unpublished(waited_s, drained)
        outstanding = len(replica.leases)
        if drained:
            self.state.remove_replica(replica.replica_id)
        return pb.UnpublishResponse(drained=drained, leases_outstanding=outstanding)

    async def _drain(self, replica: Replica, timeout_s: float) -> bool:
        """Wait until no read lease covers the replica. Leases that expire
        meanwhile count as finished: the expiry sweep releases them."""
        deadline = time.monotonic() + timeout_s
        while replica.leases:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(replica.drained.wait(), timeout=min(remaining, 0.25))
            except asyncio.TimeoutError:
                self.state.expire()
        return True

    # ------------------------------------------------------------ readers

    async def Resolve(self, request: pb.ResolveRequest, context: Any) -> bytes:
        """Answers the serialized ResolveResponse (see ``_serialize``): the holders'
        ReplicaInfo bytes are cached, not rebuilt and copied for every reader."""
        outcome, pull_started = "error", False
        started = time.perf_counter()

        async def go() -> bytes:
            nonlocal outcome, pull_started, started
            agent_id = _require_id(request.agent_id, "agent_id")
            self.metrics.pulled(_pulled(request.pulled))  # of earlier pulls, whatever this answer is
            self.state.heartbeat(agent_id)  # any call of a live agent shows it is alive: it may skip a heartbeat
            self._release_own(agent_id, request.release_leases)
            model = _require_model(request.model)
            which = request.WhichOneof("which")
            if which is None:
                raise Invalid("say which version: set version or latest")
            version = None if which == "latest" else _require_version(request.version)
            if request.group and len(request.group) > MAX_NAME:
                raise Invalid("group name too long")
            if len(request.known_memory) > MAX_KNOWN_MEMORY:
                raise Invalid(f"{len(request.known_memory)} known_memory digests, more than {MAX_KNOWN_MEMORY}")
            known = frozenset(request.known_memory)
            if len(request.withdrawals) > MAX_BATCH:
                raise Invalid(f"{len(request.withdrawals)} withdrawals with a resolve, more than {MAX_BATCH}")
            if len(request.announces) > MAX_BATCH:
                raise Invalid(f"{len(request.announces)} announces with a resolve, more than {MAX_BATCH}")
            if request.announces and version is None:
                raise Invalid("announces go with a resolve of one version, not latest")
            if len(request.known_layouts) > MAX_KNOWN_MEMORY:
                raise Invalid(f"{len(request.known_layouts)} known_layouts, more than {MAX_KNOWN_MEMORY}")
            layouts = frozenset(request.known_layouts)
            if len(request.named_layouts) > MAX_KNOWN_MEMORY or any(len(k) > 64 for k in request.named_layouts):
                raise Invalid(f"named_layouts: at most {MAX_KNOWN_MEMORY}, each a ReplicaInfo.layout")
            if not 0 <= request.named_wait_s <= MAX_WAIT_CHANGE_S:
                raise Invalid(f"named_wait_s must be within [0, {MAX_WAIT_CHANGE_S}]")
            others = self._members(agent_id, request)
            self.state.control.pulls_replayed += request.pulls_replayed
            self.state.control.pulls_planned += request.pulls_planned
            if request.wait_change_s:
                if not 0 < request.wait_change_s <= MAX_WAIT_CHANGE_S or version is None or request.lease:
                    raise Invalid(f"wait_change_s must be within (0, {MAX_WAIT_CHANGE_S}], for one version, "
                                  "without a lease")
                await self.changes.wait(model, version, request.seen_change, request.wait_change_s)
                self.state.expire()
                started = time.perf_counter()  # the resolve's own time, not the wait, goes to its metric
            change = self.changes.seen(model, version) if version is not None else 0
            try:
                # A group's members asking one by one agree through rounds; one asking for all needs none.
                resolved, entry = self.state.resolve(model, version, "" if others else request.group,
                                                     request.group_round, reader=agent_id)
            except StateError as e:
                outcome = "not_found" if e.code == "NOT_FOUND" else outcome
                raise
            shared_list: list = []
            named = None
            if request.named_layouts:  # the steady state: the holders the reader read before (``named``)
                waited = time.perf_counter()
                named = await self._named.holders(model, resolved, entry, request.named_layouts,
                                                  request.named_wait_s, others | {agent_id}, self.state.agents,
                                                  self.state.expire)
                started += time.perf_counter() - waited  # waiting is not the resolve's time (a small overcount)
            if named is not None:
                sources = named
            elif request.group and not request.max_sources:  # one list per engine (State.group_sources)
                sources = shared_list = self.state.group_sources(model, entry, agent_id, request.group,
                                                                 others=others)
            else:
                sources = self.state.sources(entry, agent_id, request.max_sources)
            response = pb.ResolveResponse(version=resolved, fingerprint=entry.fingerprint,
                                          instance_id=self.state.instance_id, change=change,
                                          layout_ids=self._numbering,
                                          pace_s=server_pace_s(self.state.relays_pulling(model, resolved)))
            by_number = request.layout_ids == self._numbering
            if request.known_fingerprint != entry.fingerprint:
                response.manifest.CopyFrom(entry.wire_manifest)
            if request.lease:
                pull_started = not self.state.leases_of.get(agent_id)  # not a pull's refresh
                lease = self.state.acquire_lease(agent_id, [r.replica_id for r in sources], others)
                response.lease_id, response.lease_ttl_s = lease.lease_id, _left(lease)
                if len(lease.replica_ids) < len(sources):  # the reader takes the answer as all leased
                    granted = set(lease.replica_ids)
                    sources = [r for r in sources if r.replica_id in granted]
            shared = request.group and not request.max_sources and named is None and len(sources) == len(shared_list)
            response.named = named is not None and len(sources) == len(named)  # all leased, when asked
            if request.named_layouts:
                if response.named:
                    self.state.control.answers_named += 1
                else:
                    self.state.control.named_missed += 1
            packed = request.packed_holders
            answer = response.SerializeToString() + (
                self._group_holders(model, resolved, sources, known, layouts, by_number, packed, response.lease_id)
                if shared else self._holders(sources, known, layouts, by_number, packed, response.lease_id))
            if request.withdrawals:  # after the answer is made, as a Batch's (a failed resolve handles none)
                waited = time.perf_counter()
                answer += wire.embedded_fields(RESOLVE_WITHDRAWALS_FIELD, [
                    o.SerializeToString() for o in await self._withdrawals(request.withdrawals)])
                started += time.perf_counter() - waited  # the drains are not the resolve's time
            if request.announces:  # after the withdrawals: the members' replicas of this version, filling
                answer += wire.embedded_fields(RESOLVE_ANNOUNCES_FIELD, [
                    self._announce_ahead(m, resolved, others | {agent_id}).SerializeToString()
                    for m in request.announces])
            control = self.state.control
            control.resolves += 1
            control.answers_shared += len(others)
            control.answer_bytes += len(answer)
            outcome = "ok"
            return answer

        try:
            return await self._run(context, go)
        finally:
            self.metrics.resolved(time.perf_counter() - started, outcome, pull_started)

    def _announce_ahead(self, request: pb.PublishRequest, version: int, group: frozenset[str]) -> pb.BatchOutcome:
        """A member's announce sent with its group's resolve: a Publish alone,
        of a replica of the resolved version, filling, by a member of the group."""
        if request.agent_id not in group:
            return pb.BatchOutcome(code=grpc.StatusCode.PERMISSION_DENIED.name,
                                   detail=f"agent {request.agent_id!r} is not a member of the resolving group")
        if request.version != version or request.state != pb.REPLICA_STATE_FILLING:
            return pb.BatchOutcome(code=grpc.StatusCode.INVALID_ARGUMENT.name,
                                   detail=f"an announce sent with a resolve of version {version} is a FILLING "
                                          f"replica of it, not version {request.version}")
        self.state.control.announces_ahead += 1
        return self._outcome(self._publish, request)

    def _members(self, agent_id: str, request: pb.ResolveRequest) -> frozenset[str]:
        """The other members of the caller's group it resolves for: known agents,
        for a group pull that takes a lease (the lease covers their reads)."""
        if not request.members:
            return frozenset()
        if not request.group or not request.lease:
            raise Invalid("members need a group and a lease: the answer is the group's, and so is its lease")
        if len(request.members) > MAX_SHARED_MEMBERS:
            raise Invalid(f"{len(request.members)} members, more than {MAX_SHARED_MEMBERS}")
        members = frozenset(_require_id(m, "members") for m in request.members) - {agent_id}
        for member in sorted(members):
            self.state.registered(member)
        return members

    def _group_holders(self, model: str, version: int, sources: list[Replica], known_memory: frozenset[bytes],
                       known: frozenset[bytes], by_number: bool, packed: bool, lease_id: str) -> bytes:
        """The holders part of an answer to a member of a group, encoded once for
        the members that ask the same (the same list, what they know alike) while
        the version's holders and their chunks stand (its change counter): the
        other members' asks cost a lookup and a send. Their read counts are the
        first member's (a hint for ranking, not a promise)."""
        key = (id(sources), self.changes.seen(model, version), hash(known), hash(known_memory), by_number, packed)
        kept = self._group_answers.get(key)
        control = self.state.control
        if kept is not None and kept[0] is sources and kept[2] == known and kept[3] == known_memory:
            control.holders_full += kept[4]
            control.holders_lean += kept[5]
            return kept[1]
        full, lean = control.holders_full, control.holders_lean
        encoded = self._holders(sources, known_memory, known, by_number, packed, lease_id)
        if len(self._group_answers) >= _GROUP_ANSWERS_KEPT:
            self._group_answers.pop(next(iter(self._group_answers)))
        # The list kept alive with it: its id stays its own while the key names it.
        self._group_answers[key] = (sources, encoded, known, known_memory, control.holders_full - full,
                                    control.holders_lean - lean)
        return encoded

    def _release_own(self, agent_id: str, lease_ids: Any) -> None:
        """Release read leases of ``agent_id``; another agent's lease is PERMISSION_DENIED
        (checked for all of them before any is released). Unknown ones are already gone;
        a lease the agent shares (``Lease.sharers``) is its owner's to release: kept."""
        for lease_id in lease_ids:
            lease = self.state.leases.get(_require_id(lease_id, "lease_id"))
            if lease is not None and lease.agent_id != agent_id and agent_id not in lease.sharers:
                raise StateError("PERMISSION_DENIED", f"read lease {lease_id!r} belongs to another agent")
        for lease_id in lease_ids:
            lease = self.state.leases.get(lease_id)
            if lease is not None and lease.agent_id == agent_id:
                self.state.release_lease(lease_id)

    def _layout_number(self, layout: bytes) -> int:
        number = self._layout_numbers.get(layout)
        if number is None:
            if len(self._layout_numbers) >= _LAYOUT_NUMBERS_KEPT:  # start anew: readers learn the new numbers
                self._layout_numbers.clear()
                self._numbering_generation += 1
                self._numbering = f"{self.state.instance_id}/{self._numbering_generation}"
            number = self._layout_numbers[layout] = len(self._layout_numbers) + 1
        return number

    def _replica_info(self, replica: Replica, known_memory: frozenset[bytes], known: frozenset[bytes],
                      by_number: bool = False) -> bytes:
        """The replica's serialized ReplicaInfo. The fields that do not change
        while it is published (its memory, NIXL metadata and held regions: most
        of the bytes) are serialized once per agent record; the ones that do
        (state, bitmap, load) are appended: a parser merges the two. ``memory``
        is left out when the reader says it has it (``known_memory``); every
        field that stays put from one version to the next when the reader
        says it has the holder's layout (``known``: the steady state)."""
        _, digest, layout_key, per_version, without_memory, full_bytes, _, by_number_bytes, _ = self._wire_info(replica)
        if layout_key in known:
            self.state.control.holders_lean += 1
            fixed = by_number_bytes if by_number else per_version
        else:
            self.state.control.holders_full += 1
            fixed = without_memory if digest in known_memory else full_bytes
        return fixed + _changing(replica)

    def _wire_info(self, replica: Replica) -> tuple:
        """The replica's ReplicaInfo parts that stay put while it is published,
        serialized once (``replica.wire_info``): (agent, memory digest, layout
        key, per-version fields, without memory, whole, numbering generation,
        by number, packed row or None)."""
        agent = self.state.agents[replica.agent_id]
        cached = replica.wire_info
        # A re-registered agent may have new labels; a new numbering, new layout numbers.
        if cached is None or cached[0] is not agent or cached[6] != self._numbering_generation:
            memory_field, digest, static, layout_digest = self._static_info(agent, replica)
            number = self._layout_number(layout_digest)
            self._named.laid_out(layout_digest, replica)
            own = pb.ReplicaInfo(chunk_crc32=replica.chunk_crc32 or [], deltas=replica.deltas).SerializeToString()
            per_version = pb.ReplicaInfo(replica_id=replica.replica_id, layout=layout_digest,
                                         layout_id=number).SerializeToString() + own
            # By number: "<agent id>.<suffix>" ids (every Hub's) as the suffix alone.
            agent_part, dot, suffix = replica.replica_id.rpartition(".")
            named = {"replica_suffix": suffix} if dot and agent_part == agent.agent_id else \
                {"replica_id": replica.replica_id}
            by_number_bytes = pb.ReplicaInfo(layout_id=number, **named).SerializeToString() + own
            without_memory = per_version + static
            full = without_memory + memory_field
            cached = replica.wire_info = (agent, digest, layout_digest, per_version, without_memory, full,
                                          self._numbering_generation, by_number_bytes,
                                          _packable(replica, number, suffix if "replica_suffix" in named else ""))
        return cached

    def _static_info(self, agent: Any, replica: Replica) -> tuple[bytes, bytes, bytes, bytes]:
        """The replica's parts that stay put from one version to the next:
        its memory as a serialized ReplicaInfo field, that memory's digest, the static ReplicaInfo
        fields (held regions included) and its layout key (``ReplicaInfo.layout``:
        the static fields, the memory and the manifest that the regions index).
        Kept per (agent record, memory, regions, chunk size, origin, manifest):
        a relay's next replica, announced by its layout, has the same memory and
        regions objects (``_known_layout``), and hashing them again for each of
        1,024 workers every step was most of what a new replica cost."""
        fingerprint = self.state.models[replica.model][replica.version].fingerprint
        key = (id(agent), id(replica.memory), id(replica.wire_held), replica.chunk_size, replica.origin, fingerprint)
        kept = self._static_infos.get(key)
        if kept is not None and kept[0] is agent and kept[1] is replica.memory and kept[2] is replica.wire_held:
            return kept[3]
        memory = replica.memory.SerializeToString()
        digest = hashlib.blake2b(memory, digest_size=16).digest()
        static = pb.ReplicaInfo(
            agent_id=agent.agent_id,
            agent_name=agent.name,
            labels=wire.labels_to_wire(agent.labels),
            reliability=wire.reliability_to_wire(agent.reliability),
            origin=replica.origin,
            chunk_size=replica.chunk_size,
            memory_digest=digest,
        ).SerializeToString() + replica.wire_held
        layout = hashlib.blake2b(static, digest_size=16, key=b"tensorhub layout")
        layout.update(memory)
        layout.update(fingerprint.encode())
        parts = (pb.ReplicaInfo(memory=replica.memory).SerializeToString(), digest, static, layout.digest())
        if len(self._static_infos) >= _STATIC_INFOS_KEPT:
            self._static_infos.pop(next(iter(self._static_infos)))
        # the objects kept alive with their parts: the ids in the key stay theirs
        self._static_infos[key] = (agent, replica.memory, replica.wire_held, parts)
        return parts

    def _holders(self, sources: list[Replica], known_memory: frozenset[bytes], known: frozenset[bytes],
                 by_number: bool, packed: bool, lease_id: str) -> bytes:
        """The holders part of a Resolve answer: a ReplicaInfo each, or, for a
        reader that asked for ``packed`` and has the numbering, the lean holders
        that fit as rows of one PackedHolders (~7 bytes a holder instead of ~16;
        the others stay messages). A packed row's reads leave out the answer's
        own lease (``lease_id``): the asker knows it reads."""
        messages, rows = [], []
        for replica in sources:
            cached = self._wire_info(replica) if packed and by_number else None
            row = cached[8] if cached is not None and cached[2] in known else None
            if row is None:
                messages.append(self._replica_info(replica, known_memory, known, by_number))
                continue
            self.state.control.holders_lean += 1  # a packed row: no message of it is built
            number, suffix, crc = row
            reads = len(replica.leases) - (lease_id in replica.leases)
            # A filling holder's bitmap without its trailing zero bytes (readers take the chunks past it
            # as not landed): a relay that just announced sends none, not a bit per chunk of its own.
            rows.append((number, suffix, replica.complete, crc,
                         b"" if replica.complete else bytes(replica.bitmap).rstrip(b"\0"), reads))
        encoded = wire.embedded_fields(RESOLVE_REPLICAS_FIELD, messages)
        if rows:
            encoded += wire.embedded_fields(RESOLVE_PACKED_FIELD,
                                            [wire.packed_holders_to_wire(rows).SerializeToString()])
        return encoded

    async def AcquireReadLease(self, request: pb.AcquireReadLeaseRequest, context: Any) -> pb.AcquireReadLeaseResponse:
        async def go() -> pb.AcquireReadLeaseResponse:
            ids = [_require_id(r, "replica_id") for r in request.replica_ids]
            lease = self.state.acquire_lease(_require_id(request.agent_id, "agent_id"), ids)
            return pb.AcquireReadLeaseResponse(lease_id=lease.lease_id, granted=lease.replica_ids, ttl_s=_left(lease))

        return await self._run(context, go)

    async def RenewReadLease(self, request: pb.RenewReadLeaseRequest, context: Any) -> pb.RenewReadLeaseResponse:
        async def go() -> pb.RenewReadLeaseResponse:
            lease_id = _require_id(request.lease_id, "lease_id")
            self.state.renew_lease(_require_id(request.agent_id, "agent_id"), lease_id)
            return pb.RenewReadLeaseResponse(ttl_s=_left(self.state.leases[lease_id]))

        return await self._run(context, go)

    async def ReleaseReadLease(self, request: pb.ReleaseReadLeaseRequest, context: Any) -> pb.ReleaseReadLeaseResponse:
        return await self._run(context, lambda: _done(self._release_lease(request)))

    def _release_lease(self, request: pb.ReleaseReadLeaseRequest) -> pb.ReleaseReadLeaseResponse:
        agent_id = _require_id(request.agent_id, "agent_id")
        pulled = _pulled(request.pulled)
        if request.lease_id or not pulled:  # a request may only report pulled bytes
            self._release_own(agent_id, [request.lease_id])
        self.metrics.pulled(pulled)
        return pb.ReleaseReadLeaseResponse()

    async def ReportLost(self, request: pb.ReportLostRequest, context: Any) -> pb.ReportLostResponse:
        async def go() -> pb.ReportLostResponse:
            agent_id = _require_id(request.agent_id, "agent_id")
            replica_id = _require_id(request.replica_id, "replica_id")
            replica = self.state.replicas.get(replica_id)
            if replica is None:
                return pb.ReportLostResponse()  # already gone: nothing to do
            # Only a reader of the replica (a read lease on it) may report it lost:
            # no agent can drop what others hold by naming it.
            if not any((lease := self.state.leases.get(lid)) is not None
                       and (lease.agent_id == agent_id or agent_id in lease.sharers) for lid in replica.leases):
                raise StateError("PERMISSION_DENIED", f"agent {agent_id!r} holds no read lease on replica "
                                                      f"{replica_id!r}; only its readers may report it lost")
            if request.stalled and self.state.heard_from(replica.agent_id, self.state.config.stall_alive_s):
                # Its holder spoke to us while this reader heard nothing from it: slow to
                # that reader (a starved flow, a queue), not gone. The reader fails over
                # on its own; the others keep reading it. A dead one stops heartbeating.
                log.info("replica %s stalled for %s, but its holder is alive: kept listed (%s)", replica_id,
                         agent_id, request.reason[:200])
                return pb.ReportLostResponse(kept=True)
            log.warning("replica %s reported lost by %s: %s", replica_id, agent_id, request.reason[:200])
            self.state.report_lost(replica_id)
            self.changes.bump(replica.model, replica.version)
            self.metrics.source_lost()
            return pb.ReportLostResponse()

        return await self._run(context, go)

    async def Batch(self, request: pb.BatchRequest, context: Any) -> pb.BatchResponse:
        """Several agents' publishes, reports, releases and withdrawals, each
        handled as it would be alone (its own checks, its own outcome), in the
        request's order; the withdrawals last, their drains waited for together."""
        async def go() -> pb.BatchResponse:
            count = len(request.publishes) + len(request.reports) + len(request.releases) + len(request.withdrawals)
            if count > MAX_BATCH:
                raise Invalid(f"{count} messages in one Batch, more than {MAX_BATCH}")
            answer = pb.BatchResponse(publishes=[self._outcome(self._publish, m) for m in request.publishes],
                                      reports=[self._outcome(self._report_chunks, m) for m in request.reports],
                                      releases=[self._outcome(self._release_lease, m) for m in request.releases])
            answer.withdrawals.extend(await self._withdrawals(request.withdrawals))
            return answer

        return await self._run(context, go)

    async def _withdrawals(self, requests: Sequence[pb.UnpublishRequest]) -> list[pb.BatchOutcome]:
        """Withdrawals sent together (a Batch's, a group's Resolve's): each
        checked and withdrawn as an Unpublish alone, then their drains waited
        for together; one outcome each, in order."""
        outcomes: list[pb.BatchOutcome] = []
        withdrawn: list[tuple[pb.BatchOutcome, Replica, float]] = []
        with self.state.withdrawals_together():  # each version's visibility recomputed once, at the end
            for m in requests:
                outcome, replica = self._outcome_of(self._withdraw, m)
                outcomes.append(outcome)
                if outcome.code:
                    continue
                if replica is None:
                    outcome.unpublished.retain_required = True
                else:
                    withdrawn.append((outcome, replica, m.drain_timeout_s))
        # Those nobody reads end now (the steady state's: an engine's previous replicas), without a
        # task each; the others' drains are waited for together.
        reading = []
        for outcome, replica, timeout_s in withdrawn:
            if replica.leases:
                reading.append((outcome, replica, timeout_s))
            else:
                outcome.unpublished.CopyFrom(self._unpublished(replica, True, 0.0))
        if reading:
            for (outcome, _, _), unpublished in zip(reading, await asyncio.gather(
                    *(self._drained(replica, timeout_s) for _, replica, timeout_s in reading))):
                outcome.unpublished.CopyFrom(unpublished)
        return outcomes

    def _outcome(self, handle: Callable[[Any], Any], message: Any) -> pb.BatchOutcome:
        """What ``handle`` answered ``message``, as the status it would have had alone."""
        return self._outcome_of(handle, message)[0]

    @staticmethod
    def _outcome_of(handle: Callable[[Any], Any], message: Any) -> tuple[pb.BatchOutcome, Any]:
        """``_outcome``, and what ``handle`` returned (None where it raised)."""
        try:
            result = handle(message)
        except Invalid as e:
            return pb.BatchOutcome(code=grpc.StatusCode.INVALID_ARGUMENT.name, detail=str(e)), None
        except StateError as e:
            return pb.BatchOutcome(code=e.code, detail=str(e)), None
        return pb.BatchOutcome(), result

    # ------------------------------------------------------------ queries

    async def ListVersions(self, request: pb.ListVersionsRequest, context: Any) -> pb.ListVersionsResponse:
        async def go() -> pb.ListVersionsResponse:
            model = _require_model(request.model)
            out = []
            for version, entry in sorted(self.state.models.get(model, {}).items()):
                live = self.state.sources(entry, "")
                complete = sum(r.complete for r in live)
                if not live:
                    continue
                out.append(pb.VersionSummary(
                    version=version,
                    complete_replicas=complete,
                    filling_replicas=len(live) - complete,
                    total_bytes=entry.manifest.total_bytes,
                    visible=entry.visible,
                ))
            return pb.ListVersionsResponse(versions=out)

        return await self._run(context, go)

    async def WaitForVersion(self, request: pb.WaitForVersionRequest, context: Any) -> pb.WaitForVersionResponse:
        async def go() -> pb.WaitForVersionResponse:
            model = _require_model(request.model)
            at_least = _require_version(request.at_least)
            if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
                raise Invalid(f"timeout_s {request.timeout_s} must be a finite number of seconds >= 0")
            timeout = min(request.timeout_s, self.state.config.max_wait_s)
            found = await self.state.wait_for_version(model, at_least, timeout)
            return pb.WaitForVersionResponse(found=found is not None, version=found or 0)

        return await self._run(context, go)


    async def ReaderCuts(self, request: pb.ReaderCutsRequest, context: Any) -> pb.ReaderCutsResponse:
        """The read sets of the model's readers (``State.reader_cuts``), each once."""

        async def go() -> pb.ReaderCutsResponse:
            model = _require_model(request.model)
            if not _FINGERPRINT.match(request.fingerprint):
                raise Invalid(f"fingerprint {request.fingerprint[:80]!r} is missing or malformed (a manifest's "
                              "fingerprint: 16-128 lower-case hex digits)")
            limit = min(request.max_cuts or MAX_READER_CUTS, MAX_READER_CUTS)
            found = self.state.reader_cuts(model, request.fingerprint)
            if found is None:
                return pb.ReaderCutsResponse(found=False)
            version, cuts = found
            shapes = shapes_of(self.state.models[model][version].manifest)
            answer = pb.ReaderCutsResponse(found=True, version=version, more=len(cuts) > limit)
            size = 0
            for held, readers in cuts[:limit]:
                cut = pb.ReaderCut(whole=True, readers=readers) if held is None else pb.ReaderCut(
                    held=wire.held_to_wire(held, shapes), readers=readers)
                size += cut.ByteSize()
                if size > MAX_READER_CUTS_BYTES and answer.cuts:  # the first always goes
                    answer.more = True
                    break
                answer.cuts.append(cut)
            return answer

        return await self._run(context, go)

    # ------------------------------------------------------------ operators

    async def Describe(self, request: pb.DescribeRequest, context: Any) -> pb.DescribeResponse:
        """Read-only: what the hub holds (``tensorhub status``). Behind the token like every call."""

        async def go() -> pb.DescribeResponse:
            model = _require_model(request.model) if request.model else ""
            return wire.status_to_wire(self.state.describe(model))

        return await self._run(context, go)


# ---------------------------------------------------------------- registration


class _Undecodable:
    """Stands in for a request whose bytes are not a valid message, so the
    handler can answer INVALID_ARGUMENT instead of grpc's bare UNKNOWN."""

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name, self.error = type_name, error


async def _done(response: Resp) -> Resp:
    """A handler's answer computed already, as ``ReferenceService._run`` awaits it."""
    return response


def _lenient(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception as e:  # noqa: BLE001  DecodeError, or anything else protobuf raises on garbage
            return _Undecodable(cls.__name__, str(e))

    return parse


def _guard(method: Callable[[Any, Any], Awaitable[Any]], calls: dict[str, int],
           name: str) -> Callable[[Any, Any], Awaitable[Any]]:
    """``method`` behind the garbage check, counted in ``calls`` (ControlView.calls) as it arrives."""

    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        calls[name] = calls.get(name, 0) + 1
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request is not a valid {request.type_name}: {request.error}")
        return await method(request, context)

    return handler


def _serialize(response: Any) -> bytes:
    """A handler may answer bytes it serialized itself (Resolve does)."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def add_to_server(service: ReferenceService, server: grpc.aio.Server) -> None:
    """Register every method of the .proto's ReferenceService, with lenient
    request parsing (see _Undecodable)."""
    descriptor = pb.DESCRIPTOR.services_by_name["ReferenceService"]
    handlers = {
        m.name: grpc.unary_unary_rpc_method_handler(
            _guard(getattr(service, m.name), service.state.control.calls, m.name),
            request_deserializer=_lenient(getattr(pb, m.input_type.name)),
            response_serializer=_serialize,
        )
        for m in descriptor.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))
