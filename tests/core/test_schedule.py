"""``tensorhub.schedule``: which chunks a reader reads next and which READ goes out next,
checked over generated waves and rounds (hypothesis) and a few cases spelled out."""

from __future__ import annotations

import itertools
from collections import Counter
from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub import schedule
from tensorhub.planner import ring_offset
from tensorhub.schedule import (
    CHAIN_MIN_READERS,
    CHAIN_PATIENCE_S,
    CHAIN_READS_PER_HOLDER,
    ORIGIN_READS_IN_WAVE,
    WAVE_READS_FACTOR,
    Batch,
    HolderView,
    PostQueue,
    Wave,
    admit,
    alternate,
    by_turns,
    chain_order,
    chain_owners,
    growing,
    next_chunks,
    reader_order,
    reads_in_flight,
    round_over,
)

N = 24


def _holder(agent: str, zone: str, complete: bool, has: set[int], will: set[int] | None = None,
            growing: bool = True) -> HolderView:
    mask = np.zeros(N, bool)
    mask[list(has)] = True
    return HolderView(agent, zone, complete, mask, frozenset(range(N) if will is None else will | has), growing)


chunk_sets = st.sets(st.integers(0, N - 1), max_size=N)


@st.composite
def waves(draw):
    zones = ["z0", "z1"]
    holders = [_holder("trainer", "z0", True, set(range(N)))]
    for i in range(draw(st.integers(0, CHAIN_MIN_READERS + 1))):  # short waves and chains
        has = draw(chunk_sets)
        holders.append(_holder(f"peer{i}", draw(st.sampled_from(zones)), False, has, has | draw(chunk_sets),
                               growing=draw(st.booleans())))
    order = draw(st.permutations(sorted(draw(chunk_sets))))
    wave = Wave(me=draw(st.sampled_from(["me", "you", "a", "b", "c"])), zone=draw(st.sampled_from(zones)), num_chunks=N, in_flight=draw(st.integers(1, 6)),
                seeds_per_zone=draw(st.integers(1, 2)), first=draw(st.booleans()), serving=draw(st.booleans()),
                patience_out=draw(st.booleans()), holders=holders)
    return order, wave


@settings(max_examples=400, deadline=None)
@given(waves())
def test_a_batch_is_chunks_asked_for_once_each_in_order(case):
    order, wave = case
    batch = next_chunks(order, wave)
    assert len(set(batch.chunks)) == len(batch.chunks)
    assert set(batch.chunks) <= set(order)
    position = {c: i for i, c in enumerate(order)}
    relayed = [c for c in batch.chunks if c in batch.relayed]
    own = [c for c in batch.chunks if c not in batch.relayed]
    assert relayed == sorted(relayed, key=position.get) and own == sorted(own, key=position.get)
    assert batch.relayed <= set(batch.chunks)
    peers = [h for h in wave.holders if not h.complete]
    if not peers:  # alone: everything, or one chunk to start a serving reader's first round
        assert batch == Batch(list(order[:1]) if wave.first and wave.serving else list(order))
        return
    assert len(batch.chunks) <= 2 * wave.in_flight
    near = [h for h in peers if h.zone == wave.zone]
    for c in batch.relayed:  # taken from a filling peer of its zone that has it now
        assert any(h.has[c] for h in near)
    chained = len(peers) + 1 >= CHAIN_MIN_READERS and all(h.zone == wave.zone for h in wave.holders)
    if chained:  # a chain: its first reads the origin uncapped, whatever its patience
        first = chain_order([wave.me, *(h.agent_id for h in peers)])[0] == wave.me
        assert batch.origin_cap == (CHAIN_READS_PER_HOLDER if first else ORIGIN_READS_IN_WAVE)
        assert batch.peer_cap == CHAIN_READS_PER_HOLDER
    else:
        assert batch.origin_cap == (0 if wave.patience_out else ORIGIN_READS_IN_WAVE)
    for c, agent in batch.prefer.items():  # a chain's upstream peer, which has the chunk now
        assert c in batch.relayed and any(h.agent_id == agent and h.has[c] for h in near)
    rest = [c for c in order if not any(h.has[c] for h in near)]
    if wave.patience_out and not chained:  # from anyone: the chunks no peer has, in order, nothing skipped for want of an owner
        assert own == rest[:len(own)]
        assert len(batch.chunks) == min(2 * wave.in_flight, len(order)) or own == rest


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), chunk_sets, st.integers(1, 2))
def test_in_a_zone_without_the_origin_each_chunk_crosses_once(readers, in_flight, wanted, seeds):
    """A wave of readers in z1, the trainer in z0, nobody in z1 holding anything
    yet: every chunk is read from across by exactly one of them (a seed)."""
    agents = [f"r{i}" for i in range(readers)]
    order = sorted(wanted)
    takers: dict[int, list[str]] = {c: [] for c in order}
    for me in agents:
        peers = [_holder(a, "z1", False, set()) for a in agents if a != me]
        wave = Wave(me=me, zone="z1", num_chunks=N, in_flight=N, seeds_per_zone=seeds,
                    holders=[_holder("trainer", "z0", True, set(range(N))), *peers])
        for c in next_chunks(order, wave).chunks:
            takers[c].append(me)
    if readers == 1:
        return  # alone: no peers, it reads everything
    assert all(len(who) == 1 for who in takers.values()), takers
    seeds_used = {who[0] for who in takers.values()}
    assert len(seeds_used) <= seeds


