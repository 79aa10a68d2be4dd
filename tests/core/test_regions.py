"""Regions, read layouts and the pull logic, against generated shard layouts.

The pull tests run the real ``PullJob`` (planning, leases, failover) with a
fake control plane and a fake transport that copies bytes with memmove inside
this process: the seam is NIXL itself, which ``test_shards.py`` exercises
across real processes.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import random
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub import InvalidRequest, ManifestMismatch, Shard, SourceLost
from tensorhub.client.puller import PullJob
from tensorhub.client.readlayout import ReadLayout, ReadPart
from tensorhub.client.rpc import RemoteReplica, Resolved
from tensorhub.errors import TensorHubError
from tensorhub.manifest import Manifest, itemsize
from tensorhub.planner import Source
from tensorhub.regions import Region, box_gaps, flat_boxes, gaps, intersect, overlap, subtract
from tensorhub.topology import Labels
from tensorhub.transport import MemoryKind, TransferFailed
from tensorhub.transport.memory import MemoryRegion, regions_of

# ---------------------------------------------------------------- regions


def _random_region(rng: random.Random, shape: tuple[int, ...]) -> Region:
    kind = rng.choice(["whole", "box", "flat", "rows", "cols"])
    n = math.prod(shape)
    if kind == "flat" and n:
        a = rng.randrange(n)
        return Region(flat=(a, rng.randint(a + 1, n)))
    if kind == "rows" and shape and shape[0]:
        a = rng.randrange(shape[0])
        return Region.of(shape, rows=(a, rng.randint(a + 1, shape[0])))
    if kind == "cols" and len(shape) >= 2 and shape[1]:
        a = rng.randrange(shape[1])
        return Region.of(shape, cols=(a, rng.randint(a + 1, shape[1])))
    if kind == "box" and shape and all(shape):
        box = []
        for d in shape:
            a = rng.randrange(d)
            box.append((a, rng.randint(a + 1, d)))
        return Region(box=tuple(box))
    return Region()


def _elements(region: Region, shape: tuple[int, ...]) -> torch.Tensor:
    """Ground truth: the flat indices of the region, in local (row-major) order."""
    index = torch.arange(math.prod(shape)).reshape(shape)
    if region.flat is not None:
        return index.flatten()[region.flat[0]:region.flat[1]]
    return index[tuple(slice(a, b) for a, b in region.bounds(shape))].flatten()


SHAPES = [(), (1,), (7,), (5, 3), (4, 1), (1, 6), (3, 4, 5), (2, 3, 1, 4), (0, 3)]


def test_runs_list_exactly_the_region_elements_in_local_order():
    rng = random.Random(1)
    for shape, _ in itertools.product(SHAPES, range(30)):
        region = _random_region(rng, shape)
        if region.problem(shape):
            continue
        runs = region.runs(shape)
        got = [s + i for s, n in zip(runs.start.tolist(), runs.length.tolist()) for i in range(n)]
        assert got == _elements(region, shape).tolist(), (shape, region)
        assert int(runs.length.sum()) == region.numel(shape)
        assert list(runs.start) == sorted(runs.start)


def test_overlap_and_gaps_match_set_arithmetic():
    rng = random.Random(2)
    for shape, _ in itertools.product([s for s in SHAPES if math.prod(s)], range(40)):
        a, b = _random_region(rng, shape), _random_region(rng, shape)
        ea, eb = _elements(a, shape).tolist(), _elements(b, shape).tolist()
        ov = overlap(a.runs(shape), b.runs(shape))
        pairs = {(s + i, oa + i, ob + i) for s, n, oa, ob in zip(ov.start, ov.length, ov.a, ov.b) for i in range(n)}
        want = {(e, ea.index(e), eb.index(e)) for e in set(ea) & set(eb)}
        assert pairs == want
        holes = {e for lo, hi in gaps(math.prod(shape), [a.runs(shape), b.runs(shape)]) for e in range(lo, hi)}
        assert holes == set(range(math.prod(shape))) - set(ea) - set(eb)


def test_region_problems_name_the_dimension():
    assert Region.of((10, 4), rows=(0, 11)).problem((10, 4)) == "dimension 0: [0:11) is empty, inverted or outside [0:10)"
    assert "inverted" in Region(flat=(5, 5)).problem((10,))
    assert "2 dimension(s)" in Region(box=((0, 1), (0, 1))).problem((3,))
    with pytest.raises(ValueError, match="two dimensions"):
        Region.of((5,), cols=(0, 1))


def test_bad_shards_are_refused_naming_tensor_and_region():
    m = Manifest.of({"w": torch.zeros(10, 4), "b": torch.zeros(4)})
    cases = {
        "w [0:11, 0:4]": {"w": Shard(torch.zeros(11, 4), (10, 4), rows=(0, 11)), "b": torch.zeros(4)},
        "the local tensor has 12 elements, the region 8": {"w": Shard(torch.zeros(3, 4), (10, 4), rows=(0, 2)),
                                                           "b": torch.zeros(4)},
        "not contiguous": {"w": Shard(torch.zeros(4, 2).t(), (10, 4), rows=(0, 2)), "b": torch.zeros(4)},
        "flat[3:3]": {"w": torch.zeros(10, 4), "b": Shard(torch.zeros(0), (4,), flat=(3, 3))},
        "overlaps [0:5, 0:4]": {"w": [Shard(torch.zeros(5, 4), (10, 4), rows=(0, 5)),
                                      Shard(torch.zeros(2, 4), (10, 4), rows=(4, 6))], "b": torch.zeros(4)},
    }
    for needle, entries in cases.items():
        with pytest.raises(InvalidRequest, match="Nothing was registered or read") as err:
            m.parts(entries, model="m", version=1)
        assert needle in str(err.value), str(err.value)
    with pytest.raises(InvalidRequest, match="not both|one of"):
        Shard(torch.zeros(2, 4), (10, 4), rows=(0, 2), cols=(0, 4))
    with pytest.raises(ManifestMismatch, match="w: version has float32\\[10, 4\\], destination torch.float32\\[12, 4\\]"):
        m.parts({"w": Shard(torch.zeros(2, 4), (12, 4), rows=(0, 2)), "b": torch.zeros(4)}, model="m", version=1)


# ---------------------------------------------------------------- pull logic with fakes


class MemcpyTransport:
    """Moves bytes with memmove in this process, done when posted (as NIXL over
    shared memory); ``fail`` makes a replica's reads raise, ``slow`` never finish."""

    def __init__(self) -> None:
        self.fail: set[str] = set()
        self.slow: set[str] = set()
        self.reads: list[tuple[str, int]] = []
        self.released = 0

    def connect(self, key: str, metadata: bytes, regions: object = None) -> str:
        return key

    def post(self, remote, local, local_kind, remote_descs, remote_kind):
        if remote in self.fail:
            raise TransferFailed(remote, "peer is gone")
        if remote in self.slow:
            return remote
        for (dst, n, _), (src, m, _) in zip(local.tolist(), remote_descs.tolist()):
            assert n == m
            ctypes.memmove(dst, src, n)
        self.reads.append((remote, int(local[:, 1].sum())))
        return None

    def poll(self, pending) -> bool:
        return pending is None

    def release(self, pending) -> None:
        self.released += 1

    def forget(self, key: str) -> None:
        """No connections to drop: reads are memmoves in this process."""


