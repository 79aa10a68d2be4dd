"""``Hub``: a process's handle on TensorHub, the front door.

    Hub.connect ── Holdings (holdings.py): agent session, heartbeats, what this process
        │          publishes (whole models or shards), retention, unpublish-with-drain
        ├─ publish ──▶ Holdings.publish
        └─ pull ─────▶ resolve ─▶ ReadSets (readsets.py) / Destinations (destination.py)
                       ─▶ PullJob (puller.py) over a ReadLayout (readlayout.py)
                       ─▶ serve=True: Holdings.open_filling, chunks reported as they land
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from tensorhub.client import ahead as ahead_announce
from tensorhub.client.ahead import AheadAnnounce, AheadUse
from tensorhub.client.config import HubConfig
from tensorhub.client.delta import (
    DeltaOutcome,
    DeltaPulls,
    covering_deltas,
    encode_against,
    previous_parts,
    publish_with_delta,
)
from tensorhub.client.destination import Destinations, destination_parts, result_tensors
from tensorhub.client.fp8companion import check_fp8_pull, publish_with_fp8
from tensorhub.client.groupanswer import GroupAnswer, MemberReport
from tensorhub.client.groupmessages import AnnounceOnce, GroupMessages
from tensorhub.client.holdings import Holdings
from tensorhub.client.landed import LandedReports
from tensorhub.client.peernews import PeerNews, PullNews
from tensorhub.client.plancache import PlanCache
from tensorhub.client.publication import Publication, PubState
from tensorhub.client.puller import ProgressFn, PullJob
from tensorhub.client.pullstats import PullStats
from tensorhub.client.readsets import ReadSet, ReadSets
from tensorhub.client.replay import DELTA, PLANNED, path_of
from tensorhub.client.rpc import ReaderCuts, ReferenceClient, RemoteReplica, Resolved
from tensorhub.client.scratch import ScratchPool
from tensorhub.client.trainercut import publish_cut
from tensorhub.client.wideread import WideReads
from tensorhub.delta.codec import Delta
from tensorhub.errors import (
    AlreadyPublished,
    InvalidRequest,
    ServerUnavailable,
    ShareUnusable,
    TensorHubError,
    VersionNotFound,
)
from tensorhub.fp8 import fp8_model
from tensorhub.manifest import Manifest
from tensorhub.shard import Entry
from tensorhub.topology import Labels
from tensorhub.transport import MemoryKind, NixlAgent
from tensorhub.transport.cost import SETTINGS, LinkCost, pick
from tensorhub.transport.transfermode import resolve_transfer

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

_WAIT_POLL_S = 30.0  # one long poll of wait_for_version at most this long


@dataclass(kw_only=True, slots=True)
class PullResult:
    """What a pull returned. ``tensors`` are the destination tensors (``into``'s
    own when given; a list where a name has several Shards). ``nbytes`` is the
    bytes requested and read; ``bytes_by_source`` adds up to it.
    ``publication`` is set when the pull serves what it got."""

    model: str
    version: int
    tensors: dict[str, Any]
    nbytes: int
    seconds: float
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    lost_sources: list[str] = field(default_factory=list)
    # Of lost_sources, those given up on as stalled that the server still listed alive: read again.
    sources_read_again: list[str] = field(default_factory=list)
    publication: Publication | None = None
    # Checked against the publishers' chunk checksums, and not (no checksums, or a part of a holder's chunk).
    verified_bytes: int = 0
    unverified_bytes: int = 0
    # Chunks whose bytes failed their check and were read again (the pull still
    # ended byte-exact); of them, those read from several holders (no culprit).
    checks_failed: int = 0
    checks_failed_unplaced: int = 0
    # Bytes of every READ that landed, including any read again, and the rows
    # around columns read wide (HubConfig.read_cost): ``nbytes`` when none was.
    read_bytes: int = 0
    descriptors: int = 0  # READ descriptors posted (of the READs that landed)
    # Chunks whose READs an earlier pull into the same buffers planned, from
    # holders laid out the same (the next version from the same buffers, too)
    plans_reused: int = 0
    # Resolves the pull sent after its first answer: asking again who holds what
    # (a round ran out of holders, or took longer than a refresh interval)
    refreshes: int = 0
    # Peers' chunk news that told the pull of chunks it did not know of yet
    # (``client/peernews.py``: a relaying peer's notification instead of a resolve)
    news_heard: int = 0
    # Readers that subscribed to this serving pull's chunk news (``peernews``)
    subscribers: int = 0
    # Per chunk of the read set, the agent most of its bytes came from (empty for a delta pull)
    chunk_sources: dict[int, str] = field(default_factory=dict)
    # A pull given ``have=u`` that patched the destination from v's deltas:
    # ``delta_from`` is u, ``delta_bytes`` the delta bytes read (then also
    # ``read_bytes``; ``nbytes`` stays the destination's bytes, and
    # ``bytes_by_source`` counts the delta bytes). None: v was read whole.
    delta_from: int | None = None
    delta_bytes: int = 0
    # Which path the pull took (``client/replay.py``): "replayed" (every holder's
    # layout known, every chunk's READs planned by an earlier pull into the
    # same buffers: the steady state), "planned", or "delta"; and for the last
    # two why it did not replay.
    path: str = PLANNED
    not_replayed: str = ""
    # The server answered with the holders the previous pull read from, by
    # name, without ranking every holder (``HubConfig.named_wait_s``)
    named: bool = False
    # ``pull(defer_complete=True)``, serving: the last report (complete), held
    # for the group to send (``member_report``); b"": sent as usual
    held_report: bytes = b""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _address(url: str) -> str:
    for scheme in ("tensorhub://", "grpc://"):
        url = url.removeprefix(scheme)
    if not re.match(r"^[^\s/:]+:\d+$|^\[[0-9a-fA-F:]+\]:\d+$", url):
        raise ValueError(f"hub address {url!r} is not host:port (e.g. 127.0.0.1:50051)")
    return url


def _bytes_by_kind(stats: PullStats) -> dict[tuple[int, bool], int]:
    """A pull's bytes by (``Labels.tier`` of the source, from an origin): what the server's metrics count."""
    out: dict[tuple[int, bool], int] = {}
    for name, nbytes in stats.bytes_by_source.items():
        kind = stats.source_kinds.get(name)
        if kind is not None:
            out[kind] = out.get(kind, 0) + nbytes
    return out


def _check_version(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise InvalidRequest(f"version must be an integer >= 0 or 'latest', not {version!r}")
    return int(version)


def _check_model(model: Any) -> str:
    if not isinstance(model, str) or not model:
        raise InvalidRequest(f"model must be a non-empty string, not {model!r}")
    return model


class Hub:
    """Thread-safe client of one reference server, with one NIXL agent.

    >>> with Hub.connect("127.0.0.1:50051", name="trainer") as hub:
    ...     pub = hub.publish("policy", 7, model.state_dict())
    ...     ...
    ...     pub.unpublish()
    """

    def __init__(self, address: str, config: HubConfig) -> None:
        self.address = _address(address)
        if config.read_cost not in SETTINGS:  # before anything starts
            raise ValueError(f"HubConfig.read_cost {config.read_cost!r} is not one of {', '.join(SETTINGS)}")
        resolve_transfer(config.transfer)  # ValueError for an unknown mode, before anything starts
        self.config = config
        self.name = config.name or f"{socket.gethostname()}:{os.getpid()}"
        self.agent_id = f"{re.sub(r'[^A-Za-z0-9._:@/+-]', '_', self.name)[:80]}-{uuid.uuid4().hex[:12]}"
        self._rpc = ReferenceClient.for_hub(self.address, config)
        self._closed = False
        try:
            self._nixl = NixlAgent(self.agent_id, config.transfer)
        except BaseException:  # TransportUnavailable: no UCX backend; nothing else was started
            self._rpc.close()
            raise
        self._holdings = Holdings(rpc=self._rpc, nixl=self._nixl, agent_id=self.agent_id, name=self.name,
                                  config=config)
        self._group_messages = GroupMessages(self._rpc, self.agent_id)  # a group's Batches (engineshare)
        self._destinations = Destinations(self._nixl)
        self._news = PeerNews(self._nixl) if config.chunk_news else None  # chunk news between relaying peers
        self._read_sets = ReadSets()  # destinations checked, and their read layouts, kept while the same
        self._plans = PlanCache()  # holder tables and chunk READs, kept while the layouts stay the same
        # Per model, the server layouts of the holders its last steady pull read from (every
        # holder known, none lost): the next pull names them (``named_layouts``); and the wave
        # of readers that pull saw (a named answer lists only those holders: ``PullJob.wave_readers``)
        self._read_before: dict[str, tuple[bytes, ...]] = {}
        self._wave_before: dict[str, int] = {}
        # Announces of this process's next replica sent ahead with its group's
        # resolve, by (model, version), until that version's pull takes its own (``ahead``)
        self._aheads: dict[tuple[str, int], AheadAnnounce] = {}
        # Per model, this rank's last trainer-cut buffer and its publication: reused once that is closed
        self._cut_buffers: dict[str, tuple[Any, Publication]] = {}
        self._deltas = DeltaPulls(self._holdings, self.pull)
        # A slot per READ in flight (HubConfig.read_workers): wide READs land there, then are cut into place.
        self._scratch = ScratchPool(2 * max(1, config.read_workers), register=self._nixl.register,
                                    deregister=self._nixl.deregister)
        try:
            self._holdings.register(wait_s=config.connect_timeout_s)
        except BaseException:
            self._shutdown_local()
            raise
        self._holdings.start_heartbeats()

    @classmethod
    def connect(cls, url: str, *, name: str | None = None, labels: Labels | dict[str, str] | None = None,
                config: HubConfig | None = None, **overrides: Any) -> Hub:
        """Connect to the reference server at ``url`` (``host:port``) and register
        this process. Raises ServerUnavailable if it cannot be reached within
        ``config.connect_timeout_s``."""
        config = config or HubConfig()
        if name is not None:
            overrides["name"] = name
        if labels is not None:
            overrides["labels"] = Labels.parse(labels)
        if overrides:
            config = replace(config, **HubConfig.coerce(overrides))
        return cls(url, config)

    # ---------------------------------------------------------------- publish

    def publish(self, model: str, version: int, tensors: Mapping[str, Entry], *,
                manifest: Manifest | Mapping[str, Entry] | None = None, chunk_size: int | None = None,
                delta_from: int | None = None, previous: Mapping[str, Entry] | None = None,
                delta: Delta | None = None, cut: Literal["readers"] | None = None, cut_group: Any = None,
                cut_gather_bytes: int | None = None, fp8: bool = False, trainer_group: Any = None) -> Publication:
        """Make ``tensors`` pullable as ``version`` of ``model``, in place (their
        memory is registered with NIXL, not copied). Do not modify them until
        the returned publication is unpublished.

        Values are whole tensors or ``Shard``s (a region of the full tensor): each
        rank of a trainer group publishes the regions it holds, and the version
        becomes visible once the ranks' regions cover every element. The
        manifest (names, full shapes, dtypes) comes from ``tensors``; a rank that
        holds nothing of some tensors passes ``manifest=`` naming the whole model
        (a Manifest, or a mapping of tensors / Shards / meta tensors to take it from).

        ``delta_from=u`` also publishes the delta of this version against u
        (the elements whose bits changed, computed here on the tensors'
        device), so that readers holding u pull only that (``pull(have=u)``).
        u's bytes come from ``previous`` (the same names and regions as
        ``tensors``), or else from this process's replica of u, which must live
        in other memory, or ``delta`` is that delta, computed already
        (``tensorhub.delta.codec.DeltaEncoder``, e.g. while a trainer copied
        each tensor over u's bytes). The version itself stays whole: readers
        without u pull it as always.

        ``cut="readers"``: every rank of the trainer group ``cut_group`` (a
        torch.distributed process group; default the whole world) calls this
        together, and besides its shards publishes one more replica: its share
        of the regions the model's readers hold (the distinct read sets of the
        relays of its last version, asked of the server), each read set back
        to back, so a TP worker reads contiguous bytes instead of a run per
        row of a column (``tensorhub.client.trainercut``). Each rank gathers
        the full tensors of its share from the others' shards, at most
        ``cut_gather_bytes`` (default ``HubConfig.cut_gather_bytes``) at a time.
        No readers yet (the first version): the shards only. The cost is in
        ``publication.cut_report``; the cut is ``publication.cut``, withdrawn
        with the publication. The ranks withdraw it together too, as they
        published it: call ``unpublish`` on every rank of ``cut_group`` at once
        (the first sends every rank's withdrawals; a rank that does not come
        within half the timeout fails that message for all, and each withdraws
        alone in the other half).

        ``trainer_group``: a torch.distributed process group whose every rank
        publishes this version at once (a trainer's ranks, each its shards),
        without the cut: as with ``cut=``, the group's first rank sends every
        rank's announce in one message where they go lean (every step from the
        same buffers), and the ranks withdraw it together: call ``unpublish``
        on every rank at once. A step then costs the server two messages for the
        whole trainer, not two per rank (``tensorhub bench scale --trainer-group``).

        ``fp8=True`` also publishes the version's block-FP8 companion
        (``tensorhub.fp8``: 2-D floating ``*.weight`` tensors as float8_e4m3fn
        plus fp32 ``*.weight_scale_inv`` per 128x128 block, rounded as vLLM
        rounds, quantized on the tensors' device; the rest as it is) as model
        ``<model>@fp8``, withdrawn with this publication; readers that want FP8
        pull it with ``pull(model, v, fp8=True)``, at about half the bytes. It
        needs the whole model as whole tensors in this process, and no cut or delta.
        """
        model, version = _check_model(model), _check_version(version)
        if manifest is None:
            manifest = Manifest.of(tensors)
        elif not isinstance(manifest, Manifest):
            manifest = Manifest.of(manifest)
        try:
            manifest.validate()
        except ValueError as e:
            raise InvalidRequest(f"publish {model!r} version {version}: {e}") from None
        parts = manifest.parts(tensors, model=model, version=version, whole_model=False,
                               nothing="Nothing was published.")
        if not parts:
            raise InvalidRequest(f"publish {model!r} version {version}: no tensor or region to publish")
        chunk_size = chunk_size or self.config.chunk_size
        if trainer_group is not None and (delta_from is not None or fp8):
            raise InvalidRequest(f"publish {model!r} version {version}: trainer_group= goes with neither delta_from= "
                                 "nor fp8= (not built yet). Nothing was published.")
        if cut is not None and cut_group is None:
            cut_group = trainer_group  # the trainer's group gathers the cut
        if fp8:
            if cut is not None or delta_from is not None:
                raise InvalidRequest(f"publish {model!r} version {version}: fp8=True goes with neither cut= nor "
                                     "delta_from= (not built yet). Nothing was published.")
            return publish_with_fp8(self._holdings, model=model, version=version, manifest=manifest, parts=parts,
                                    tensors=tensors, chunk_size=chunk_size)
        if cut is not None:
            if delta_from is None:  # the cut and the shards announced together (a delta publish announces its own)
                return self._publish_with_cut(
                    model, version, manifest, parts, chunk_size, cut=cut, group=cut_group,
                    gather_bytes=cut_gather_bytes, together=True,
                    shards=lambda: self._holdings.publish(model, version, manifest, parts, chunk_size, announce=False))
            return self._publish_with_cut(model, version, manifest, parts, chunk_size, cut=cut, group=cut_group,
                                          gather_bytes=cut_gather_bytes, together=False,
                                          shards=lambda: self.publish(model, version, tensors, manifest=manifest,
                                                                      chunk_size=chunk_size, delta_from=delta_from,
                                                                      previous=previous, delta=delta))
        if delta_from is None and trainer_group is not None:
            return self._publish_together(model, version, manifest, parts, chunk_size, trainer_group)
        if delta_from is None:
            return self._holdings.publish(model, version, manifest, parts, chunk_size)
        delta_from = _check_version(delta_from)
        if delta_from == version:
            raise InvalidRequest(f"publish {model!r} version {version}: delta_from is the version itself")
        if delta is None:
            old = None if previous is None else manifest.parts(previous, model=model, version=delta_from,
                                                              whole_model=False, nothing="Nothing was published.")
            delta = encode_against(manifest, parts, previous_parts(self._holdings, model, delta_from, parts, old),
                                   from_version=delta_from, to_version=version)
        return publish_with_delta(self._holdings, model=model, version=version, manifest=manifest, parts=parts,
                                  chunk_size=chunk_size, from_version=delta_from, delta=delta)

    def _publish_together(self, model: str, version: int, manifest: Manifest, parts: list, chunk_size: int,
                          group: Any) -> Publication:
        """``publish(trainer_group=)``: this rank's shards published unannounced, then
        announced with every rank's by the group's first rank (``Holdings.announce_together``);
        withdrawn together too (``Publication.group``)."""
        pub = self._holdings.publish(model, version, manifest, parts, chunk_size, announce=False)
        try:
            self._holdings.announce_together([pub], group=group)
        except BaseException:
            self._withdraw_quietly(model, version, [pub])
            raise
        pub.group = group
        return pub

    def _withdraw_quietly(self, model: str, version: int, pubs: Iterable[Publication | None]) -> None:
        """Withdraw what a publish that failed had published, logging what could not
        be: the error that brought us here is the one to raise."""
        for pub in pubs:
            if pub is not None:
                try:
                    pub.unpublish(timeout=self._holdings.lease_ttl_s + 1)
                except TensorHubError as e:
                    log.warning("%r v%d: withdrawing %s: %s", model, version, pub.replica_id, e)

    def _publish_with_cut(self, model: str, version: int, manifest: Manifest, parts: list, chunk_size: int, *,
                          cut: str, group: Any, gather_bytes: int | None, together: bool,
                          shards: Callable[[], Publication]) -> Publication:
        """``publish(cut=...)``: this rank's share of the readers' cut, then its
        shards; ``together``: both published unannounced, then announced where
        both go lean (every step from the same buffers), every rank's in one
        message sent by the group's first rank (``Holdings.announce_together``)."""
        if cut != "readers":
            raise InvalidRequest(f"publish {model!r} version {version}: cut must be 'readers' or None, not {cut!r}")
        gather_bytes = self.config.cut_gather_bytes if gather_bytes is None else gather_bytes
        if isinstance(gather_bytes, bool) or not isinstance(gather_bytes, int) or gather_bytes <= 0:
            raise InvalidRequest(f"publish {model!r} version {version}: cut_gather_bytes must be a positive "
                                 f"number of bytes, not {gather_bytes!r}")
        import torch.distributed as dist

        if group is None:
            if not dist.is_initialized():
                raise InvalidRequest(f"publish {model!r} version {version}: cut='readers' gathers over a "
                                     "torch.distributed group: initialize one, or pass cut_group=")
            group = dist.group.WORLD

        def ask() -> ReaderCuts | None:
            return self._holdings.with_agent(lambda: self._rpc.reader_cuts(model, manifest))

        def publish(held: list) -> Publication:
            return self._holdings.publish(model, version, manifest, held, chunk_size, trainer_cut=True,
                                          announce=not together)

        import torch

        kept = self._cut_buffers.get(model)
        chosen: list[torch.Tensor] = []

        def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
            """The last version's cut buffer once its publication is closed (never
            while a reader may still read it); else a new one."""
            buffer = None
            if kept is not None and kept[1].state is PubState.CLOSED:
                old = kept[0]
                if old.numel() == nbytes and old.device == device:
                    buffer = old
            chosen.append(torch.empty(nbytes, dtype=torch.uint8, device=device) if buffer is None else buffer)
            return chosen[-1]

        cut_pub, report = publish_cut(ask=ask, manifest=manifest, parts=parts, group=group,
                                      gather_bytes=gather_bytes, publish=publish, allocate=allocate)
        if cut_pub is not None and chosen:
            self._cut_buffers[model] = (chosen[-1], cut_pub)
        pub = None
        try:
            try:
                pub = shards()
            finally:
                if together:  # every rank of the group at once, its first sending all (a failed rank: nothing)
                    self._holdings.announce_together([p for p in (cut_pub, pub) if p is not None and pub is not None],
                                                     group=group)
        except BaseException:
            self._withdraw_quietly(model, version, (cut_pub, pub))
            raise
        pub.cut, pub.cut_report = cut_pub, report
        if together:  # announced together: withdrawn together too (Publication.unpublish)
            pub.group = group
        if cut_pub is not None:
            log.info("%r v%d: trainer cut of %d read set(s) of v%d: %d regions, %d bytes; gathered %d tensors, "
                     "at most %d bytes at once (bound %d), in %.3fs", model, version, report.read_sets,
                     report.from_version, report.regions, report.nbytes, report.tensors, report.peak_gather_bytes,
                     gather_bytes, report.seconds)
        return pub

    def reader_cuts(self, model: str, manifest: Manifest | Mapping[str, Entry]) -> ReaderCuts | None:
        """The regions the readers of ``model`` hold: the distinct read sets of
        the relays of its newest version with ``manifest`` that has relays,
        most readers first; None when none has any yet."""
        model = _check_model(model)
        manifest = manifest if isinstance(manifest, Manifest) else Manifest.of(manifest)
        return self._holdings.with_agent(lambda: self._rpc.reader_cuts(model, manifest))

    def unpublish(self, model: str, version: int, timeout: float = 60.0) -> None:
        """Unpublish this process's replica of (model, version); see Publication.unpublish."""
        pubs = self._holdings.find(model, version)
        if not pubs:
            raise VersionNotFound(model, version, f"this process publishes no replica of {model!r} version {version}")
        for pub in pubs:
            pub.unpublish(timeout)

    # ---------------------------------------------------------------- pull

    def resolve_for_group(self, model: str, version: int | Literal["latest"] = "latest", *, group: str,
                          members: list[str], withdrawals: Sequence[bytes] = (),
                          named_layouts: Sequence[bytes] = (), announces: Sequence[bytes] = ()) -> GroupAnswer:
        """Resolve ``model`` once for this process and the other ``members`` (their
        ``agent_id``s) of ``group``: hand the answer to them over the group's own
        channel, each passes it to ``pull(answer=)``, and once every member's pull
        is done this process calls ``release_group_answer``. One Resolve per
        engine and version reaches the server instead of one per worker
        (``groupanswer``). Its lease covers every member's reads.
        ``withdrawals``: the members' ``withdrawal`` messages (b"": none), sent
        with the resolve (one message a step, not two); their outcomes in
        ``GroupAnswer.withdrawn``, as ``send_group_withdrawals`` gives them. A
        resolve that raises handled none of them. ``named_layouts``: what the
        members' previous pulls read from (each one's ``named_layouts``): the
        answer names those holders alone when the server has them all.
        ``announces``: the members' ``announce_ahead`` messages (b"": none),
        handled after the withdrawals; per member whether the server took it in
        ``GroupAnswer.announced`` (each member passes it to ``ahead_taken``)."""
        model = _check_model(model)
        wanted = None if version == "latest" else _check_version(version)
        if not group:
            raise InvalidRequest("resolve_for_group needs the group's name (group=)")
        others = sorted(set(members) - {self.agent_id})
        resolved = self._holdings.with_agent(lambda: self._rpc.resolve(
            self.agent_id, model, wanted, group=group, lease=True, members=others,
            withdrawals=[w for w in withdrawals if w], named_layouts=named_layouts,
            named_wait_s=self._named_wait_s(named_layouts), announces=[a for a in announces if a]))
        outcomes, announced = iter(resolved.withdrawn), iter(resolved.announced)
        return GroupAnswer(model, resolved.version, group, resolved.lease_id, resolved.shared,
                           tuple(next(outcomes) if w else None for w in withdrawals),
                           tuple(next(announced) is None if a else False for a in announces))

    def announce_ahead(self, previous: Publication, version: int) -> bytes:
        """A member of a group about to pull ``version`` serving into
        ``previous``'s memory (the steady state): the announce of that pull's
        replica, for the member that resolves to send with the group's
        Resolve (``resolve_for_group(announces=)``); b"" where it cannot go
        ahead. Then ``ahead_taken`` with the server's word, before the pull."""
        ahead = ahead_announce.build(self._holdings, self._rpc, previous, _check_version(version))
        if ahead is None:
            return b""
        self._drop_ahead(self._aheads.pop((ahead.model, ahead.version), None))
        self._aheads[(ahead.model, ahead.version)] = ahead
        return ahead.data

    def ahead_taken(self, model: str, version: int, taken: bool) -> None:
        """Whether the server took this process's ``announce_ahead`` of
        ``version``: taken, the pull announces nothing more where its replica
        is what was announced."""
        ahead = self._aheads.get((model, version))
        if ahead is not None:
            self._aheads[(model, version)] = replace(ahead, taken=taken)

    def forget_ahead(self, version: int | str) -> None:
        """The update of ``version`` is over: an announce sent ahead for it that
        no pull took (the group's resolve failed, so no pull ran) is dropped."""
        for key in [k for k in self._aheads if k[1] == version]:
            self._drop_ahead(self._aheads.pop(key))

    def _drop_ahead(self, ahead: AheadAnnounce | None) -> None:
        """An announce sent ahead that no pull opened: withdrawn where the server may have it."""
        if ahead is not None and ahead.taken is not False:  # taken, or not known (the resolve failed)
            self._holdings.drop_unopened(ahead.replica_id)

    def release_group_answer(self, answer: GroupAnswer) -> None:
        """Every member's pull with ``answer`` is done: its lease goes (without
        waiting; it rides on this process's next resolve when one comes soon)."""
        self._rpc.release_shared(self.agent_id, answer.lease_id)

    def send_group_announces(self, announces: Sequence[bytes]) -> list[bool]:
        """The member that resolved: every member's announce (handed to
        ``pull(announce_with=)``; b"": none) in one message. Per member, whether
        the server took it (one it did not, its member announces alone)."""
        return self._group_messages.announces(announces)

    def withdrawal(self, publication: Publication, timeout: float) -> bytes:
        """A member of a group begins withdrawing ``publication`` (its previous
        version, whose memory its next pull fills): the message, for the member
        that resolves to send with the others' (``send_group_withdrawals``);
        then ``withdrawn`` with its outcome, before the memory is written."""
        return self._holdings.withdrawal(publication, timeout)

    def send_group_withdrawals(self, withdrawals: Sequence[bytes]) -> list:
        """The member that resolves: every member's ``withdrawal`` (b"": none) in
        one message, the drains waited for together; per member its outcome."""
        return self._group_messages.withdrawals(withdrawals)

    def withdrawn(self, publication: Publication, outcome: Any, timeout: float) -> None:
        """``withdrawal``'s outcome: drained, ``publication`` is closed; else it
        is unpublished alone here (raising as ``Publication.unpublish`` does)."""
        self._holdings.withdrawn(publication, outcome, timeout)

    def member_report(self, result: PullResult | None) -> MemberReport:
        """This member's end of a group's update: the last report its pull held
        (``pull(defer_complete=True)``; ``result`` None: the pull failed) and
        the bytes its pulls read, for the member that resolved to send."""
        return self._group_messages.member_report(result.held_report if result is not None else b"")

    def send_group_reports(self, answer: GroupAnswer | None, reports: Sequence[MemberReport]) -> list[str]:
        """The member that resolved: every member's report (``member_report``,
        its own included) and the release of ``answer``'s lease in one message.
        Per member, why its report was not taken ("" if it was); that member
        then calls ``report_later``. Never raises."""
        return self._group_messages.reports(answer, reports)

    def report_later(self, result: PullResult | None) -> None:
        """A report ``result`` held was not taken (``send_group_reports``): this
        process's next heartbeat announces its replica again, complete."""
        if result is not None and result.held_report and result.publication is not None:
            self._holdings.report_later(result.publication)

    def _first_resolve(self, model: str, wanted: int | None, group: str, group_round: int,
                       answer: GroupAnswer | None) -> Resolved:
        if answer is not None:
            if answer.model != model or (wanted is not None and wanted != answer.version):
                raise InvalidRequest(f"the group answer is for {answer.model!r} version {answer.version}, not "
                                     f"{model!r} version {'latest' if wanted is None else wanted}")
            try:
                return self._rpc.adopt(model, answer.data)
            except ShareUnusable as e:  # this member's history differs: it asks on its own
                log.info("%r v%d: the group answer is not usable here (%s); resolving", model, answer.version, e)
                wanted, group = answer.version, ""  # that version exactly: no round of the group pins another
        named = self.named_layouts(model)
        return self._holdings.with_agent(
            lambda: self._rpc.resolve(self.agent_id, model, wanted, group=group, group_round=group_round, lease=True,
                                      named_layouts=named, named_wait_s=self._named_wait_s(named)))

    def named_layouts(self, model: str) -> tuple[bytes, ...]:
        """The holders (their server layouts) this process's last pull of ``model``
        read from, if it was steady (every holder's layout known from before, none
        lost): the next pull names them, and the server answers with their replicas
        of the version alone (``server/named.py``). () when not, or switched off
        (``HubConfig.named_wait_s`` < 0)."""
        return self._read_before.get(model, ()) if self.config.named_wait_s >= 0 else ()

    def _named_wait_s(self, named: Sequence[bytes]) -> float:
        return max(0.0, self.config.named_wait_s) if named else 0.0

    def _remember_read(self, model: str, steady: bool, layouts: Iterable[bytes], wave: int) -> None:
        if steady:
            self._read_before[model], self._wave_before[model] = tuple(layouts), wave
        else:
            self._read_before.pop(model, None)
            self._wave_before.pop(model, None)

    def pull(self, model: str, version: int | Literal["latest"] = "latest",
             into: Mapping[str, Entry] | Callable[[Manifest], Mapping[str, Entry]] | None = None, *,
             serve: bool = False, group: str = "", group_round: int = 0, progress: ProgressFn | None = None,
             timeout: float | None = None, before_write: Callable[[], None] | None = None,
             have: int | None = None, answer: GroupAnswer | None = None, fp8: bool = False,
             defer_complete: bool = False, announce_with: Callable[[bytes], bool] | None = None) -> PullResult:
        """Pull a visible version of ``model`` from whoever holds it.

        ``into``: destination per tensor name: a tensor (the whole tensor) or
        ``Shard``s (regions of it: only those bytes are read, from whichever
        holders cover them). Checked against the manifest region by region
        before any byte moves; bytes land in place. Without it, new whole
        tensors are allocated. It may also be a function of the resolved
        version's manifest that returns that mapping, for a destination whose
        names depend on the publisher's (``tensorhub.experts.onto``: a
        checkpoint's per-expert tensors onto a version of fused experts).
        ``serve=True`` publishes the destination as a
        replica of exactly those regions as chunks land (pipeline replication):
        unpublish ``result.publication`` before modifying it.
        ``group``/``group_round``: all members of a group asking in the same
        round receive the same version (the first request fixes it).
        ``before_write``: called once the version is resolved and ``into``
        checked, before the destination is registered or written; what it
        raises ends the pull. A serving reader that re-fills the buffer of its
        previous version waits there for that version's withdrawal, which it
        started before the pull: the withdrawal overlaps the resolve.
        ``have=u``: ``into`` holds version u now. Where the version's holders
        published deltas from u that cover ``into`` (``publish(delta_from=u)``),
        only those are read and ``into`` is patched in place, then checked
        against the version's chunk checksums; a mismatch, or no such deltas,
        reads the version whole (``HubConfig.delta="off"``: always). Serving,
        the reader serves the deltas it read too.
        ``answer``: what another member of this process's group resolved for it
        (``resolve_for_group``): no Resolve is sent unless it is unusable here.
        ``defer_complete=True`` (a member of a group, with ``answer``): the
        serving pull's last report and the bytes read are not sent but held
        (``result.held_report``), for the member that resolved to send with
        the others' in one message (``member_report``, ``send_group_reports``).
        ``announce_with`` (a member of a group): the serving pull's announce,
        encoded, is handed to it before any byte is read; it returns whether the
        server took it (the group's first member sends every member's in one
        Batch: ``engineshare``). It is called exactly once per pull, with b""
        where there is nothing to hand over (not serving, a delta pull, a
        failure before it), so that a collective behind it sees every member.
        ``fp8=True``: pull the version's block-FP8 companion (``publish(fp8=True)``,
        model ``<model>@fp8``) instead; ``into``'s float8 tensors must be 2-D with
        their fp32 ``_scale_inv`` beside them, checked before any byte moves.
        """
        share, ahead = AnnounceOnce(announce_with), AheadUse()
        try:
            return self._pull(model, version, into, serve=serve, group=group, group_round=group_round,
                              progress=progress, timeout=timeout, before_write=before_write, have=have, answer=answer,
                              fp8=fp8, defer_complete=defer_complete, share=share, ahead=ahead)
        finally:
            share(b"")
            if not ahead.opened:
                self._drop_ahead(ahead.announce)

    def _pull(self, model: str, version: int | Literal["latest"],
              into: Mapping[str, Entry] | Callable[[Manifest], Mapping[str, Entry]] | None, *, serve: bool,
              group: str, group_round: int, progress: ProgressFn | None, timeout: float | None,
              before_write: Callable[[], None] | None, have: int | None, answer: GroupAnswer | None, fp8: bool,
              defer_complete: bool, share: AnnounceOnce, ahead: AheadUse) -> PullResult:
        model = _check_model(model)
        if fp8:
            check_fp8_pull(model, into)
            model = fp8_model(model)
        wanted = None if version == "latest" else _check_version(version)
        ahead.announce = self._aheads.pop((model, wanted), None) if wanted is not None else None
        start = time.perf_counter()
        resolved = self._first_resolve(model, wanted, group, group_round, answer)
        if serve:
            self._refuse_second_replica(model, resolved)
        else:
            share(b"")  # nothing to announce: the group goes on at once
        manifest = resolved.manifest
        # Chunks as the publishers cut theirs: a serving reader's chunk i then
        # lines up with its sources', and the pull is paced as they chose.
        chunk_size = min((r.chunk_size for r in resolved.replicas if r.chunk_size), default=self.config.chunk_size)
        publication = None
        try:
            if callable(into):
                into = into(manifest)
            if into is None:
                read_set = ReadSet(destination_parts(manifest, None, model=model, version=resolved.version))
            else:
                read_set = self._read_sets.parts(manifest, into, model=model, version=resolved.version)
            parts = read_set.parts
            names = None
            if have is not None and into is not None and self.config.delta != "off":
                have = _check_version(have)
                names = covering_deltas(resolved, parts, have) if have != resolved.version else None
        except BaseException:
            self._rpc.release_lease_async(self.agent_id, resolved.lease_id)
            raise
        if names is not None:
            share(b"")  # a patched destination is published whole, on its own
            self._drop_ahead(ahead.announce)  # (withdrawn before it publishes: one replica per version)
            ahead.announce = None
            # The version's own holders are not read: their lease goes now.
            self._rpc.release_lease_async(self.agent_id, resolved.lease_id)
            wrote = [False]

            def write() -> None:
                wrote[0] = True
                if before_write is not None:
                    before_write()

            deadline = time.monotonic() + (timeout or self.config.pull_timeout_s)
            outcome = self._deltas.pull(resolved, parts, have, names, serve=serve, before_write=write,
                                        deadline=deadline)
            if outcome is not None and outcome.status == "patched":
                return self._patched(resolved, parts, have, outcome, serve=serve, start=start)
            if wrote[0]:
                before_write = None  # it ran: v is pulled whole into what it released
            resolved = self._holdings.with_agent(lambda: self._rpc.resolve(
                self.agent_id, model, resolved.version, group=group, group_round=group_round, lease=True))
        try:
            if before_write is not None:
                before_write()
            if serve:
                self._destinations.uncache(parts)
                publication = self._holdings.open_filling(
                    model, resolved.version, manifest, parts, chunk_size, resolved.replicas, announce=False,
                    replica_id=ahead.announce.replica_id if ahead.announce is not None else None)
                ahead.opened = True
                registration = publication.registration
            else:
                registration = self._destinations.register(parts, cache=into is not None)
        except BaseException:
            # The resolve leased the sources; unreleased, that lease would hold
            # their unpublish for a whole TTL although no byte will be read.
            self._rpc.release_lease_async(self.agent_id, resolved.lease_id)
            raise
        reports = None
        if publication is not None:
            announced = False
            if ahead.announce is not None and ahead.announce.taken and \
                    ahead_announce.matches(self._holdings, self._rpc, publication, ahead.announce):
                announced = True  # it went with the group's Resolve
                share(b"")
            elif share.waiting:  # a group takes the announce (its encoding is wasted otherwise)
                data = self._holdings.group_announce(publication)
                with publication.confirming(self._rpc.timeout_s):
                    announced = share(data)
                if announced:
                    self._holdings.group_announce_taken(publication, data)
            publication.announce_pending = not announced  # else its reports thread announces it first
            reports = LandedReports(self._holdings, publication, announced=announced, paced_from_start=resolved.named)
        layout = self._read_sets.layout(read_set, manifest, registration.regions, chunk_size)
        job = PullJob(
            rpc=self._holdings.control_plane(), nixl=self._nixl, agent_id=self.agent_id, labels=self.config.labels,
            resolved=resolved,
            layout=layout, plans=self._plans.plans(layout), dest_kind=registration.kind,
            in_flight=2 * max(1, self.config.read_workers), chunk_timeout_s=self.config.chunk_timeout_s,
            seeds_per_zone=self.config.seeds_per_zone, progress=progress, verify=self.config.verify_chunks,
            deadline=time.monotonic() + (timeout or self.config.pull_timeout_s),
            landed=reports.submit if reports is not None else None,
            failure_detection_s=self._nixl.failure_detection_s, wide=self._wide_reads(registration.kind),
            news=self._pull_news(model, resolved.version, publication) if self._news is not None else None,
            wave_readers=self._wave_before.get(model, 0),
        )
        if reports is not None and job.news is not None:
            reports.tell = job.news.tell
            reports.server_pace = lambda: job.server_pace_s
        try:
            stats = job.run()
            held_report = b""
            if publication is not None:
                held_report = reports.finish(hold_last=defer_complete)  # the last report says complete
        except BaseException:
            if publication is not None:
                reports.abandon()
                try:
                    publication.unpublish(timeout=self._holdings.lease_ttl_s + 1)
                except TensorHubError as e:
                    log.warning("could not withdraw the partial replica: %s", e)
            else:
                self._destinations.release(registration, cached=into is not None)
            raise
        self._rpc.report_pulled(self.agent_id, _bytes_by_kind(stats), flush=not defer_complete)
        path = path_of(earlier_pulls=job.plans.pulls, holders_read=stats.lean_sources.items(),
                       lost=stats.lost_sources, plans_made=stats.plans_made)
        self._remember_read(model, job.plans.pulls > 0 and not stats.lost_sources
                            and all(stats.lean_sources.values()), stats.read_layouts, stats.wave_readers)
        job.plans.pulls += 1
        self._rpc.report_path(path.replayed)
        if publication is None:
            self._destinations.release(registration, cached=into is not None)
        return PullResult(model=model, version=resolved.version, tensors=result_tensors(parts), nbytes=stats.nbytes,
                          seconds=time.perf_counter() - start, bytes_by_source=stats.bytes_by_source,
                          lost_sources=stats.lost_sources, sources_read_again=stats.sources_read_again,
                          publication=publication,
                          verified_bytes=stats.verified_bytes, unverified_bytes=stats.unverified_bytes,
                          checks_failed=stats.checks_failed, checks_failed_unplaced=stats.checks_failed_unplaced,
                          read_bytes=stats.read_bytes, descriptors=stats.descriptors,
                          chunk_sources=stats.chunk_sources, plans_reused=stats.plans_reused,
                          refreshes=stats.refreshes, news_heard=stats.news_heard, subscribers=stats.subscribers,
                          path=path.path,
                          not_replayed=path.why, held_report=held_report, named=resolved.named)

    def _patched(self, resolved: Resolved, parts: list, have: int, outcome: DeltaOutcome, *, serve: bool,
                 start: float) -> PullResult:
        """The result of a pull that patched its destination from deltas; serving,
        the destination is published whole, naming the deltas it serves too."""
        publication = None
        if serve:
            chunk_size = min((r.chunk_size for r in resolved.replicas if r.chunk_size), default=self.config.chunk_size)
            self._destinations.uncache(parts)
            publication = self._holdings.publish(resolved.model, resolved.version, resolved.manifest, parts, chunk_size,
                                                 origin=False, deltas=outcome.deltas, companions=outcome.publications)
        return PullResult(model=resolved.model, version=resolved.version, tensors=result_tensors(parts),
                          nbytes=sum(p.nbytes for p in parts), seconds=time.perf_counter() - start,
                          bytes_by_source=outcome.bytes_by_source, publication=publication,
                          verified_bytes=outcome.verified_bytes, unverified_bytes=outcome.unverified_bytes,
                          read_bytes=outcome.delta_bytes, delta_from=have, delta_bytes=outcome.delta_bytes,
                          path=DELTA, not_replayed="a delta pull (have=) patches the destination instead")

    def _pull_news(self, model: str, version: int, publication: Publication | None) -> PullNews:
        """A pull's side of the chunk news (``peernews``): a serving pull names
        its replica, and the holders it subscribes to reach it by its
        registration; one that does not serve, by its agent's connection."""
        if publication is None:
            return PullNews(self._news, model=model, version=version, me=self.agent_id,
                            metadata=self._nixl.listen_metadata())
        regions = np.array([(r.addr, r.size, r.device_id) for r in publication.registration.regions], np.int64)
        return PullNews(self._news, model=model, version=version, me=self.agent_id,
                        replica_id=publication.replica_id, metadata=publication.registration.metadata,
                        regions=regions.reshape(-1, 3), landed_now=publication.landed)

    def _wide_reads(self, dest_kind: MemoryKind) -> WideReads:
        """Wide READs into host memory only: the cut is a host copy (a GPU
        destination reads its exact runs)."""
        if dest_kind != MemoryKind.DRAM or self.config.read_cost == "exact":
            return WideReads()
        labels, setting = self.config.labels, self.config.read_cost

        def cost(replica: RemoteReplica) -> LinkCost | None:
            return pick(setting, same_host=labels.tier(replica.source.labels) == 0,
                        device_memory=replica.kind == MemoryKind.VRAM)

        return WideReads(self._scratch, cost)

    def _refuse_second_replica(self, model: str, resolved: Resolved) -> None:
        """The server takes one replica per process and version: a serving pull
        of a version this process already serves would move every byte, then
        be refused (the fault campaign's readers pulled 'latest' just as newer
        versions stopped being visible). Refused before any READ instead."""
        serving = [p for p in self._holdings.find(model, resolved.version) if p.announced]
        if serving:
            self._rpc.release_lease_async(self.agent_id, resolved.lease_id)
            raise AlreadyPublished(
                f"this process already serves {model!r} version {resolved.version} (replica "
                f"{serving[0].replica_id}): a serving pull of it would be a second replica; nothing was read. "
                "Unpublish it first, or pull another version")

    # ---------------------------------------------------------------- queries

    def versions(self, model: str) -> list[int]:
        """Versions of ``model`` that are visible now (their holders cover every element), ascending."""
        return [v.version for v in self._rpc.list_versions(_check_model(model)) if v.visible]

    def latest(self, model: str) -> int:
        """The highest visible version of ``model``; VersionNotFound if none."""
        versions = self.versions(model)
        if not versions:
            raise VersionNotFound(model, "latest")
        return versions[-1]

    def latest_near(self, model: str) -> int:
        """The highest visible version of ``model`` that a complete replica of
        another process in this one's zone (or nearer: rack, host) holds whole; VersionNotFound
        if none. A rollout across a slow link moves to this one, not ``latest``:
        it keeps generating on the version it has while the next one crosses to
        its zone's seed, and then reads it from there. Asks the server about
        the visible versions, newest first, until one qualifies."""
        model = _check_model(model)
        me = self.config.labels
        for version in reversed(self.versions(model)):
            try:
                resolved = self._rpc.resolve(self.agent_id, model, version)
            except VersionNotFound:  # let go since it was listed
                continue
            tensors = len(resolved.manifest.tensors)
            for r in resolved.replicas:
                if (r.source.complete and me.tier(r.source.labels) <= 2 and len(r.held) == tensors
                        and all(region.whole for _, region in r.held)):
                    return version
        raise VersionNotFound(model, "latest", f"no complete replica of {model!r} in zone {me.zone!r}")

    def wait_for_version(self, model: str, at_least: int = 0, timeout: float = 60.0) -> int:
        """Block until a version >= ``at_least`` of ``model`` is visible and return
        the highest visible one; VersionNotFound after ``timeout`` seconds. The
        server answers as soon as it happens (a long poll, not a poll loop). A
        server out of reach (restarting) is asked again until the deadline, then
        ServerUnavailable is raised."""
        model, at_least = _check_model(model), _check_version(at_least)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                found = self._rpc.wait_for_version(model, at_least, max(0.0, min(left, _WAIT_POLL_S)))
            except ServerUnavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
                continue
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                raise VersionNotFound(model, f">= {at_least}",
                                      f"no version >= {at_least} of {model!r} became visible within {timeout:.1f}s")

    def publications(self) -> list[Publication]:
        return self._holdings.publications()

    # ---------------------------------------------------------------- lifecycle

    def close(self, timeout: float = 30.0) -> None:
        """Unpublish everything this process holds (waiting for readers), stop
        heartbeats and release NIXL. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._holdings.close(timeout)
        self._shutdown_local()

    def _shutdown_local(self) -> None:
        self._holdings.shutdown_local()
        self._destinations.close()
        self._scratch.close()
        self._nixl.close()
        self._rpc.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Hub({self.address!r}, name={self.name!r})"
