"""Chunk news between relaying peers (tensorhub.client.peernews): the message,
what a pull makes of it beside the server's answers, and the per-process
mailbox. The whole path between real processes over NIXL is in
tests/core/test_hosts.py (relays that start together hear each other)."""

from __future__ import annotations

import numpy as np

from tensorhub.client.peernews import (
    News,
    PeerNews,
    PeerProgress,
    PullNews,
    decode,
    decode_subscription,
    encode,
    encode_subscription,
)
from tensorhub.client.rpc import RemoteReplica
from tensorhub.planner import Source
from tensorhub.regions import Region
from tensorhub.topology import Labels, Reliability
from tensorhub.transport import MemoryKind
from tensorhub.transport.nixl import NEWS_TAG

CHUNK = 4096
OWN = 20  # chunks of the replica's own bytes


def _replica(landed=(), *, complete=False, crcs=None, rid="r1.0"):
    bits = np.zeros(OWN, np.uint8)
    bits[list(landed)] = 1
    source = Source(rid, rid, Labels(rid), origin=False, complete=complete, reliability=Reliability.SPOT)
    regions = np.array([[0x1000, OWN * CHUNK - 100, 0]], dtype=np.int64)  # the last chunk is short
    return RemoteReplica(source, rid.rpartition(".")[0], MemoryKind.DRAM, ((0, Region()),), regions, b"meta", CHUNK,
                         bitmap=b"" if complete else np.packbits(bits, bitorder="little").tobytes(),
                         chunk_crc32=crcs)


def _landed(replica):
    bits = np.unpackbits(np.frombuffer(replica.bitmap, np.uint8), bitorder="little")[:OWN]
    return set(np.flatnonzero(bits).tolist())


def test_news_round_trips_with_and_without_checksums():
    crcs = np.array([7, 0xFFFFFFFF, 3], np.uint32)
    got = decode(encode("policy/lora/a", 12, "agent-x.3", [4, 0, 19], crcs))
    assert (got.model, got.version, got.replica_id) == ("policy/lora/a", 12, "agent-x.3")
    assert got.chunks.tolist() == [4, 0, 19] and got.crcs.tolist() == crcs.tolist()
    bare = decode(encode("m", 1, "a.0", [2], None))
    assert bare.chunks.tolist() == [2] and bare.crcs is None


def test_anything_else_is_not_news():
    good = encode("m", 1, "a.0", [2, 3], np.array([1, 2], np.uint32))
    for message in (b"", b"THQ1 a push request", NEWS_TAG, good[:-1], good + b"x", NEWS_TAG + b"\xff" * 30,
                    good.replace(b"m", b"\xff", 1)):
        assert decode(message) is None, message


def test_news_adds_chunks_and_their_checksums_to_the_servers_view():
    progress = PeerProgress()
    server = _replica({0}, crcs=np.zeros(OWN, np.uint32))
    heard = progress.heard(News("m", 1, "r1.0", np.array([3, 5]), np.array([33, 55], np.uint32)), server)
    assert _landed(heard) == {0, 3, 5}
    assert heard.chunk_crc32[[3, 5]].tolist() == [33, 55]
    # Nothing new: no new view (the pull keeps its holder map)
    assert progress.heard(News("m", 1, "r1.0", np.array([3]), np.array([33], np.uint32)), heard) is None


def test_an_older_answer_from_the_server_does_not_take_heard_chunks_away():
    progress = PeerProgress()
    progress.heard(News("m", 1, "r1.0", np.array([7]), np.array([77], np.uint32)),
                   _replica(crcs=np.zeros(OWN, np.uint32)))
    # The server's next answer lists chunk 1 (reported) but not yet 7 (told first)
    merged = progress.merged(_replica({1}, crcs=np.where(np.arange(OWN) == 1, 11, 0).astype(np.uint32)))
    assert _landed(merged) == {1, 7}
    assert merged.chunk_crc32[[1, 7]].tolist() == [11, 77]
    # A replica nobody told of is the server's view, unchanged
    other = _replica({2}, rid="r2.0")
    assert progress.merged(other) is other


def test_news_that_does_not_fit_the_holder_is_ignored():
    progress = PeerProgress()
    assert progress.heard(News("m", 1, "r1.0", np.array([OWN]), None), _replica()) is None  # past its last chunk
    complete = _replica(complete=True)
    assert progress.heard(News("m", 1, "r1.0", np.array([1]), None), complete) is None
    assert progress.merged(complete) is complete


class _Agent:
    """The NIXL agent's side of PeerNews: a notification queue, sends that may fail."""

    def __init__(self, queue=(), dead=()):
        self.queue, self.dead, self.sent = list(queue), set(dead), []

    def news(self):
        out, self.queue = self.queue, []
        return out

    def reach(self, key, metadata, regions=None):
        if key in self.dead:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        return key.rpartition(".")[0]

    def notify(self, remote, message):
        self.sent.append((remote, message))


def test_the_mailbox_files_news_for_the_pulls_listening_and_drops_the_rest():
    one, two, late = (encode("m", v, "p.0", [v], None) for v in (1, 2, 3))
    agent = _Agent([("p", one), ("p", two), ("p", late), ("p", b"garbage")])
    news = PeerNews(agent)
    news.listen("m", 1)
    news.listen("m", 2)
    assert [n.version for n in news.take("m", 1)] == [1]
    assert [n.version for n in news.take("m", 2)] == [2]  # filed by the first take
    assert news.take("m", 2) == [] and news.take("m", 3) == []  # nobody listened to version 3
    news.stop("m", 1)
    agent.queue = [("p", one)]
    assert news.take("m", 2) == [] and news.heard == 2