class FakeControlPlane:
    def __init__(self, resolved: Resolved) -> None:
        self.resolved = resolved
        self.lost: list[str] = []

    def resolve(self, agent_id, model, version, *, group="", group_round=0, lease=False, **_wait):
        alive = tuple(r for r in self.resolved.replicas if r.source.replica_id not in self.lost)
        return Resolved(model, self.resolved.version, self.resolved.manifest, alive)

    def acquire_lease(self, agent_id, replica_ids):
        return "lease", [r for r in replica_ids if r not in self.lost], 60.0

    def renew_lease(self, agent_id, lease_id):
        return 60.0

    def release_lease_async(self, agent_id, lease_id):
        """Leases are not tracked: nothing drains in these tests."""

    def report_lost(self, agent_id, replica_id, reason, stalled=False):
        self.lost.append(replica_id)


def _remote(rid: str, manifest: Manifest, parts: list[tuple[str, Region, torch.Tensor]], *,
            origin: bool = True) -> RemoteReplica:
    index = manifest.index()
    _, mem = regions_of([t for _, _, t in parts])
    regions = np.array([(m.addr, m.size, 0) for m in mem], np.uint64).reshape(-1, 3)
    return RemoteReplica(Source(rid, rid, Labels("h0"), origin=origin), rid, MemoryKind.DRAM,
                         tuple((index[n], r) for n, r, _ in parts), regions, b"", 1 << 20)


