"""The trainer's cut (``Hub.publish(cut="readers")``, ``client/trainercut.py``):
trainer ranks learn their readers' read sets from the server (``ReaderCuts``:
the relays' held regions, each distinct one once), gather the full tensors of
a byte-balanced share over gloo, at most ``cut_gather_bytes`` at a time, and
publish each read set's regions back to back beside their row shards. Real
processes: two trainer ranks (gloo over 127.0.0.1), TP readers, real NIXL and
a real gRPC server."""

from __future__ import annotations

import math
import time

import pytest

from tensorhub.client.rpc import ReaderCuts, ReadSet, ReferenceClient
from tensorhub.client.trainercut import plan_cut
from tensorhub.errors import InvalidRequest
from tensorhub.manifest import Manifest, TensorSpec
from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.regions import Region
from tensorhub.testing import HubProcess, RemoteError, join_group, read_region

# A TP reader ("tp", w, world) reads rows of even-numbered tensors and columns
# of odd-numbered ones (read_region); the trainer's ranks hold uneven rows.
SPECS = [("a", "bfloat16", (512, 256)), ("b", "bfloat16", (512, 256)), ("c", "float32", (384, 128)),
         ("d", "float32", (256, 96)), ("norm", "float32", (256,)), ("scale", "float32", ())]
ITEM = {"bfloat16": 2, "float32": 4}
TOTAL = sum(math.prod(shape) * ITEM[dtype] for _, dtype, shape in SPECS)
LARGEST = max(math.prod(shape) * ITEM[dtype] for _, dtype, shape in SPECS)
CHUNK = 64 << 10


def _trainer(hubs, world: int = 2) -> list[HubProcess]:
    return join_group([hubs(f"rank{r}") for r in range(world)])


def _publish(ranks: list[HubProcess], version: int, how: str = "rows", **kw) -> list[dict]:
    """Every rank at once: the cut's gather is collective."""
    for r, hub in enumerate(ranks):
        hub.send("publish_shard", model="m", version=version, specs=SPECS, seed=version, how=how, rank=r,
                 world=len(ranks), chunk_size=CHUNK, cut="readers", **kw)
    return [hub.result() for hub in ranks]


def _pull(reader: HubProcess, version: int, read: tuple[str, int, int], **kw) -> dict:
    got = reader.call("pull", model="m", version=version, specs=SPECS, expect_seed=version, read=read, **kw)
    assert got["mismatched"] == [], got["mismatched"]
    return got


def _no_reader_in_flight(address: str, timeout: float = 10.0) -> None:
    """Until the server holds no read lease: a pull lets its leases go in the
    background (``release_lease_async``), and a reader that resolves while one is
    still held sees its holders more loaded and ranks them otherwise (planner
    rule 6), so it plans afresh what it would have replayed (on a loaded machine)."""
    client = ReferenceClient(address)
    try:
        deadline = time.monotonic() + timeout
        while client.describe().leases:
            assert time.monotonic() < deadline, "read leases still held"
            time.sleep(0.01)
    finally:
        client.close()


def _replicas(address: str, version: int) -> list:
    client = ReferenceClient(address)
    try:
        models = client.describe("m").models
    finally:
        client.close()
    return [r for m in models for v in m.versions if v.version == version for r in v.replicas]


