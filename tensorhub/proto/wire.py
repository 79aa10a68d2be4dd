"""The one protobuf <-> Python codec, used by the client stub (``client/rpc.py``)
and the server (``server/service.py``). Only the RPC modules import this."""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import asdict
from typing import Any

import numpy as np

from tensorhub.manifest import Manifest, TensorSpec
from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.regions import Region
from tensorhub.regiontable import MAX_RULES, RegionTable, Shapes, memory_addrs, memory_gaps, rules_of, table_of_rules
from tensorhub.status import AgentView, ControlView, HubStatus, LeaseView, ModelView, ReplicaView, VersionView
from tensorhub.topology import Labels, Reliability
from tensorhub.transport.memory import MemoryKind, MemoryRegion

KIND = {MemoryKind.DRAM: pb.MEMORY_KIND_DRAM, MemoryKind.VRAM: pb.MEMORY_KIND_VRAM}
KIND_BACK = {v: k for k, v in KIND.items()}

# A held region on the wire: (index of the tensor in the manifest, region).
Held = tuple[int, Region]


def manifest_to_wire(manifest: Manifest) -> pb.Manifest:
    return pb.Manifest(
        tensors=[pb.TensorSpec(name=t.name, dtype=t.dtype, shape=t.shape, nbytes=t.nbytes) for t in manifest.tensors],
        fingerprint=manifest.fingerprint,
    )


