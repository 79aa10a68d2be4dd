"""Chunk news between relaying readers: a serving pull tells the filling peers
it knows which chunks it just landed, over NIXL notifications, so that they
read them at once instead of asking the server who holds what.

    relay A lands chunk c (checked) ─▶ Holdings.landed: its checksum, its bitmap
                                          ├─▶ news (NIXL notification) ─▶ each filling peer A knows (tell)
                                          └─▶ ReportChunks ─▶ server: joiners, restarts, the record
    peer B's PullJob, every round ─▶ PeerNews.take(model, version) ─▶ PeerProgress.heard: A's bitmap
        and checksums as the news says ─▶ A's holder map again ─▶ chunk c readable, no resolve

Why: a relay wave is a pipeline, and each reader must learn of each chunk its
peers land. Through the server that was a resolve after every round and a long
poll woken by every report: at 16 readers ~150 resolves per reader and version,
about two thirds of all the messages the server received (``tensorhub bench
cluster --versions 3``, docs/history/cluster.md). A notification goes from peer
to peer on the connection the READs use; the server hears the reports as before
and stays the authority on *who* holds the version: a reader still asks it, only
less often once news flows (``PullJob``), and news of a holder the server did
not list to this pull is ignored. News only ever adds chunks a relay has checked
and landed (the same point its report is sent from), with their checksums, so a
pull reads nothing from news that it would not have read from the next answer.

Who is told: the filling peers of the pull's own answers (up to
``MAX_TOLD``), and every reader that subscribed. A pull subscribes to each
filling holder it reads from (once per pull and holder): a NIXL notification,
on the connection its READs opened, carrying how the holder reaches it (a
serving pull's replica id, NIXL metadata and memory regions; another's agent
connection alone: ``NixlAgent.listen_metadata``). The holder's
pull adds it to the peers it tells and at once tells it every chunk it has
landed so far. So news reaches the readers of a relay whether or not the
relay's own answers list them: a steady relay whose answer named only the
holders above it (``server/named.py``) never learns of the readers below it
from the server, and at a thousand readers a relay's answers list only a few
of its filling peers.

    reader B's pull, each round ─▶ filling holders it may read from ─▶ subscribe (once each) ─▶ relay A
    relay A's pull, each round ─▶ PullNews.updates: new subscribers ─▶ tell them what landed so far
    relay A lands chunk c ─▶ tell: its answer's peers + its subscribers

``PeerNews`` is the process's (it calls the NIXL agent); ``PullNews`` one
pull's side of it; the messages and ``PeerProgress`` are pure.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from tensorhub.client.rpc import RemoteReplica, own_chunks
from tensorhub.planner import ring_offset
from tensorhub.transport.nixl import NEWS_TAG

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)
V = TypeVar("V")

# How many filling peers a relay tells of each chunk, at most: every peer of a
# wave of this size. Beyond it, a relay tells the peers nearest after it in the
# ring order (the planner's, the readers' common chunk order). Telling every
# peer of a wave of 1,024 would be a million notifications a version; the
# readers that read from it subscribe (``PullNews.subscribe``), so interest
# bounds it instead, and those it does not know of are told too.
MAX_TOLD = 32

_HEAD = struct.Struct("<HHQI?")  # model length, replica id length, version, chunks, checksums follow
# A subscription: after NEWS_TAG, this mark (never the start of a news head:
# its first two bytes would say a model name of 30,067 bytes), then the head.
SUBSCRIBE = b"sub\0"
# model length, holder's replica id length, subscriber's replica id length, metadata length, version, regions
_SUB_HEAD = struct.Struct("<HHHIQI")


@dataclass(frozen=True, slots=True)
class News:
    """One relay's landed chunks (its own chunk numbers, as in ReportChunks)."""

    model: str
    version: int
    replica_id: str
    chunks: np.ndarray  # int64
    crcs: np.ndarray | None  # uint32, one per chunk; None: the relay derives none


