"""Wide READs chosen by the transport's cost model (``transport.cost``,
``client.wideread``): short column runs of a row-sharded matrix are read as
whole-row spans into scratch and cut locally; long runs stay exact. Not timed:
the tests count descriptors and bytes and compare the bytes with torch indexing.

The pull tests run the real ``PullJob`` with a fake control plane and a fake
transport that copies with memmove in this process (as test_regions.py's);
the last test runs real NIXL between processes.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
import torch
from test_regions import FakeControlPlane  # the fake control plane of the pull tests

from tensorhub.client.puller import PullJob
from tensorhub.client.readlayout import ReadLayout, ReadPart
from tensorhub.client.rpc import RemoteReplica, Resolved
from tensorhub.client.scratch import ScratchPool
from tensorhub.client.transfer import Transfer
from tensorhub.client.wideread import WideReads, widen
from tensorhub.integrity import chunk_checksums
from tensorhub.manifest import Manifest, itemsize
from tensorhub.planner import Source
from tensorhub.regions import Region
from tensorhub.topology import Labels
from tensorhub.transport import MemoryKind, TransferFailed
from tensorhub.transport.cost import BACKENDS, fit, measure, pick
from tensorhub.transport.memory import MemoryRegion, regions_of

SHM = BACKENDS["shm"]

# ---------------------------------------------------------------- the cost model


def test_the_cost_model_reads_long_runs_exactly_and_many_short_runs_wide():
    # A TP=8 column slice of a [2048, 768] bf16 expert: 192 of every 1,536 bytes.
    runs, run, row = 2048, 192, 1536
    assert SHM.wide_s((runs - 1) * row + run, runs * run) < SHM.exact_s(runs, runs * run) / 5
    # Half of every 64 KiB row: the runs are long, reading the other half costs more than their descriptors.
    runs, run, row = 256, 32 << 10, 64 << 10
    assert SHM.exact_s(runs, runs * run) < SHM.wide_s((runs - 1) * row + run, runs * run)
    # Every backend has a break-even run length between the two.
    for cost in BACKENDS.values():
        assert cost.wide_s(1535 * 64 + 64, 1536 * 64) < cost.exact_s(1536, 1536 * 64), cost.name


def test_auto_picks_shared_memory_within_a_host_and_exact_never_widens():
    assert pick("auto", same_host=True, device_memory=False).name == "shm"
    assert pick("auto", same_host=True, device_memory=True).name == "nvlink"
    assert pick("auto", same_host=False, device_memory=False).name == "tcp"
    assert pick("rdma", same_host=False, device_memory=False).name == "rdma"
    assert pick("exact", same_host=True, device_memory=False) is None
    with pytest.raises(ValueError, match="not one of"):
        pick("infiniband", same_host=True, device_memory=False)


def test_measure_fits_the_per_descriptor_cost_and_bandwidth_of_a_link():
    # A link costing 3 us per descriptor at 5 GB/s, read through ``measure``'s procedure.
    cost = measure("shm", lambda d, n, _stride: d * 3e-6 + d * n / 5e9)
    assert cost.per_descriptor_s == pytest.approx(3e-6, rel=1e-6)
    assert cost.bandwidth == pytest.approx(5e9, rel=1e-6)
    assert fit([(1, 10, 1.0), (10, 10, 10.0)])[0] == pytest.approx(1.0)


# ---------------------------------------------------------------- widening one READ


def _strided(runs: int, run: int, stride: int) -> Transfer:
    """A READ of ``runs`` runs of ``run`` bytes, ``stride`` apart on the holder, back to back locally."""
    i = np.arange(runs, dtype=np.uint64)
    local = np.stack([(1 << 30) + i * run, np.full(runs, run, np.uint64), np.zeros(runs, np.uint64)], 1)
    remote = np.stack([(1 << 32) + i * stride, np.full(runs, run, np.uint64), np.zeros(runs, np.uint64)], 1)
    return Transfer("h", local, remote, runs * run, (i * stride).astype(np.int64))


def test_a_read_of_short_runs_goes_wide_within_one_held_region_and_one_slot():
    t = _strided(2048, 192, 1536)
    one_region = np.array([2048 * 1536], np.int64)
    out = widen(t, one_region, SHM, 8 << 20)
    assert len(out) == 1 and out[0].wide is not None
    plan = out[0].wide
    assert len(plan.local) == 1 and plan.read_bytes == 2047 * 1536 + 192  # one descriptor of the rows' span
    assert np.array_equal(out[0].local, t.local) and out[0].nbytes == t.nbytes  # the exact view stays
    # The held region ends half-way: the span never crosses it (two groups, one per region).
    halves = np.array([1024 * 1536, 2048 * 1536], np.int64)
    plan = widen(t, halves, SHM, 8 << 20)[0].wide
    assert len(plan.local) == 2
    spans = [(int(a), int(a) + int(n)) for a, n, _ in plan.remote.tolist()]
    assert all(a >= (1 << 32) + int(i) * 1024 * 1536 and b <= (1 << 32) + (int(i) + 1) * 1024 * 1536
               for i, (a, b) in enumerate(spans))
    # A slot of 1 MiB: spans of at most 512 KiB, READs of at most one slot of them.
    small = widen(t, one_region, SHM, 1 << 20)
    assert len(small) > 1 and sum(x.nbytes for x in small) == t.nbytes
    for x in small:
        assert x.wide is not None and int(x.wide.local[:, 1].sum()) <= 1 << 20
        assert (x.wide.local[:, 0] + x.wide.local[:, 1] <= 1 << 20).all()  # offsets inside the slot


def test_a_read_of_long_runs_stays_exact():
    t = _strided(256, 32 << 10, 64 << 10)
    assert widen(t, np.array([256 << 16], np.int64), SHM, 8 << 20) == [t]


# ---------------------------------------------------------------- holder tables from boxes


def _region(rng, shape: tuple[int, ...]) -> Region:
    kind = rng.choice(["whole", "box", "box", "rows", "cols", "flat"])
    if kind == "whole" or not shape:
        return Region()
    if kind == "flat":
        n = int(np.prod(shape))
        a = rng.randrange(n)
        return Region(flat=(a, rng.randrange(a + 1, n + 1)))
    if kind in ("rows", "cols") and len(shape) >= 2:
        size = shape[0 if kind == "rows" else 1]
        a = rng.randrange(size)
        return Region.of(shape, **{kind: (a, rng.randrange(a + 1, size + 1))})
    box = []
    for d in shape:
        a = rng.randrange(d)
        box.append((a, rng.randrange(a + 1, d + 1)))
    return Region(box=tuple(box))


def _held(rng, shape: tuple[int, ...]) -> list[Region]:
    """What one replica holds of a tensor: nothing, one region, or two that do not overlap."""
    how = rng.choice(["none", "one", "two"])
    if how == "none":
        return []
    if how == "one" or not shape or shape[0] < 2:
        return [_region(rng, shape)]
    cut = rng.randrange(1, shape[0])
    kind = rng.random()
    if kind < 0.4:  # rows, as two FSDP ranks
        return [Region.of(shape, rows=(0, cut)), Region.of(shape, rows=(cut, shape[0]))]
    if kind < 0.7:  # a flat range and a box after it
        return [Region(flat=(0, cut * int(np.prod(shape[1:])))), Region.of(shape, rows=(cut, shape[0]))]
    n = int(np.prod(shape))  # two ZeRO-3 partitions, cut anywhere
    cut = rng.randrange(1, n)
    return [Region(flat=(0, cut)), Region(flat=(cut, n))]


def test_holder_tables_from_boxes_are_those_from_element_runs():
    """The box path (``boxsegments``) against intersecting element runs, on
    random boxes, rows, columns, flat ranges and whole tensors of 0 to 4
    dimensions (fused experts' [E, rows, columns] among them), as the reader's
    parts and as the holder's regions: the same segments, byte for byte, cut
    at the same chunks."""
    import random

    rng = random.Random(5)
    boxed = boxed_nd = boxed_flat = 0
    for trial in range(300):
        shapes = [rng.choice([(), (37,), (12, 9), (8, 64), (5, 6, 7), (1, 40), (4, 1, 9), (8, 6, 10), (3, 4, 5, 6)])
                  for _ in range(rng.randint(1, 4))]
        manifest = Manifest.of({f"t{i}": torch.zeros(s, dtype=torch.bfloat16) for i, s in enumerate(shapes)})
        wants = [(t, _region(rng, shapes[t])) for t in (rng.randrange(len(shapes)) for _ in range(rng.randint(1, 5)))]
        held = [(t, r) for t in range(len(shapes)) for r in _held(rng, shapes[t])]
        regions = np.array([((1 << 40) + i * (1 << 20), r.numel(shapes[t]) * 2, 0) for i, (t, r) in enumerate(held)],
                           np.uint64).reshape(-1, 3)
        replica = RemoteReplica(Source("h", "h", Labels("h0")), "h", MemoryKind.DRAM, tuple(held), regions, b"",
                                rng.choice([64, 256, 1 << 20]))
        chunk = rng.choice([128, 512, 1 << 20])
        tables = []
        for by_box in (True, False):
            at, parts = 1 << 30, []
            for i, (t, r) in enumerate(wants):
                nbytes = r.numel(shapes[t]) * 2
                parts.append(ReadPart(f"p{i}", t, shapes[t], r.runs(shapes[t]), 2, MemoryRegion(at, nbytes, 0),
                                      r if by_box else None))
                at += nbytes
            tables.append(ReadLayout(manifest, parts, chunk).holder_table(replica))
        assert tables[0].keys() == tables[1].keys()
        for key in tables[0]:
            assert np.array_equal(tables[0][key], tables[1][key]), (trial, key, wants, held)
        boxed += any(r.flat is None and len(shapes[t]) <= 2 for t, r in held)
        boxed_nd += any(r.flat is None and len(shapes[t]) > 2 for t, r in held)
        boxed_flat += any(r.flat is not None for t, r in held)
    assert boxed > 100 and boxed_nd > 50 and boxed_flat > 50  # every kind of region took the box path


def test_box_pairs_are_every_pair_whose_rows_meet_and_not_experts_squared():
    """``boxsegments.pairs`` against every pair of one tensor, on random
    regions (rows that meet: none missed); and a fused expert tensor relayed
    cut as the reader cuts it (a box per expert on both sides) pairs each
    expert once, not 384 x 384 times."""
    import random

    from tensorhub.client.boxsegments import Boxes, pairs

    rng = random.Random(7)
    for _ in range(200):
        shapes = [rng.choice([(37,), (12, 9), (5, 6, 7), (3, 4, 5, 6)]) for _ in range(rng.randint(1, 3))]
        a = Boxes.of([(t, _region(rng, shapes[t])) for t in (rng.randrange(len(shapes)) for _ in range(4))], shapes)
        b = Boxes.of([(t, r) for t in range(len(shapes)) for r in _held(rng, shapes[t])], shapes)
        p, h = pairs(a, b, np.arange(len(a.ok)), np.arange(len(b.ok)))
        got = set(zip(p.tolist(), h.tolist()))
        for i in range(len(a.ok)):
            for j in range(len(b.ok)):
                meet = a.tensor[i] == b.tensor[j] and max(a.r0[i], b.r0[j]) < min(a.r1[i], b.r1[j])
                assert not meet or (i, j) in got, (i, j)
    shape = (384, 64, 32)  # [experts, rows, columns]: rows 8:16 of every expert on both sides
    tp = Region(box=((0, 384), (8, 16), (0, 32)))
    mine, relay = Boxes.of([(0, tp)], [shape]), Boxes.of([(0, tp)], [shape])
    assert len(mine.ok) == 384
    p, h = pairs(mine, relay, np.arange(384), np.arange(384))
    assert len(p) == 384 and bool((p == h).all())


# ---------------------------------------------------------------- pulls with fakes


class MemcpyTransport:
    """Moves bytes with memmove in this process, done when posted (as NIXL over
    shared memory); counts descriptors; ``fail_wide`` READs with a descriptor of
    more than ``wide_bytes`` (a wide span) raise, the first ones posted."""

    def __init__(self) -> None:
        self.descriptors = 0
        self.fail_wide = 0
        self.wide_bytes = 1 << 62

    def connect(self, key: str, metadata: bytes, regions: object = None) -> str:
        return key

    def post(self, remote, local, local_kind, remote_descs, remote_kind):
        if self.fail_wide and int(local[:, 1].max()) > self.wide_bytes:
            self.fail_wide -= 1
            raise TransferFailed(remote, "peer is gone")
        for (dst, n, _), (src, m, _) in zip(local.tolist(), remote_descs.tolist()):
            assert n == m
            ctypes.memmove(dst, src, n)
        self.descriptors += len(local)
        return "done"  # landed when posted

    def poll(self, pending) -> bool:
        return True

    def release(self, pending) -> None:
        """Nothing to release: reads are memmoves."""

    def forget(self, key: str) -> None:
        """No connections to drop."""


CHUNK = 64 << 10


def _replica(rid: str, manifest: Manifest, held: list[tuple[str, Region, torch.Tensor]]) -> RemoteReplica:
    index = manifest.index()
    _, mem = regions_of([t for _, _, t in held])
    regions = np.array([(m.addr, m.size, 0) for m in mem], np.uint64).reshape(-1, 3)
    crcs = chunk_checksums([t for _, _, t in held], CHUNK)
    return RemoteReplica(Source(rid, rid, Labels("h0"), origin=True), rid, MemoryKind.DRAM,
                         tuple((index[n], r) for n, r, _ in held), regions, b"", CHUNK, chunk_crc32=crcs)


def _pull(manifest: Manifest, replicas: list[RemoteReplica], want: list[tuple[str, Region]], *, wide: bool,
          transport: MemcpyTransport, verify: bool = True, boxed: bool = False):
    index = manifest.index()
    dests = [torch.full((r.numel(manifest.tensors[index[n]].shape),), -1, dtype=torch.bfloat16) for n, r in want]
    _, mem = regions_of(dests)
    parts = [ReadPart(n, index[n], manifest.tensors[index[n]].shape, r.runs(manifest.tensors[index[n]].shape),
                      itemsize(manifest.tensors[index[n]].dtype), m, r if boxed else None)
             for (n, r), m in zip(want, mem)]
    plane = FakeControlPlane(Resolved("m", 1, manifest, tuple(replicas)))
    reads = WideReads(ScratchPool(4, 1 << 20), lambda replica: SHM) if wide else WideReads()
    job = PullJob(rpc=plane, nixl=transport, agent_id="reader", labels=Labels("h0"),
                  resolved=plane.resolve("reader", "m", 1), layout=ReadLayout(manifest, parts, CHUNK),
                  dest_kind=MemoryKind.DRAM, in_flight=4, chunk_timeout_s=5, deadline=time.monotonic() + 30,
                  verify=verify, wide=reads)
    return job.run(), dests, plane


def _row_sharded(full: torch.Tensor, ranks: int = 2):
    manifest = Manifest.of({"w": full})
    rows = full.shape[0]
    held = [full[r * rows // ranks:(r + 1) * rows // ranks].clone() for r in range(ranks)]  # kept alive by the caller
    replicas = [_replica(f"rank{r}", manifest, [("w", Region.of(tuple(full.shape), rows=(r * rows // ranks,
                                                                                       (r + 1) * rows // ranks)),
                                                  held[r])]) for r in range(ranks)]
    return manifest, replicas, held


def test_a_column_slice_from_row_shards_lands_exactly_with_fewer_descriptors_and_more_bytes_read():
    full = torch.randn(2048, 768).to(torch.bfloat16)  # a Qwen3-30B-A3B expert's down_proj
    manifest, replicas, _held = _row_sharded(full)
    cols = Region.of((2048, 768), cols=(0, 96))  # TP rank 0 of 8
    exact, wide = MemcpyTransport(), MemcpyTransport()
    stats_exact, (dest_exact,), _ = _pull(manifest, replicas, [("w", cols)], wide=False, transport=exact)
    stats, (dest,), _ = _pull(manifest, replicas, [("w", cols)], wide=True, transport=wide)
    for d in (dest_exact, dest):
        assert torch.equal(d.view(2048, 96), full[:, 0:96])
    wanted = 2048 * 96 * 2
    assert stats.nbytes == stats_exact.nbytes == stats_exact.read_bytes == wanted
    assert sum(stats.bytes_by_source.values()) == wanted  # accounting counts the reader's bytes
    assert stats.read_bytes > 4 * wanted  # the rows around the columns crossed the link too
    assert stats.read_bytes <= 2048 * 768 * 2
    assert exact.descriptors == stats_exact.descriptors >= 2048  # a descriptor per row
    assert wide.descriptors == stats.descriptors < 2048 // 50


def test_fused_experts_from_expert_shards_land_exactly_through_the_box_path():
    """Fused 3-D experts ([E, 2I, H] and [E, H, I], as transformers 5 and
    FSDP2 ``Shard(0)`` hold them) in two expert shards; a TP reader wants rows
    of every expert of one and columns of every expert of the other. Its parts
    given as boxes (the box path of more than 2 dimensions) land the same bytes
    with the same READs as given as element runs."""
    gate_up, down = torch.randn(8, 96, 64).to(torch.bfloat16), torch.randn(8, 64, 48).to(torch.bfloat16)
    manifest = Manifest.of({"gate_up": gate_up, "down": down})
    shards = [(gate_up[r * 4:(r + 1) * 4].clone(), down[r * 4:(r + 1) * 4].clone()) for r in range(2)]
    replicas = [_replica(f"rank{r}", manifest, [
        ("gate_up", Region(box=((r * 4, r * 4 + 4), (0, 96), (0, 64))), shards[r][0]),
        ("down", Region(box=((r * 4, r * 4 + 4), (0, 64), (0, 48))), shards[r][1])]) for r in range(2)]
    want = [("gate_up", Region(box=((0, 8), (12, 24), (0, 64)))), ("down", Region(box=((0, 8), (0, 64), (6, 12))))]
    got = []
    for boxed in (True, False):
        transport = MemcpyTransport()
        stats, (a, b), _ = _pull(manifest, replicas, want, wide=False, transport=transport, boxed=boxed)
        assert torch.equal(a.view(8, 12, 64), gate_up[:, 12:24]) and torch.equal(b.view(8, 64, 6), down[:, :, 6:12])
        assert stats.checks_failed == 0 and stats.nbytes == stats.read_bytes == (a.numel() + b.numel()) * 2
        got.append(transport.descriptors)
    assert got[0] == got[1] == 8 + 8 * 64  # a READ per expert's rows, one per row of columns


def test_checks_pass_on_the_cut_bytes_of_a_wide_read():
    """Two parts of one tensor (columns 0:96 and 96:768, as two Shards) cover
    each holder chunk whole, so each is checked against its publisher's CRC.
    The CRC must read the destination after the cut: read before it, the
    bytes are the destination's old ones and the check fails."""
    full = torch.randn(1024, 768).to(torch.bfloat16)
    manifest, replicas, _held = _row_sharded(full)
    want = [("w", Region.of((1024, 768), cols=(0, 96))), ("w", Region.of((1024, 768), cols=(96, 768)))]
    transport = MemcpyTransport()
    stats, (left, right), _ = _pull(manifest, replicas, want, wide=True, transport=transport)
    assert torch.equal(left.view(1024, 96), full[:, :96]) and torch.equal(right.view(1024, 672), full[:, 96:])
    assert stats.verified_bytes == full.numel() * 2 and stats.unverified_bytes == 0
    assert stats.checks_failed == 0
    assert stats.read_bytes > stats.nbytes and transport.descriptors < 1024


def test_a_wide_read_that_fails_is_read_again_from_another_holder():
    full = torch.randn(1024, 768).to(torch.bfloat16)
    manifest = Manifest.of({"w": full})
    whole = Region()
    a, b = full.clone(), full.clone()
    replicas = [_replica("a", manifest, [("w", whole, a)]), _replica("b", manifest, [("w", whole, b)])]
    transport = MemcpyTransport()
    transport.fail_wide = 1  # whichever holder the plan reads first fails its first wide READ
    transport.wide_bytes = 4096  # only wide spans are that long here (a row's columns are 192 bytes)
    cols = Region.of((1024, 768), cols=(0, 96))
    stats, (dest,), plane = _pull(manifest, replicas, [("w", cols)], wide=True, transport=transport)
    assert torch.equal(dest.view(1024, 96), full[:, :96])
    assert len(plane.lost) == 1 and stats.lost_sources == plane.lost
    assert stats.read_bytes > stats.nbytes  # the other holder's reads went wide too


# ---------------------------------------------------------------- real NIXL between processes

SPECS = [("gate", "bfloat16", (768, 2048)), ("down", "bfloat16", (2048, 768))]


def test_a_tp8_reader_of_row_shards_reads_columns_wide_over_nixl(hubs):
    """vLLM's TP rank 0 of 8 reads rows of gate and columns of down; two trainer
    ranks hold rows. Byte-exact, and the columns go as whole-row spans: more
    bytes read, far fewer descriptors than with ``read_cost="exact"``."""
    ranks = [hubs(f"rank{r}") for r in range(2)]
    for r, rank in enumerate(ranks):
        rank.call("publish_shard", model="m", version=1, specs=SPECS, seed=1, how="rows", rank=r, world=2)
    read = ("tp", 0, 8)
    wide = hubs("reader").call("pull", model="m", version=1, specs=SPECS, expect_seed=1, read=read)
    exact = hubs("exact", read_cost="exact").call("pull", model="m", version=1, specs=SPECS, expect_seed=1, read=read)
    wanted = (96 * 2048 + 2048 * 96) * 2
    for got in (wide, exact):
        assert got["mismatched"] == [] and got["in_place"] is True and got["nbytes"] == wanted
    assert exact["read_bytes"] == wanted and exact["descriptors"] >= 2048
    assert wide["read_bytes"] > 2 * wanted and wide["descriptors"] < 50


def test_a_slot_that_a_read_may_still_land_in_is_never_reused():
    pool = ScratchPool(2, 4096)
    a, b = pool.take(), pool.take()
    assert a is not None and b is not None and a.addr != b.addr
    assert pool.take() is None  # both in use: the READ goes as its exact runs
    pool.retire(a)  # a stalled READ may still land in it
    c = pool.take()
    assert c is not None and c.addr not in (a.addr, b.addr)
    pool.give(b)
    assert pool.take() is b and pool.retired == 1


def test_cutting_at_both_sides_chunks_at_once_is_cutting_at_each_in_turn():
    from tensorhub.client.readlayout import _cut, _cut_chunks

    rng = np.random.default_rng(3)
    for n in (1, 10, 300, 3000):  # a few crossings (one splice) and many (the general path)
        length = rng.integers(1, 5000, n)
        r_off = np.cumsum(length) - length
        h_off = rng.permutation(n)  # the holder's order differs from the reader's
        h_off = (np.cumsum(length[h_off]) - length[h_off])[np.argsort(h_off)]
        cols = {"r_off": r_off, "h_off": h_off, "local": r_off + (1 << 30), "remote": h_off + (1 << 40),
                "local_dev": np.zeros(n, np.int64), "remote_dev": np.ones(n, np.int64), "length": length}
        for periods in ((4096, 65536), (1 << 20, 777), (1 << 30, 1 << 30)):
            once = _cut_chunks(cols, [("r_off", periods[0]), ("h_off", periods[1])])
            each = _cut(_cut(cols, "r_off", periods[0]), "h_off", periods[1])
            assert once.keys() == each.keys()
            assert all(np.array_equal(once[k], each[k]) for k in once), (n, periods)
