"""A wave of spot rollouts joining together relays among itself.

Found by ``tensorhub bench rl scenario=elastic``: three spot joiners and one
reliable rollout holding the version complete. The planner ranked reliable
before spot, so for the chunks a joiner meant to take from a filling peer
(``PullJob._batch``'s relay share) it still chose the reliable rollout: all
three read the whole version from it and queued on its one link (6.7 s, as
slow as plain point-to-point). Chunks marked ``relayed`` go to a filling
holder of the whole chunk first; every other chunk ranks as before."""

from __future__ import annotations

from tensorhub.planner import Source, choose_sources
from tensorhub.topology import Labels, Reliability

READER = Labels("h0", "r0", "z0")


def _src(rid: str, host: str, **kw) -> Source:
    return Source(replica_id=rid, agent_name=rid, labels=Labels(host, "r0", "z0"), **kw)


def test_relayed_chunks_come_from_a_filling_spot_peer_before_the_reliable_holder():
    reliable = _src("r3", "h3")  # a rollout that holds the version complete
    trainer = _src("trainer", "h9", origin=True)
    peer = _src("r1#1", "h1", reliability=Reliability.SPOT, complete=False)  # a joiner beside the reader
    sources = [reliable, trainer, peer]
    holders = {0: {"r3": True, "trainer": True, "r1#1": True}, 1: {"r3": True, "trainer": True, "r1#1": True},
               2: {"r3": True, "trainer": True}}
    plan = choose_sources(holders, sources, READER, relayed={0, 1})
    assert plan.order[0] == ["r1#1", "r3", "trainer"] and plan.order[1][0] == "r1#1"
    assert plan.order[2] == ["r3", "trainer"]
    # Without the mark, the ranking is unchanged: reliable (even the origin) before spot.
    assert choose_sources(holders, sources, READER).order[0] == ["r3", "trainer", "r1#1"]


def test_relaying_never_prefers_a_part_or_a_farther_peer():
    reliable = _src("r3", "h3")
    part = _src("part", "h1", reliability=Reliability.SPOT, complete=False)
    far = Source("far", "far", Labels("h7", "r7", "z7"), complete=False)
    holders = {0: {"r3": True, "part": False}, 1: {"r3": True, "far": True}}
    plan = choose_sources(holders, [reliable, part, far], READER, relayed={0, 1})
    assert plan.order[0] == ["r3", "part"]  # one read of the whole chunk first
    assert plan.order[1] == ["r3", "far"]  # nearer first, always


def test_relayed_chunks_spread_over_filling_peers_reliable_or_spot():
    # A reliable rollout fills the same version ahead of the wave: ranked first
    # for every relayed chunk, it took three joiners' relayed chunks on its one
    # link while theirs idled (tensorhub bench rl, elastic: joins of 4.1-4.9 s).
    ahead = _src("r3", "h3", complete=False, active_reads=2)
    trainer = _src("trainer", "h9", origin=True)
    peer = _src("r1#1", "h1", reliability=Reliability.SPOT, complete=False, active_reads=1)
    other = _src("r2#1", "h2", reliability=Reliability.SPOT, complete=False, active_reads=1)
    sources = [ahead, trainer, peer, other]
    holders = {c: {"r3": True, "trainer": True, "r1#1": True, "r2#1": True} for c in range(6)}
    plan = choose_sources(holders, sources, READER, relayed=set(range(6)))
    firsts = [plan.order[c][0] for c in range(6)]
    assert "trainer" not in firsts
    assert 1 <= firsts.count("r3") <= 2 and firsts.count("r1#1") == firsts.count("r2#1") == 2, firsts
    # Not relayed: reliable before spot, as before.
    assert choose_sources(holders, sources, READER).order[0][0] == "r3"