def test_peers_chunks_come_from_peers_and_the_reader_keeps_reading_its_own():
    trainer = _holder("trainer", "z0", True, set(range(N)))
    ahead = _holder("ahead", "z0", False, set(range(12)), set(range(12)))  # it reads the first half only
    far = _holder("far", "z1", False, set())  # a wave across zones: shares, not a chain
    wave = Wave(me="me", zone="z0", num_chunks=N, in_flight=4, holders=[trainer, ahead, far])
    batch = next_chunks(list(range(N)), wave)
    assert batch.relayed and batch.relayed <= set(range(12))
    assert [c for c in batch.chunks if c >= 12], "its own share waits while only relayed chunks are read"
    assert batch.origin_cap == 1
    assert next_chunks(list(range(N)), Wave(me="me", zone="z0", num_chunks=N, in_flight=4, patience_out=True,
                                             holders=[trainer, ahead, far])).origin_cap == 0


def _chain_run(wants: dict[str, set[int]], in_flight: int, turns: list[int], joined: dict[str, int]):
    """A one-zone wave played out: in each step the readers (those ``joined``
    by then) take turns in the order ``turns`` gives; each lands at once the
    first ``in_flight`` chunks of its batch, from where the batch says. Returns
    who gave each reader each chunk, and the steps it took."""
    with mock.patch.object(schedule, "CHAIN_MIN_READERS", 2):  # the chain's mechanics, on short waves too
        return _play(wants, in_flight, turns, joined)


def _play(wants: dict[str, set[int]], in_flight: int, turns: list[int], joined: dict[str, int]):
    got: dict[str, dict[int, str]] = {a: {} for a in wants}
    agents = sorted(wants)
    for step in range(4 * N * len(wants) + 8):
        if all(len(got[a]) == len(wants[a]) for a in agents):
            return got, step
        live = [a for a in agents if joined.get(a, 0) <= step]
        for k in range(len(live)):
            me = live[(turns[step % len(turns)] + k) % len(live)]
            peers = [_holder(a, "z0", False, set(got[a]), wants[a]) for a in live if a != me]
            wave = Wave(me=me, zone="z0", num_chunks=N, in_flight=in_flight, held=len(got[me]),
                        holders=[_holder("trainer", "z0", True, set(range(N))), *peers])
            batch = next_chunks(sorted(wants[me] - set(got[me])), wave)
            for c in batch.chunks[:in_flight]:
                if c in batch.prefer:
                    source = batch.prefer[c]
                elif c in batch.relayed:
                    source = next(h.agent_id for h in peers if h.has[c])
                else:
                    source = "trainer"
                got[me][c] = source
    raise AssertionError(f"the wave never finished: {got}")


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 6), st.integers(1, 4), st.lists(st.integers(0, 5), min_size=1, max_size=6), st.data())
def test_a_one_zone_wave_is_a_chain_that_takes_one_copy_from_the_origin(readers, in_flight, turns, data):
    """Readers that start together and all want everything: the first in the
    chain's order reads from the trainer, every other from the one before it;
    the trainer sends each chunk once, whatever order the readers take turns in."""
    wants = {f"r{i}": set(range(N)) for i in range(readers)}
    got, _ = _chain_run(wants, in_flight, turns, {})
    order = chain_order(list(wants))
    for i, agent in enumerate(order):
        assert set(got[agent].values()) == {"trainer" if i == 0 else order[i - 1]}, (agent, got[agent])
    # Read sets of their own (TP slices): still every chunk once from the trainer at most per reader, all done.
    wants = {f"r{i}": data.draw(chunk_sets) for i in range(readers)}
    got, _ = _chain_run(wants, in_flight, turns, {})
    assert all(set(got[a]) == wants[a] for a in wants)