def _pull(manifest: Manifest, replicas: list[RemoteReplica], want: list[tuple[str, Region]], *,
          chunk_size: int = 4096, transport: MemcpyTransport | None = None, chunk_timeout_s: float = 5,
          progress=None):
    index = manifest.index()
    dests = []
    for name, region in want:
        spec = manifest.tensors[index[name]]
        dests.append(torch.full((region.numel(spec.shape),), -1, dtype=getattr(torch, spec.dtype)))
    _, mem = regions_of(dests)
    parts = [ReadPart(n, index[n], manifest.tensors[index[n]].shape, r.runs(manifest.tensors[index[n]].shape),
                      itemsize(manifest.tensors[index[n]].dtype), m) for (n, r), m in zip(want, mem)]
    transport = transport or MemcpyTransport()
    plane = FakeControlPlane(Resolved("m", 1, manifest, tuple(replicas)))
    job = PullJob(rpc=plane, nixl=transport, agent_id="reader", labels=Labels("h0"),
                  resolved=plane.resolve("reader", "m", 1), layout=ReadLayout(manifest, parts, chunk_size),
                  dest_kind=MemoryKind.DRAM, in_flight=4, chunk_timeout_s=chunk_timeout_s,
                  deadline=time.monotonic() + 30, progress=progress)
    stats = job.run()
    return stats, dests, plane


def _model(rng: random.Random) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(rng.randint(1, 4)):
        shape = rng.choice([(37, 11), (8, 300), (1000,), (5, 6, 7), (64, 64)])
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64])
        out[f"t{i}"] = (torch.randn(shape) * 100).to(dtype)
    return out


def _split(rng: random.Random, shape: tuple[int, ...], holders: int) -> list[Region]:
    """Regions that together cover the tensor: rows, columns or flat ranges."""
    kind = rng.choice(["rows", "flat"] + (["cols"] if len(shape) >= 2 else []))
    dim = {"rows": shape[0], "cols": shape[1] if len(shape) > 1 else 0, "flat": math.prod(shape)}[kind]
    cuts = sorted({0, dim, *(rng.randrange(1, dim) for _ in range(holders - 1))})
    return [Region.of(shape, **{kind: (a, b)}) for a, b in itertools.pairwise(cuts)]


def test_generated_shard_layouts_pull_byte_exact_and_count_each_byte_once():
    rng = random.Random(3)
    for trial in range(40):
        full = _model(rng)
        manifest = Manifest.of(full)
        holders: dict[str, list] = {f"h{i}": [] for i in range(rng.randint(1, 4))}
        for name, tensor in full.items():
            regions = _split(rng, tuple(tensor.shape), len(holders))
            if rng.random() < 0.3:  # replicated: every holder has it whole
                regions = [Region()] * len(holders)
            for rid, region in zip(itertools.cycle(holders), regions):
                local = _elements(region, tuple(tensor.shape))
                holders[rid].append((name, region, tensor.flatten()[local].contiguous()))
        replicas = [_remote(rid, manifest, parts) for rid, parts in holders.items() if parts]
        want = [(name, _random_region(rng, tuple(t.shape))) for name, t in full.items()]
        stats, dests, _ = _pull(manifest, replicas, want, chunk_size=rng.choice([4096, 8192, 1 << 20]))
        for (name, region), dest in zip(want, dests):
            expected = full[name].flatten()[_elements(region, tuple(full[name].shape))]
            assert torch.equal(dest, expected), (trial, name, region)
        requested = sum(d.numel() * d.element_size() for d in dests)
        assert stats.nbytes == requested
        assert sum(stats.bytes_by_source.values()) == requested


def test_a_whole_tensor_spanning_four_shards_reads_from_all_four():
    full = {"w": torch.arange(1000 * 8, dtype=torch.float32).reshape(1000, 8)}
    manifest = Manifest.of(full)
    cuts = [0, 250, 500, 750, 1000]
    replicas = [_remote(f"rank{i}", manifest, [("w", Region.of((1000, 8), rows=(a, b)), full["w"][a:b].contiguous())])
                for i, (a, b) in enumerate(itertools.pairwise(cuts))]
    stats, dests, _ = _pull(manifest, replicas, [("w", Region())], chunk_size=1 << 20)
    assert torch.equal(dests[0].reshape(1000, 8), full["w"])
    assert stats.bytes_by_source == {f"rank{i}": 250 * 8 * 4 for i in range(4)}