def test_a_peer_that_cannot_be_told_is_named():
    agent = _Agent(dead={"gone.0"})
    regions = np.zeros((1, 3), np.int64)
    failed = PeerNews(agent).tell([(rid, b"m", regions) for rid in ("a.0", "gone.0", "b.0")], b"THN1 x")
    assert failed == ["gone.0"]
    assert [remote for remote, _ in agent.sent] == ["a", "b"]


# ------------------------------------------------------------------ subscriptions

REGIONS = np.array([[0x2000, 4096, 0], [0x9000, 100, 0]], np.int64)


def test_a_subscription_round_trips_and_is_never_news():
    message = encode_subscription("policy", 7, "relay.3", "reader.5", b"nixl-meta", REGIONS)
    sub = decode_subscription(message)
    assert (sub.model, sub.version, sub.holder, sub.replica_id, sub.metadata) == (
        "policy", 7, "relay.3", "reader.5", b"nixl-meta")
    assert sub.regions.tolist() == REGIONS.tolist()
    assert decode(message) is None  # the same tag as news: a pull never reads it as chunks
    news = encode("m", 1, "a.0", [2], None)
    for bad in (news, message[:-1], message + b"x", b"", encode_subscription("m", 1, "h.0", "", b"x", REGIONS),
                encode_subscription("m", 1, "h.0", "r.0", b"", REGIONS)):
        assert decode_subscription(bad) is None, bad


def _serving_pull(news, rid="relay.1", landed=((), None)):
    return PullNews(news, model="m", version=1, me=rid.rpartition(".")[0], replica_id=rid, metadata=b"meta-" +
                    rid.encode(), regions=REGIONS, landed_now=lambda: (np.array(landed[0], np.int64), landed[1]))


def test_a_reader_subscribes_once_to_each_filling_holder_it_reads_from():
    agent = _Agent()
    pull = _serving_pull(PeerNews(agent), "reader.1")
    filling, other, complete = _replica(rid="relay.0"), _replica(rid="relay2.0"), _replica(rid="t.0", complete=True)
    pull.subscribe([filling, complete])
    pull.subscribe([filling, other])
    sent = [(remote, decode_subscription(m)) for remote, m in agent.sent]
    assert [(remote, sub.holder) for remote, sub in sent] == [("relay", "relay.0"), ("relay2", "relay2.0")]
    assert {(sub.replica_id, sub.metadata) for _, sub in sent} == {("reader.1", b"meta-reader.1")}
    # A pull that does not serve subscribes as its agent (its connection's metadata, no regions)
    leaf = PullNews(PeerNews(agent), model="m", version=1, me="leaf", metadata=b"conn")
    leaf.subscribe([_replica(rid="relay3.0")])
    sub = decode_subscription(agent.sent[-1][1])
    assert (sub.replica_id, sub.metadata, sub.regions.shape) == ("leaf.listen", b"conn", (0, 3))
    # Without a way to be reached, nobody
    PullNews(PeerNews(agent), model="m", version=1, me="x").subscribe([_replica(rid="relay4.0")])
    assert len(agent.sent) == 3


def test_a_subscriber_is_told_what_landed_so_far_then_every_landing():
    agent = _Agent()
    news = PeerNews(agent)
    relay = _serving_pull(news, "relay.0", landed=([0, 3], np.array([10, 13], np.uint32)))
    with relay:
        # The relay's own answers listed no peer; a reader below it subscribes
        agent.queue = [("reader", encode_subscription("m", 1, "relay.0", "reader.1", b"meta", REGIONS)),
                       ("x", encode_subscription("m", 1, "someone-else.0", "reader.2", b"meta", REGIONS)),
                       ("y", encode_subscription("m", 2, "relay.0", "reader.3", b"meta", REGIONS))]
        relay.updates({})
        assert relay.subscribers == 1  # not for this replica, not for this version: ignored
        (remote, caught_up), = agent.sent
        told = decode(caught_up)
        assert remote == "reader" and told.chunks.tolist() == [0, 3] and told.crcs.tolist() == [10, 13]
        assert relay.tell([5], np.array([15], np.uint32))
        assert decode(agent.sent[-1][1]).chunks.tolist() == [5] and agent.sent[-1][0] == "reader"
        # Subscribing again changes nothing
        agent.queue = [("reader", encode_subscription("m", 1, "relay.0", "reader.1", b"meta", REGIONS))]
        relay.updates({})
        assert relay.subscribers == 1 and len(agent.sent) == 2


def test_a_subscriber_that_cannot_be_reached_is_dropped():
    agent = _Agent(dead={"gone.1"})
    relay = _serving_pull(PeerNews(agent), "relay.0", landed=([1], None))
    with relay:
        agent.queue = [("gone", encode_subscription("m", 1, "relay.0", "gone.1", b"meta", REGIONS))]
        relay.updates({})
        assert relay.subscribers == 0
        assert not relay.tell([2], None)


def test_news_from_a_holder_the_server_did_not_list_makes_the_pull_ask_once():
    agent = _Agent([("late", encode("m", 1, "late.0", [1], None))])
    pull = PullNews(PeerNews(agent), model="m", version=1, me="r")
    with pull:
        assert pull.updates({"r1.0": _replica(rid="r1.0")}) == {}  # not used: the server did not list it
        assert pull.strangers  # ... so the pull asks who holds the version now
        pull.asked()
        assert not pull.strangers
        agent.queue = [("late", encode("m", 1, "late.0", [2], None))]
        pull.updates({})
        assert not pull.strangers  # asked about once: its next news does not ask again