def test_a_wave_shorter_than_chain_min_readers_shares_instead():
    """One zone, every reader wanting everything: a chain from
    ``CHAIN_MIN_READERS`` readers on; fewer share the chunks out (one READ at a
    time on the trainer, none waits behind a peer with nothing yet)."""
    for readers in (CHAIN_MIN_READERS - 1, CHAIN_MIN_READERS):
        names = [f"r{i}" for i in range(readers)]
        me = chain_order(names)[-1]
        peers = [_holder(a, "z0", False, set()) for a in names if a != me]
        wave = Wave(me=me, zone="z0", num_chunks=N, in_flight=2,
                    holders=[_holder("trainer", "z0", True, set(range(N))), *peers])
        batch = next_chunks(list(range(N)), wave)
        if readers < CHAIN_MIN_READERS:
            assert batch.chunks and batch.peer_cap == 0 and batch.origin_cap == ORIGIN_READS_IN_WAVE
        else:
            assert batch.chunks == [] and batch.peer_cap == CHAIN_READS_PER_HOLDER


def test_a_named_reader_sees_one_peer_yet_chains_in_a_long_wave():
    """A steady pull's answer names only the holders it read before: the
    trainer and the peer before it in the chain. Told the wave its last pull
    saw (``Wave.wave_readers``) it still chains: what the peer will hold waits
    for it, nothing comes from the trainer. Seen as a wave of two, it took a
    share from the trainer beside the peer (the bug: 11-25 of 64 chunks a
    version at 8 readers)."""
    names = [f"r{i}" for i in range(8)]
    order = chain_order(names)
    up, me = order[3], order[4]
    peer = _holder(up, "z0", False, set(range(N // 2)))  # half landed, the rest to come
    holders = [_holder("trainer", "z0", True, set(range(N))), peer]
    chained = next_chunks(list(range(N)), Wave(me=me, zone="z0", num_chunks=N, in_flight=2, holders=holders,
                                               wave_readers=len(names)))
    assert set(chained.chunks) <= set(range(N // 2)) and set(chained.chunks) == chained.relayed
    assert chained.prefer and set(chained.prefer.values()) == {up}
    assert chained.peer_cap == CHAIN_READS_PER_HOLDER and chained.origin_cap == ORIGIN_READS_IN_WAVE
    shared = next_chunks(list(range(N)), Wave(me=me, zone="z0", num_chunks=N, in_flight=2, holders=holders))
    assert set(shared.chunks) - shared.relayed  # a share of its own from the trainer
    # a short wave seen before still shares
    short = next_chunks(list(range(N)), Wave(me=me, zone="z0", num_chunks=N, in_flight=2, holders=holders,
                                             wave_readers=CHAIN_MIN_READERS - 1))
    assert short == shared


def test_a_reader_that_joins_late_is_not_waited_for():
    """r_late sorts before the others in the chain's order, but joins when they
    are half done: they do not wait for it, and it reads from them."""
    names = ["a", "b", "c", "late"]
    late = chain_order(names)[0]
    wants = {a: set(range(N)) for a in names}
    got, _ = _chain_run(wants, 2, [0], {late: N // 4})
    assert "trainer" not in got[late].values()
    assert sum(1 for a in names for s in got[a].values() if s == "trainer") == N
    assert chain_owners("x", 5, [_holder("behind", "z0", False, {1})], N)[0] is None  # behind, lacks it


def test_a_chain_stops_waiting_for_a_peer_that_stopped_landing_chunks():
    """The peer before it in the chain holds chunk 0 and no more: chunk 0 still
    comes from it, the rest from the trainer (one READ at a time: its peers
    before it read there too) once the peer is no longer ``growing``."""
    names = [f"p{i}" for i in range(CHAIN_MIN_READERS)]
    up, me, *after = chain_order(names)
    for grows in (True, False):
        peer = _holder(up, "z0", False, {0}, growing=grows)
        wave = Wave(me=me, zone="z0", num_chunks=N, in_flight=2, patience_out=True,
                    holders=[_holder("trainer", "z0", True, set(range(N))), peer,
                             *(_holder(a, "z0", False, set()) for a in after)])
        batch = next_chunks(list(range(N)), wave)
        assert batch.chunks[0] == 0 and batch.prefer == {0: up}
        assert batch.chunks[1:] == ([] if grows else [1, 2, 3]) and batch.origin_cap == ORIGIN_READS_IN_WAVE


def test_a_far_zones_chunk_on_its_way_to_a_reader_near_the_origin_waits_for_it():
    """The chunk a reader of the origin's zone will hold (and does not yet):
    nobody far reads it from the origin; the far zone's seed takes it from that reader."""
    trainer = _holder("trainer", "z0", True, set(range(N)))
    near_origin = _holder("near", "z0", False, set(), set(range(N)))
    wave = Wave(me="far", zone="z1", num_chunks=N, in_flight=N, holders=[trainer, near_origin])
    assert next_chunks(list(range(N)), wave).chunks == []


def test_reads_take_turns_over_holders_and_admit_caps_complete_ones():
    reads = {0: ["a"], 1: ["a"], 2: ["a"], 3: ["b"], 4: ["b"], 5: ["c"]}
    assert by_turns(reads, str) == [(0, "a"), (3, "b"), (5, "c"), (1, "a"), (4, "b"), (2, "a")]
    assert alternate([1, 2, 3], [9]) == [1, 9, 2, 3]
    assert admit("t", complete=True, flying={"t": 1}, cap=1) is False
    assert admit("t", complete=True, flying={"t": 0}, cap=1) is True
    assert admit("p", complete=False, flying={"p": 7}, cap=1) is True  # filling peers are not capped
    assert admit("t", complete=True, flying={"t": 7}, cap=0) is True  # no cap: alone, or out of patience
    assert admit("p", complete=False, flying={"p": 2}, cap=0, peer_cap=2) is False  # a chain caps peers too
    assert admit("q", complete=False, flying={"p": 2}, cap=0, peer_cap=2) is True


@given(st.integers(1, 16), st.lists(st.booleans(), max_size=6))
def test_a_reader_keeps_more_reads_in_flight_only_in_a_wave(base, complete):
    holders = [_holder(f"h{i}", "z", c, set()) for i, c in enumerate(complete)]
    wave = not all(complete)
    assert reads_in_flight(base, holders) == (base * WAVE_READS_FACTOR if wave else base)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 16), chunk_sets, st.sampled_from(["me", "you", "a", "reader-7", ""]))
def test_a_readers_order_is_its_chunks_sorted_and_turned_to_start_at_its_place_on_the_ring(n, chunks, me):
    chunks = {c for c in chunks if c < n}
    start = ring_offset(me, n)
    ordered = sorted(chunks)
    turn = next((i for i, c in enumerate(ordered) if c >= start), len(ordered))
    assert reader_order(chunks, me, n) == ordered[turn:] + ordered[:turn]


def test_readers_that_start_together_begin_at_different_chunks():
    starts = {reader_order(range(N), f"r{i}", N)[0] for i in range(8)}
    assert len(starts) > 1 and reader_order([], "me", 0) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.floats(0, 2 * CHAIN_PATIENCE_S)), min_size=1, max_size=12))
def test_a_filling_holder_grows_while_its_most_chunks_rose_within_chain_patience(steps):
    """Fed its chunk counts over time: it grows while the count reached its
    highest (first seen counts as a rise) within ``CHAIN_PATIENCE_S``; a count
    that falls back changes nothing."""
    seen, now, best, rose_at = None, 0.0, -1, 0.0
    for count, dt in steps:
        now += dt
        if count > best:
            best, rose_at = count, now
        grows, seen = growing(count, seen, now)
        assert seen == (best, rose_at)
        assert grows == (now - rose_at <= CHAIN_PATIENCE_S)


@st.composite
def rounds(draw):
    """A round's READs (per chunk, each from a holder), which holders are complete, the caps."""
    holders = ["t", "u", "p", "q"][: draw(st.integers(1, 4))]
    complete = {h: draw(st.booleans()) for h in holders}
    reads = {c: draw(st.lists(st.sampled_from(holders), min_size=1, max_size=3)) for c in range(draw(st.integers(0, 6)))}
    return reads, complete, draw(st.integers(0, 2)), draw(st.integers(0, 2))


def _room(holder: str, complete: dict, flying: dict, cap: int, peer_cap: int) -> bool:
    limit = cap if complete[holder] else peer_cap
    return limit == 0 or flying.get(holder, 0) < limit


@settings(max_examples=400, deadline=None)
@given(rounds(), st.lists(st.integers(0, 3), max_size=40), st.integers(-1, 8))
def test_a_post_queue_posts_each_read_once_held_back_ones_first_never_over_a_holders_cap(case, lands, cut_at):
    """Played out: READs are taken while one is given, then one in flight lands
    (``lands`` picks which), until none is left. The READ taken is always the
    first of those not taken, held-back ones before the rest (in turns over
    their holders), whose holder has room; none is taken twice; after ``cut``
    only chunks begun go; with no cut every READ goes."""
    reads, complete, cap, peer_cap = case
    queue = PostQueue(reads, str, complete=complete, cap=cap, peer_cap=peer_cap)
    left = list(by_turns(reads, str))  # not looked at yet, in turns over their holders
    held: list[tuple[int, str]] = []  # looked at, their holder without room then
    flying: list[tuple[int, str]] = []
    taken: list[tuple[int, str]] = []
    begun: set[int] = set()
    cut, at_cut = False, set()
    for step in range(200):
        if step == cut_at:
            cut, at_cut = True, set(begun)
            queue.cut(begun)
            left = [item for item in left if item[0] in begun]
            held = [item for item in held if item[0] in begun]
        count = {h: sum(1 for _, f in flying if f == h) for h in complete}
        item = queue.take(count.__getitem__)
        assert item == next((i for i in held + left if _room(i[1], complete, count, cap, peer_cap)), None)
        if item is not None:
            if item in held:
                held.remove(item)
            else:  # those before it in turn had no room: held back
                k = left.index(item)
                held, left = held + left[:k], left[k + 1:]
            flying.append(item)
            taken.append(item)
            assert not cut or item[0] in at_cut  # after the cut, only the chunks begun before it
            begun.add(item[0])
            continue
        held, left = held + left, []
        assert queue.held_back == bool(held)
        if not flying:
            break
        flying.pop(lands[step % len(lands)] % len(flying) if lands else 0)
    else:
        raise AssertionError("the round never ended")
    every = Counter((c, h) for c, hs in reads.items() for h in hs)
    assert not Counter(taken) - every  # none taken more often than it was planned
    if not cut:
        assert Counter(taken) == every and not queue.held_back


def test_a_post_queue_holds_a_capped_holders_reads_back_and_sends_them_when_it_has_room():
    queue = PostQueue({0: ["t", "t"], 1: ["p"]}, str, complete={"t": True, "p": False}, cap=1)
    assert queue.take({"t": 0, "p": 0}.__getitem__) == (0, "t")
    assert queue.take({"t": 1, "p": 0}.__getitem__) == (1, "p")  # the trainer's second READ waits: held back
    assert queue.take({"t": 1, "p": 1}.__getitem__) is None and queue.held_back
    assert queue.take({"t": 0, "p": 1}.__getitem__) == (0, "t") and not queue.held_back
    cut = PostQueue({0: ["t"], 1: ["t"], 2: ["p"]}, str, complete={"t": True, "p": False}, cap=1)
    assert cut.take({"t": 0, "p": 0}.__getitem__) == (0, "t")
    cut.cut({0})  # time is up: chunk 1 (held back) and chunk 2 (not looked at yet) wait for the next round
    assert cut.take({"t": 0, "p": 0}.__getitem__) is None and not cut.held_back


def test_a_round_is_over_when_nothing_flies_or_what_flies_is_carried():
    for flying, slots, posting, carry, landed_any in itertools.product(range(6), range(1, 6), *[(False, True)] * 3):
        over = round_over(flying, slots, posting=posting, carry=carry, landed_any=landed_any)
        if flying == 0:
            assert over
        elif not carry or posting or not landed_any:  # never returns with READs out it will not carry
            assert not over
        else:  # carried: once at most half its slots fly
            assert over == (2 * flying <= slots)