def encode(model: str, version: int, replica_id: str, chunks: Iterable[int], crcs: np.ndarray | None) -> bytes:
    chunk_arr = np.asarray(list(chunks), dtype="<u4")
    m, r = model.encode(), replica_id.encode()
    body = [NEWS_TAG, _HEAD.pack(len(m), len(r), version, len(chunk_arr), crcs is not None), m, r, chunk_arr.tobytes()]
    if crcs is not None:
        body.append(np.asarray(crcs, dtype="<u4").tobytes())
    return b"".join(body)


@dataclass(frozen=True, slots=True)
class Subscription:
    """A reader asking holder ``holder`` (a replica id of this process) for
    its news: where to send it (the reader's replica, as ``PeerNews.tell``
    takes a peer)."""

    model: str
    version: int
    holder: str
    replica_id: str
    metadata: bytes
    regions: np.ndarray  # int64 (N x 3): addr, nbytes, device

    @property
    def peer(self) -> tuple[str, bytes, np.ndarray]:
        return self.replica_id, self.metadata, self.regions


def encode_subscription(model: str, version: int, holder: str, replica_id: str, metadata: bytes,
                        regions: np.ndarray) -> bytes:
    m, h, r = model.encode(), holder.encode(), replica_id.encode()
    regions = np.ascontiguousarray(regions, dtype="<i8").reshape(-1, 3)
    return b"".join([NEWS_TAG, SUBSCRIBE, _SUB_HEAD.pack(len(m), len(h), len(r), len(metadata), version, len(regions)),
                     m, h, r, metadata, regions.tobytes()])


def decode_subscription(message: bytes) -> Subscription | None:
    """The subscription in ``message``; None if it is none or not well formed."""
    if not message.startswith(NEWS_TAG + SUBSCRIBE):
        return None
    at = len(NEWS_TAG) + len(SUBSCRIBE)
    try:
        mlen, hlen, rlen, metalen, version, n = _SUB_HEAD.unpack_from(message, at)
        at += _SUB_HEAD.size
        if at + mlen + hlen + rlen + metalen + 24 * n != len(message):
            return None
        model, at = message[at:at + mlen].decode(), at + mlen
        holder, at = message[at:at + hlen].decode(), at + hlen
        replica_id, at = message[at:at + rlen].decode(), at + rlen
        metadata, at = message[at:at + metalen], at + metalen
        regions = np.frombuffer(message, dtype="<i8", count=3 * n, offset=at).astype(np.int64).reshape(n, 3)
    except (struct.error, UnicodeDecodeError, ValueError):
        return None
    if not replica_id or not metadata:
        return None
    return Subscription(model, version, holder, replica_id, metadata, regions)


def decode(message: bytes) -> News | None:
    """The news in ``message``; None if it is not news or not well formed (a
    notification is never trusted to be either)."""
    if not message.startswith(NEWS_TAG) or message.startswith(NEWS_TAG + SUBSCRIBE):
        return None
    at = len(NEWS_TAG)
    try:
        mlen, rlen, version, n, has_crcs = _HEAD.unpack_from(message, at)
        at += _HEAD.size
        model, at = message[at:at + mlen].decode(), at + mlen
        replica_id, at = message[at:at + rlen].decode(), at + rlen
        want = at + 4 * n * (2 if has_crcs else 1)
        if want != len(message):
            return None
        chunks = np.frombuffer(message, dtype="<u4", count=n, offset=at).astype(np.int64)
        crcs = np.frombuffer(message, dtype="<u4", count=n, offset=at + 4 * n).astype(np.uint32) if has_crcs else None
    except (struct.error, UnicodeDecodeError, ValueError):
        return None
    return News(model, version, replica_id, chunks, crcs)


