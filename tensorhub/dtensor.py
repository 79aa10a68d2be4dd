"""What one rank holds of a torch.distributed DTensor (an FSDP2 parameter),
as something to publish in place: its local shard as a region of the full
tensor, with no ``full_tensor()`` and no gather.

    entry = local_part("model.layers.0.mlp.up_proj.weight", param)   # Shard | Tensor | None
"""

from __future__ import annotations

import sys

import torch

from tensorhub.shard import Shard


def is_dtensor(tensor: torch.Tensor) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # none made yet: not loaded, and nothing to load
    return module is not None and isinstance(tensor, module.DTensor)


def local_part(name: str, param: torch.Tensor) -> Shard | torch.Tensor | None:
    """``param`` itself (detached) when it is a plain tensor; for a DTensor
    its local shard as a ``Shard`` of the full shape (the box the mesh gives
    this rank), or None when an uneven split left this rank none of it.
    Raises ValueError (naming ``name``) for what cannot be published in place:
    a partial sum, a local shard that is not contiguous."""
    if not is_dtensor(param):
        return param.detach()
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in param.placements):
        raise ValueError(f"tensorhub: {name} is a partial sum (placements {param.placements}): nothing to "
                         "publish in place until it is reduced")
    local = param.detach().to_local()
    if local.numel() == 0:
        return None
    if not local.is_contiguous():
        raise ValueError(f"tensorhub: the local shard of {name} is not contiguous; it cannot be published in place")
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    box = tuple((o, o + s) for o, s in zip(offset, shape))
    return Shard(local, tuple(param.shape), box=box) if box else local