def test_failover_to_another_holder_of_the_region_else_source_lost_names_it():
    full = {"w": torch.arange(100 * 4, dtype=torch.float32).reshape(100, 4)}
    manifest = Manifest.of(full)
    top = ("w", Region.of((100, 4), rows=(0, 50)), full["w"][:50].contiguous())
    bottom = ("w", Region.of((100, 4), rows=(50, 100)), full["w"][50:].contiguous())
    transport = MemcpyTransport()
    transport.fail = {"reader2"}  # a reader serving the bottom half ranks first for it, then dies
    replicas = [_remote("rank0", manifest, [top]), _remote("rank1", manifest, [bottom]),
                _remote("reader2", manifest, [bottom], origin=False)]
    stats, dests, plane = _pull(manifest, replicas, [("w", Region())], transport=transport)
    assert torch.equal(dests[0].reshape(100, 4), full["w"])
    assert stats.bytes_by_source == {"rank0": 800, "rank1": 800} and plane.lost == ["reader2"]
    transport = MemcpyTransport()
    transport.fail = {"rank1"}
    with pytest.raises(SourceLost, match="no remaining holder has w rows 50:100"):
        _pull(manifest, replicas[:2], [("w", Region())], transport=transport)


def test_a_filling_holder_gives_only_the_chunks_it_has_landed():
    full = {"w": torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256)}  # 64 KiB
    manifest = Manifest.of(full)
    trainer = _remote("trainer", manifest, [("w", Region(), full["w"])])
    # A reader that serves the whole tensor, 4 KiB chunks, only every other one landed;
    # the rest of its memory is garbage that must never be read.
    landed = full["w"].clone()
    bits = bytearray(2)
    for chunk in range(16):
        if chunk % 2:
            bits[chunk >> 3] |= 1 << (chunk & 7)
        else:
            landed.view(-1)[chunk * 1024:(chunk + 1) * 1024] = -7.0
    filling = _remote("filling", manifest, [("w", Region(), landed)], origin=False)
    filling = RemoteReplica(Source("filling", "filling", Labels("h0"), complete=False), "filling", MemoryKind.DRAM,
                            filling.held, filling.regions, b"", 4096, bytes(bits))
    stats, dests, _ = _pull(manifest, [trainer, filling], [("w", Region.of((64, 256), cols=(0, 200)))],
                            chunk_size=8192)
    assert torch.equal(dests[0].reshape(64, 200), full["w"][:, :200])
    assert stats.bytes_by_source["filling"] > 0 and stats.bytes_by_source["trainer"] > 0


def test_a_read_that_never_completes_is_a_stalled_source_and_every_handle_is_released():
    full = {"w": torch.arange(100 * 4, dtype=torch.float32).reshape(100, 4)}
    manifest = Manifest.of(full)
    reader = ("w", Region(), full["w"].clone())
    transport = MemcpyTransport()
    transport.slow = {"stuck"}  # a cut link: the READ is posted and never finishes
    replicas = [_remote("stuck", manifest, [reader], origin=False), _remote("trainer", manifest, [reader])]
    start = time.monotonic()
    stats, dests, plane = _pull(manifest, replicas, [("w", Region())], transport=transport, chunk_timeout_s=0.3)
    assert time.monotonic() - start < 5
    assert torch.equal(dests[0].reshape(100, 4), full["w"])
    assert plane.lost == ["stuck"] and stats.bytes_by_source == {"trainer": 1600}
    assert transport.released == len(transport.reads) + 1  # the stalled handle too