class PeerProgress:
    """What news said of each filling holder of one pull, laid over the
    server's (older) view of it: an answer that lists fewer chunks than the
    news did must not take them away again."""

    def __init__(self) -> None:
        self._heard: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}  # replica id -> (landed bools, crcs)

    def heard(self, news: News, replica: RemoteReplica) -> RemoteReplica | None:
        """``replica`` with ``news`` applied; None if it adds nothing (or does
        not fit the replica: chunk numbers past its end)."""
        own = own_chunks(replica)
        if own == 0 or replica.source.complete or (len(news.chunks) and int(news.chunks.max()) >= own):
            return None
        landed, crcs = self._heard.get(replica.source.replica_id, (np.zeros(own, bool), None))
        if news.crcs is not None:
            if crcs is None:
                crcs = np.zeros(own, np.uint32)
            crcs[news.chunks] = news.crcs
        new = bool(len(news.chunks)) and not landed[news.chunks].all()
        landed[news.chunks] = True
        self._heard[replica.source.replica_id] = (landed, crcs)
        return self.merged(replica) if new else None

    def merged(self, replica: RemoteReplica) -> RemoteReplica:
        """The server's view of ``replica`` with what news said of it."""
        got = self._heard.get(replica.source.replica_id)
        if got is None or replica.source.complete:
            return replica
        landed, crcs = got
        own = len(landed)
        bits = np.unpackbits(np.frombuffer(replica.bitmap, np.uint8), bitorder="little")[:own] if replica.bitmap \
            else np.zeros(own, np.uint8)
        if len(bits) < own:
            bits = np.concatenate([bits, np.zeros(own - len(bits), np.uint8)])
        both = bits.astype(bool) | landed
        out_crcs = replica.chunk_crc32
        if crcs is not None and out_crcs is not None and len(out_crcs) == own:
            out_crcs = np.where(landed & ~bits.astype(bool), crcs, out_crcs).astype(np.uint32)
        elif crcs is not None and out_crcs is None and replica.bitmap == b"":
            out_crcs = crcs.copy()
        return replace(replica, bitmap=np.packbits(both, bitorder="little").tobytes(), chunk_crc32=out_crcs)


class PeerNews:
    """One process's chunk news: sends it, and files what arrives by (model,
    version) for the pulls listening (news of any other is dropped)."""

    def __init__(self, nixl: object) -> None:
        self._nixl = nixl  # NixlAgent: reach, notify, news
        self._lock = threading.Lock()
        self._boxes: dict[tuple[str, int], list[News]] = {}
        self._subscriptions: dict[tuple[str, int], list[Subscription]] = {}
        self._listeners: dict[tuple[str, int], int] = {}
        self.told = 0  # notifications sent
        self.heard = 0  # news filed for a listening pull
        self.subscribed = 0  # subscriptions sent

    def listen(self, model: str, version: int) -> None:
        with self._lock:
            key = (model, version)
            self._listeners[key] = self._listeners.get(key, 0) + 1
            self._boxes.setdefault(key, [])
            self._subscriptions.setdefault(key, [])

    def stop(self, model: str, version: int) -> None:
        with self._lock:
            key = (model, version)
            left = self._listeners.get(key, 0) - 1
            if left > 0:
                self._listeners[key] = left
            else:
                self._listeners.pop(key, None)
                self._boxes.pop(key, None)
                self._subscriptions.pop(key, None)

    def take(self, model: str, version: int) -> list[News]:
        """News of (model, version) since the last take (files the rest)."""
        return self._take(self._boxes, (model, version))

    def take_subscriptions(self, model: str, version: int) -> list[Subscription]:
        """Readers that asked for the news of (model, version) since the last call."""
        return self._take(self._subscriptions, (model, version))

    def _take(self, boxes: dict[tuple[str, int], list[V]], key: tuple[str, int]) -> list[V]:
        """What NIXL received filed, then ``boxes[key]`` emptied (a pull's side only listens to its own)."""
        with self._lock:
            self._file()
            box = boxes.get(key)
            if not box:
                return []
            boxes[key] = []
            return box

    def _file(self) -> None:  # under the lock
        """What NIXL received, by (model, version), for the pulls listening (the rest dropped)."""
        for _, message in self._nixl.news():
            subscription = decode_subscription(message)
            if subscription is not None:
                box = self._subscriptions.get((subscription.model, subscription.version))
                if box is not None:
                    box.append(subscription)
                continue
            news = decode(message)
            if news is None:
                continue
            box = self._boxes.get((news.model, news.version))
            if box is not None:
                box.append(news)
                self.heard += 1

    def subscribe(self, holder: tuple[str, bytes, np.ndarray], message: bytes) -> bool:
        """Send a subscription (``encode_subscription``) to ``holder`` (replica
        id, metadata, regions: the agent this pull reads from); whether it went."""
        replica_id, metadata, regions = holder
        try:
            self._nixl.notify(self._nixl.reach(replica_id, metadata, regions), message)
        except Exception as e:  # noqa: BLE001  the holder is gone or closing: its READs will say so
            log.debug("subscription to %s not sent: %s", replica_id, e)
            return False
        self.subscribed += 1
        return True

    def tell(self, peers: Iterable[tuple[str, bytes, np.ndarray]], message: bytes) -> list[str]:
        """Send ``message`` to each peer (replica id, its NIXL metadata, its
        memory regions: ``NixlAgent.reach``); the
        replica ids of those that could not be reached (gone or closing: their
        pulls ask the server instead), which the caller stops telling."""
        failed = []
        for replica_id, metadata, regions in peers:
            try:
                remote = self._nixl.reach(replica_id, metadata, regions)
                self._nixl.notify(remote, message)
                self.told += 1
            except Exception as e:  # noqa: BLE001
                log.debug("chunk news to %s not sent: %s", replica_id, e)
                failed.append(replica_id)
        return failed


