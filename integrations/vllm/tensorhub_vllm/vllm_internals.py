"""Everything TensorHub takes from vLLM's internals, in one place (vLLM 0.32).

* ``VIEW_OPS``: the tensor methods vLLM's ``sharded_rdt`` backend treats as
  pure views when it records which slice a loader reads
  (``sharded_rdt_common.SUPPORTED_OPS``); we record with the same list.
* ``loaders_on_meta``: the model's parameters back in checkpoint layout on the
  meta device, with their original weight loaders (no layer-wise processing),
  for a dry run of ``model.load_weights``; afterwards the model is exactly as
  before. vLLM's ``sharded_rdt`` dry run does the same steps
  (``_bake`` / ``_restore_after_dry_run``); vLLM has no public API for it yet.

* ``module_of``: the module behind vLLM's ``ModuleSource`` (a trainer's
  ``WeightSource``), whose DTensor parameters the trainer side publishes shard
  by shard instead of iterating the source (which gathers each of them).

When vLLM changes these internals, this module is what to update.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from vllm.distributed.weight_transfer.base import ModuleSource, WeightSource
from vllm.distributed.weight_transfer.sharded_rdt_common import SUPPORTED_OPS
from vllm.model_executor.model_loader.reload.layerwise import (
    LAYERWISE_INFO,
    _get_original_loader,
    _place_kernel_tensors,
    initialize_layerwise_reload,
)
from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

VIEW_OPS = SUPPORTED_OPS  # {torch.Tensor.narrow: "narrow", ...}

_MISSING = object()


@contextmanager
def loaders_on_meta(model: torch.nn.Module) -> Iterator[None]:
    """Inside: every loadable parameter in checkpoint layout (meta, except the
    few vLLM never moves there, e.g. ``bias``), its ``weight_loader`` the
    model's own. On exit the kernel tensors are back in place, untouched, and
    no loader wrapper is left behind."""
    # Loaders of live tensors (those not swapped for meta copies) as they are now:
    # layer-wise setup wraps them, and nothing else would unwrap them.
    live = [(t, getattr(t, "weight_loader", _MISSING)) for m in model.modules()
            for t in get_layer_tensors(m).values()]
    initialize_layerwise_reload(model)
    try:
        for module in model.modules():
            for tensor in get_layer_tensors(module).values():
                if hasattr(tensor, "weight_loader"):
                    tensor.weight_loader = _get_original_loader(tensor)
        yield
    finally:
        for layer in model.modules():
            info = LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load():
                if info.kernel_tensors is not None:
                    _place_kernel_tensors(layer, info)
                info.reset()
        for tensor, loader in live:
            if loader is _MISSING:
                if "weight_loader" in vars(tensor):
                    del tensor.weight_loader
            else:
                tensor.weight_loader = loader
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload


def module_of(source: WeightSource) -> torch.nn.Module | None:
    """The module a ``ModuleSource`` iterates, or None for any other source."""
    return source._module if isinstance(source, ModuleSource) else None