def manifest_from_wire(msg: pb.Manifest) -> Manifest:
    return Manifest(tuple(TensorSpec(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in msg.tensors))


def labels_to_wire(labels: Labels) -> pb.Labels:
    return pb.Labels(host=labels.host, rack=labels.rack, zone=labels.zone)


def labels_from_wire(msg: pb.Labels) -> Labels:
    return Labels(msg.host, msg.rack, msg.zone)


def reliability_to_wire(value: Reliability) -> int:
    return pb.RELIABILITY_SPOT if value is Reliability.SPOT else pb.RELIABILITY_RELIABLE


def reliability_from_wire(value: int) -> Reliability:
    """ValueError for a value this version does not know."""
    if value == pb.RELIABILITY_SPOT:
        return Reliability.SPOT
    if value in (pb.RELIABILITY_UNSPECIFIED, pb.RELIABILITY_RELIABLE):
        return Reliability.RELIABLE
    raise ValueError(f"unknown reliability {value}")


def region_from_wire(msg: pb.TensorRegion) -> Held:
    """ValueError when start and stop do not pair up."""
    if len(msg.start) != len(msg.stop):
        raise ValueError(f"region of tensor #{msg.tensor}: {len(msg.start)} starts but {len(msg.stop)} stops")
    if msg.flat:
        if len(msg.start) != 1:
            raise ValueError(f"flat region of tensor #{msg.tensor} needs exactly one start and stop")
        return msg.tensor, Region(flat=(msg.start[0], msg.stop[0]))
    if not msg.start:
        return msg.tensor, Region()
    return msg.tensor, Region(box=tuple(zip(msg.start, msg.stop)))


def held_to_wire(table: RegionTable, shapes: Shapes) -> pb.HeldRegions:
    """Chunk rules where the regions are such (a few bytes for 10^5 tensors), else packed columns."""
    ruled = rules_of(table, shapes)
    if ruled is not None:
        rules, rule_of = ruled
        return pb.HeldRegions(rules=[pb.HeldRule(dim=d, parts=n, part=k) for d, n, k in rules],
                              rule_of=zlib.compress(rule_of.tobytes(), 6))
    step, cut, flat_at = table.to_packed(shapes)
    return pb.HeldRegions(tensor_step=step.tolist(), cut=cut.tolist(), flat_at=flat_at.tolist())


def held_table_field(held: bytes) -> bytes:
    """A serialized ``HeldRegions`` as ReplicaInfo field ``held_table``, to
    append to a serialized ReplicaInfo (the server keeps only these bytes)."""
    number = pb.ReplicaInfo.DESCRIPTOR.fields_by_name["held_table"].number
    return _varint(number << 3 | 2) + _varint(len(held)) + held


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def held_from_wire(msg: pb.HeldRegions, shapes: Shapes) -> RegionTable:
    """ValueError when the columns or rules do not fit together (the bounds are checked by the caller)."""
    if msg.rules or msg.rule_of:
        if msg.tensor_step or msg.cut or msg.flat_at:
            raise ValueError("held regions given as both columns and rules")
        if len(msg.rules) > MAX_RULES:
            raise ValueError(f"{len(msg.rules)} held rules, more than {MAX_RULES}")
        inflate = zlib.decompressobj()
        try:
            raw = inflate.decompress(msg.rule_of, len(shapes.ndim) + 1)  # a bomb stops at one byte too many
        except zlib.error as e:
            raise ValueError(f"held rule_of does not inflate: {e}") from None
        if len(raw) != len(shapes.ndim) or inflate.unconsumed_tail:
            raise ValueError(f"held rule_of names {len(raw)}+ tensors; the manifest has {len(shapes.ndim)}")
        rules = [(r.dim, r.parts, r.part) for r in msg.rules]
        return table_of_rules(rules, np.frombuffer(raw, np.uint8), shapes)
    return RegionTable.from_packed(np.array(msg.tensor_step, np.int64), np.array(msg.cut, np.int64),
                                   np.array(msg.flat_at, np.int64), shapes)


def memory_packed_to_wire(kind: MemoryKind, addr: np.ndarray, size: np.ndarray, device_id: int,
                          metadata: bytes) -> pb.ReplicaMemory:
    """Memory regions of one device, one per held region, as address gaps (sizes are the regions' bytes)."""
    gaps = memory_gaps(addr, size)
    used = int(np.flatnonzero(gaps)[-1]) + 1 if gaps.any() else min(1, len(gaps))  # trailing zeros left out
    return pb.ReplicaMemory(kind=KIND[kind], packed=True, region_gap=gaps[:used].tolist(),
                            device_id=device_id, nixl_metadata=metadata)


def memory_regions_from_wire(msg: pb.ReplicaMemory, sizes: np.ndarray) -> np.ndarray:
    """(regions x 3) addr, nbytes, device id; ``sizes``: the held regions' bytes
    (what packed regions are). ValueError when the counts differ."""
    if msg.packed:
        if len(msg.region_gap) > len(sizes) or (len(sizes) and not msg.region_gap):
            raise ValueError(f"{len(msg.region_gap)} memory regions for {len(sizes)} held regions")
        sizes = np.asarray(sizes, np.int64)
        gaps = np.zeros(len(sizes), np.int64)
        gaps[:len(msg.region_gap)] = msg.region_gap
        addr = memory_addrs(gaps, sizes)
        if len(addr) and addr.min() < 0:
            raise ValueError("a packed memory region has a negative address")
        out = np.empty((len(sizes), 3), np.uint64)
        out[:, 0], out[:, 1], out[:, 2] = addr, sizes, msg.device_id
        return out
    return np.array([(r.addr, r.size, r.device_id) for r in msg.regions], dtype=np.uint64).reshape(-1, 3)


def whole_model(manifest: Manifest) -> list[Held]:
    """What an empty ``held`` list means: every tensor whole."""
    return [(i, Region()) for i in range(len(manifest.tensors))]


# Source tiers by ``Labels.tier`` (0: same host .. 3: another zone), as metric label values.
TIERS = ("same_host", "same_rack", "same_zone", "other_zone")
MAX_BATCH = 256  # messages in one Batch: an engine's workers' (a few each), a trainer group's announces
MAX_PULLED_BYTES = 1 << 62  # one report's count; a larger one is a broken or hostile client


def pulled_to_wire(by_kind: dict[tuple[int, bool], int]) -> list[pb.PulledBytes]:
    """Bytes read, by (``Labels.tier``, from an origin) -> ``PulledBytes`` messages."""
    return [pb.PulledBytes(tier=tier + 1, origin=origin, nbytes=n) for (tier, origin), n in sorted(by_kind.items())]


def pulled_from_wire(msgs: Any) -> list[tuple[str, bool, int]]:
    """(tier name, from an origin, bytes) per message; ValueError for an unknown
    tier, a count over ``MAX_PULLED_BYTES`` or more entries than tiers x roles."""
    if len(msgs) > 2 * len(TIERS):
        raise ValueError(f"{len(msgs)} pulled-bytes entries, more than {2 * len(TIERS)} (tiers x origin or relay)")
    out = []
    for m in msgs:
        if not 1 <= m.tier <= len(TIERS):
            raise ValueError(f"pulled bytes of unknown source tier {m.tier}")
        if m.nbytes > MAX_PULLED_BYTES:
            raise ValueError(f"pulled bytes {m.nbytes} over {MAX_PULLED_BYTES}")
        out.append((TIERS[m.tier - 1], m.origin, m.nbytes))
    return out


def memory_to_wire(kind: MemoryKind, regions: list[MemoryRegion], metadata: bytes) -> pb.ReplicaMemory:
    return pb.ReplicaMemory(
        kind=KIND[kind],
        regions=[pb.MemoryRegion(addr=r.addr, size=r.size, device_id=r.device_id) for r in regions],
        nixl_metadata=metadata,
    )


def _varint(n: int) -> bytes:
    if n < 0x4000:  # the common case: a tag, or a length under 16 KiB
        return bytes((n,)) if n < 0x80 else bytes((n & 0x7F | 0x80, n >> 7))
    out = bytearray()
    while n > 0x7F:
        out.append(0x80 | (n & 0x7F))
        n >>= 7
    out.append(n)
    return bytes(out)


def publish_layout(request: pb.PublishRequest) -> bytes:
    """The digest of what a Publish says about its layout (PublishRequest.layout):
    its manifest's fingerprint, chunk size, held regions and memory. The client
    and the server compute it alike from the request, so a later Publish from
    the same buffers can name it instead of sending them."""
    h = hashlib.blake2b(digest_size=16)
    fingerprint = request.manifest.fingerprint if request.HasField("manifest") else request.manifest_fingerprint
    h.update(f"{fingerprint}/{request.chunk_size}/{len(request.held)}/".encode())
    for region in request.held:
        h.update(region.SerializeToString(deterministic=True))
    h.update(b"/table/" if request.HasField("held_table") else b"/none/")
    h.update(request.held_table.SerializeToString(deterministic=True))
    h.update(b"/memory/")
    h.update(request.memory.SerializeToString(deterministic=True))
    return h.digest()


def embedded_fields(number: int, payloads: list[bytes]) -> bytes:
    """Already serialized messages as the repeated message field ``number``: a
    parser reads ``SerializeToString()`` of the rest + this as one message (the
    wire format lets fields come in any order). Lets the server keep a holder's
    serialized form instead of building and copying a message per answer."""
    tag = _varint(number << 3 | 2)  # wire type 2: length-delimited
    return b"".join(tag + _varint(len(p)) + p for p in payloads)


def status_to_wire(status: HubStatus) -> pb.DescribeResponse:
    def replica(r: ReplicaView) -> pb.ReplicaStatus:
        return pb.ReplicaStatus(
            replica_id=r.replica_id, agent_id=r.agent_id,
            state=pb.REPLICA_STATE_COMPLETE if r.complete else pb.REPLICA_STATE_FILLING,
            chunks_present=r.chunks_present, num_chunks=r.num_chunks, origin=r.origin, retained=r.retained,
            withdrawn=r.withdrawn, held_regions=r.held_regions, held_bytes=r.held_bytes, active_reads=r.active_reads,
            trainer_cut=r.trainer_cut)

    return pb.DescribeResponse(
        instance_id=status.instance_id,
        uptime_s=status.uptime_s,
        agents=[pb.AgentStatus(agent_id=a.agent_id, name=a.name, labels=labels_to_wire(a.labels),
                               reliability=reliability_to_wire(a.reliability), expires_in_s=a.expires_in_s)
                for a in status.agents],
        models=[pb.ModelStatus(model=m.model, versions=[
            pb.VersionStatus(version=v.version, visible=v.visible, fingerprint=v.fingerprint, tensors=v.tensors,
                             total_bytes=v.total_bytes, missing=v.missing, replicas=[replica(r) for r in v.replicas])
            for v in m.versions]) for m in status.models],
        leases=[pb.LeaseStatus(lease_id=x.lease_id, agent_id=x.agent_id, replica_ids=x.replica_ids,
                               expires_in_s=x.expires_in_s) for x in status.leases],
        control=pb.ControlCounters(**asdict(status.control)),
    )


def status_from_wire(msg: pb.DescribeResponse) -> HubStatus:
    """ValueError for an enum value this version does not know."""
    def replica(r: pb.ReplicaStatus) -> ReplicaView:
        return ReplicaView(
            replica_id=r.replica_id, agent_id=r.agent_id, complete=r.state == pb.REPLICA_STATE_COMPLETE,
            chunks_present=r.chunks_present, num_chunks=r.num_chunks, origin=r.origin, retained=r.retained,
            withdrawn=r.withdrawn, held_regions=r.held_regions, held_bytes=r.held_bytes, active_reads=r.active_reads,
            trainer_cut=r.trainer_cut)

    return HubStatus(
        instance_id=msg.instance_id,
        uptime_s=msg.uptime_s,
        agents=tuple(AgentView(agent_id=a.agent_id, name=a.name, labels=labels_from_wire(a.labels),
                               reliability=reliability_from_wire(a.reliability), expires_in_s=a.expires_in_s)
                     for a in msg.agents),
        models=tuple(ModelView(model=m.model, versions=tuple(
            VersionView(version=v.version, visible=v.visible, fingerprint=v.fingerprint, tensors=v.tensors,
                        total_bytes=v.total_bytes, missing=v.missing, replicas=tuple(replica(r) for r in v.replicas))
            for v in m.versions)) for m in msg.models),
        leases=tuple(LeaseView(lease_id=x.lease_id, agent_id=x.agent_id, replica_ids=tuple(x.replica_ids),
                               expires_in_s=x.expires_in_s) for x in msg.leases),
        control=ControlView(**{f: getattr(msg.control, f) for f in ControlView.__slots__ if f != "calls"},
                            calls=dict(msg.control.calls)),
    )


# The shared token travels as call metadata (server/auth.py checks it).
AUTH_METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
AUTH_SCHEME = "Bearer "


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token``; none for an empty token."""
    return ((AUTH_METADATA_KEY, AUTH_SCHEME + token),) if token else ()


# A lean holder by number, packed (pb.PackedHolders): its layout number, the
# decimal suffix of its replica id, complete or not, its CRCs as little-endian
# bytes (b"": not known), its bitmap while filling, its reads in flight.
PackedRow = tuple[int, int, bool, bytes, bytes, int]


def packed_holders_to_wire(rows: list[PackedRow]) -> pb.PackedHolders:
    msg = pb.PackedHolders()
    previous = 0
    crcs = []
    for i, (number, suffix, complete, crc, bitmap, reads) in enumerate(rows):
        msg.layout_id_step.append(number - previous)
        previous = number
        msg.replica_suffix.append(suffix)
        flags = pb.PACKED_COMPLETE if complete else pb.PACKED_NONE
        if crc:
            flags |= pb.PACKED_CRC32
            crcs.append(crc)
        if not complete:
            flags |= pb.PACKED_BITMAP
            msg.chunk_bitmap.append(bitmap)
        msg.flags.append(flags)
        if reads:
            msg.busy_row.append(i)
            msg.busy_reads.append(reads)
    msg.chunk_crc32 = b"".join(crcs)
    return msg


def packed_holders_from_wire(msg: pb.PackedHolders, chunks_of: Any) -> list[tuple[int, int, bool, Any, bytes, int]]:
    """The rows of ``msg``: (layout number, suffix, complete, CRCs as uint32 or
    None, bitmap, reads). ``chunks_of(layout number)`` is the holder's chunk
    count (from the reader's template). ValueError when the arrays disagree."""
    n = len(msg.layout_id_step)
    if len(msg.replica_suffix) != n or len(msg.flags) != n or len(msg.busy_row) != len(msg.busy_reads):
        raise ValueError(f"packed holders of unequal lengths: {n} layouts, {len(msg.replica_suffix)} suffixes, "
                         f"{len(msg.flags)} flags, {len(msg.busy_row)} busy rows, {len(msg.busy_reads)} counts")
    crcs = np.frombuffer(msg.chunk_crc32, "<u4")
    busy = dict(zip(msg.busy_row, msg.busy_reads, strict=True))
    rows = []
    number = at = bitmaps = 0
    for i in range(n):
        number += msg.layout_id_step[i]
        flags = msg.flags[i]
        crc = None
        if flags & pb.PACKED_CRC32:
            count = chunks_of(number)
            crc = crcs[at:at + count].astype(np.uint32)
            at += count
            if len(crc) != count:
                raise ValueError(f"packed holder {i}: {len(crc)} CRCs sent, its layout has {count} chunks")
        bitmap = b""
        if flags & pb.PACKED_BITMAP:
            if bitmaps >= len(msg.chunk_bitmap):
                raise ValueError(f"packed holder {i} is flagged filling but no bitmap was sent for it")
            bitmap = msg.chunk_bitmap[bitmaps]
            bitmaps += 1
        rows.append((number, msg.replica_suffix[i], bool(flags & pb.PACKED_COMPLETE), crc, bitmap, busy.get(i, 0)))
    if at != len(crcs) or bitmaps != len(msg.chunk_bitmap):
        raise ValueError(f"packed holders sent {len(crcs)} CRCs and {len(msg.chunk_bitmap)} bitmaps, "
                         f"their layouts take {at} and {bitmaps}")
    return rows
