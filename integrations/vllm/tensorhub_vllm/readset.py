"""Read sets: which box of which checkpoint tensor one vLLM worker loads.

Found by a dry run of the model's own weight loaders (vLLM's ``sharded_rdt``
technique): each checkpoint tensor is handed to ``model.load_weights`` as a
``ViewTensor``, a tensor without storage whose pure-view ops (``narrow``,
``chunk``, ``view``, ...) are tracked on a meta tensor of the full shape. When
a loader copies one into a parameter, the view it copies is a box of the
checkpoint tensor (``views.BoxView``): that box is what this worker reads.

    init:    load_weights(ViewTensors) ──copy_──▶ RecordSink: boxes per name
    update:  pull exactly those boxes ──▶ load_weights(ViewTensors) inside vLLM's
             layer-wise reload ──copy_──▶ ReplaySink: the same view of the pulled box

Anything else a loader does to a checkpoint tensor (``.to()``, arithmetic, a
copying ``reshape``, a view that is not a box) fails closed: a warning names the
tensor and the op, and that tensor is pulled whole and handed to its loader as
a real tensor. Never a guess, so never wrong bytes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from typing_extensions import Self  # typing.Self needs Python 3.11

from tensorhub import Shard
from tensorhub.regions import Bounds
from tensorhub.staging import one_buffer
from tensorhub_vllm.views import BoxView, contains, merge_boxes, row_major_strides, widening

log = logging.getLogger(__name__)

# A gap between two runs of a box wider than this costs more to read than the
# READ descriptor it saves: over shared memory a descriptor costs about as much
# as 17 KB of bytes (measured: docs/history/transport-costs.md).
MAX_GAP_BYTES = 16 << 10
# Staging tensors start at multiples of this in their shared buffer: aligned for
# any dtype and for vectorised copies (a cache line).


class UnsupportedLoaderOp(NotImplementedError):
    """A loader did something to a checkpoint tensor that is not a pure view."""

    def __init__(self, name: str, op: str) -> None:
        super().__init__(f"the weight loader of {name!r} calls {op}, which is not a pure view of the checkpoint "
                         "tensor: that tensor is pulled whole")
        self.name, self.op = name, op


class ViewTensor(torch.Tensor):
    """A checkpoint tensor ``_name`` seen through a chain of pure views, without
    storage. ``_view`` is the same view of a meta tensor of the full shape
    (``_root``), so PyTorch itself computes the geometry; ``copy_`` from it goes
    to ``_sink``."""

    _name: str
    _root: torch.Tensor
    _view: torch.Tensor
    _sink: RecordSink | ReplaySink

    @staticmethod
    def __new__(cls, name: str, root: torch.Tensor, view: torch.Tensor, sink: RecordSink | ReplaySink,
                device: torch.device) -> Self:
        t = torch.Tensor._make_wrapper_subclass(cls, view.shape, dtype=view.dtype, device=device,
                                                requires_grad=False)
        t._name, t._root, t._view, t._sink = name, root, view, sink
        return t

    @classmethod
    def full(cls, name: str, like: torch.Tensor, sink: RecordSink | ReplaySink, device: torch.device) -> ViewTensor:
        root = torch.empty(like.shape, dtype=like.dtype, device="meta")
        return cls(name, root, root, sink, device)

    def box_view(self) -> BoxView | None:
        if self._view.dtype != self._root.dtype:  # view(dtype): offsets in another itemsize
            return None
        return BoxView.of(self._root.shape, self._view.storage_offset(), self._view.shape, self._view.stride())

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            src = args[1] if len(args) > 1 else kwargs.get("src")
            if isinstance(src, cls):
                return src._sink.copy(args[0], src)
        from tensorhub_vllm.vllm_internals import VIEW_OPS

        op = VIEW_OPS.get(func)
        if op is not None and isinstance(args[0], cls):
            self = args[0]
            with torch._C.DisableTorchFunctionSubclass():
                out = func(self._view, *args[1:], **kwargs)
            if isinstance(out, torch.Tensor):
                return self._child(out, op)
            return tuple(self._child(o, op) for o in out)  # chunk, unbind
        # Metadata reads (shape, dim, numel, ...) are answered by the wrapper;
        # anything that needs data reaches __torch_dispatch__ and raises there.
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _child(self, view: torch.Tensor, op: str) -> ViewTensor:
        if view is not self._root and view._base is not self._root:
            raise UnsupportedLoaderOp(self._name, f"{op}() that copies")  # e.g. contiguous() of a transpose
        return ViewTensor(self._name, self._root, view, self._sink, self.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        for arg in (*args, *(kwargs or {}).values()):
            if isinstance(arg, cls):
                raise UnsupportedLoaderOp(arg._name, str(func))
        return func(*args, **(kwargs or {}))


@dataclass
class RecordSink:
    """``copy_`` during the dry run: note the box each copy reads, move nothing."""

    views: dict[str, list[BoxView]] = field(default_factory=dict)
    not_boxes: dict[str, str] = field(default_factory=dict)

    def copy(self, dest: torch.Tensor, src: ViewTensor) -> torch.Tensor:
        view = src.box_view()
        if view is None:
            self.not_boxes[src._name] = (f"reads a view {list(src.shape)} (stride {list(src._view.stride())}, "
                                         f"dtype {src.dtype}) that is not a box of it")
        else:
            self.views.setdefault(src._name, []).append(view)
        return dest


@dataclass
class ReplaySink:
    """``copy_`` during an update: copy the same view out of the pulled box.

    ``plans``: where each view the loaders take lies in the pulled boxes, by
    its geometry. The loaders take the same views at every update (and twice
    per update: vLLM's layer-wise reload runs each loader once to count what it
    loads), so the box arithmetic runs once per view, not per copy."""

    pulled: Mapping[str, list[tuple[Bounds, torch.Tensor]]]
    plans: dict[tuple, tuple[int, tuple[int, ...], tuple[int, ...], int]] = field(default_factory=dict)

    def copy(self, dest: torch.Tensor, src: ViewTensor) -> torch.Tensor:
        v = src._view
        key = (src._name, v.storage_offset(), tuple(v.shape), v.stride(), v.dtype)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self._plan(src)
        part, size, stride, offset = plan
        local = self.pulled[src._name][part][1]
        with torch._C.DisableTorchFunctionSubclass():
            return dest.copy_(local.as_strided(size, stride, local.storage_offset() + offset))

    def _plan(self, src: ViewTensor) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
        """(which pulled box, size, stride, offset in it) of the view ``src`` reads."""
        view = src.box_view()
        part = None if view is None else next(
            (i for i, (box, _) in enumerate(self.pulled.get(src._name, ())) if contains(box, view.box)), None)
        if part is None:  # the loaders read differently from the dry run: refuse rather than guess
            raise RuntimeError(f"tensorhub: the loader of {src._name!r} reads a view the dry run at init did not "
                               f"record ({list(src.shape)}); re-run init_weight_transfer_engine")
        return (part, *view.local(self.pulled[src._name][part][0]))


@dataclass(kw_only=True, slots=True)
class ReadSet:
    """What one worker loads of each checkpoint tensor: ``boxes[name]`` (disjoint)
    where it reads part of it, the whole tensor otherwise. ``fallbacks``: why a
    tensor is read whole although the worker may need less of it. ``unread``:
    tensors no loader of the worker reads, pulled as one element (a 0-d one whole)."""

    layout: dict[str, torch.Tensor]  # meta tensors: the checkpoint's names, shapes, dtypes
    boxes: dict[str, list[Bounds]]
    fallbacks: dict[str, str]
    widened: dict[str, int] = field(default_factory=dict)  # bytes read beyond the loaders' boxes, by name
    unread: list[str] = field(default_factory=list)  # no loader reads them: one element each is pulled
    _replays: dict = field(default_factory=dict, repr=False, compare=False)  # ReplaySink.plans, kept across updates
    _replayed: set = field(default_factory=set, repr=False, compare=False)  # names whose loaders replayed once

    def nbytes(self) -> int:
        return sum(self._numel(n) * t.element_size() for n, t in self.layout.items())

    def coalesced(self, overread: float, max_gap: int = MAX_GAP_BYTES) -> ReadSet:
        """This read set with some boxes widened to whole rows, so that they are
        read as a few long runs instead of one READ descriptor per row: a
        row-parallel weight's columns (o_proj, down_proj) are rows of 1-3 KiB
        each, and a READ spends ~3.5 us per descriptor (see MAX_GAP_BYTES).
        At most ``overread`` x this read set's bytes are added, the boxes with the
        narrowest gaps first (most descriptors saved per extra byte); gaps wider
        than ``max_gap`` never. The staging then holds the widened box and the
        loaders view their columns in it; a serving worker serves (and
        advertises) the widened box. 0 keeps the read set exact."""
        budget = int(overread * self.nbytes())
        found = []
        for name, boxes in self.boxes.items():
            meta = self.layout[name]
            for i, box in enumerate(boxes):
                w = widening(meta.shape, box, meta.element_size())
                if w is not None and w.gap <= max_gap:
                    found.append((w.gap, name, i, w))
        boxes = {name: list(bs) for name, bs in self.boxes.items()}
        widened: dict[str, int] = {}
        for _, name, i, w in sorted(found, key=lambda f: f[:3]):
            if w.extra <= budget:
                budget -= w.extra
                boxes[name][i] = w.box
                widened[name] = widened.get(name, 0) + w.extra
        out: dict[str, list[Bounds]] = {}
        for name, bs in boxes.items():
            merged = merge_boxes(bs)
            if tuple((0, d) for d in self.layout[name].shape) not in merged:
                out[name] = merged
        return ReadSet(layout=self.layout, boxes=out, fallbacks=self.fallbacks, widened=widened, unread=self.unread)

    def checkpoint_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layout.values())

    def _numel(self, name: str) -> int:
        boxes = self.boxes.get(name)
        if boxes is None:
            return self.layout[name].numel()
        return sum(math.prod(b - a for a, b in box) for box in boxes)

    def allocate(self, device: torch.device | str) -> dict[str, torch.Tensor | list[Shard]]:
        """Fresh staging memory for exactly this read set, as ``hub.pull(into=...)``
        takes it: views of one buffer, so NIXL registers one region (one storage)
        per update or per serving buffer, not one per box (hundreds)."""
        pieces = []
        for name, t in self.layout.items():
            boxes = self.boxes.get(name)
            if boxes is None:
                pieces.append((name, t.dtype, None, list(t.shape)))
            else:
                pieces.extend((name, t.dtype, box, [b - a for a, b in box]) for box in boxes)
        return one_buffer(pieces, {name: tuple(t.shape) for name, t in self.layout.items()}, device)

    def weights(self, staged: Mapping[str, torch.Tensor | list[Shard]], device: torch.device):
        """``(name, tensor)`` for ``model.load_weights``: the real tensor where it
        was pulled whole; a ViewTensor over the pulled boxes otherwise, or, for
        a box of whole rows whose loaders an earlier update already replayed
        through a ViewTensor, a real tensor of the full shape laid over the
        staging (``rows_as_full``): the loaders then run at the speed of plain
        tensors (a ViewTensor's Python dispatch cost a MoE apply about a fifth)."""
        sink = ReplaySink({n: [(s.region.box, s.tensor) for s in v] for n, v in staged.items() if isinstance(v, list)},
                          self._replays)
        replayed = []
        for name, t in self.layout.items():
            value = staged[name]
            if not isinstance(value, list):
                yield name, value
                continue
            full = rows_as_full(t, value) if name in self._replayed else None
            if full is None:
                replayed.append(name)
                full = ViewTensor.full(name, t, sink, device)
            yield name, full
        # Every loader took its views of these without a refusal from the
        # ReplaySink: the views are the dry run's, inside the pulled boxes.
        self._replayed.update(replayed)


def rows_as_full(meta: torch.Tensor, parts: list[Shard]) -> torch.Tensor | None:
    """The full tensor ``meta`` describes as a real tensor over the staging of
    ``parts``, when that is one box of whole rows (every dimension after its
    first partial one whole): the box's elements are where a contiguous full
    tensor would hold them, so every view that lies inside the box, however it
    is taken, reads the pulled bytes. Elements outside the box alias other
    staging memory; the dry run and the first replay showed the loaders read
    none of them. None where that does not hold or the full tensor would reach
    outside the staging buffer."""
    if len(parts) != 1:
        return None
    (part,) = parts
    local, box = part.tensor, part.region.box
    if box is None or len(box) != meta.dim() or local.dtype != meta.dtype:
        return None
    strides = row_major_strides(meta.shape)
    if any(b - a > 1 and local.stride(i) != strides[i] for i, ((a, b), s) in enumerate(zip(box, strides))):
        return None
    base = local.storage_offset() - sum(a * s for (a, _), s in zip(box, strides))
    if base < 0 or base + meta.numel() > local.untyped_storage().nbytes() // local.element_size():
        return None
    return local.as_strided(meta.shape, strides, base)


def dry_run(model: torch.nn.Module, layout: dict[str, torch.Tensor], device: torch.device) -> ReadSet:
    """The read set of this worker's ``model`` for a checkpoint of ``layout``
    (meta tensors), from a dry run of its loaders; the model is unchanged.
    A tensor whose loader is not a pure view is read whole (logged, named)."""
    from tensorhub_vllm.vllm_internals import loaders_on_meta

    fallbacks: dict[str, str] = {}
    while True:  # one more run per tensor with an unsupported loader: a handful at most
        sink = RecordSink()
        try:
            with loaders_on_meta(model), torch.device(device), torch.no_grad():
                model.load_weights((n, ViewTensor.full(n, t, sink, device)) for n, t in layout.items()
                                   if n not in fallbacks)
        except UnsupportedLoaderOp as e:
            if e.name in fallbacks:
                raise
            fallbacks[e.name] = f"its loader calls {e.op}, not a pure view"
            continue
        break
    fallbacks.update(sink.not_boxes)
    for name, why in fallbacks.items():
        log.warning("tensorhub: %s is pulled whole: %s", name, why)
    boxes: dict[str, list[Bounds]] = {}
    for name, views in sink.views.items():
        if name in fallbacks:
            continue
        merged = merge_boxes([v.box for v in views])
        whole = tuple((0, d) for d in layout[name].shape)
        if whole not in merged:
            boxes[name] = merged
    # Tensors no loader of this worker reads (another pipeline stage's layers):
    # one element each, so the pull still checks the version has them with this
    # shape and dtype, at 1 element instead of the whole tensor.
    unread = [n for n, t in layout.items() if n not in fallbacks and n not in sink.views and t.dim() and t.numel()]
    for name in unread:
        boxes[name] = [tuple((0, 1) for _ in layout[name].shape)]
    if unread:
        log.info("tensorhub: no loader of this worker reads %d tensor(s) (%s%s): one element of each is pulled",
                 len(unread), ", ".join(unread[:3]), ", ..." if len(unread) > 3 else "")
    return ReadSet(layout=layout, boxes=boxes, fallbacks=fallbacks, unread=unread)
