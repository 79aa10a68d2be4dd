"""Which part of each LoRA matrix one vLLM worker keeps: all a TP worker
pulls of an adapter version.

At TP > 1 vLLM's LoRA layers cut every adapter matrix they are given to the
worker's shard: a column-parallel layer (q/k/v, gate/up) keeps the rows of B
for its output shard and all of A, a row-parallel one (o, down) the columns of
A for its input shard and all of B. Handing the layer's own cut a
``ViewTensor`` of the full matrix (the dry-run technique of ``readset``) gives
the box it keeps, so the parts follow vLLM's code, whatever the layer.

A cut that is not a pure view of the matrix (a ``torch.cat`` of q, k and v
shards: ``QKVParallelLinearWithLoRA``) is read whole: never a guess.
"""

from __future__ import annotations

import logging

import torch

from tensorhub.regions import Bounds
from tensorhub_vllm.readset import RecordSink, UnsupportedLoaderOp, ViewTensor
from tensorhub_vllm.vllm_internals import lora_cut_of

log = logging.getLogger(__name__)


class AdapterParts:
    """``part(name, shape, dtype)``: the box of matrix ``name`` this worker's
    LoRA layers read, or None to read it whole (``tensorhub.lora.pull_adapter``'s
    ``parts``). Remembered per (name, shape, dtype): every version asks again."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self._known: dict[tuple, Bounds | None] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Bounds | None:
        key = (name, tuple(shape), dtype)
        if key not in self._known:
            self._known[key] = self._find(name, tuple(shape), dtype)
        return self._known[key]

    def _find(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Bounds | None:
        cut = lora_cut_of(self.manager, name)
        if cut is None or len(shape) != 2:
            return None
        full = ViewTensor.full(name, torch.empty(shape, dtype=dtype, device="meta"), RecordSink(), torch.device("cpu"))
        try:
            kept = cut(full)
        except UnsupportedLoaderOp as e:
            log.warning("tensorhub: adapter matrix %s is pulled whole: %s", name, e)
            return None
        view = kept.box_view() if isinstance(kept, ViewTensor) else None
        if view is None:
            log.warning("tensorhub: adapter matrix %s is pulled whole: its layer keeps a part that is not a box", name)
            return None
        if view.box == tuple((0, d) for d in shape):
            return None
        return view.box
