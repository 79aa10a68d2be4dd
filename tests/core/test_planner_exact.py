"""The planner's rule 2 (whole chunk first) against rule 5 (laid out like the
reader): a holder of a part that needs fewer READ descriptors than every whole
holder of its tier ranks before them, so it gives its part exactly and they
only the rest. Pure: ``choose_sources`` only."""

from __future__ import annotations

import itertools

from tensorhub.planner import Source, _layout_cost, choose_sources
from tensorhub.topology import Labels

READER = Labels("h0", "r0", "z0")


def _src(rid: str, host: str = "h0", **kw) -> Source:
    return Source(replica_id=rid, agent_name=rid, labels=Labels(host, "r0", "z0"), **kw)


def test_two_cut_holders_of_a_chunks_tensors_rank_before_the_row_shard_that_holds_it_whole():
    """verl's two-rank test, reader 0's first chunk (4,096 B): the embedding's
    rows (2,048 B, rank 0's cut, one run) and a column slice of the next
    tensor's first 32 rows (2,048 B, rank 1's cut, one run). Rank 0's row
    shard holds both: the rows in one run, the columns in a run per row (33).
    Ranked first as the one whole holder, the shard was read wide: 6,080 B
    for the chunk's 4,096."""
    shard, cut0, cut1 = (_src(rid, origin=True) for rid in ("shard0", "cut0", "cut1"))
    holders = {0: {"shard0": True, "cut0": False, "cut1": False}}
    runs = {"shard0": [33], "cut0": [1], "cut1": [1]}
    order = choose_sources(holders, [shard, cut0, cut1], READER, runs=runs).order[0]
    assert sorted(order[:2]) == ["cut0", "cut1"] and order[2] == "shard0"
    # Without layouts (runs unknown) the whole holder still reads alone, first.
    assert choose_sources(holders, [shard, cut0, cut1], READER).order[0][0] == "shard0"


def test_equally_exact_holders_still_share_the_load_and_a_whole_holder_as_exact_reads_alone():
    shard, cut0, cut1 = (_src(rid, origin=True) for rid in ("shard0", "cut0", "cut1"))
    sources = [shard, cut0, cut1]
    # Both cuts hold whole chunks in one run: they share them; the shard (a run per row) gets none.
    holders = {c: {"shard0": True, "cut0": True, "cut1": True} for c in range(4)}
    runs = {"shard0": [40] * 4, "cut0": [1] * 4, "cut1": [1] * 4}
    assert choose_sources(holders, sources, READER, runs=runs).primary_load() == {"cut0": 2, "cut1": 2}
    # A shard that holds the chunk in as few runs (a row slice: contiguous) is as exact: it reads it alone.
    part = {0: {"shard0": True, "cut0": False, "cut1": False}}
    assert choose_sources(part, sources, READER, runs={"shard0": [2], "cut0": [1], "cut1": [1]}).order[0][0] == "shard0"
    # After the part holders, only the first whole holder may give the rest:
    # the next chunk's tie between two shards goes to the other one.
    shard1 = _src("shard1", origin=True)
    holders = {0: {"shard0": True, "shard1": True, "cut0": False}, 1: {"shard0": True, "shard1": True}}
    runs = {"shard0": [40, 40], "shard1": [40, 40], "cut0": [1, 0]}
    plan = choose_sources(holders, [shard, shard1, cut0], READER, runs=runs)
    assert plan.order[0] == ["cut0", "shard0", "shard1"] and plan.order[1][0] == "shard1"


def test_a_better_laid_out_part_holder_never_crosses_a_tier_nor_the_cap():
    near, far = _src("near-rows", origin=True), _src("far-cut", host="h1", origin=True)
    holders = {0: {"near-rows": True, "far-cut": False}}
    runs = {"near-rows": [4096], "far-cut": [1]}
    assert choose_sources(holders, [near, far], READER, runs=runs).order[0] == ["near-rows", "far-cut"]
    busy = _src("busy-cut", origin=True, active_reads=4)
    holders = {0: {"near-rows": True, "busy-cut": False}}
    runs = {"near-rows": [4096], "busy-cut": [1]}
    assert choose_sources(holders, [near, busy], READER, runs=runs, cap=4).order[0] == ["near-rows", "busy-cut"]
    assert choose_sources(holders, [near, busy], READER, runs=runs).order[0] == ["busy-cut", "near-rows"]


def test_every_small_case_ranks_a_whole_holder_before_a_part_only_when_laid_out_as_well():
    """Three holders, each nothing, a part or the whole chunk, in 1, 33 or
    4,096 runs, on the reader's host or not, origin or not: every holder ranked,
    nearer first; within a tier, a part holder precedes a whole holder exactly
    when it needs fewer descriptors (powers of 8) than every whole holder of
    that tier."""
    hosts, counts = ("h0", "h1"), (1, 33, 4096)
    for case in itertools.product((None, False, True), counts, hosts, (False, True), repeat=3):
        holds = {f"s{i}": case[4 * i: 4 * i + 4] for i in range(3)}
        sources = [_src(rid, host=h, origin=o) for rid, (_, _, h, o) in holds.items()]
        holders = {0: {rid: h[0] for rid, h in holds.items() if h[0] is not None}}
        runs = {rid: [h[1]] for rid, h in holds.items()}
        plan = choose_sources(holders, sources, READER, runs=runs)
        if not holders[0]:
            assert plan.unavailable == [0]
            continue
        order = plan.order[0]
        assert sorted(order) == sorted(holders[0])
        tier = {s.replica_id: READER.tier(s.labels) for s in sources}
        assert [tier[r] for r in order] == sorted(tier[r] for r in order)
        cost = {rid: _layout_cost(runs, 0, rid) for rid in holders[0]}
        for t in {tier[r] for r in order}:
            mine = [r for r in order if tier[r] == t]
            wholes = [r for r in mine if holders[0][r]]
            for i, r in enumerate(mine):
                if wholes and not holders[0][r]:
                    before_whole = any(holders[0][w] for w in mine[i + 1:])
                    assert before_whole == (cost[r] < min(cost[w] for w in wholes)), (case, order)