class PullNews:
    """One pull's side of the news (``PullJob``): the filling peers it tells
    and what it heard of each. ``tell`` runs on the pull's reports thread
    (``LandedReports``), the rest on the pull's own. A context: listening while
    the pull runs."""

    def __init__(self, news: PeerNews, *, model: str, version: int, me: str, replica_id: str = "",
                 metadata: bytes = b"", regions: np.ndarray | None = None,
                 landed_now: Callable[[], tuple[np.ndarray, np.ndarray | None]] | None = None) -> None:
        """``replica_id``: this pull's own replica when it serves (what its news
        names); ``metadata`` and ``regions``: how a holder it subscribes to
        reaches it (its replica's; a pull that does not serve, its agent's
        connection: ``NixlAgent.listen_metadata``, no regions); ``landed_now``:
        the chunks it has landed so far and their checksums, told to a new
        subscriber at once."""
        self._news, self.model, self.version = news, model, version
        self._me = me  # this pull's agent id: where it stands in the ring order
        self._replica_id = replica_id  # its own replica, when it serves (what its news names); "" tells nobody
        # Who it is to the holders it subscribes to: its replica, or its agent (a key "<agent id>.<anything>")
        self._listen_as = replica_id or f"{me}.listen"
        self._metadata = metadata
        self._regions = regions if regions is not None else np.zeros((0, 3), np.int64)
        self._landed_now = landed_now
        self._progress = PeerProgress()
        self._peers: tuple[tuple[str, bytes, np.ndarray], ...] = ()  # (replica id, metadata, regions)
        # Readers that subscribed to this pull's news; replaced whole (``tell`` runs on another thread)
        self._subscribers: tuple[tuple[str, bytes, np.ndarray], ...] = ()
        self._subscribed: set[str] = set()  # holders this pull subscribed to (or tried)
        self._untold: set[str] = set()  # peers a news could not reach: not told again
        self.heard = 0  # news that told this pull of chunks it did not know of
        # Holders whose news came but the server's answers to this pull did not list (a relay that
        # announced after this pull's last answer): the pull asks the server about them once
        self._strangers: set[str] = set()
        self._asked_about: set[str] = set()

    def __enter__(self) -> Self:
        self._news.listen(self.model, self.version)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._news.stop(self.model, self.version)

    def merged(self, replica: RemoteReplica) -> RemoteReplica:
        """The server's view of a filling holder with what news said of it since (never less)."""
        return self._progress.merged(replica)

    def know(self, filling: list[RemoteReplica]) -> None:
        """The filling peers of the server's latest answer: this pull tells all
        of them up to ``MAX_TOLD``, else the nearest after it in the ring order."""
        if not self._replica_id:
            return
        ring = 1 << 20
        me = ring_offset(self._me, ring)
        peers = sorted((r for r in filling if r.source.replica_id not in self._untold),
                       key=lambda r: (ring_offset(r.agent_id, ring) - me) % ring)
        self._peers = tuple((r.source.replica_id, r.metadata, r.regions) for r in peers[:MAX_TOLD])

    @property
    def subscribers(self) -> int:
        """Readers that subscribed to this pull's news."""
        return len(self._subscribers)

    def subscribe(self, filling: Iterable[RemoteReplica]) -> None:
        """Ask each filling holder this pull may read from for its news, once."""
        if not self._metadata:
            return
        for r in filling:
            rid = r.source.replica_id
            if rid in self._subscribed or r.source.complete:
                continue
            self._subscribed.add(rid)
            self._news.subscribe((rid, r.metadata, r.regions), encode_subscription(
                self.model, self.version, rid, self._listen_as, self._metadata, self._regions))

    def _admit(self, subscriptions: list[Subscription]) -> None:
        """New subscribers: told from now on, and at once of every chunk landed so far."""
        if not self._replica_id:
            return
        known = {p[0] for p in self._subscribers} | self._untold
        for sub in subscriptions:
            if sub.holder != self._replica_id or sub.replica_id in known or sub.replica_id == self._replica_id:
                continue
            known.add(sub.replica_id)
            # Told first, then caught up: a chunk that lands meanwhile is in the
            # catch-up or in a news the reports thread sends it (or in both).
            self._subscribers = (*self._subscribers, sub.peer)
            if self._landed_now is None:
                continue
            chunks, crcs = self._landed_now()
            if len(chunks):
                failed = self._news.tell([sub.peer], encode(self.model, self.version, self._replica_id,
                                                             chunks.tolist(), crcs))
                self._drop(failed)

    def _drop(self, failed: Iterable[str]) -> None:
        self._untold.update(failed)
        self._peers = tuple(p for p in self._peers if p[0] not in self._untold)
        self._subscribers = tuple(p for p in self._subscribers if p[0] not in self._untold)

    def tell(self, chunks: list[int], crcs: np.ndarray | None) -> bool:
        """Tell the peers and the subscribers that ``chunks`` of this pull's
        replica landed (with their checksums); whether one was told. A peer a
        news cannot reach is not told again by this pull."""
        peers = self._peers
        ids = {p[0] for p in peers}
        targets = peers + tuple(p for p in self._subscribers if p[0] not in ids)
        if not targets:
            return False
        failed = self._news.tell(targets, encode(self.model, self.version, self._replica_id, chunks, crcs))
        if failed:
            self._drop(failed)
        return len(failed) < len(targets)

    @property
    def strangers(self) -> bool:
        """Whether news came from a holder the server's answers did not list to
        this pull and it has not asked about since: it asks now (its asks are
        otherwise paced, and a relay that announced after its last answer is
        one it may read from)."""
        return bool(self._strangers)

    def asked(self) -> None:
        """The pull asked the server who holds the version: the strangers so far are asked about."""
        self._asked_about |= self._strangers
        self._strangers = set()

    def updates(self, replicas: Mapping[str, RemoteReplica]) -> dict[str, RemoteReplica]:
        """Of ``replicas`` (the holders the pull knows, by replica id), those
        whose news since the last call told of chunks not known: their new views.
        News of a holder not in ``replicas`` is not used."""
        self._admit(self._news.take_subscriptions(self.model, self.version))
        out: dict[str, RemoteReplica] = {}
        for news in self._news.take(self.model, self.version):
            replica = out.get(news.replica_id) or replicas.get(news.replica_id)
            if replica is None:
                if news.replica_id not in self._asked_about:
                    self._strangers.add(news.replica_id)
                continue
            new = self._progress.heard(news, replica)
            if new is not None:
                out[news.replica_id] = new
                self.heard += 1
        return out
