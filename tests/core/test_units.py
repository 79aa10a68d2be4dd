"""Pure parts: manifests, bitmaps, the source planner, config."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tensorhub.chunks import bitmap_count, bitmap_empty, bitmap_full, bitmap_has, bitmap_set, bitmap_set_many
from tensorhub.client.config import HubConfig
from tensorhub.errors import InvalidRequest, ManifestMismatch
from tensorhub.manifest import Manifest, TensorSpec
from tensorhub.planner import Source, best_holders, choose_sources, relay_share
from tensorhub.topology import Labels, Reliability


def test_bitmap_roundtrip():
    bits = bitmap_empty(20)
    for c in (0, 7, 8, 19):
        bitmap_set(bits, c)
    assert [c for c in range(20) if bitmap_has(bits, c)] == [0, 7, 8, 19]
    assert bitmap_count(bits) == 4
    assert bitmap_count(bitmap_full(13)) == 13
    assert not bitmap_has(b"", 3)


@pytest.mark.parametrize("num_chunks", [1, 8, 13, 64, 4099])
def test_bitmap_set_many_equals_one_by_one(num_chunks):
    rng = random.Random(num_chunks)
    for _ in range(20):
        chunks = [rng.randrange(num_chunks) for _ in range(rng.randrange(num_chunks + 1))]
        start = bitmap_empty(num_chunks)
        for c in rng.sample(range(num_chunks), num_chunks // 3):  # some bits set before
            bitmap_set(start, c)
        one, many = bytearray(start), bytearray(start)
        for c in chunks:
            bitmap_set(one, c)
        bitmap_set_many(many, chunks)
        assert many == one and len(many) == len(start)


def test_manifest_fingerprint_depends_on_names_shapes_dtypes():
    a = {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    base = Manifest.of(a).fingerprint
    assert Manifest.of({"w": torch.ones(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}).fingerprint == base
    assert Manifest.of({"w": torch.zeros(3, 2), "b": a["b"]}).fingerprint != base
    assert Manifest.of({"w": a["w"], "b": torch.zeros(3)}).fingerprint != base
    assert Manifest.of({"x": a["w"], "b": a["b"]}).fingerprint != base
    assert Manifest.of({"b": a["b"], "w": a["w"]}).fingerprint != base  # order is part of the layout


def test_manifest_validate_rejects_inconsistent_entries():
    for bad in (
        (TensorSpec("w", "float32", (2,), 4),),
        (TensorSpec("w", "complex64", (2,), 16),),
        (TensorSpec("", "float32", (1,), 4),),
        (TensorSpec("w", "float32", (-1,), 4),),
        (TensorSpec("w", "float32", (1,), 4), TensorSpec("w", "float32", (1,), 4)),
    ):
        with pytest.raises(ValueError):
            Manifest(bad).validate()


def test_check_destination_names_every_problem():
    manifest = Manifest.of({"w": torch.zeros(2, 3), "b": torch.zeros(3)})
    manifest.check_destination({"w": torch.zeros(2, 3), "b": torch.zeros(3)}, model="m", version=1)
    cases = {
        "missing 'b'": {"w": torch.zeros(2, 3)},
        "not in the version 'x'": {"w": torch.zeros(2, 3), "b": torch.zeros(3), "x": torch.zeros(1)},
        "version has float32[2, 3], destination torch.float32[3, 2]": {"w": torch.zeros(3, 2), "b": torch.zeros(3)},
        "destination torch.float16[3]": {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.float16)},
    }
    for needle, into in cases.items():
        with pytest.raises(ManifestMismatch, match="Nothing was transferred") as err:
            manifest.check_destination(into, model="m", version=1)
        assert needle in str(err.value)
        assert "'m' version 1" in str(err.value)
    with pytest.raises(InvalidRequest, match="w: the local tensor is not contiguous"):
        manifest.check_destination({"w": torch.zeros(3, 2).t(), "b": torch.zeros(3)}, model="m", version=1)


def _src(rid, host="h0", rack="r0", zone="z0", **kw):
    return Source(replica_id=rid, agent_name=rid, labels=Labels(host, rack, zone), **kw)


def _all(chunks, sources, whole=True):
    return {c: {s.replica_id: whole for s in sources} for c in chunks}


def test_planner_prefers_near_reliable_rollouts_then_spreads_load():
    reader = Labels("h1", "r0", "z0")
    trainer = _src("trainer", host="h9", origin=True)
    same_host = _src("a", host="h1")
    same_rack = _src("b", host="h2")
    other_zone = _src("c", host="h3", rack="r9", zone="z9")
    spot = _src("d", host="h1", reliability=Reliability.SPOT)
    sources = [trainer, same_rack, other_zone, spot, same_host]
    plan = choose_sources(_all(range(4), sources), sources, reader)
    assert all(order[0] == "a" for order in plan.order.values())
    assert plan.order[0] == ["a", "d", "b", "trainer", "c"]  # host > spot-on-host > rack > origin > elsewhere


def test_planner_ranks_whole_chunk_holders_before_part_holders_of_the_same_tier():
    filling = _src("filling", complete=False)
    trainer = _src("trainer", host="h9", origin=True)
    shard = _src("shard", host="h9", origin=True)
    holders = {0: {"filling": False, "trainer": True}, 1: {"filling": True, "trainer": True},
               2: {"shard": False, "trainer": True}, 3: {"trainer": True}}
    plan = choose_sources(holders, [filling, trainer, shard], Labels("h0", "r0", "z0"))
    assert plan.order[0] == ["filling", "trainer"]  # nearer first, even for a part
    assert plan.order[1][0] == "filling"
    assert plan.order[2] == ["trainer", "shard"]  # same tier: one read of the whole chunk first
    assert plan.order[3] == ["trainer"]


def test_planner_ranks_the_schedules_pick_first_among_whole_holders_of_its_tier():
    """A chain's upstream peer (``prefer``) reads first, even busier, but never
    before a nearer holder nor a whole one before a part."""
    up, idle = _src("up", complete=False, active_reads=5), _src("idle", complete=False)
    far = _src("far", host="h9", complete=False)
    sources = [up, idle, far]
    plan = choose_sources(_all(range(3), sources), sources, Labels("h0", "r0", "z0"),
                          relayed={0, 1, 2}, prefer={0: "up", 1: "far"})
    assert plan.order[0][0] == "up" and plan.order[2][0] == "idle"
    assert plan.order[1][0] != "far"  # same host first: a preference does not cross tiers
    part = choose_sources({0: {"up": False, "idle": True}}, sources, Labels("h0", "r0", "z0"), prefer={0: "up"})
    assert part.order[0] == ["idle", "up"]


def test_planner_spreads_ties_and_reports_unavailable():
    a, b = _src("a"), _src("b")
    plan = choose_sources(_all(range(10), [a, b]), [a, b], Labels("h0"))
    assert plan.primary_load() == {"a": 5, "b": 5}
    plan = choose_sources(_all(range(3), [a, b]), [a, b], Labels("h0"), exclude=frozenset({"a", "b"}))
    assert plan.unavailable == [0, 1, 2]
    busy, idle = _src("busy", active_reads=3), _src("idle")
    plan = choose_sources(_all(range(4), [busy, idle]), [busy, idle], Labels("h0"))
    assert plan.primary_load() == {"idle": 4}


def test_planner_exhaustive_small_cases_always_rank_exactly_the_holders():
    """Every chunk any usable source holds (whole or in part) is assigned, to its holders only."""
    labels = [Labels("h0", "r0", "z0"), Labels("h1", "r0", "z0"), Labels("h2", "r1", "z1")]
    states = [None, False, True]  # holds nothing / a part / the whole chunk
    for layout in itertools.product(states, repeat=6):
        a, b = _src("a"), Source("b", "b", labels[layout.count(True) % 3])
        holders = {c: {rid: layout[2 * c + i] for i, rid in enumerate("ab") if layout[2 * c + i] is not None}
                   for c in range(3)}
        plan = choose_sources(holders, [a, b], labels[0])
        for chunk in range(3):
            if holders[chunk]:
                assert set(plan.order[chunk]) == set(holders[chunk])
                tiers = [labels[0].tier({"a": a, "b": b}[r].labels) for r in plan.order[chunk]]
                assert tiers == sorted(tiers)
            else:
                assert chunk in plan.unavailable


def test_planner_prefers_a_holder_laid_out_like_the_reader_among_equals():
    """Two relays of the same tier: worker k of the engine before (its column
    slice in one contiguous run) ranks before one holding whole rows (a run per
    row), whatever their load; small differences (within a power of 8) leave the
    load to decide; the origin still ranks after the relays. A part holder laid
    out like the reader ranks before a whole holder of rows (it gives its part
    exactly, the rows the rest); a whole holder laid out as well ranks first."""
    like_me, rows = _src("like-me", active_reads=3), _src("rows")
    sources, reader = [like_me, rows], Labels("h0")
    runs = {"like-me": [1] * 4, "rows": [4096] * 4}
    plan = choose_sources(_all(range(4), sources), sources, reader, runs=runs)
    assert all(order == ["like-me", "rows"] for order in plan.order.values())
    assert choose_sources(_all(range(4), sources), sources, reader).primary_load() == {"rows": 4}  # no runs: load
    near = {"like-me": [2] * 4, "rows": [7] * 4}
    assert choose_sources(_all(range(4), sources), sources, reader, runs=near).primary_load() == {"rows": 4}
    trainer = _src("trainer", origin=True)
    runs = {"trainer": [1], "rows": [4096]}
    assert choose_sources(_all([0], [trainer, rows]), [trainer, rows], reader, runs=runs).order[0] == ["rows", "trainer"]
    part = {0: {"like-me": False, "rows": True}}
    assert choose_sources(part, sources, reader, runs={"like-me": [1], "rows": [4096]}).order[0] == ["like-me", "rows"]
    assert choose_sources(part, sources, reader, runs={"like-me": [1], "rows": [7]}).order[0] == ["rows", "like-me"]


def test_planner_cap_sends_readers_past_a_busy_holder_but_never_strands_a_chunk():
    # A peer already serving 4 readers, and the trainer (origin) idle, same rack.
    busy, calm = _src("busy", host="h1", active_reads=4), _src("calm", host="h2", origin=True)
    sources, reader = [busy, calm], Labels("h0", "r0", "z0")
    assert choose_sources(_all(range(3), sources), sources, reader).order[0] == ["busy", "calm"]  # peers first
    assert choose_sources(_all(range(3), sources), sources, reader, cap=4).order[0] == ["calm", "busy"]
    assert choose_sources(_all(range(3), sources), sources, reader, cap=5).order[0] == ["busy", "calm"]
    only = choose_sources(_all(range(3), [busy]), [busy], Labels("h0"), cap=1)
    assert only.order[0] == ["busy"] and not only.unavailable  # soft: over the cap still serves


def _topology(rng, n):
    """n holders over 2 zones x 2 racks x 3 hosts, some spot, some filling, one origin."""
    out = []
    for i in range(n):
        z, r, h = rng.randrange(2), rng.randrange(2), rng.randrange(3)
        out.append(Source(f"s{i}", f"s{i}", Labels(f"z{z}r{r}h{h}", f"z{z}r{r}", f"z{z}"),
                          Reliability.SPOT if rng.random() < 0.2 else Reliability.RELIABLE,
                          complete=rng.random() < 0.7, origin=i == 0, active_reads=rng.randrange(4)))
    return out


def test_best_holders_over_generated_topologies_keep_the_best_k_and_coverage():
    rng = random.Random(7)
    for trial in range(300):
        sources = _topology(rng, rng.randrange(1, 40))
        reader = Labels(f"z{trial % 2}r0h0", f"z{trial % 2}r0", f"z{trial % 2}")
        k = rng.randrange(1, 10)
        # Coverage: the origin's shards s0..s2 together (or any whole holder) cover the version.
        shards = {"s0", "s1", "s2"}
        wholes = {s.replica_id for s in sources if s.complete and s.replica_id not in shards and rng.random() < 0.5}

        def covers(complete, wholes=wholes, shards=shards):
            ids = {s.replica_id for s in complete}
            return bool(ids & wholes) or shards <= ids

        chosen = best_holders(sources, reader, k, salt=f"reader{trial}", covers=covers)
        ids = [s.replica_id for s in chosen]
        assert len(set(ids)) == len(ids) and set(ids) <= {s.replica_id for s in sources}
        if len(sources) <= k:
            assert len(chosen) == len(sources)
            continue
        head = chosen[:k]
        rest = [s for s in sources if s.replica_id not in set(ids)]
        worst = max(reader.tier(s.labels) for s in head)
        assert all(reader.tier(s.labels) >= worst for s in rest)  # nobody nearer was left out
        extra = chosen[k:]
        assert all(s.complete for s in extra)  # only added to cover
        coverable = covers([s for s in sources if s.complete])
        if coverable:
            assert covers([s for s in chosen if s.complete])
            assert not extra or not covers([s for s in chosen[:-1] if s.complete])  # no more than needed
    # Spot and origin rank after reliable readers of the same tier.
    near = [_src("spot", reliability=Reliability.SPOT), _src("origin", origin=True), _src("peer")]
    assert [s.replica_id for s in best_holders(near, Labels("h0", "r0", "z0"), 1, salt="x",
                                               covers=lambda c: True)] == ["peer"]


def test_best_holders_spread_equal_holders_over_readers():
    sources = [_src(f"s{i}") for i in range(100)]
    picks = [best_holders(sources, Labels("h0"), 4, salt=f"reader{r}", covers=lambda c: True) for r in range(200)]
    counts = {}
    for chosen in picks:
        for s in chosen:
            counts[s.replica_id] = counts.get(s.replica_id, 0) + 1
    assert len(counts) > 90 and max(counts.values()) < 30  # 800 picks over ~100 holders, no hot spot
    again = best_holders(sources, Labels("h0"), 4, salt="reader0", covers=lambda c: True)
    assert again == picks[0]  # one reader always gets the same ones


def test_relay_share_gives_each_chunk_one_owner_per_zone_and_crosses_zones_through_seeds():
    rng = random.Random(3)
    for trial in range(200):
        num_chunks = rng.randrange(1, 80)
        zone_size = rng.randrange(1, 6)
        readers = [f"agent-{trial}-{i}" for i in range(zone_size)]
        full = trial % 2 == 0  # half the trials: every reader will hold every chunk
        holds = {a: frozenset(c for c in range(num_chunks) if full or rng.random() < 0.9) for a in readers}
        local = {c for c in range(num_chunks) if rng.random() < 0.5}
        seeds = rng.randrange(1, 4)
        owned = {}
        for me in readers:
            peers = {a: holds[a] for a in readers if a != me}
            mine = relay_share(sorted(holds[me]), me, peers, num_chunks=num_chunks, local=local, seeds_per_zone=seeds)
            assert set(mine) <= holds[me]
            for c in mine:
                assert c not in owned, f"chunk {c} owned twice"
                owned[c] = me
        assert set(owned) == set().union(*holds.values())  # every chunk someone needs has exactly one owner
        if full:  # then only the seeds read across the zone's boundary
            assert len({owned[c] for c in owned if c not in local}) <= seeds


def test_relay_share_alone_reads_everything_and_one_seed_reads_all_remote_chunks():
    assert relay_share([0, 1, 2], "me", {}, num_chunks=3, local=set()) == [0, 1, 2]
    # Chunk 1 is on its way to a reader in the origin's zone: not read from the origin here.
    assert relay_share([0, 1, 2], "me", {}, num_chunks=3, local=set(), upstream={1}) == [0, 2]
    assert relay_share([0, 1, 2], "me", {}, num_chunks=3, local={1}, upstream={1}) == [0, 1, 2]  # local wins
    peers = {f"p{i}": frozenset(range(64)) for i in range(3)}
    everyone = ["me", *peers]
    remote = {a: relay_share(list(range(64)), a, {p: frozenset(range(64)) for p in everyone if p != a},
                             num_chunks=64, local=set(), seeds_per_zone=1) for a in everyone}
    assert sorted(len(v) for v in remote.values()) == [0, 0, 0, 64]  # one seed crosses for the zone
    local = {a: relay_share(list(range(64)), a, {p: frozenset(range(64)) for p in everyone if p != a},
                            num_chunks=64, local=set(range(64))) for a in everyone}
    assert sum(len(v) for v in local.values()) == 64 and all(local.values())  # arcs: everyone reads some


def test_config_from_dict_names_bad_fields():
    cfg = HubConfig.from_dict({"chunk_size": 1 << 20, "labels": {"zone": "z1"}, "reliability": "spot"})
    assert cfg.labels.zone == "z1" and cfg.reliability is Reliability.SPOT
    with pytest.raises(ValueError, match="chunk_sise"):
        HubConfig.from_dict({"chunk_sise": 1})
    with pytest.raises(ValueError, match="reliability"):
        HubConfig.from_dict({"reliability": "sometimes"})
    with pytest.raises(ValueError, match="label"):
        HubConfig.from_dict({"labels": {"planet": "earth"}})


def test_an_idle_nixl_agent_does_not_spin_a_core():
    """NIXL's Python API busy-polls its progress thread (a whole core per agent);
    ours waits for events. CPU time, not wall time: robust on a loaded machine."""
    import subprocess
    import sys

    code = ("import time; from tensorhub.transport import NixlAgent; a = NixlAgent('idle'); "
            "t = time.process_time(); time.sleep(2); print(time.process_time() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert float(out.stdout.split()[-1]) < 1.0, "an idle agent used more than half a core"


def test_a_pull_s_control_plane_re_registers_a_forgotten_agent_and_retries_once():
    """Found by tensorhub chaos: AgentUnknown escaped pulls whose mid-pull calls met a
    restarted server. The server is a stand-in here (it must forget the agent between
    two calls of one pull); tests/core/test_chaos.py restarts a real one."""
    from tensorhub.client.holdings import Holdings
    from tensorhub.client.rpc import AgentUnknown

    class ForgetfulServer:
        def __init__(self):
            self.registered, self.calls = 0, []

        def register_agent(self, agent_id, name, labels, reliability):
            self.registered += 1
            return "instance-2", 5.0

        def renew_lease(self, agent_id, lease_id):
            self.calls.append(lease_id)
            if len(self.calls) == 1:
                raise AgentUnknown(f"agent {agent_id!r} is not registered")
            return 5.0

        def report_lost(self, agent_id, replica_id, reason, stalled=False):
            raise AgentUnknown("still forgotten")

    server = ForgetfulServer()
    holdings = Holdings(rpc=server, nixl=None, agent_id="r1", name="r1", config=HubConfig())
    plane = holdings.control_plane()
    assert plane.renew_lease("r1", "lease-7") == 5.0
    assert server.calls == ["lease-7", "lease-7"] and server.registered == 1
    with pytest.raises(AgentUnknown):  # once only: a server that keeps forgetting is not retried forever
        plane.report_lost("r1", "rep", "gone")
    assert server.registered == 2
    holdings._chores.shutdown()


def test_wait_for_version_asks_a_restarting_server_again_until_its_deadline():
    """Found by CI (tests/verl, a restarted server actor): the restarted server
    answered Ray before its gRPC port, and the wait raised at once."""
    import time

    import pytest

    from tensorhub.client.hub import Hub
    from tensorhub.errors import ServerUnavailable

    class Restarting:
        calls = 0

        def wait_for_version(self, model, at_least, timeout_s):
            self.calls += 1
            if self.calls < 3:
                raise ServerUnavailable("127.0.0.1:1", "restarting")
            return 7

    class Down:
        def wait_for_version(self, model, at_least, timeout_s):
            raise ServerUnavailable("127.0.0.1:1", "down")

    hub = Hub.__new__(Hub)  # only its control plane is used
    hub._rpc = Restarting()
    assert hub.wait_for_version("m", 7, timeout=5) == 7 and hub._rpc.calls == 3
    hub._rpc = Down()
    start = time.monotonic()
    with pytest.raises(ServerUnavailable):
        hub.wait_for_version("m", 7, timeout=0.5)
    assert 0.4 < time.monotonic() - start < 3
