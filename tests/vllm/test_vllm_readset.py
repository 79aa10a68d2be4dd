"""Read sets without an engine: the box arithmetic against real tensors, and the
dry run and replay of a toy model's loaders inside vLLM's layer-wise reload."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from tensorhub_vllm.readset import dry_run
from tensorhub_vllm.views import BoxView, merge_boxes, widening

from tensorhub import Shard
from tensorhub.regions import Region


def _random_view(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """A chain of the view ops loaders use, with random arguments."""
    for _ in range(rng.randint(1, 3)):
        op = rng.choice(["narrow", "chunk", "t", "getitem", "unsqueeze", "view"])
        dim = rng.randrange(t.dim()) if t.dim() else 0
        if op == "narrow" and t.dim() and t.shape[dim] > 1:
            start = rng.randrange(t.shape[dim])
            t = t.narrow(dim, start, rng.randint(1, t.shape[dim] - start))
        elif op == "chunk" and t.dim() and t.shape[dim] >= 2:
            parts = t.chunk(2, dim)
            t = parts[rng.randrange(len(parts))]
        elif op == "t" and t.dim() == 2:
            t = t.t()
        elif op == "getitem" and t.dim() and t.shape[0] > 1:
            a = rng.randrange(t.shape[0])
            t = t[a:rng.randint(a + 1, t.shape[0]):rng.choice([1, 1, 2])]
        elif op == "unsqueeze":
            t = t.unsqueeze(rng.randrange(t.dim() + 1))
        elif op == "view" and t.is_contiguous() and t.numel():
            t = t.view(-1)
    return t


def test_box_view_reads_exactly_what_the_view_reads():
    boxes = 0
    for seed in range(500):
        rng = random.Random(seed)
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3)))
        full = torch.arange(torch.Size(shape).numel()).reshape(shape)
        view = _random_view(full, rng)
        box = BoxView.of(shape, view.storage_offset(), view.shape, view.stride())
        if box is None:
            continue  # not a box: the caller reads the whole tensor
        boxes += 1
        local = full[tuple(slice(a, b) for a, b in box.box)].clone()
        size, stride, offset = box.local(box.box)
        assert torch.equal(local.as_strided(size, stride, offset), view), seed
        # inside a larger box too (several views of one tensor merged into one pull)
        outer = tuple((max(0, a - 1), b) for a, b in box.box)
        size, stride, offset = box.local(outer)
        got = full[tuple(slice(a, b) for a, b in outer)].clone().as_strided(size, stride, offset)
        assert torch.equal(got, view), seed
    assert boxes > 400  # almost every chain of these ops is a box


def test_views_that_wrap_are_not_boxes():
    full = torch.arange(24).reshape(4, 6)
    wrapped = full.view(-1).narrow(0, 4, 4)  # end of row 0, start of row 1
    assert BoxView.of((4, 6), wrapped.storage_offset(), wrapped.shape, wrapped.stride()) is None
    rows = full.view(-1).narrow(0, 6, 12)  # whole rows 1-2: a box
    assert BoxView.of((4, 6), rows.storage_offset(), rows.shape, rows.stride()).box == ((1, 3), (0, 6))


def test_merge_boxes_keeps_disjoint_and_joins_overlapping():
    assert merge_boxes([((0, 2), (0, 4)), ((4, 6), (0, 4))]) == [((0, 2), (0, 4)), ((4, 6), (0, 4))]
    assert merge_boxes([((0, 3), (0, 4)), ((2, 6), (1, 2))]) == [((0, 6), (0, 4))]


def test_widening_reads_a_column_slice_as_whole_rows():
    w = widening((8, 6), ((0, 8), (3, 6)), 2)  # 8 runs of 6 B, 6 B apart
    assert (w.box, w.gap, w.extra, w.runs_saved) == (((0, 8), (0, 6)), 6, 48, 7)
    assert widening((8, 6), ((4, 8), (0, 6)), 2) is None  # whole rows: one run already
    assert widening((6,), ((0, 3),), 2) is None
    assert widening((8, 6), ((2, 3), (1, 4)), 2) is None  # one row: one run


def test_widening_against_the_runs_of_the_full_tensor():
    rng = random.Random(0)
    widened = 0
    for _ in range(300):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
        box = tuple((a, rng.randint(a + 1, n)) for n in shape for a in [rng.randrange(n)])
        itemsize = rng.choice([1, 2, 4])
        w = widening(shape, box, itemsize)
        runs = len(Region(box=box).runs(shape).start)
        if w is None:  # one run already, or taking the innermost partial dimension whole joins none
            if runs > 1:
                d = max(i for i, ((a, b), n) in enumerate(zip(box, shape)) if b - a < n)
                wide = (*box[:d], (0, shape[d]), *box[d + 1:])
                assert len(Region(box=wide).runs(shape).start) == runs, (shape, box)
            continue
        widened += 1
        assert all(c <= a and b <= d for (a, b), (c, d) in zip(box, w.box))  # still holds the box
        assert len(Region(box=w.box).runs(shape).start) == runs - w.runs_saved < runs, (shape, box)
        extra = (Region(box=w.box).numel(shape) - Region(box=box).numel(shape)) * itemsize
        assert w.extra == extra == w.gap * runs, (shape, box)
    assert widened > 50  # the rest: one run already, or nothing to join


class Toy(torch.nn.Module):
    """Worker ``rank`` of 2 of a model whose loaders take row and column halves
    (their first argument must be named ``param``, as vLLM's are: the reload
    replays them with the materialized parameter under that name),
    plus loaders that are not pure views (``.to()``, a copying ``contiguous()``)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rows = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16), requires_grad=False)
        self.cols = torch.nn.Parameter(torch.zeros(8, 3, dtype=torch.bfloat16), requires_grad=False)
        self.cast = torch.nn.Parameter(torch.zeros(8, 6, dtype=torch.bfloat16), requires_grad=False)
        self.tcopy = torch.nn.Parameter(torch.zeros(3, 8, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16), requires_grad=False)
        self.rows.weight_loader = lambda param, w: param.data.copy_(w.narrow(0, 4 * rank, 4))
        self.cols.weight_loader = lambda param, w: param.data.copy_(w.chunk(2, dim=1)[rank])
        self.cast.weight_loader = lambda param, w: param.data.copy_(w.to(torch.float32))
        self.tcopy.weight_loader = lambda param, w: param.data.copy_(w.narrow(1, 3 * rank, 3).t().contiguous())

    def load_weights(self, weights):
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        for name, w in weights:
            p = getattr(self, name)
            getattr(p, "weight_loader", default_weight_loader)(p, w)


