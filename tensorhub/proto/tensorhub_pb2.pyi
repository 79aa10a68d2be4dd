from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Reliability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELIABILITY_UNSPECIFIED: _ClassVar[Reliability]
    RELIABILITY_RELIABLE: _ClassVar[Reliability]
    RELIABILITY_SPOT: _ClassVar[Reliability]

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_FILLING: _ClassVar[ReplicaState]
    REPLICA_STATE_COMPLETE: _ClassVar[ReplicaState]

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_DRAM: _ClassVar[MemoryKind]
    MEMORY_KIND_VRAM: _ClassVar[MemoryKind]

class SourceTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SOURCE_TIER_UNSPECIFIED: _ClassVar[SourceTier]
    SOURCE_TIER_SAME_HOST: _ClassVar[SourceTier]
    SOURCE_TIER_SAME_RACK: _ClassVar[SourceTier]
    SOURCE_TIER_SAME_ZONE: _ClassVar[SourceTier]
    SOURCE_TIER_OTHER_ZONE: _ClassVar[SourceTier]

class PackedFlag(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PACKED_NONE: _ClassVar[PackedFlag]
    PACKED_COMPLETE: _ClassVar[PackedFlag]
    PACKED_CRC32: _ClassVar[PackedFlag]
    PACKED_BITMAP: _ClassVar[PackedFlag]
RELIABILITY_UNSPECIFIED: Reliability
RELIABILITY_RELIABLE: Reliability
RELIABILITY_SPOT: Reliability
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_FILLING: ReplicaState
REPLICA_STATE_COMPLETE: ReplicaState
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_DRAM: MemoryKind
MEMORY_KIND_VRAM: MemoryKind
SOURCE_TIER_UNSPECIFIED: SourceTier
SOURCE_TIER_SAME_HOST: SourceTier
SOURCE_TIER_SAME_RACK: SourceTier
SOURCE_TIER_SAME_ZONE: SourceTier
SOURCE_TIER_OTHER_ZONE: SourceTier
PACKED_NONE: PackedFlag
PACKED_COMPLETE: PackedFlag
PACKED_CRC32: PackedFlag
PACKED_BITMAP: PackedFlag

class PulledBytes(_message.Message):
    __slots__ = ("tier", "origin", "nbytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    tier: SourceTier
    origin: bool
    nbytes: int
    def __init__(self, tier: _Optional[_Union[SourceTier, str]] = ..., origin: _Optional[bool] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Labels(_message.Message):
    __slots__ = ("host", "rack", "zone")
    HOST_FIELD_NUMBER: _ClassVar[int]
    RACK_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    host: str
    rack: str
    zone: str
    def __init__(self, host: _Optional[str] = ..., rack: _Optional[str] = ..., zone: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("tensors", "fingerprint")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    fingerprint: str
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class TensorRegion(_message.Message):
    __slots__ = ("tensor", "start", "stop", "flat")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    FLAT_FIELD_NUMBER: _ClassVar[int]
    tensor: int
    start: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[int]
    flat: bool
    def __init__(self, tensor: _Optional[int] = ..., start: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[int]] = ..., flat: _Optional[bool] = ...) -> None: ...

class HeldRegions(_message.Message):
    __slots__ = ("tensor_step", "cut", "flat_at", "rules", "rule_of")
    TENSOR_STEP_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    FLAT_AT_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    RULE_OF_FIELD_NUMBER: _ClassVar[int]
    tensor_step: _containers.RepeatedScalarFieldContainer[int]
    cut: _containers.RepeatedScalarFieldContainer[int]
    flat_at: _containers.RepeatedScalarFieldContainer[int]
    rules: _containers.RepeatedCompositeFieldContainer[HeldRule]
    rule_of: bytes
    def __init__(self, tensor_step: _Optional[_Iterable[int]] = ..., cut: _Optional[_Iterable[int]] = ..., flat_at: _Optional[_Iterable[int]] = ..., rules: _Optional[_Iterable[_Union[HeldRule, _Mapping]]] = ..., rule_of: _Optional[bytes] = ...) -> None: ...

class HeldRule(_message.Message):
    __slots__ = ("dim", "parts", "part")
    DIM_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    dim: int
    parts: int
    part: int
    def __init__(self, dim: _Optional[int] = ..., parts: _Optional[int] = ..., part: _Optional[int] = ...) -> None: ...

class MemoryRegion(_message.Message):
    __slots__ = ("addr", "size", "device_id")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    addr: int
    size: int
    device_id: int
    def __init__(self, addr: _Optional[int] = ..., size: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class ReplicaMemory(_message.Message):
    __slots__ = ("kind", "regions", "region_gap", "device_id", "packed", "nixl_metadata")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    REGION_GAP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    kind: MemoryKind
    regions: _containers.RepeatedCompositeFieldContainer[MemoryRegion]
    region_gap: _containers.RepeatedScalarFieldContainer[int]
    device_id: int
    packed: bool
    nixl_metadata: bytes
    def __init__(self, kind: _Optional[_Union[MemoryKind, str]] = ..., regions: _Optional[_Iterable[_Union[MemoryRegion, _Mapping]]] = ..., region_gap: _Optional[_Iterable[int]] = ..., device_id: _Optional[int] = ..., packed: _Optional[bool] = ..., nixl_metadata: _Optional[bytes] = ...) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("replica_id", "agent_id", "agent_name", "labels", "reliability", "state", "chunk_bitmap", "memory", "active_reads", "origin", "held", "chunk_size", "memory_digest", "chunk_crc32", "held_table", "deltas", "layout", "layout_id", "replica_suffix")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RELIABILITY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BITMAP_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_READS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CRC32_FIELD_NUMBER: _ClassVar[int]
    HELD_TABLE_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SUFFIX_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    agent_id: str
    agent_name: str
    labels: Labels
    reliability: Reliability
    state: ReplicaState
    chunk_bitmap: bytes
    memory: ReplicaMemory
    active_reads: int
    origin: bool
    held: _containers.RepeatedCompositeFieldContainer[TensorRegion]
    chunk_size: int
    memory_digest: bytes
    chunk_crc32: _containers.RepeatedScalarFieldContainer[int]
    held_table: HeldRegions
    deltas: _containers.RepeatedScalarFieldContainer[str]
    layout: bytes
    layout_id: int
    replica_suffix: str
    def __init__(self, replica_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., labels: _Optional[_Union[Labels, _Mapping]] = ..., reliability: _Optional[_Union[Reliability, str]] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., chunk_bitmap: _Optional[bytes] = ..., memory: _Optional[_Union[ReplicaMemory, _Mapping]] = ..., active_reads: _Optional[int] = ..., origin: _Optional[bool] = ..., held: _Optional[_Iterable[_Union[TensorRegion, _Mapping]]] = ..., chunk_size: _Optional[int] = ..., memory_digest: _Optional[bytes] = ..., chunk_crc32: _Optional[_Iterable[int]] = ..., held_table: _Optional[_Union[HeldRegions, _Mapping]] = ..., deltas: _Optional[_Iterable[str]] = ..., layout: _Optional[bytes] = ..., layout_id: _Optional[int] = ..., replica_suffix: _Optional[str] = ...) -> None: ...

class RegisterAgentRequest(_message.Message):
    __slots__ = ("agent_id", "name", "labels", "reliability")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RELIABILITY_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    name: str
    labels: Labels
    reliability: Reliability
    def __init__(self, agent_id: _Optional[str] = ..., name: _Optional[str] = ..., labels: _Optional[_Union[Labels, _Mapping]] = ..., reliability: _Optional[_Union[Reliability, str]] = ...) -> None: ...

class RegisterAgentResponse(_message.Message):
    __slots__ = ("instance_id", "agent_ttl_s", "lease_ttl_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_TTL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    agent_ttl_s: float
    lease_ttl_s: float
    def __init__(self, instance_id: _Optional[str] = ..., agent_ttl_s: _Optional[float] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("agent_id", "replica_ids")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, agent_id: _Optional[str] = ..., replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("instance_id", "agent_known", "unknown_replicas", "release_replicas")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_KNOWN_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    agent_known: bool
    unknown_replicas: _containers.RepeatedScalarFieldContainer[str]
    release_replicas: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, instance_id: _Optional[str] = ..., agent_known: _Optional[bool] = ..., unknown_replicas: _Optional[_Iterable[str]] = ..., release_replicas: _Optional[_Iterable[str]] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("agent_id", "model", "version", "manifest", "chunk_size", "memory", "state", "chunk_bitmap", "replica_id", "origin", "retained", "held", "chunk_crc32", "held_table", "manifest_fingerprint", "deltas", "layout", "trainer_cut", "checksums_from_alike")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BITMAP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CRC32_FIELD_NUMBER: _ClassVar[int]
    HELD_TABLE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRAINER_CUT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FROM_ALIKE_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    model: str
    version: int
    manifest: Manifest
    chunk_size: int
    memory: ReplicaMemory
    state: ReplicaState
    chunk_bitmap: bytes
    replica_id: str
    origin: bool
    retained: bool
    held: _containers.RepeatedCompositeFieldContainer[TensorRegion]
    chunk_crc32: _containers.RepeatedScalarFieldContainer[int]
    held_table: HeldRegions
    manifest_fingerprint: str
    deltas: _containers.RepeatedScalarFieldContainer[str]
    layout: bytes
    trainer_cut: bool
    checksums_from_alike: bool
    def __init__(self, agent_id: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[int] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., chunk_size: _Optional[int] = ..., memory: _Optional[_Union[ReplicaMemory, _Mapping]] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., chunk_bitmap: _Optional[bytes] = ..., replica_id: _Optional[str] = ..., origin: _Optional[bool] = ..., retained: _Optional[bool] = ..., held: _Optional[_Iterable[_Union[TensorRegion, _Mapping]]] = ..., chunk_crc32: _Optional[_Iterable[int]] = ..., held_table: _Optional[_Union[HeldRegions, _Mapping]] = ..., manifest_fingerprint: _Optional[str] = ..., deltas: _Optional[_Iterable[str]] = ..., layout: _Optional[bytes] = ..., trainer_cut: _Optional[bool] = ..., checksums_from_alike: _Optional[bool] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class ReportChunksRequest(_message.Message):
    __slots__ = ("agent_id", "replica_id", "chunks", "complete", "chunk_crc32")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CRC32_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    replica_id: str
    chunks: _containers.RepeatedScalarFieldContainer[int]
    complete: bool
    chunk_crc32: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, agent_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., chunks: _Optional[_Iterable[int]] = ..., complete: _Optional[bool] = ..., chunk_crc32: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportChunksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnpublishRequest(_message.Message):
    __slots__ = ("agent_id", "replica_id", "drain_timeout_s", "force")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    replica_id: str
    drain_timeout_s: float
    force: bool
    def __init__(self, agent_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., drain_timeout_s: _Optional[float] = ..., force: _Optional[bool] = ...) -> None: ...

class UnpublishResponse(_message.Message):
    __slots__ = ("drained", "leases_outstanding", "retain_required")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    LEASES_OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    RETAIN_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    leases_outstanding: int
    retain_required: bool
    def __init__(self, drained: _Optional[bool] = ..., leases_outstanding: _Optional[int] = ..., retain_required: _Optional[bool] = ...) -> None: ...

class ResolveRequest(_message.Message):
    __slots__ = ("agent_id", "model", "version", "latest", "group", "group_round", "lease", "known_fingerprint", "release_leases", "max_sources", "known_memory", "pulled", "wait_change_s", "seen_change", "known_layouts", "pulls_replayed", "pulls_planned", "members", "layout_ids", "packed_holders", "withdrawals", "named_layouts", "named_wait_s", "announces")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_ROUND_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_FIELD_NUMBER: _ClassVar[int]
    MAX_SOURCES_FIELD_NUMBER: _ClassVar[int]
    KNOWN_MEMORY_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    WAIT_CHANGE_S_FIELD_NUMBER: _ClassVar[int]
    SEEN_CHANGE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    PULLS_REPLAYED_FIELD_NUMBER: _ClassVar[int]
    PULLS_PLANNED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    WITHDRAWALS_FIELD_NUMBER: _ClassVar[int]
    NAMED_LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    NAMED_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCES_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    model: str
    version: int
    latest: bool
    group: str
    group_round: int
    lease: bool
    known_fingerprint: str
    release_leases: _containers.RepeatedScalarFieldContainer[str]
    max_sources: int
    known_memory: _containers.RepeatedScalarFieldContainer[bytes]
    pulled: _containers.RepeatedCompositeFieldContainer[PulledBytes]
    wait_change_s: float
    seen_change: int
    known_layouts: _containers.RepeatedScalarFieldContainer[bytes]
    pulls_replayed: int
    pulls_planned: int
    members: _containers.RepeatedScalarFieldContainer[str]
    layout_ids: str
    packed_holders: bool
    withdrawals: _containers.RepeatedCompositeFieldContainer[UnpublishRequest]
    named_layouts: _containers.RepeatedScalarFieldContainer[bytes]
    named_wait_s: float
    announces: _containers.RepeatedCompositeFieldContainer[PublishRequest]
    def __init__(self, agent_id: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[int] = ..., latest: _Optional[bool] = ..., group: _Optional[str] = ..., group_round: _Optional[int] = ..., lease: _Optional[bool] = ..., known_fingerprint: _Optional[str] = ..., release_leases: _Optional[_Iterable[str]] = ..., max_sources: _Optional[int] = ..., known_memory: _Optional[_Iterable[bytes]] = ..., pulled: _Optional[_Iterable[_Union[PulledBytes, _Mapping]]] = ..., wait_change_s: _Optional[float] = ..., seen_change: _Optional[int] = ..., known_layouts: _Optional[_Iterable[bytes]] = ..., pulls_replayed: _Optional[int] = ..., pulls_planned: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., layout_ids: _Optional[str] = ..., packed_holders: _Optional[bool] = ..., withdrawals: _Optional[_Iterable[_Union[UnpublishRequest, _Mapping]]] = ..., named_layouts: _Optional[_Iterable[bytes]] = ..., named_wait_s: _Optional[float] = ..., announces: _Optional[_Iterable[_Union[PublishRequest, _Mapping]]] = ...) -> None: ...

class ResolveResponse(_message.Message):
    __slots__ = ("version", "manifest", "replicas", "fingerprint", "lease_id", "lease_ttl_s", "instance_id", "change", "layout_ids", "packed", "withdrawals", "named", "pace_s", "announces")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    WITHDRAWALS_FIELD_NUMBER: _ClassVar[int]
    NAMED_FIELD_NUMBER: _ClassVar[int]
    PACE_S_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCES_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest: Manifest
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    fingerprint: str
    lease_id: str
    lease_ttl_s: float
    instance_id: str
    change: int
    layout_ids: str
    packed: PackedHolders
    withdrawals: _containers.RepeatedCompositeFieldContainer[BatchOutcome]
    named: bool
    pace_s: float
    announces: _containers.RepeatedCompositeFieldContainer[BatchOutcome]
    def __init__(self, version: _Optional[int] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ..., fingerprint: _Optional[str] = ..., lease_id: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ..., instance_id: _Optional[str] = ..., change: _Optional[int] = ..., layout_ids: _Optional[str] = ..., packed: _Optional[_Union[PackedHolders, _Mapping]] = ..., withdrawals: _Optional[_Iterable[_Union[BatchOutcome, _Mapping]]] = ..., named: _Optional[bool] = ..., pace_s: _Optional[float] = ..., announces: _Optional[_Iterable[_Union[BatchOutcome, _Mapping]]] = ...) -> None: ...

class PackedHolders(_message.Message):
    __slots__ = ("layout_id_step", "replica_suffix", "flags", "chunk_crc32", "chunk_bitmap", "busy_row", "busy_reads")
    LAYOUT_ID_STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SUFFIX_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CRC32_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BITMAP_FIELD_NUMBER: _ClassVar[int]
    BUSY_ROW_FIELD_NUMBER: _ClassVar[int]
    BUSY_READS_FIELD_NUMBER: _ClassVar[int]
    layout_id_step: _containers.RepeatedScalarFieldContainer[int]
    replica_suffix: _containers.RepeatedScalarFieldContainer[int]
    flags: _containers.RepeatedScalarFieldContainer[int]
    chunk_crc32: bytes
    chunk_bitmap: _containers.RepeatedScalarFieldContainer[bytes]
    busy_row: _containers.RepeatedScalarFieldContainer[int]
    busy_reads: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layout_id_step: _Optional[_Iterable[int]] = ..., replica_suffix: _Optional[_Iterable[int]] = ..., flags: _Optional[_Iterable[int]] = ..., chunk_crc32: _Optional[bytes] = ..., chunk_bitmap: _Optional[_Iterable[bytes]] = ..., busy_row: _Optional[_Iterable[int]] = ..., busy_reads: _Optional[_Iterable[int]] = ...) -> None: ...

class AcquireReadLeaseRequest(_message.Message):
    __slots__ = ("agent_id", "replica_ids")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, agent_id: _Optional[str] = ..., replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AcquireReadLeaseResponse(_message.Message):
    __slots__ = ("lease_id", "granted", "ttl_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    granted: _containers.RepeatedScalarFieldContainer[str]
    ttl_s: float
    def __init__(self, lease_id: _Optional[str] = ..., granted: _Optional[_Iterable[str]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class RenewReadLeaseRequest(_message.Message):
    __slots__ = ("agent_id", "lease_id")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    lease_id: str
    def __init__(self, agent_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class RenewReadLeaseResponse(_message.Message):
    __slots__ = ("ttl_s",)
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ttl_s: float
    def __init__(self, ttl_s: _Optional[float] = ...) -> None: ...

class ReleaseReadLeaseRequest(_message.Message):
    __slots__ = ("agent_id", "lease_id", "pulled")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    lease_id: str
    pulled: _containers.RepeatedCompositeFieldContainer[PulledBytes]
    def __init__(self, agent_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., pulled: _Optional[_Iterable[_Union[PulledBytes, _Mapping]]] = ...) -> None: ...

class ReleaseReadLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("publishes", "reports", "releases", "withdrawals")
    PUBLISHES_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    WITHDRAWALS_FIELD_NUMBER: _ClassVar[int]
    publishes: _containers.RepeatedCompositeFieldContainer[PublishRequest]
    reports: _containers.RepeatedCompositeFieldContainer[ReportChunksRequest]
    releases: _containers.RepeatedCompositeFieldContainer[ReleaseReadLeaseRequest]
    withdrawals: _containers.RepeatedCompositeFieldContainer[UnpublishRequest]
    def __init__(self, publishes: _Optional[_Iterable[_Union[PublishRequest, _Mapping]]] = ..., reports: _Optional[_Iterable[_Union[ReportChunksRequest, _Mapping]]] = ..., releases: _Optional[_Iterable[_Union[ReleaseReadLeaseRequest, _Mapping]]] = ..., withdrawals: _Optional[_Iterable[_Union[UnpublishRequest, _Mapping]]] = ...) -> None: ...

class BatchOutcome(_message.Message):
    __slots__ = ("code", "detail", "unpublished")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    UNPUBLISHED_FIELD_NUMBER: _ClassVar[int]
    code: str
    detail: str
    unpublished: UnpublishResponse
    def __init__(self, code: _Optional[str] = ..., detail: _Optional[str] = ..., unpublished: _Optional[_Union[UnpublishResponse, _Mapping]] = ...) -> None: ...

class BatchResponse(_message.Message):
    __slots__ = ("publishes", "reports", "releases", "withdrawals")
    PUBLISHES_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    WITHDRAWALS_FIELD_NUMBER: _ClassVar[int]
    publishes: _containers.RepeatedCompositeFieldContainer[BatchOutcome]
    reports: _containers.RepeatedCompositeFieldContainer[BatchOutcome]
    releases: _containers.RepeatedCompositeFieldContainer[BatchOutcome]
    withdrawals: _containers.RepeatedCompositeFieldContainer[BatchOutcome]
    def __init__(self, publishes: _Optional[_Iterable[_Union[BatchOutcome, _Mapping]]] = ..., reports: _Optional[_Iterable[_Union[BatchOutcome, _Mapping]]] = ..., releases: _Optional[_Iterable[_Union[BatchOutcome, _Mapping]]] = ..., withdrawals: _Optional[_Iterable[_Union[BatchOutcome, _Mapping]]] = ...) -> None: ...

class ReportLostRequest(_message.Message):
    __slots__ = ("agent_id", "replica_id", "reason", "stalled")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    replica_id: str
    reason: str
    stalled: bool
    def __init__(self, agent_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., reason: _Optional[str] = ..., stalled: _Optional[bool] = ...) -> None: ...

class ReportLostResponse(_message.Message):
    __slots__ = ("kept",)
    KEPT_FIELD_NUMBER: _ClassVar[int]
    kept: bool
    def __init__(self, kept: _Optional[bool] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class VersionSummary(_message.Message):
    __slots__ = ("version", "complete_replicas", "filling_replicas", "total_bytes", "visible")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    FILLING_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_FIELD_NUMBER: _ClassVar[int]
    version: int
    complete_replicas: int
    filling_replicas: int
    total_bytes: int
    visible: bool
    def __init__(self, version: _Optional[int] = ..., complete_replicas: _Optional[int] = ..., filling_replicas: _Optional[int] = ..., total_bytes: _Optional[int] = ..., visible: _Optional[bool] = ...) -> None: ...

class WaitForVersionRequest(_message.Message):
    __slots__ = ("model", "at_least", "timeout_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    AT_LEAST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    at_least: int
    timeout_s: float
    def __init__(self, model: _Optional[str] = ..., at_least: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WaitForVersionResponse(_message.Message):
    __slots__ = ("found", "version")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    found: bool
    version: int
    def __init__(self, found: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionSummary]
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionSummary, _Mapping]]] = ...) -> None: ...

class ReaderCutsRequest(_message.Message):
    __slots__ = ("model", "fingerprint", "max_cuts")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CUTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    fingerprint: str
    max_cuts: int
    def __init__(self, model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., max_cuts: _Optional[int] = ...) -> None: ...

class ReaderCut(_message.Message):
    __slots__ = ("held", "whole", "readers")
    HELD_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    READERS_FIELD_NUMBER: _ClassVar[int]
    held: HeldRegions
    whole: bool
    readers: int
    def __init__(self, held: _Optional[_Union[HeldRegions, _Mapping]] = ..., whole: _Optional[bool] = ..., readers: _Optional[int] = ...) -> None: ...

class ReaderCutsResponse(_message.Message):
    __slots__ = ("found", "version", "cuts", "more")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CUTS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    version: int
    cuts: _containers.RepeatedCompositeFieldContainer[ReaderCut]
    more: bool
    def __init__(self, found: _Optional[bool] = ..., version: _Optional[int] = ..., cuts: _Optional[_Iterable[_Union[ReaderCut, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class AgentStatus(_message.Message):
    __slots__ = ("agent_id", "name", "labels", "reliability", "expires_in_s")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RELIABILITY_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    name: str
    labels: Labels
    reliability: Reliability
    expires_in_s: float
    def __init__(self, agent_id: _Optional[str] = ..., name: _Optional[str] = ..., labels: _Optional[_Union[Labels, _Mapping]] = ..., reliability: _Optional[_Union[Reliability, str]] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_id", "agent_id", "state", "chunks_present", "num_chunks", "origin", "retained", "withdrawn", "held_regions", "held_bytes", "active_reads", "trainer_cut")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_PRESENT_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    WITHDRAWN_FIELD_NUMBER: _ClassVar[int]
    HELD_REGIONS_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_READS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_CUT_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    agent_id: str
    state: ReplicaState
    chunks_present: int
    num_chunks: int
    origin: bool
    retained: bool
    withdrawn: bool
    held_regions: int
    held_bytes: int
    active_reads: int
    trainer_cut: bool
    def __init__(self, replica_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., chunks_present: _Optional[int] = ..., num_chunks: _Optional[int] = ..., origin: _Optional[bool] = ..., retained: _Optional[bool] = ..., withdrawn: _Optional[bool] = ..., held_regions: _Optional[int] = ..., held_bytes: _Optional[int] = ..., active_reads: _Optional[int] = ..., trainer_cut: _Optional[bool] = ...) -> None: ...

class VersionStatus(_message.Message):
    __slots__ = ("version", "visible", "fingerprint", "tensors", "total_bytes", "missing", "replicas")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    version: int
    visible: bool
    fingerprint: str
    tensors: int
    total_bytes: int
    missing: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    def __init__(self, version: _Optional[int] = ..., visible: _Optional[bool] = ..., fingerprint: _Optional[str] = ..., tensors: _Optional[int] = ..., total_bytes: _Optional[int] = ..., missing: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ...) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("model", "versions")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    versions: _containers.RepeatedCompositeFieldContainer[VersionStatus]
    def __init__(self, model: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[VersionStatus, _Mapping]]] = ...) -> None: ...

class LeaseStatus(_message.Message):
    __slots__ = ("lease_id", "agent_id", "replica_ids", "expires_in_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    agent_id: str
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    expires_in_s: float
    def __init__(self, lease_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., replica_ids: _Optional[_Iterable[str]] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("instance_id", "uptime_s", "agents", "models", "leases", "control")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    uptime_s: float
    agents: _containers.RepeatedCompositeFieldContainer[AgentStatus]
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseStatus]
    control: ControlCounters
    def __init__(self, instance_id: _Optional[str] = ..., uptime_s: _Optional[float] = ..., agents: _Optional[_Iterable[_Union[AgentStatus, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ..., leases: _Optional[_Iterable[_Union[LeaseStatus, _Mapping]]] = ..., control: _Optional[_Union[ControlCounters, _Mapping]] = ...) -> None: ...

class ControlCounters(_message.Message):
    __slots__ = ("resolves", "holders_full", "holders_lean", "answer_bytes", "pulls_replayed", "pulls_planned", "publishes_full", "publishes_lean", "answers_shared", "calls", "answers_named", "named_missed", "announces_ahead")
    class CallsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RESOLVES_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FULL_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_LEAN_FIELD_NUMBER: _ClassVar[int]
    ANSWER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PULLS_REPLAYED_FIELD_NUMBER: _ClassVar[int]
    PULLS_PLANNED_FIELD_NUMBER: _ClassVar[int]
    PUBLISHES_FULL_FIELD_NUMBER: _ClassVar[int]
    PUBLISHES_LEAN_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_SHARED_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_NAMED_FIELD_NUMBER: _ClassVar[int]
    NAMED_MISSED_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCES_AHEAD_FIELD_NUMBER: _ClassVar[int]
    resolves: int
    holders_full: int
    holders_lean: int
    answer_bytes: int
    pulls_replayed: int
    pulls_planned: int
    publishes_full: int
    publishes_lean: int
    answers_shared: int
    calls: _containers.ScalarMap[str, int]
    answers_named: int
    named_missed: int
    announces_ahead: int
    def __init__(self, resolves: _Optional[int] = ..., holders_full: _Optional[int] = ..., holders_lean: _Optional[int] = ..., answer_bytes: _Optional[int] = ..., pulls_replayed: _Optional[int] = ..., pulls_planned: _Optional[int] = ..., publishes_full: _Optional[int] = ..., publishes_lean: _Optional[int] = ..., answers_shared: _Optional[int] = ..., calls: _Optional[_Mapping[str, int]] = ..., answers_named: _Optional[int] = ..., named_missed: _Optional[int] = ..., announces_ahead: _Optional[int] = ...) -> None: ...
