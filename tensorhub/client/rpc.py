"""The reference server's client stub: plain Python in, frozen dataclasses out.
Protobuf and grpc stay inside this module; gRPC failures become TensorHub errors."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from tensorhub.client.config import HubConfig
from tensorhub.client.lru import Lru
from tensorhub.errors import (
    AlreadyPublished,
    InvalidRequest,
    PermissionDenied,
    ServerUnavailable,
    ShareUnusable,
    TensorHubError,
    VersionNotFound,
)
from tensorhub.manifest import Manifest
from tensorhub.planner import Source
from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc
from tensorhub.proto import wire
from tensorhub.regions import Region
from tensorhub.regiontable import RegionTable, memory_addrs, shapes_of
from tensorhub.status import HubStatus
from tensorhub.topology import Labels, Reliability
from tensorhub.transport import MemoryKind, MemoryRegion

T = TypeVar("T")
log = logging.getLogger(__name__)
MAX_BATCH = wire.MAX_BATCH  # messages the server takes in one ``batch``
_MANIFESTS_CACHED = 16
_LAYOUTS_SENT = 64  # publish layouts remembered: a few models' and versions' buffers
_SHARED_KEPT = 64  # leases of shared group answers remembered (``_shared_leases``)
_LAYOUT_NUMBERS_KEPT = 16384  # layout numbers remembered (every model's holders' layouts, and some)
_LAYOUTS_KNOWN = 1024  # holder layouts listed per model in a Resolve (the server takes 4096)
_HELD_CACHED = 64  # holders' held tables (a 16-rank trainer, relays, two versions)
_RELEASE_DELAY_S = 0.005
# A holder's memory as the server sent it: kind, the regions (one per held
# region: (regions x 3) addr/nbytes/device, or packed as address gaps and one
# device, whose sizes are the held regions'), NIXL metadata.
_Memory = tuple[MemoryKind, "np.ndarray | tuple[np.ndarray, int]", bytes]

# Retry idempotent calls while the server restarts or briefly refuses.
_SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": "tensorhub.v1.ReferenceService"}],
        "retryPolicy": {
            "maxAttempts": 5,
            "initialBackoff": "0.05s",
            "maxBackoff": "1s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }]
})


class AgentUnknown(TensorHubError):
    """The server does not know this agent (it restarted or the agent expired)."""


class ReplicaUnknown(TensorHubError):
    """The server does not know this replica (it restarted, or dropped it with its expired agent)."""


@dataclass(frozen=True, slots=True)
class RemoteReplica:
    """A replica a reader may read: what the planner ranks, and how to read it."""

    source: Source
    agent_id: str
    kind: MemoryKind
    held: tuple[tuple[int, Region], ...]  # (manifest tensor index, region), in memory order
    regions: np.ndarray  # (held regions x 3): addr, nbytes, device id
    metadata: bytes
    chunk_size: int  # of the replica's own bytes: the unit of its bitmap
    bitmap: bytes = b""  # chunks present while filling (bit i, LSB first); unused when complete
    chunk_crc32: np.ndarray | None = None  # uint32 per own chunk (tensorhub.integrity); None: cannot be verified
    deltas: tuple[str, ...] = ()  # delta models holding its changes from an earlier version (tensorhub.delta)
    # A digest of what a reader's plans of it depend on: its held regions, its
    # memory regions and chunk size (``plancache``). Equal keys, equal layouts,
    # whatever the version: b"" (a replica made by hand) is known by its id.
    layout_key: bytes = b""
    lean: bool = False  # sent lean: its layout was known from an earlier answer (nothing decoded)
    # The server's ReplicaInfo.layout of it (b"": made by hand), which stays put from
    # one version to the next: what a reader names to read the next version from it
    # again (``ResolveRequest.named_layouts``).
    wire_layout: bytes = b""


@dataclass(frozen=True, slots=True)
class Resolved:
    model: str
    version: int
    manifest: Manifest
    replicas: tuple[RemoteReplica, ...]
    lease_id: str = ""  # a read lease on every replica, when asked for
    lease_ttl_s: float = 0.0
    lease_sent_at: float = 0.0  # time.monotonic() before the request left
    instance_id: str = ""  # the server's instance that answered (empty: a server older than this client)
    change: int = 0  # the version's change counter this answer reflects (a long-poll's ``seen_change``)
    # The answer as sent, for the other members of the group it was resolved
    # for (``ReferenceClient.resolve(members=)``; ``adopt`` on their side).
    shared: bytes = field(default=b"", repr=False)
    # Per withdrawal sent with the resolve (``resolve(withdrawals=)``), what
    # ``withdraw_batch`` answers for it.
    withdrawn: tuple = ()
    # Per announce sent ahead with the resolve (``resolve(announces=)``): None
    # where the server took it, else its typed error.
    announced: tuple = ()
    named: bool = False  # the replicas are exactly those of ``resolve(named_layouts=)``
    pace_s: float = 0.0  # the server's pace for this version's pulls whose news flows (``pacing.server_pace_s``)


@dataclass(frozen=True, slots=True)
class ReadSet:
    """The regions some readers hold, (manifest tensor index, region) in their
    memory order, and how many relays hold exactly these."""

    held: tuple[tuple[int, Region], ...]
    readers: int


@dataclass(frozen=True, slots=True)
class ReaderCuts:
    """The distinct read sets of the relays of ``version`` (ReaderCuts RPC),
    most readers first; ``more``: the server had more than it sent."""

    version: int
    read_sets: tuple[ReadSet, ...]
    more: bool = False


@dataclass(frozen=True, slots=True)
class VersionInfo:
    version: int
    complete_replicas: int
    filling_replicas: int
    total_bytes: int
    visible: bool  # complete replicas cover every element: listed, latest, pullable


class ReferenceClient:
    """Thread-safe: one channel, shared by every thread of the process."""

    def __init__(self, address: str, *, timeout_s: float = 10.0, token: str = "", tls_root_cert: str = "",
                 tls_server_name: str = "") -> None:
        """``token``: the server's shared token, sent with every call. ``tls_root_cert``:
        PEM of the CA the server's certificate is checked against; set, the channel uses TLS."""
        self.address = address
        self.timeout_s = timeout_s
        # Every call carries the token (server/auth.py checks it); an empty tuple sends nothing.
        self._metadata = wire.auth_metadata(token)
        options = [
            ("grpc.service_config", _SERVICE_CONFIG),
            ("grpc.enable_retries", 1),
            ("grpc.max_receive_message_length", 16 << 20),
            ("grpc.max_send_message_length", 16 << 20),
            # Reconnect to a restarted server within a second of it coming back.
            # gRPC's default backoff grows 1 s x1.6 per failed attempt (to 120 s),
            # so a server down for a few seconds stayed out of reach seconds after
            # its return: its holders re-announced late and pulls waited for them
            # (puller._RESETTLE_S).
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        if tls_root_cert:
            try:
                roots = Path(tls_root_cert).read_bytes()
            except OSError as e:
                raise ValueError(f"cannot read the TLS root certificate {tls_root_cert!r}: {e}") from None
            self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(roots), options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.ReferenceServiceStub(self._channel)
        # One thread for calls nobody waits on (lease releases): cheaper than
        # grpc's future(), which starts a thread per call.
        self._background = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensorhub-rpc")
        # Manifests by fingerprint: the server omits one the client already has.
        self._manifests: dict[str, Manifest] = {}
        self._manifests_sent: dict[str, None] = {}  # fingerprints this server took a publish of (LRU)
        self._layouts_sent: dict[tuple[str, bytes], None] = {}  # (agent, wire.publish_layout) this server took
        # Per model, by ReplicaInfo.layout, a holder as an earlier answer gave it:
        # the server sends a holder whose layout the client lists lean (its id,
        # checksums, state), rebound here to that holder (the steady state).
        self._layouts: dict[str, dict[bytes, RemoteReplica]] = {}
        # The server's numbers of holder layouts (ReplicaInfo.layout_id) under its numbering
        # ``_numbering``: lean holders come by number once this client has the numbers.
        self._numbering = ""
        self._layout_numbers: dict[int, bytes] = {}
        self._pull_paths = [0, 0]  # finished pulls (replayed, planned) not reported yet
        self._last_fingerprint: dict[str, str] = {}
        # Per model, the memory of the last answer's holders by digest: the server
        # leaves out what the client has (a re-resolve during a pull then costs a
        # few hundred bytes a holder, not its NIXL metadata). Replaced, never mutated.
        self._memories: dict[str, dict[bytes, _Memory]] = {}
        self._cache_lock = threading.Lock()
        # Held tables parsed, by their wire bytes: a holder's regions, resolved
        # again and again (every refresh of every pull), are parsed once.
        self._held: Lru[tuple[RegionTable, tuple[tuple[int, Region], ...]]] = Lru(_HELD_CACHED)
        self._releases: list[str] = []  # leases to release, not yet sent
        # Leases of answers shared in a group (``resolve(members=)``, ``adopt``):
        # the member that resolved releases them once every member is done, so a
        # pull's own release of them is dropped (the newest _SHARED_KEPT).
        self._shared_leases: dict[str, None] = {}
        # Bytes of finished pulls by (Labels.tier, from an origin), not yet sent:
        # they ride on the next lease release or resolve (the server's metrics).
        self._pulled: dict[tuple[int, bool], int] = {}
        # The server instance that answered this client's last Resolve, and when it
        # was sent: a Resolve refreshes the agent, so a heartbeat may be skipped.
        self.last_resolve: tuple[str, float] = ("", -float("inf"))

    @classmethod
    def for_hub(cls, address: str, config: HubConfig) -> ReferenceClient:
        """The client a Hub with ``config`` uses: its timeout, token and TLS settings."""
        return cls(address, timeout_s=config.rpc_timeout_s, token=config.resolved_token(),
                   tls_root_cert=config.tls_root_cert, tls_server_name=config.tls_server_name)

    def close(self) -> None:
        self._background.shutdown(wait=True)
        self._channel.close()

    def _call(self, method: Callable[..., T], request: Any, *, timeout: float | None = None,
              not_found: Callable[[str], Exception] | None = None) -> T:
        try:
            return method(request, timeout=timeout or self.timeout_s, wait_for_ready=False, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._translate(e, not_found) from None

    def _translate(self, e: grpc.RpcError, not_found: Callable[[str], Exception] | None) -> Exception:
        return self._error(e.code(), e.details() or "", not_found)

    def _error(self, code: grpc.StatusCode, detail: str, not_found: Callable[[str], Exception] | None) -> Exception:
        """The typed error of a call the server answered ``code`` (alone or in a Batch)."""
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            # gRPC's wording when no connection could be made: the request was never sent.
            never_sent = code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in detail
            return ServerUnavailable(self.address, f"{code.name}: {detail}", maybe_applied=not never_sent)
        if code == grpc.StatusCode.NOT_FOUND and not_found is not None:
            return not_found(detail)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return PermissionDenied(
                f"reference server at {self.address} refused this client ({detail}); give it the server's token: "
                "HubConfig(token=...) or the TENSORHUB_TOKEN environment variable")
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return PermissionDenied(f"reference server at {self.address} refused the call: {detail}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidRequest(detail)
        if code == grpc.StatusCode.ALREADY_EXISTS:
            return AlreadyPublished(detail)
        if code == grpc.StatusCode.FAILED_PRECONDITION and "not registered" in detail:
            return AgentUnknown(detail)
        return TensorHubError(f"reference server at {self.address} answered {code.name}: {detail}")

    # ---------------------------------------------------------------- agents

    def register_agent(self, agent_id: str, name: str, labels: Labels, reliability: Reliability) -> tuple[str, float]:
        """Returns the server's instance id and its read-lease TTL."""
        resp = self._call(self._stub.RegisterAgent, pb.RegisterAgentRequest(
            agent_id=agent_id,
            name=name,
            labels=wire.labels_to_wire(labels),
            reliability=wire.reliability_to_wire(reliability),
        ))
        return resp.instance_id, resp.lease_ttl_s

    def heartbeat(self, agent_id: str, replica_ids: list[str], *,
                  timeout: float | None = None) -> tuple[str, bool, list[str], list[str]]:
        """Returns (server instance id, whether it knows the agent, replicas it
        lost, retained copies it no longer needs)."""
        resp = self._call(self._stub.Heartbeat, pb.HeartbeatRequest(agent_id=agent_id, replica_ids=replica_ids),
                          timeout=timeout)
        return resp.instance_id, resp.agent_known, list(resp.unknown_replicas), list(resp.release_replicas)

    # ---------------------------------------------------------------- holders

    def publish(self, *, agent_id: str, replica_id: str, model: str, version: int, manifest: Manifest,
                held: list[tuple[int, Region]], chunk_size: int, kind: MemoryKind, regions: list[MemoryRegion],
                metadata: bytes, complete: bool, bitmap: bytes, origin: bool, retained: bool = False,
                chunk_crc32: np.ndarray | None = None, deltas: Sequence[str] = (), trainer_cut: bool = False) -> None:
        """``held``: (tensor index, region) per memory region; empty: every tensor whole.
        ``trainer_cut``: a trainer rank's copy of its readers' cut, beside its shards.
        ``deltas``: delta models of this version that hold its changes (tensorhub.delta).
        ``chunk_crc32``: CRC-32 of each of the replica's chunks, for its readers to check.
        Both go packed (``HeldRegions``, memory as address gaps) where the
        regions lie on one device: a few bytes per region for the server to keep."""
        request = self._publish_request(
            agent_id=agent_id, replica_id=replica_id, model=model, version=version, manifest=manifest, held=held,
            chunk_size=chunk_size, kind=kind, regions=regions, metadata=metadata, complete=complete, bitmap=bitmap,
            origin=origin, retained=retained, chunk_crc32=chunk_crc32, deltas=deltas, trainer_cut=trainer_cut)
        # A manifest this server acknowledged goes by its fingerprint (megabytes
        # of names for 10^5 tensors); the server says when it does not have it.
        fingerprint = manifest.fingerprint
        if fingerprint in self._manifests_sent:
            request.manifest_fingerprint = fingerprint
            try:
                self._publish_lean(request, model, version)
                return
            except TensorHubError as e:
                if "manifest unknown" not in str(e):
                    raise
            request.ClearField("manifest_fingerprint")
        request.manifest.CopyFrom(wire.manifest_to_wire(manifest))
        self._publish_lean(request, model, version)
        self._remember_sent(fingerprint=fingerprint)

    def group_publish(self, *, lean_only: bool = False, **publish: Any) -> bytes:
        """What ``publish(**publish)`` would send, encoded for another member of
        the group to send in one Batch (``batch(publishes=)``): lean where this
        server took a publish of the same layout from this client; else whole
        but naming its manifest by fingerprint (a relay's version was published
        with its manifest: a server without it refuses that message alone, and
        the member publishes on its own). ``lean_only``: b"" rather than whole.
        Once the server took it, ``group_publish_taken``."""
        request = self._publish_request(**publish)
        fingerprint = publish["manifest"].fingerprint
        request.manifest_fingerprint = fingerprint
        layout = wire.publish_layout(request)
        with self._cache_lock:
            lean = fingerprint in self._manifests_sent and (request.agent_id, layout) in self._layouts_sent
        if not lean:
            return b"" if lean_only else request.SerializeToString()
        for name in ("held", "held_table", "memory"):
            request.ClearField(name)
        request.layout = layout
        return request.SerializeToString()

    def ahead_publish(self, *, checksums_from_alike: bool = False, **publish: Any) -> bytes:
        """``group_publish`` of a FILLING replica sent ahead with its group's
        resolve (``resolve(announces=)``), before its pull has an answer: lean
        only (b"" where this server never took the layout), with
        ``checksums_from_alike`` where the server takes its chunk checksums
        from the version's complete holder cut alike (the reader would take
        them from that holder's answer)."""
        data = self.group_publish(lean_only=True, **publish)
        if not data or not checksums_from_alike:
            return data
        request = pb.PublishRequest.FromString(data)
        request.ClearField("chunk_crc32")
        request.checksums_from_alike = True
        return request.SerializeToString()

    @staticmethod
    def same_announce(a: bytes, b: bytes) -> bool:
        """Whether two ``ahead_publish`` messages announce the same replica, their
        checksums' values and bitmaps aside."""
        requests = [pb.PublishRequest.FromString(m) for m in (a, b)]
        for request in requests:
            request.ClearField("chunk_crc32")
            request.ClearField("chunk_bitmap")
        return requests[0].SerializeToString(deterministic=True) == requests[1].SerializeToString(deterministic=True)

    def group_publish_taken(self, data: bytes) -> None:
        """The server took ``group_publish``'s ``data``: a whole one makes later
        publishes of its layout go lean, as ``publish`` does."""
        request = pb.PublishRequest.FromString(data)
        if request.layout:
            return
        self._remember_sent(fingerprint=request.manifest_fingerprint,
                            layout_key=(request.agent_id, wire.publish_layout(request)))

    def _remember_sent(self, *, fingerprint: str = "", layout_key: tuple[str, bytes] | None = None) -> None:
        """What this server took from this client (a manifest, a publish's layout): later publishes go lean."""
        with self._cache_lock:
            for kept, key, bound in ((self._manifests_sent, fingerprint or None, _MANIFESTS_CACHED),
                                     (self._layouts_sent, layout_key, _LAYOUTS_SENT)):
                if key is not None:
                    kept[key] = None
                    while len(kept) > bound:
                        kept.pop(next(iter(kept)))

    @staticmethod
    def _publish_request(*, agent_id: str, replica_id: str, model: str, version: int, manifest: Manifest,
                         held: list[tuple[int, Region]], chunk_size: int, kind: MemoryKind,
                         regions: list[MemoryRegion], metadata: bytes, complete: bool, bitmap: bytes, origin: bool,
                         retained: bool = False, chunk_crc32: np.ndarray | None = None, deltas: Sequence[str] = (),
                         trainer_cut: bool = False) -> pb.PublishRequest:
        """The whole PublishRequest of ``publish``, its manifest left out."""
        shapes = shapes_of(manifest)
        if regions and all(r.device_id == regions[0].device_id for r in regions):
            memory = wire.memory_packed_to_wire(kind, np.array([r.addr for r in regions], np.int64),
                                                np.array([r.size for r in regions], np.int64),
                                                regions[0].device_id, metadata)
        else:
            memory = wire.memory_to_wire(kind, regions, metadata)
        request = pb.PublishRequest(
            agent_id=agent_id,
            replica_id=replica_id,
            model=model,
            version=version,
            held_table=wire.held_to_wire(RegionTable.from_held(held, shapes), shapes) if held else None,
            chunk_size=chunk_size,
            memory=memory,
            state=pb.REPLICA_STATE_COMPLETE if complete else pb.REPLICA_STATE_FILLING,
            chunk_bitmap=bytes(bitmap),
            origin=origin,
            retained=retained,
            chunk_crc32=[] if chunk_crc32 is None else chunk_crc32.tolist(),
            deltas=list(deltas),
            trainer_cut=trainer_cut,
        )
        return request

    def _publish_lean(self, request: pb.PublishRequest, model: str, version: int) -> None:
        """Send ``request``, naming its layout instead of its regions and memory
        when this server took a publish of the same layout from this client
        (``wire.publish_layout``: a trainer publishing every step from the same
        buffers); whole when it did not, or no longer has it."""
        layout = wire.publish_layout(request)
        key = (request.agent_id, layout)
        if key in self._layouts_sent:
            lean = pb.PublishRequest()
            lean.CopyFrom(request)
            for name in ("held", "held_table", "memory"):
                lean.ClearField(name)
            lean.layout = layout
            try:
                self._call(self._stub.Publish, lean, not_found=lambda d: VersionNotFound(model, version, d))
                return
            except TensorHubError as e:
                if "layout unknown" not in str(e):
                    raise
        self._call(self._stub.Publish, request, not_found=lambda d: VersionNotFound(model, version, d))
        self._remember_sent(layout_key=key)

    def report_chunks(self, agent_id: str, replica_id: str, chunks: list[int], complete: bool,
                      chunk_crc32: list[int] | None = None) -> None:
        """``chunk_crc32``: the CRC-32 of each of ``chunks``, for a replica that
        computes its checksums as it fills."""
        self._call(self._stub.ReportChunks, pb.ReportChunksRequest(
            agent_id=agent_id, replica_id=replica_id, chunks=chunks, complete=complete,
            chunk_crc32=chunk_crc32 or []),
            not_found=lambda d: ReplicaUnknown(d))

    # ---------------------------------------------------------------- a group's messages in one

    @staticmethod
    def complete_report(agent_id: str, replica_id: str, chunks: list[int],
                        chunk_crc32: list[int] | None = None) -> bytes:
        """A serving pull's last report (``complete``), encoded for another
        member of its group to send in one ``batch`` with the others'."""
        return pb.ReportChunksRequest(agent_id=agent_id, replica_id=replica_id, chunks=chunks, complete=True,
                                      chunk_crc32=chunk_crc32 or []).SerializeToString()

    def take_pulled_report(self, agent_id: str) -> bytes:
        """The bytes of finished pulls not reported yet (``report_pulled``),
        encoded for a ``batch``, and taken: b"" when there are none."""
        pulled = self._take_pulled()
        if not pulled:
            return b""
        return pb.ReleaseReadLeaseRequest(agent_id=agent_id, pulled=pulled).SerializeToString()

    def batch(self, agent_id: str, *, publishes: Sequence[bytes] = (), reports: Sequence[bytes] = (),
              releases: Sequence[bytes] = (), lease_id: str = ""
              ) -> tuple[list[Exception | None], list[Exception | None], list[Exception | None]]:
        """Send the group's ``publishes`` (``group_publish``), ``reports``
        (``complete_report``) and ``releases`` (``take_pulled_report``), and
        this agent's release of ``lease_id``, in one call: the server handles
        each as it would alone. Returns the typed error of each publish, report
        and release (None: taken), in order; raises only what the call as a
        whole met (``ServerUnavailable``, ...)."""
        request = pb.BatchRequest(publishes=[pb.PublishRequest.FromString(p) for p in publishes],
                                  reports=[pb.ReportChunksRequest.FromString(r) for r in reports],
                                  releases=[pb.ReleaseReadLeaseRequest.FromString(r) for r in releases])
        if lease_id:
            with self._cache_lock:
                self._shared_leases.pop(lease_id, None)
            request.releases.append(pb.ReleaseReadLeaseRequest(agent_id=agent_id, lease_id=lease_id))
        answer = self._call(self._stub.Batch, request)
        sent = (len(request.publishes), len(request.reports), len(request.releases))
        if (len(answer.publishes), len(answer.reports), len(answer.releases)) != sent:
            raise TensorHubError(f"reference server at {self.address} answered {len(answer.publishes)} publishes, "
                                 f"{len(answer.reports)} reports and {len(answer.releases)} releases of a Batch of "
                                 f"{sent[0]}, {sent[1]} and {sent[2]}")

        errors = self._outcome_errors
        return (errors(answer.publishes, TensorHubError), errors(answer.reports, ReplicaUnknown),
                errors(answer.releases, TensorHubError)[:len(releases)])

    def _outcome_errors(self, outcomes: Any, not_found: Callable[[str], Exception]) -> list[Exception | None]:
        """Per ``BatchOutcome`` (a Batch's, a Resolve's announces), the typed error it answered, or None: taken."""
        return [self._error(getattr(grpc.StatusCode, o.code, grpc.StatusCode.UNKNOWN), o.detail, not_found)
                if o.code else None for o in outcomes]

    @staticmethod
    def withdrawal(agent_id: str, replica_id: str, drain_timeout_s: float, *, force: bool = False) -> bytes:
        """``unpublish``'s message, encoded for ``withdraw_batch`` (another member of a group may send it)."""
        return pb.UnpublishRequest(agent_id=agent_id, replica_id=replica_id, drain_timeout_s=drain_timeout_s,
                                   force=force).SerializeToString()

    def withdraw_batch(self, withdrawals: Sequence[bytes], *, call_slack_s: float | None = None
                       ) -> list[tuple[bool, int, bool] | Exception]:
        """Send ``withdrawals`` (``withdrawal``) in one Batch; the server waits
        for their drains together. Per withdrawal what ``unpublish`` would
        return (an unknown replica counts as drained), or its typed error;
        raises only what the call as a whole met (``ServerUnavailable``, ...)."""
        request = pb.BatchRequest(withdrawals=[pb.UnpublishRequest.FromString(w) for w in withdrawals])
        drain_s = max((w.drain_timeout_s for w in request.withdrawals), default=0.0)
        answer = self._call(self._stub.Batch, request,
                            timeout=drain_s + (self.timeout_s if call_slack_s is None else call_slack_s))
        if len(answer.withdrawals) != len(request.withdrawals):
            raise TensorHubError(f"reference server at {self.address} answered {len(answer.withdrawals)} "
                                 f"withdrawals of a Batch of {len(request.withdrawals)}")
        return self._withdrawal_outcomes(answer.withdrawals)

    def _withdrawal_outcomes(self, outcomes: Sequence[pb.BatchOutcome]) -> list[tuple[bool, int, bool] | Exception]:
        """Per withdrawal sent together, what ``unpublish`` would return, or its typed error."""
        out: list[tuple[bool, int, bool] | Exception] = []
        for o in outcomes:
            if o.code == grpc.StatusCode.NOT_FOUND.name:
                out.append((True, 0, False))
            elif o.code:
                out.append(self._error(getattr(grpc.StatusCode, o.code, grpc.StatusCode.UNKNOWN), o.detail,
                                       TensorHubError))
            else:
                u = o.unpublished
                out.append((u.drained, u.leases_outstanding, u.retain_required))
        return out

    def unpublish(self, agent_id: str, replica_id: str, drain_timeout_s: float, *,
                  force: bool = False, call_slack_s: float | None = None) -> tuple[bool, int, bool]:
        """Withdraw a replica and wait on the server for its readers to finish.
        Returns (drained, leases still outstanding, retain_required); with
        retain_required nothing was withdrawn. An unknown replica counts as drained.
        The call gives up ``call_slack_s`` (default: the RPC timeout) after the drain's end."""
        try:
            resp = self._call(
                self._stub.Unpublish,
                pb.UnpublishRequest(agent_id=agent_id, replica_id=replica_id, drain_timeout_s=drain_timeout_s,
                                    force=force),
                timeout=drain_timeout_s + (self.timeout_s if call_slack_s is None else call_slack_s),
                not_found=lambda d: KeyError(d),
            )
        except KeyError:
            return True, 0, False
        return resp.drained, resp.leases_outstanding, resp.retain_required

    # ---------------------------------------------------------------- readers

    def resolve(self, agent_id: str, model: str, version: int | None, *, group: str = "",
                group_round: int = 0, lease: bool = False, wait_change_s: float = 0.0,
                seen_change: int = 0, members: Sequence[str] = (), withdrawals: Sequence[bytes] = (),
                named_layouts: Sequence[bytes] = (), named_wait_s: float = 0.0,
                announces: Sequence[bytes] = ()) -> Resolved:
        """Which version to read and who holds it. ``lease=True`` also leases every
        replica returned, saving a round trip on small pulls. ``wait_change_s``: a
        long poll; the server answers once the version's holders changed since the
        answer whose ``change`` was ``seen_change``, or after that long.
        ``members``: the other members of ``group`` this answer is for; the
        answer's ``shared`` bytes go to them (``adopt``), and its lease is
        theirs too, released by ``release_shared`` once all are done.
        ``withdrawals``: ``withdrawal`` messages the server handles after the
        answer, as ``withdraw_batch`` would (the answer then waits for their
        drains); their outcomes in ``Resolved.withdrawn``. ``named_layouts``: the
        layouts (``RemoteReplica.wire_layout``) of the holders an earlier pull read
        from: the answer names their replicas of the version alone when all are
        there (``Resolved.named``), waiting up to ``named_wait_s`` for them.
        ``announces``: ``ahead_publish`` messages for ``version``, which the
        server handles after the withdrawals, each as a Publish alone; whether
        each was taken in ``Resolved.announced``."""
        request = pb.ResolveRequest(agent_id=agent_id, model=model, group=group, group_round=group_round, lease=lease,
                                    wait_change_s=wait_change_s, seen_change=seen_change,
                                    named_layouts=named_layouts, named_wait_s=named_wait_s,
                                    known_fingerprint=self._known_fingerprint(model),
                                    release_leases=self._take_releases(), pulled=self._take_pulled(), members=members,
                                    withdrawals=[pb.UnpublishRequest.FromString(w) for w in withdrawals],
                                    announces=[pb.PublishRequest.FromString(a) for a in announces])
        request.known_memory.extend(self._memories.get(model, {}))
        request.known_layouts.extend(self._layouts.get(model, {}))
        if self._layout_numbers:
            request.layout_ids = self._numbering
            request.packed_holders = True  # the lean holders by number as rows of one PackedHolders
        with self._cache_lock:
            (request.pulls_replayed, request.pulls_planned), self._pull_paths = self._pull_paths, [0, 0]
        if version is None:
            request.latest = True
        else:
            request.version = version
        drain_s = max((w.drain_timeout_s for w in request.withdrawals), default=0.0)
        sent = time.monotonic()
        resp = self._call(self._stub.Resolve, request, timeout=self.timeout_s + wait_change_s + drain_s + named_wait_s,
                          not_found=lambda d: VersionNotFound(model, "latest" if version is None else version, d))
        if resp.instance_id:
            self.last_resolve = (resp.instance_id, sent)
        resolved = self._decode(model, resp, sent, broken="the server is broken")
        if request.withdrawals:
            withdrawn: list = self._withdrawal_outcomes(resp.withdrawals)
            if len(withdrawn) != len(request.withdrawals):  # an older server: it handled none of them
                withdrawn = [TensorHubError(f"reference server at {self.address} answered {len(withdrawn)} "
                                            f"withdrawals of {len(request.withdrawals)}")] * len(request.withdrawals)
            resolved = replace(resolved, withdrawn=tuple(withdrawn))
            resp.ClearField("withdrawals")  # the members' answer is the resolve's alone
        if request.announces:
            announced = self._outcome_errors(resp.announces, TensorHubError)
            if len(announced) != len(request.announces):  # an older server: it handled none of them
                announced = [TensorHubError(f"reference server at {self.address} answered {len(announced)} "
                                            f"announces of {len(request.announces)}")] * len(request.announces)
            resolved = replace(resolved, announced=tuple(announced))
            resp.ClearField("announces")
        if not members:
            return resolved
        self._share(resp.lease_id)
        return replace(resolved, shared=resp.SerializeToString())

    def _numbers(self, numbering: str) -> dict[int, bytes]:
        """The layout numbers of ``numbering`` this client has (a new numbering: none yet)."""
        with self._cache_lock:
            if numbering != self._numbering:
                self._numbering, self._layout_numbers = numbering, {}
            while len(self._layout_numbers) > _LAYOUT_NUMBERS_KEPT:  # the oldest first
                self._layout_numbers.pop(next(iter(self._layout_numbers)))
            return self._layout_numbers

    def _known_fingerprint(self, model: str) -> str:
        """The manifest the server may leave out: the model's last one, if still cached."""
        fingerprint = self._last_fingerprint.get(model, "")
        return fingerprint if fingerprint in self._manifests else ""

    def adopt(self, model: str, shared: bytes) -> Resolved:
        """The answer another member of this client's group resolved for it
        (``Resolved.shared``), decoded as if this client had asked: its lease
        is the group's (renewed by whoever reads, released by the member that
        resolved). ``ShareUnusable`` when it names what this client does not
        have (a holder layout, a memory or a manifest it never saw: its
        history differs from the resolving member's): resolve instead."""
        resp = pb.ResolveResponse.FromString(shared)
        self._share(resp.lease_id)
        return self._decode(model, resp, time.monotonic(), broken="resolve instead", error=ShareUnusable)

    def release_shared(self, agent_id: str, lease_id: str) -> None:
        """The resolving member releases a shared answer's lease: every member is done."""
        with self._cache_lock:
            self._shared_leases.pop(lease_id, None)
        self.release_lease_async(agent_id, lease_id)

    def _share(self, lease_id: str) -> None:
        if lease_id:
            with self._cache_lock:
                self._shared_leases[lease_id] = None
                while len(self._shared_leases) > _SHARED_KEPT:
                    self._shared_leases.pop(next(iter(self._shared_leases)))

    def _decode(self, model: str, resp: pb.ResolveResponse, sent: float, *, broken: str,
                error: type[TensorHubError] = TensorHubError) -> Resolved:
        """A Resolve answer as this client's holder tables: lean holders rebound to
        the templates it has, memories it listed reused, the manifest cached."""
        known = self._memories.get(model, {})
        templates = self._layouts.get(model, {})
        manifest = self._manifests.get(resp.fingerprint)
        if manifest is None or resp.HasField("manifest"):
            if not resp.HasField("manifest"):
                raise error(f"the answer left out manifest {resp.fingerprint[:12]} this client never had; {broken}")
            manifest = wire.manifest_from_wire(resp.manifest)
            with self._cache_lock:
                self._manifests[resp.fingerprint] = manifest
                while len(self._manifests) > _MANIFESTS_CACHED:
                    self._manifests.pop(next(iter(self._manifests)))
        memories: dict[bytes, _Memory] = {}
        replicas = []
        seen = dict(templates)
        numbers = self._numbers(resp.layout_ids)
        for msg in resp.replicas:
            if msg.layout and msg.layout_id:
                numbers[msg.layout_id] = msg.layout
            if not msg.agent_id and (msg.layout or msg.layout_id):  # lean: laid out as a holder this client has
                layout = msg.layout or numbers.get(msg.layout_id, b"")
                template = templates.get(layout)
                if template is None:
                    raise error(f"the answer sent replica {msg.replica_id or msg.replica_suffix!r} lean, by a layout "
                                f"this client never listed as known; {broken}")
                crcs = np.array(msg.chunk_crc32, np.uint32) if msg.chunk_crc32 else None
                replica_id = msg.replica_id or f"{template.source.agent_id}.{msg.replica_suffix}"  # by number
                replicas.append(_rebound(template, replica_id, msg.state == pb.REPLICA_STATE_COMPLETE,
                                         msg.active_reads, bytes(msg.chunk_bitmap), crcs, tuple(msg.deltas)))
                seen[layout] = seen.pop(layout)  # in use: the last to be forgotten
                continue
            if msg.HasField("memory"):
                memory = _memory(msg.memory)
            elif (memory := known.get(msg.memory_digest)) is None:
                raise error(f"the answer left out the memory of replica {msg.replica_id!r} but this client never "
                            f"listed its digest as known; {broken}")
            if msg.memory_digest:
                memories[msg.memory_digest] = memory
            replicas.append(_replica(msg, manifest, memory, self._held))
            if msg.layout:
                seen.pop(msg.layout, None)
                seen[msg.layout] = replicas[-1]
        if resp.HasField("packed"):
            replicas.extend(self._unpacked(resp.packed, numbers, templates, seen, broken, error))
        self._memories[model] = memories
        while len(seen) > _LAYOUTS_KNOWN:  # the oldest go first
            seen.pop(next(iter(seen)))
        self._layouts[model] = seen
        self._last_fingerprint[model] = resp.fingerprint
        return Resolved(model, resp.version, manifest, tuple(replicas), resp.lease_id, resp.lease_ttl_s, sent,
                        resp.instance_id, resp.change, named=resp.named, pace_s=resp.pace_s)

    @staticmethod
    def _unpacked(packed: pb.PackedHolders, numbers: dict[int, bytes], templates: dict[bytes, RemoteReplica],
                  seen: dict[bytes, RemoteReplica], broken: str, error: type[TensorHubError]) -> list[RemoteReplica]:
        """The packed lean holders of an answer, rebound to this client's
        templates (whose layouts give each one's chunk count)."""
        def template_of(number: int) -> RemoteReplica:
            template = templates.get(numbers.get(number, b""))
            if template is None:
                raise error(f"the answer sent a holder packed by layout number {number}, which this client never "
                            f"listed as known; {broken}")
            return template

        counts: dict[int, int] = {}  # per layout number: holders of one layout (a TP rank's relays) share it

        def chunks_of(number: int) -> int:
            if number not in counts:
                counts[number] = own_chunks(template_of(number))
            return counts[number]

        try:
            rows = wire.packed_holders_from_wire(packed, chunks_of)
        except ValueError as e:
            raise error(f"the answer's packed holders are malformed: {e}; {broken}") from None
        replicas = []
        for number, suffix, complete, crcs, bitmap, reads in rows:
            template = template_of(number)
            replicas.append(_rebound(template, f"{template.source.agent_id}.{suffix}", complete, reads, bitmap, crcs,
                                     ()))
            layout = numbers[number]
            seen[layout] = seen.pop(layout)  # in use: the last to be forgotten
        return replicas

    def acquire_lease(self, agent_id: str, replica_ids: list[str]) -> tuple[str, list[str], float]:
        resp = self._call(self._stub.AcquireReadLease,
                          pb.AcquireReadLeaseRequest(agent_id=agent_id, replica_ids=replica_ids))
        return resp.lease_id, list(resp.granted), resp.ttl_s

    def renew_lease(self, agent_id: str, lease_id: str) -> float:
        resp = self._call(self._stub.RenewReadLease, pb.RenewReadLeaseRequest(agent_id=agent_id, lease_id=lease_id),
                          not_found=lambda d: TensorHubError(d))
        return resp.ttl_s

    def release_lease_async(self, agent_id: str, lease_id: str) -> None:
        """Release a lease without waiting. It rides on the next resolve if one
        comes within a few milliseconds (a pull loop costs no extra round trip),
        else a background thread sends it. The lease also expires by itself."""
        with self._cache_lock:
            if lease_id in self._shared_leases:  # a group's: the member that resolved releases it
                return
            self._releases.append(lease_id)
        self._background.submit(self._flush_releases, agent_id)

    def report_path(self, replayed: bool) -> None:
        """A finished pull's path (``PullResult.path``), for the server's counters:
        sent with the next Resolve."""
        with self._cache_lock:
            self._pull_paths[0 if replayed else 1] += 1

    def report_pulled(self, agent_id: str, by_kind: dict[tuple[int, bool], int], *, flush: bool = True) -> None:
        """Bytes a finished pull read, by (``Labels.tier`` of the source, from an
        origin), for the server's metrics. Sent without waiting, with the pull's
        lease release (or the next resolve); lost if that call fails (counts only).
        ``flush=False``: kept for ``take_pulled_report`` (a group's batch) or the next call."""
        with self._cache_lock:
            for kind, n in by_kind.items():
                if n:
                    self._pulled[kind] = self._pulled.get(kind, 0) + n
        if flush:
            self._background.submit(self._flush_releases, agent_id)

    def _take_releases(self) -> list[str]:
        with self._cache_lock:
            taken, self._releases = self._releases, []
        return taken

    def _take_pulled(self) -> list[pb.PulledBytes]:
        with self._cache_lock:
            taken, self._pulled = self._pulled, {}
        return wire.pulled_to_wire(taken)

    def _flush_releases(self, agent_id: str) -> None:
        time.sleep(_RELEASE_DELAY_S)
        pulled = self._take_pulled()
        # The pulled bytes go with the first release, or alone (no lease id) when none is due.
        for lease_id in self._take_releases() or ([""] if pulled else []):
            try:
                self._stub.ReleaseReadLease(pb.ReleaseReadLeaseRequest(agent_id=agent_id, lease_id=lease_id,
                                                                       pulled=pulled),
                                            timeout=self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as e:
                log.debug("release lease %s: %s", lease_id, e.code())
            pulled = []

    def report_lost(self, agent_id: str, replica_id: str, reason: str, *, stalled: bool = False) -> bool:
        """``stalled``: nothing was heard from it, without an error. True when
        the server kept it listed: its holder is alive (only a stalled report)."""
        return self._call(self._stub.ReportLost, pb.ReportLostRequest(
            agent_id=agent_id, replica_id=replica_id, reason=reason, stalled=stalled)).kept

    # ---------------------------------------------------------------- queries

    def describe(self, model: str = "") -> HubStatus:
        """What the server holds now: agents, versions and their replicas, read leases (``tensorhub status``)."""
        resp = self._call(self._stub.Describe, pb.DescribeRequest(model=model))
        try:
            return wire.status_from_wire(resp)
        except ValueError as e:
            raise TensorHubError(f"reference server at {self.address} sent a status this client cannot read: {e}") \
                from None

    def reader_cuts(self, model: str, manifest: Manifest, max_cuts: int = 0) -> ReaderCuts | None:
        """Which regions the readers of ``model`` hold (the distinct read sets of
        the relays of its newest version with ``manifest`` that has relays), in
        terms of ``manifest``; None when no such version has a relay yet."""
        resp = self._call(self._stub.ReaderCuts, pb.ReaderCutsRequest(model=model, fingerprint=manifest.fingerprint,
                                                                       max_cuts=max_cuts))
        if not resp.found:
            return None
        shapes = shapes_of(manifest)
        read_sets = []
        for cut in resp.cuts:
            try:
                if cut.whole:
                    held = wire.whole_model(manifest)
                else:
                    table = wire.held_from_wire(cut.held, shapes)
                    bad = table.problem(shapes)
                    if bad is not None:
                        raise ValueError(bad[1])
                    held = table.held(shapes)
            except ValueError as e:
                raise TensorHubError(f"reference server at {self.address} sent a read set this client cannot "
                                     f"read: {e}") from None
            read_sets.append(ReadSet(tuple(held), cut.readers))
        return ReaderCuts(resp.version, tuple(read_sets), resp.more)

    def list_versions(self, model: str) -> list[VersionInfo]:
        resp = self._call(self._stub.ListVersions, pb.ListVersionsRequest(model=model))
        return [VersionInfo(v.version, v.complete_replicas, v.filling_replicas, v.total_bytes, v.visible)
                for v in resp.versions]

    def wait_for_version(self, model: str, at_least: int, timeout_s: float) -> int | None:
        """The highest visible version once one >= ``at_least`` exists; None
        when ``timeout_s`` passed first (one long poll on the server)."""
        resp = self._call(self._stub.WaitForVersion,
                          pb.WaitForVersionRequest(model=model, at_least=at_least, timeout_s=timeout_s),
                          timeout=timeout_s + self.timeout_s)
        return resp.version if resp.found else None


def own_chunks(replica: RemoteReplica) -> int:
    """How many chunks of its own a replica has (its bitmap's length in bits, its CRCs' count)."""
    size = int(replica.regions[:, 1].sum()) if len(replica.regions) else 0
    return -(-size // replica.chunk_size) if replica.chunk_size else 0


def _rebound(template: RemoteReplica, replica_id: str, complete: bool, reads: int, bitmap: bytes,
             crcs: np.ndarray | None, deltas: tuple[str, ...]) -> RemoteReplica:
    """A holder sent lean (a message or a packed row), from ``template``, one
    laid out the same (same agent, regions, memory, manifest): only what belongs
    to this replica of this version is new (its id, state, load, checksums, deltas)."""
    source = replace(template.source, replica_id=replica_id, complete=complete, active_reads=reads)
    return replace(template, source=source, bitmap=bitmap, chunk_crc32=crcs, deltas=deltas, lean=True)


def _memory(msg: pb.ReplicaMemory) -> _Memory:
    if msg.packed:
        return wire.KIND_BACK[msg.kind], (np.array(msg.region_gap, np.int64), msg.device_id), msg.nixl_metadata
    regions = np.array([(r.addr, r.size, r.device_id) for r in msg.regions], dtype=np.uint64).reshape(-1, 3)
    return wire.KIND_BACK[msg.kind], regions, msg.nixl_metadata


def _replica(msg: pb.ReplicaInfo, manifest: Manifest, memory: _Memory,
             held_cache: Lru | None = None) -> RemoteReplica:
    source = Source(
        replica_id=msg.replica_id,
        agent_name=msg.agent_name,
        labels=wire.labels_from_wire(msg.labels),
        reliability=wire.reliability_from_wire(msg.reliability),
        complete=msg.state == pb.REPLICA_STATE_COMPLETE,
        origin=msg.origin,
        active_reads=msg.active_reads,
        agent_id=msg.agent_id,
    )
    shapes = shapes_of(manifest)
    if msg.HasField("held_table"):
        held_bytes = msg.held_table.SerializeToString()
        cache_key = manifest.fingerprint.encode() + held_bytes  # the same table parses by the manifest's shapes
        hit = held_cache.get(cache_key) if held_cache is not None else None
        if hit is None:
            table = wire.held_from_wire(msg.held_table, shapes)
            hit = (table, tuple(table.held(shapes)))
            if held_cache is not None:
                held_cache.put(cache_key, hit)
        table, held = hit
    elif msg.held:
        held_bytes = b"".join(r.SerializeToString() for r in msg.held)
        held = tuple(wire.region_from_wire(r) for r in msg.held)
        table = RegionTable.from_held(list(held), shapes)
    else:
        held_bytes = b"whole"
        held = tuple(wire.whole_model(manifest))
        table = None  # every tensor whole
    kind, regions, metadata = memory
    if isinstance(regions, tuple):  # packed: the sizes are the held regions'
        gaps, device = regions
        sizes = shapes.numel * shapes.itemsize if table is None else table.nbytes(shapes)
        if len(gaps) > len(sizes):
            raise TensorHubError(f"replica {msg.replica_id!r} has {len(gaps)} memory regions for {len(sizes)} held "
                                 "regions; the server is broken")
        every = np.zeros(len(sizes), np.int64)
        every[:len(gaps)] = gaps  # the gaps left out are 0: back to back
        regions = np.empty((len(sizes), 3), np.uint64)
        regions[:, 0], regions[:, 1], regions[:, 2] = memory_addrs(every, sizes), sizes, device
    crcs = np.array(msg.chunk_crc32, np.uint32) if msg.chunk_crc32 else None
    key = hashlib.blake2b(held_bytes, digest_size=20)
    key.update(np.ascontiguousarray(regions, np.uint64).tobytes())
    key.update(f"{msg.chunk_size}/{manifest.fingerprint}".encode())
    return RemoteReplica(source, msg.agent_id, kind, held, regions, metadata, msg.chunk_size, bytes(msg.chunk_bitmap),
                         crcs, tuple(msg.deltas), key.digest(), wire_layout=msg.layout)