CHECKPOINT = {n: torch.randn(s, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
              for i, (n, s) in enumerate({"rows": (8, 6), "cols": (8, 6), "cast": (8, 6), "tcopy": (8, 6),
                                          "norm": (6,)}.items())}


def _expected(rank: int) -> dict[str, torch.Tensor]:
    c = CHECKPOINT
    return {"rows": c["rows"][4 * rank:4 * rank + 4], "cols": c["cols"][:, 3 * rank:3 * rank + 3],
            "cast": c["cast"], "tcopy": c["tcopy"][:, 3 * rank:3 * rank + 3].t(), "norm": c["norm"]}


@pytest.mark.parametrize("rank", [0, 1])
def test_dry_run_finds_slices_and_falls_back_by_name(rank, caplog):
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    model = Toy(rank)
    record_metadata_for_reloading(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    layout = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in CHECKPOINT.items()}
    read_set = dry_run(model, layout, torch.device("cpu"))

    assert read_set.boxes == {"rows": [((4 * rank, 4 * rank + 4), (0, 6))],
                              "cols": [((0, 8), (3 * rank, 3 * rank + 3))]}
    assert set(read_set.fallbacks) == {"cast", "tcopy"}
    assert "_to_copy" in read_set.fallbacks["cast"]  # names the op
    assert "contiguous" in read_set.fallbacks["tcopy"]
    assert "cast is pulled whole" in caplog.text and "tcopy is pulled whole" in caplog.text
    for n, p in model.named_parameters():  # the dry run moved nothing
        assert torch.equal(p, before[n]) and not hasattr(p, "_rdt_stamp_inner")

    # the pulled staging (here filled by hand) replayed through vLLM's layer-wise reload
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    staged = read_set.allocate("cpu")
    for name, value in staged.items():
        for s in value if isinstance(value, list) else [Shard(value, value.shape)]:
            s.tensor.copy_(CHECKPOINT[name][tuple(slice(a, b) for a, b in s.region.bounds(s.full_shape))])
    assert read_set.nbytes() == sum(
        s.tensor.nbytes for v in staged.values() for s in (v if isinstance(v, list) else [Shard(v, v.shape)]))
    initialize_layerwise_reload(model)
    model.load_weights(read_set.weights(staged, torch.device("cpu")))
    finalize_layerwise_reload(model, None)
    for name, want in _expected(rank).items():
        assert torch.equal(getattr(model, name), want), name


def test_coalesced_spends_the_overread_budget_on_the_narrowest_gaps_first():
    from tensorhub_vllm.readset import ReadSet

    layout = {"narrow": torch.empty(64, 8, dtype=torch.bfloat16, device="meta"),  # column half: gaps of 8 B
              "wide": torch.empty(64, 32, dtype=torch.bfloat16, device="meta"),  # gaps of 32 B
              "rows": torch.empty(64, 8, dtype=torch.bfloat16, device="meta")}
    exact = ReadSet(layout=layout, boxes={"narrow": [((0, 64), (0, 4))], "wide": [((0, 64), (16, 32))],
                                          "rows": [((0, 32), (0, 8))]}, fallbacks={})
    assert exact.nbytes() == 512 + 2048 + 512
    assert exact.coalesced(0.0).boxes == exact.boxes and exact.coalesced(0.0).widened == {}
    # 0.2 x 3072 B = 614 B: "narrow" whole (+512 B), not "wide" (+2048 B); "rows" is one run already
    some = exact.coalesced(0.2)
    assert some.boxes == {"wide": [((0, 64), (16, 32))], "rows": [((0, 32), (0, 8))]}  # "narrow": whole
    assert some.widened == {"narrow": 512} and some.nbytes() == exact.nbytes() + 512
    assert exact.coalesced(1.0).boxes == {"rows": [((0, 32), (0, 8))]}
    assert exact.coalesced(1.0, max_gap=16).widened == {"narrow": 512}  # a 32 B gap is over the limit


def test_staging_is_one_buffer_of_aligned_disjoint_tensors():
    """One storage (one NIXL registration per update), every tensor contiguous,
    aligned and apart from the others, with the read set's shapes and dtypes."""
    from tensorhub_vllm.readset import ReadSet

    layout = {"w": torch.empty(6, 10, dtype=torch.bfloat16, device="meta"),
              "b": torch.empty(3, dtype=torch.float32, device="meta"),
              "s": torch.empty((), dtype=torch.int64, device="meta")}
    staged = ReadSet(layout=layout, boxes={"w": [((0, 3), (0, 10)), ((3, 6), (5, 10))]}, fallbacks={}).allocate("cpu")
    tensors = [s.tensor for s in staged["w"]] + [staged["b"], staged["s"]]
    assert [tuple(t.shape) for t in tensors] == [(3, 10), (3, 5), (3,), ()]
    assert [t.dtype for t in tensors] == [torch.bfloat16] * 2 + [torch.float32, torch.int64]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(t.is_contiguous() and t.data_ptr() % 64 == 0 for t in tensors)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))