def test_relay_reads_what_a_filling_peer_landed_and_waits_for_it_only_so_long():
    full = {"w": torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256)}  # 256 KiB: 64 chunks of 4 KiB
    manifest = Manifest.of(full)
    trainer = _remote("trainer", manifest, [("w", Region(), full["w"])])
    bits = bytes([0xFF] * 4 + [0] * 4)  # the peer landed chunks 0-31 and is stuck there
    peer_memory = full["w"].clone()  # kept alive: the fake transport reads it by address
    base = _remote("peer", manifest, [("w", Region(), peer_memory)], origin=False)
    peer = RemoteReplica(Source("peer", "peer", Labels("h0"), complete=False), "peer-agent", MemoryKind.DRAM,
                         base.held, base.regions, b"", 4096, bits)
    start = time.monotonic()
    stats, dests, _ = _pull(manifest, [trainer, peer], [("w", Region())], chunk_size=4096)
    assert torch.equal(dests[0].reshape(256, 256), full["w"])
    assert stats.bytes_by_source["peer"] == 32 * 4096  # every landed chunk came from the peer
    assert stats.bytes_by_source["trainer"] == 32 * 4096
    # The chunks the peer owns on the ring but never landed were waited for, then read anyway.
    assert time.monotonic() - start < 10


def test_a_pull_that_raises_mid_round_releases_every_read_in_flight():
    full = {"a": torch.ones(32, 32), "b": torch.zeros(32, 32)}  # one 4 KiB chunk each
    manifest = Manifest.of(full)
    transport = MemcpyTransport()
    transport.slow = {"stuck"}  # holds b: its READ stays in flight
    replicas = [_remote("fast", manifest, [("a", Region(), full["a"])]),
                _remote("stuck", manifest, [("b", Region(), full["b"])])]

    def stop(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _pull(manifest, replicas, [("b", Region()), ("a", Region())], transport=transport, progress=stop)
    assert transport.released == len(transport.reads) + 1  # the READ still in flight too


def test_a_lease_that_fails_to_renew_mid_round_defers_its_chunks_to_the_next_round():
    """The first READ finds its lease cannot be renewed: that chunk and every
    later one on the same holder wait for a new lease; the pull completes."""
    full = {"w": torch.arange(64 * 256, dtype=torch.float32)}  # 16 chunks of 4 KiB
    manifest = Manifest.of(full)

    class FlakyRenewal(FakeControlPlane):
        renewals = 0

        def acquire_lease(self, agent_id, replica_ids):
            return "lease", list(replica_ids), 1e-9  # renewed at every READ

        def renew_lease(self, agent_id, lease_id):
            FlakyRenewal.renewals += 1
            if FlakyRenewal.renewals == 1:
                raise TensorHubError("lease expired")
            return 60.0

    index = manifest.index()
    dest = torch.full((64 * 256,), -1.0)
    _, mem = regions_of([dest])
    parts = [ReadPart("w", index["w"], (64 * 256,), Region().runs((64 * 256,)), 4, mem[0])]
    plane = FlakyRenewal(Resolved("m", 1, manifest, (_remote("trainer", manifest, [("w", Region(), full["w"])]),)))
    job = PullJob(rpc=plane, nixl=MemcpyTransport(), agent_id="reader", labels=Labels("h0"),
                  resolved=plane.resolve("reader", "m", 1), layout=ReadLayout(manifest, parts, 4096),
                  dest_kind=MemoryKind.DRAM, in_flight=4, chunk_timeout_s=5, deadline=time.monotonic() + 30)
    stats = job.run()
    assert torch.equal(dest, full["w"]) and stats.bytes_by_source == {"trainer": 64 * 256 * 4}
    assert FlakyRenewal.renewals > 1


def test_runs_are_kept_read_only_and_the_keeping_is_bounded() -> None:
    from tensorhub import regions

    regions._kept_runs.cache_clear()
    few, many = Region.of((8, 4), rows=(2, 6)), Region.of((100, 4), cols=(1, 3))  # 1 run; 100 runs
    first = few.runs((8, 4))
    assert few.runs([8, 4]) is first  # kept (a list shape is the same key)
    with pytest.raises(ValueError, match="read-only"):
        first.start[0] = 5  # shared: nobody may change it
    big = many.runs((100, 4))
    assert len(big) == many.run_count((100, 4)) == 100 and many.runs((100, 4)) is not big  # over 64 runs: not kept
    assert not big.length.flags.writeable
    for k in range(regions._kept_runs.cache_info().maxsize):  # as many others: the first goes
        Region(flat=(k, k + 1)).runs((10_000,))
    again = few.runs((8, 4))
    assert again is not first and np.array_equal(again.start, first.start) and np.array_equal(again.length, first.length)


def test_run_count_is_the_number_of_runs() -> None:
    rng = random.Random(7)
    for _ in range(300):
        shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 4)))
        region = _random_region(rng, shape) if math.prod(shape) else Region()
        assert region.run_count(shape) == max(1, len(region.runs(shape)))