def test_the_cut_holds_each_readers_regions_and_serves_them_byte_exact(server, hubs):
    ranks = _trainer(hubs)
    # The first version: nobody reads it yet, so nothing is cut.
    first = _publish(ranks, 1)
    assert all(f["cut_report"]["from_version"] == -1 and f["cut_regions"] == [] for f in first)
    workers = [hubs("w0"), hubs("w1")]
    from_shards = [_pull(hub, 1, ("tp", w, 2), serve=True) for w, hub in enumerate(workers)]
    # From row shards the columns go wide (rows read whole, cut locally).
    assert all(g["read_bytes"] > g["nbytes"] for g in from_shards)

    # The next: the two workers' read sets, gathered one tensor at a time
    # (the bound is the largest tensor), each region once.
    second = _publish(ranks, 2, cut_gather_bytes=LARGEST)
    reports = [s["cut_report"] for s in second]
    for s, report in zip(second, reports):
        assert s["cut_mismatched"] == []
        assert report["from_version"] == 1 and report["read_sets"] == 2 and report["skipped_regions"] == 0
        assert 0 < report["peak_gather_bytes"] <= LARGEST == report["gather_bytes"]
    # Between them the ranks hold every region of both read sets once: here
    # the whole model (the scalar, which both workers hold whole, once).
    assert sum(r["nbytes"] for r in reports) == TOTAL
    assert sum(r["regions"] for r in reports) == 2 * len(SPECS) - 1
    assert all(r["nbytes"] > 0 for r in reports)  # a share for each rank
    # Each rank's buffer holds one read set's regions, then the other's.
    for s in second:
        held = [(name, region) for name, region in s["cut_regions"]]
        expected = list(dict.fromkeys((name, read_region(shape, i, "tp", w, 2).describe())
                                      for w in range(2) for i, (name, _, shape) in enumerate(SPECS)))
        assert held == [e for e in expected if e in held]
    origins = [r for r in _replicas(server.address, 2) if r.origin]  # two shards, two cuts (tensorhub status)
    assert sorted(r.trainer_cut for r in origins) == [False, False, True, True]
    assert sum(r.held_bytes for r in origins if r.trainer_cut) == TOTAL

    # Readers of the same cut (a second engine) read exactly their bytes, and
    # a reader of another (TP=4, a joiner whose cut nobody holds: the shards
    # serve it) reads byte-exact too.
    for w in range(2):
        got = _pull(hubs(f"e1w{w}"), 2, ("tp", w, 2))
        assert got["read_bytes"] == got["nbytes"] and got["descriptors"] <= from_shards[w]["descriptors"]
    _pull(hubs("tp4"), 2, ("tp", 1, 4))

    # With the shards withdrawn the cuts alone cover the version: a reader's
    # bytes can come from nowhere else, and are exact.
    for hub in ranks:
        hub.call("withdraw_shards", model="m", version=2)
    assert [r.trainer_cut for r in _replicas(server.address, 2) if r.origin] == [True, True]
    cut_bytes = [r.held_bytes for r in _replicas(server.address, 2) if r.trainer_cut]
    for w in range(2):
        got = _pull(hubs(f"e2w{w}"), 2, ("tp", w, 2))
        assert set(got["sources"]) <= {"rank0", "rank1"} and sum(got["sources"].values()) == got["nbytes"]
        # From the cut, one contiguous READ per region, split only where a chunk
        # ends (the reader's, or a cut holder's: READs and checksums are per chunk).
        chunk_ends = -(-got["nbytes"] // CHUNK) - 1 + sum(-(-n // CHUNK) - 1 for n in cut_bytes)
        assert got["read_bytes"] == got["nbytes"] and got["descriptors"] <= len(SPECS) + chunk_ends, \
            (got["descriptors"], len(SPECS), chunk_ends)

    # Unpublish withdraws the cut too.
    _unpublish(ranks, 2)
    assert not any(r.origin for r in _replicas(server.address, 2))


def test_shards_and_cut_go_together_and_a_bound_below_a_tensor_is_refused(server, hubs):
    ranks = _trainer(hubs)
    _publish(ranks, 1)
    _pull(hubs("w0"), 1, ("tp", 0, 2), serve=True)
    # A bound under the largest tensor: refused on every rank, before a byte moves.
    for r, hub in enumerate(ranks):
        hub.send("publish_shard", model="m", version=2, specs=SPECS, seed=2, how="rows", rank=r, world=2,
                 chunk_size=CHUNK, cut="readers", cut_gather_bytes=LARGEST - 1)
    for hub in ranks:
        with pytest.raises(RemoteError) as e:
            hub.result()
        assert e.value.type_name == "InvalidRequest" and "cut_gather_bytes" in e.value.message
    assert _replicas(server.address, 2) == []
    # One read set (w0's): the shards and half of the model's regions cut.
    second = _publish(ranks, 2, cut_gather_bytes=2 * LARGEST)
    assert all(s["cut_mismatched"] == [] and s["cut_report"]["read_sets"] == 1 for s in second)
    assert all(s["cut_report"]["peak_gather_bytes"] <= 2 * LARGEST for s in second)
    w0 = {name: read_region(shape, i, "tp", 0, 2) for i, (name, _, shape) in enumerate(SPECS)}
    assert sum(s["cut_report"]["nbytes"] for s in second) == sum(
        w0[name].numel(shape) * ITEM[dtype] for name, dtype, shape in SPECS)
    _pull(hubs("w1"), 2, ("tp", 1, 2))


@pytest.mark.parametrize("how", ["cols", "flat"])
def test_column_and_flat_trainer_shards_gather_exact(server, hubs, how):
    """Column shards arrive through staging (not contiguous in the full
    tensor), counted in the bound; flat ranges (ZeRO-3) land in place."""
    ranks = _trainer(hubs)
    _publish(ranks, 1, how)
    for w in range(2):
        _pull(hubs(f"w{w}"), 1, ("tp", w, 2), serve=True)
    second = _publish(ranks, 2, how, cut_gather_bytes=2 * LARGEST)
    for s in second:
        assert s["cut_mismatched"] == [] and s["cut_report"]["read_sets"] == 2
        assert 0 < s["cut_report"]["peak_gather_bytes"] <= 2 * LARGEST
    assert sum(s["cut_report"]["nbytes"] for s in second) == TOTAL
    for hub in ranks:
        hub.call("withdraw_shards", model="m", version=2)
    for w in range(2):
        _pull(hubs(f"e1w{w}"), 2, ("tp", w, 2))


def test_reader_cuts_are_the_distinct_read_sets_of_the_newest_version_with_relays(server, hubs):
    ranks = _trainer(hubs)
    _publish(ranks, 1)
    client = ReferenceClient(server.address)
    try:
        manifest = _manifest()
        assert client.reader_cuts("m", manifest) is None  # no relay yet
        for name, read in (("x0", ("tp", 0, 2)), ("y0", ("tp", 0, 2)), ("x1", ("tp", 1, 2))):
            _pull(hubs(name), 1, read, serve=True)
        cuts = client.reader_cuts("m", manifest)
        assert cuts.version == 1 and [s.readers for s in cuts.read_sets] == [2, 1]  # most readers first
        for read_set, w in zip(cuts.read_sets, (0, 1)):
            assert [(i, region.boxes(shape)) for (i, region), (_, _, shape) in zip(read_set.held, SPECS)] == [
                (i, read_region(shape, i, "tp", w, 2).boxes(shape)) for i, (_, _, shape) in enumerate(SPECS)]
        assert client.reader_cuts("m", manifest, max_cuts=1).more
        # Another manifest has no readers; a malformed fingerprint is refused.
        other = Manifest((TensorSpec("z", "float32", (4,), 16),))
        assert client.reader_cuts("m", other) is None
        with pytest.raises(InvalidRequest, match="fingerprint"):
            client._call(client._stub.ReaderCuts, pb.ReaderCutsRequest(model="m", fingerprint="not hex"))
    finally:
        client.close()


def _manifest() -> Manifest:
    return Manifest(tuple(TensorSpec(name, dtype, shape, math.prod(shape) * ITEM[dtype])
                          for name, dtype, shape in SPECS))


def test_the_plan_cuts_overlapping_read_sets_once_and_balances_the_ranks():
    manifest = _manifest()
    shapes = [shape for _, _, shape in SPECS]

    def read_set(w: int, world: int, readers: int) -> ReadSet:
        return ReadSet(tuple((i, read_region(s, i, "tp", w, world)) for i, s in enumerate(shapes)), readers)

    # Two TP=2 workers (the most readers), then a TP=4 worker whose regions overlap theirs.
    cuts = ReaderCuts(3, (read_set(0, 2, 8), read_set(1, 2, 8), read_set(0, 4, 1)))
    rows = [[(i, Region.of(s, rows=(0, s[0] // 2)) if s else Region(), 0) for i, s in enumerate(shapes)],
            [(i, Region.of(s, rows=(s[0] // 2, s[0])), 0) for i, s in enumerate(shapes) if s]]
    rows = [[(i, r, r.numel(shapes[i])) for i, r, _ in layout] for layout in rows]
    plan = plan_cut(manifest, cuts, rows)
    assert plan.read_sets == 2
    assert plan.skipped == len(SPECS) - 1  # every TP=4 region but the scalar's (the same whole region)
    assert plan == plan_cut(manifest, cuts, rows)  # deterministic
    load = [sum(r.numel(shapes[i]) * ITEM[SPECS[i][1]] for i, r in held) for held in plan.held]
    assert min(load) > 0
    assert max(load) - min(load) <= LARGEST  # greedy by bytes: within one tensor
    # A tensor no rank holds whole between them is left to the shards.
    partial = [[x for x in layout if x[0] != 0] + ([(0, Region.of(shapes[0], rows=(0, 10)), 10 * 256)]
                                                   if k == 0 else []) for k, layout in enumerate(rows)]
    assert 0 not in plan_cut(manifest, cuts, partial).owner


def test_the_next_steps_cut_reuses_its_buffer_and_its_readers_replay(server, hubs):
    """A trainer's step: withdraw version v (shards and cut), write the new
    bytes in place, publish v+1 from the same buffers with its cut. The cut
    lands in the buffer of v's cut (closed by then), so its readers, like the
    shards' readers, replay their plans, and once steady name the cut holders."""
    ranks = _trainer(hubs)
    _publish(ranks, 1)
    for w, hub in enumerate([hubs("w0"), hubs("w1")]):
        _pull(hub, 1, ("tp", w, 2), serve=True)  # relays: the read sets the trainer learns
    _publish(ranks, 2)
    readers = [hubs("e1w0"), hubs("e1w1")]
    for w, reader in enumerate(readers):
        _pull(reader, 2, ("tp", w, 2), keep="dest")
    addrs = {}
    for version in (3, 4, 5):
        _unpublish(ranks, version - 1)
        for hub in ranks:
            hub.call("overwrite", model="m", version=version - 1, seed=version)
        for r, hub in enumerate(ranks):
            hub.send("republish", model="m", version=version, of=version - 1, how="rows", rank=r, world=2,
                     chunk_size=CHUNK, cut="readers")
        outs = [hub.result() for hub in ranks]
        assert all(o["cut_mismatched"] == [] for o in outs)
        addrs[version] = [o["cut_addr"] for o in outs]
        for w, reader in enumerate(readers):
            _no_reader_in_flight(server.address)
            got = _pull(reader, version, ("tp", w, 2), keep="dest")
            # version 3's pull was steady: from 4 on it names the cut holders
            assert got["named"] == (version > 3), (version, got["path"], got["not_replayed"], got["lost"])
            if version == 4:  # the holders ranked are the cut's alone now, not the cut's and the shards': once
                assert got["path"] == "planned" and "plan(s) made afresh" in got["not_replayed"], got["not_replayed"]
            else:
                assert got["path"] == "replayed", got["not_replayed"]
            assert got["read_bytes"] == got["nbytes"]  # from the cut: exactly the read set
    assert addrs[3] == addrs[4] == addrs[5]  # one buffer per rank, step after step


# A chunk of reader 0 that two cut holders share and one row shard holds whole:
# "a" (replicated: every rank holds it whole) is its first 2,048 B, "b"'s column
# slice of rows 0-63 (32 B of each 64 B row, rank 0's rows) the next 2,048 B.
# The cut deals "b" (the larger) to one rank and "a" to the other.
SMALL = [("a", "float32", (16, 64)), ("b", "float32", (256, 16)), ("c", "float32", (64, 32))]
SMALL_CHUNK = 4096


def test_a_reader_takes_a_chunk_that_two_cut_holders_share_from_them_not_from_the_shard(server, hubs):
    """Reader 0's first chunk: rank 0's row shard holds all of it ("a" in one
    run, "b"'s columns in a run per row), the two cut holders a tensor each in
    one run. The reader reads it from the cuts, exactly its bytes; the shard,
    ranked first as the one whole holder, was read wide (whole rows of "b")."""
    ranks = _trainer(hubs)

    def publish(version: int, **kw) -> list[dict]:
        for r, hub in enumerate(ranks):
            hub.send("publish_shard", model="m", version=version, specs=SMALL, seed=version, how="rows", rank=r,
                     world=2, replicated=("a",), chunk_size=SMALL_CHUNK, cut="readers", **kw)
        return [hub.result() for hub in ranks]

    def pull(name: str, version: int, w: int, **kw) -> dict:
        got = hubs(name, chunk_size=SMALL_CHUNK).call("pull", model="m", version=version, specs=SMALL,
                                                      expect_seed=version, read=("tp", w, 2), **kw)
        assert got["mismatched"] == [], got["mismatched"]
        return got

    publish(1)
    first = [pull(f"w{w}", 1, w, serve=True) for w in range(2)]
    assert first[0]["read_bytes"] > first[0]["nbytes"]  # from the shards: "b"'s columns as whole rows
    second = publish(2)
    owners = [{name for name, _ in s["cut_regions"]} for s in second]
    assert sorted(("a" in o, "b" in o) for o in owners) == [(False, True), (True, False)], owners  # apart
    for w in range(2):
        got = pull(f"e1w{w}", 2, w)
        assert got["read_bytes"] == got["nbytes"] == first[w]["nbytes"], (w, got["read_bytes"], got["nbytes"])


def _unpublish(ranks: list[HubProcess], version: int) -> list[dict]:
    """Every rank withdraws its cut and shards at once, as it published them
    (``Publication.unpublish`` of a publication made with ``cut=``: a collective)."""
    for hub in ranks:
        hub.send("unpublish", model="m", version=version)
    return [hub.result() for hub in ranks]


def _republish(ranks: list[HubProcess], version: int) -> None:
    """Every rank's step from the same buffers (its shards and its cut buffer), with the cut."""
    _unpublish(ranks, version - 1)  # every rank's cut and shards, sent by rank 0
    for hub in ranks:
        hub.call("overwrite", model="m", version=version - 1, seed=version)
    for r, hub in enumerate(ranks):
        hub.send("republish", model="m", version=version, of=version - 1, how="rows", rank=r, world=len(ranks),
                 chunk_size=CHUNK, cut="readers")
    for hub in ranks:
        hub.result()


def test_a_steady_step_withdraws_and_announces_every_ranks_cut_and_shards_in_one_message_each(server, hubs):
    ranks = _trainer(hubs)
    for r, hub in enumerate(ranks):
        hub.send("publish_shard", model="m", version=1, specs=SPECS, seed=1, how="rows", rank=r, world=2,
                 chunk_size=CHUNK)
    for hub in ranks:
        hub.result()
    for w in range(2):
        _pull(hubs(f"w{w}"), 1, ("tp", w, 2), serve=True)
    _republish(ranks, 2)  # the first cut: sent whole, alone; the shards by their layout
    client = ReferenceClient(server.address)
    try:
        before = dict(client.describe().control.calls)
        _republish(ranks, 3)
        after = dict(client.describe().control.calls)
    finally:
        client.close()
    sent = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0) and k != "Heartbeat"}
    # One Batch, sent by rank 0, withdrawing every rank's cut and shards of the version before
    # (Publication.unpublish over the trainer group); one, sent by rank 0, announcing every rank's cut
    # and shards (Holdings.announce_together); rank 0's ask for the readers' cut. Nothing a rank.
    sent.pop("Describe", None)
    assert sent == {"Batch": 2, "ReaderCuts": 1}, sent
    assert sorted(r.trainer_cut for r in _replicas(server.address, 3) if r.origin) == [False, False, True, True]
    for w in range(2):  # and what they hold is version 3, exactly
        got = _pull(hubs(f"e1w{w}"), 3, ("tp", w, 2))
        assert got["read_bytes"] == got["nbytes"]


def test_a_rank_that_does_not_come_to_the_groups_withdrawal_costs_the_others_only_their_timeout(server, hubs):
    """``unpublish`` of a publication made with ``cut=`` is collective over the
    trainer group; a rank that never calls it does not hang the others: past
    half the unpublish's timeout the round fails for the rank that came (gloo's
    monitored barrier), and it withdraws alone in the other half, its memory
    free once it returns."""
    ranks = _trainer(hubs)
    _publish(ranks, 1)
    start = time.monotonic()
    ranks[0].send("unpublish", model="m", version=1, timeout=3.0)  # rank 1 never comes
    out = ranks[0].result(timeout=30)
    assert 1.5 <= out["end"] - start < 3.0 + 10.0, out["end"] - start
    left = {r.agent_id for r in _replicas(server.address, 1) if not r.withdrawn}
    assert left == {ranks[1].agent_id}, left
    ranks[1].send("unpublish", model="m", version=1, timeout=3.0)  # alone too: rank 0 has done its part
    ranks[1].result(timeout=30)
    assert not any(not r.withdrawn for r in _replicas(server.address, 1))


def test_ranks_that_publish_together_without_the_cut_cost_the_server_two_messages_a_step(server, hubs):
    """``publish(trainer_group=)``: no cut, but the ranks' announces go in one
    message sent by rank 0 (from the step whose publishes go lean), and so do
    their withdrawals (``unpublish`` on every rank at once). The reader gets
    every version byte-exact."""
    ranks = _trainer(hubs)
    reader = hubs("reader")

    def step(version: int) -> None:
        if version > 1:
            _unpublish(ranks, version - 1)  # every rank's shards, sent by rank 0
            for hub in ranks:
                hub.call("overwrite", model="m", version=version - 1, seed=version)
        for r, hub in enumerate(ranks):
            if version > 1:
                hub.send("republish", model="m", version=version, of=version - 1, how="rows", rank=r, world=2,
                         chunk_size=CHUNK, together=True)
            else:
                hub.send("publish_shard", model="m", version=1, specs=SPECS, seed=1, how="rows", rank=r, world=2,
                         chunk_size=CHUNK, together=True)
        for hub in ranks:
            hub.result()

    step(1)  # the first publishes go whole, each rank its own
    _pull(reader, 1, ("tp", 0, 2), keep="dest")
    step(2)
    client = ReferenceClient(server.address)
    try:
        before = dict(client.describe().control.calls)
        step(3)
        after = dict(client.describe().control.calls)
    finally:
        client.close()
    sent = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0) and k not in ("Heartbeat",)}
    sent.pop("Describe", None)
    assert sent == {"Batch": 2}, sent  # no Publish, no Unpublish of a rank's own
    got = _pull(reader, 3, ("tp", 0, 2), keep="dest")
    assert set(got["sources"]) == {"rank0", "rank1"}