def _fill(staged, checkpoint) -> None:
    """What a pull writes: each staging tensor gets its region of ``checkpoint``."""
    for name, value in staged.items():
        for s in value if isinstance(value, list) else [Shard(value, value.shape)]:
            s.tensor.copy_(checkpoint[name][tuple(slice(a, b) for a, b in s.region.bounds(s.full_shape))])


def test_replay_views_columns_inside_whole_rows():
    """The Toy's column loader replayed on a staging of whole rows (the coalesced
    read set) loads the same bytes as on its exact columns."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    for rank in (0, 1):
        model = Toy(rank)
        record_metadata_for_reloading(model)
        layout = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in CHECKPOINT.items()}
        read_set = dry_run(model, layout, torch.device("cpu")).coalesced(1.0)
        assert "cols" not in read_set.boxes and read_set.widened["cols"] == 8 * 3 * 2
        staged = read_set.allocate("cpu")
        _fill(staged, CHECKPOINT)
        initialize_layerwise_reload(model)
        model.load_weights(read_set.weights(staged, torch.device("cpu")))
        finalize_layerwise_reload(model, None)
        for name, want in _expected(rank).items():
            assert torch.equal(getattr(model, name), want), (rank, name)


class ToyStage(Toy):
    """The Toy as a pipeline stage that does not hold ``norm``: its loaders skip it."""

    def load_weights(self, weights):
        super().load_weights((n, w) for n, w in weights if n != "norm")


def test_a_tensor_no_loader_reads_is_pulled_as_one_element():
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    from tensorhub import Hub
    from tensorhub.server import EmbeddedServer

    model = ToyStage(0)
    record_metadata_for_reloading(model)
    layout = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in CHECKPOINT.items()}
    read_set = dry_run(model, layout, torch.device("cpu"))
    assert read_set.unread == ["norm"] and read_set.boxes["norm"] == [((0, 1),)]
    assert "norm" not in read_set.fallbacks
    staged = read_set.allocate("cpu")
    with EmbeddedServer() as server, Hub.connect(server.address, name="trainer") as trainer, \
            Hub.connect(server.address, name="stage") as worker:
        trainer.publish("toy", 1, CHECKPOINT)
        result = worker.pull("toy", 1, into=staged)  # every name is still checked against the version
    assert result.nbytes == read_set.nbytes() == sum(
        s.tensor.nbytes for v in staged.values() for s in (v if isinstance(v, list) else [Shard(v, v.shape)]))
    assert staged["norm"][0].tensor.nbytes == 2
    initialize_layerwise_reload(model)
    model.load_weights(read_set.weights(staged, torch.device("cpu")))
    finalize_layerwise_reload(model, None)
    for name, want in _expected(0).items():
        if name != "norm":
            assert torch.equal(getattr(model, name), want), name


def test_rows_as_full_lays_the_full_tensor_over_a_box_of_rows():
    """A box of whole rows in the staging is handed to loaders as a real tensor
    of the full shape whose box is the staging itself (same memory); anything
    else (columns, several parts, a full tensor reaching outside the buffer) is not."""
    from tensorhub_vllm.readset import rows_as_full

    meta = torch.empty(8, 6, dtype=torch.bfloat16, device="meta")
    buffer = torch.arange(100, dtype=torch.bfloat16)
    rows = Shard(buffer[40:64].view(4, 6), (8, 6), rows=(4, 8))  # rows 4-7 start 24 elements into the full tensor
    full = rows_as_full(meta, [rows])
    assert full is not None and full.shape == (8, 6) and full.is_contiguous()
    assert full[4:8].data_ptr() == rows.tensor.data_ptr() and torch.equal(full[4:8], rows.tensor)
    assert torch.equal(full.chunk(2)[1].t(), rows.tensor.t())  # any view inside the box reads the staging
    assert rows_as_full(meta, [Shard(buffer[10:34].view(8, 3), (8, 6), cols=(3, 6))]) is None  # columns
    assert rows_as_full(meta, [Shard(buffer[10:34].view(4, 6), (8, 6), rows=(4, 8))]) is None  # before the buffer
    assert rows_as_full(meta, [Shard(buffer[80:92].view(2, 6), (8, 6), rows=(0, 2))]) is None  # past its end
    assert rows_as_full(meta, [rows, rows]) is None
    cube = torch.empty(3, 4, 5, dtype=torch.bfloat16, device="meta")
    inner = Shard(buffer[60:70].view(1, 2, 5), (3, 4, 5), box=((1, 2), (2, 4), (0, 5)))
    full = rows_as_full(cube, [inner])
    assert full is not None and torch.equal(full[1:2, 2:4], inner.tensor)
    assert rows_as_full(cube, [Shard(buffer[60:66].view(1, 2, 3), (3, 4, 5), box=((1, 2), (2, 4), (0, 3)))]) is None


def test_a_replayed_box_of_rows_is_loaded_as_a_plain_tensor_next_time():
    """The first update replays every loader through ViewTensors (the views are
    checked against the dry run's); from the second on, a box of whole rows is
    handed over as a real tensor. Both load exactly the checkpoint's slices."""
    from tensorhub_vllm.readset import ViewTensor
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    for rank in (0, 1):
        model = Toy(rank)
        record_metadata_for_reloading(model)
        layout = {n: torch.empty(CHECKPOINT[n].shape, dtype=CHECKPOINT[n].dtype, device="meta")
                  for n in sorted(CHECKPOINT)}  # sorted, as checkpoint_layout: "rows" is not first in the buffer
        read_set = dry_run(model, layout, torch.device("cpu"))
        staged = read_set.allocate("cpu")
        for step in range(3):
            checkpoint = {n: t + step for n, t in CHECKPOINT.items()}
            _fill(staged, checkpoint)
            handed = {}

            def weights(read_set=read_set, staged=staged, handed=handed):
                for name, w in read_set.weights(staged, torch.device("cpu")):
                    handed[name] = type(w)
                    yield name, w

            initialize_layerwise_reload(model)
            model.load_weights(weights())
            finalize_layerwise_reload(model, None)
            assert handed["rows"] is (ViewTensor if step == 0 else torch.Tensor), (rank, step)
            assert handed["cols"] is ViewTensor  # columns: always through the ViewTensor
            c = checkpoint
            assert torch.equal(model.rows, c["rows"][4 * rank:4 * rank + 4]), (rank, step)
            assert torch.equal(model.cols, c["cols"][:, 3 * rank:3 * rank + 3]), (rank, step)