def test_a_same_layout_holder_is_read_in_one_descriptor_per_contiguous_range():
    """Worker k of one engine to worker k of the next: both hold the same column
    slice of a 4,096-row tensor contiguously, so each chunk's piece of it is one
    READ descriptor, not one per row; from a holder of whole rows it stays one
    per row (its columns are not contiguous there). Byte-exact either way."""
    full = torch.randn(4096, 256).to(torch.bfloat16)
    manifest = Manifest.of({"w": full})
    cols = Region.of((4096, 256), cols=(64, 128))
    chunk_size = 128 << 10  # the slice is 512 KiB: 4 chunks
    held = full[:, 64:128].contiguous()  # the holders' memory stays alive: replicas hold addresses only
    same = _remote("same", manifest, [("w", cols, held)])
    rows = _remote("rows", manifest, [("w", Region(), full)])
    for holder, per_chunk in ((same, 1), (rows, 128 << 10 >> 7)):  # 128 B of each row
        stats, (dest,), _ = _pull(manifest, [holder], [("w", cols)], chunk_size=chunk_size)
        assert torch.equal(dest.view(4096, 64), full[:, 64:128])
        assert stats.read_bytes == stats.nbytes == 4096 * 64 * 2
        layout = ReadLayout(manifest, [ReadPart("w", 0, (4096, 256), cols.runs((4096, 256)), 2,
                                                MemoryRegion(1 << 20, 4096 * 64 * 2, 0))], chunk_size)
        table = layout.holder_table(holder)
        assert len(table["length"]) == 4 * per_chunk, holder.agent_id
        assert int(table["length"].sum()) == 4096 * 64 * 2


# ---------------------------------------------------------------- box algebra, against torch indexing


_shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)


@st.composite
def _box(draw, shape):
    out = []
    for d in shape:
        a = draw(st.integers(0, d - 1))
        out.append((a, draw(st.integers(a + 1, d))))
    return tuple(out)


def _mask(shape, boxes):
    mask = torch.zeros(shape, dtype=torch.int32)
    for box in boxes:
        mask[tuple(slice(a, b) for a, b in box)] += 1
    return mask


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_intersect_and_subtract_match_torch_masks(data):
    shape = data.draw(_shapes)
    a, b = data.draw(_box(shape)), data.draw(_box(shape))
    ma, mb = _mask(shape, [a]).bool(), _mask(shape, [b]).bool()
    both = intersect(a, b)
    assert torch.equal(_mask(shape, [both] if both else []).bool(), ma & mb)
    pieces = subtract(a, b)
    assert len(pieces) <= 2 * len(shape)
    counted = _mask(shape, pieces)
    assert counted.max() <= 1  # disjoint
    assert torch.equal(counted.bool(), ma & ~mb)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_box_gaps_are_the_disjoint_complement_of_the_union(data):
    shape = data.draw(_shapes)
    boxes = data.draw(st.lists(_box(shape), max_size=6))
    holes = box_gaps(shape, boxes)
    counted = _mask(shape, holes)
    assert counted.max() <= 1
    assert torch.equal(counted.bool(), ~_mask(shape, boxes).bool())


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_flat_ranges_as_boxes_hold_exactly_the_range(data):
    shape = data.draw(_shapes)
    n = math.prod(shape)
    a = data.draw(st.integers(0, n - 1))
    b = data.draw(st.integers(a + 1, n))
    boxes = flat_boxes(shape, a, b)
    assert len(boxes) <= 2 * len(shape) - 1
    counted = _mask(shape, boxes)
    assert counted.max() <= 1
    want = torch.zeros(n, dtype=torch.bool)
    want[a:b] = True
    assert torch.equal(counted.bool().flatten(), want)
    region = Region(flat=(a, b))
    other = data.draw(_box(shape))
    assert region.overlaps(Region(box=other), shape) == bool((counted.bool() & _mask(shape, [other]).bool()).any())



def test_a_regions_first_element_is_its_first_runs_start():
    rng = random.Random(5)
    for shape, _ in itertools.product([s for s in SHAPES if math.prod(s)], range(30)):
        region = _random_region(rng, shape)
        assert region.first_element(shape) == int(region.runs(shape).start[0]), (shape, region)
