"""A reader standing in for a vLLM TP worker: it pulls the regions a TP
worker of a Qwen2 reads (a partial read set), checked byte-exact. The tests
of the readers' cut use it in place of a TP=2 engine, which would add an
engine start to a suite at its time limit (the suite's engines run TP=1)."""

from __future__ import annotations

import torch


def tp_read_set(full: dict[str, torch.Tensor], worker: int, tp: int = 2) -> dict:
    """What vLLM TP worker ``worker`` of ``tp`` reads of a Qwen2: columns of the
    row-parallel tensors (``o_proj``, ``down_proj``), rows of the other
    matrices (the vocabulary-parallel embedding and head too), norms whole."""
    from tensorhub.regions import Region

    regions = {}
    for name, t in full.items():
        shape = tuple(t.shape)
        if len(shape) < 2:
            regions[name] = Region()
            continue
        axis = "cols" if name.endswith(("o_proj.weight", "down_proj.weight")) else "rows"
        size = shape[1] if axis == "cols" else shape[0]
        regions[name] = Region.of(shape, **{axis: (size * worker // tp, size * (worker + 1) // tp)})
    return regions


def pull_read_set(hub, model: str, version: int, full: dict[str, torch.Tensor], regions: dict, *, serve: bool):
    """Pull ``regions`` of ``version`` as a TP worker does, checked byte-exact against ``full``."""
    from tensorhub import Shard
    from tensorhub.testing import take

    into = {name: Shard(torch.zeros(r.numel(tuple(full[name].shape)), dtype=full[name].dtype),
                        tuple(full[name].shape), box=r.box, flat=r.flat) for name, r in regions.items()}
    result = hub.pull(model, version, into=into, serve=serve, timeout=120)
    for name, r in regions.items():
        assert torch.equal(into[name].tensor.reshape(-1).view(torch.uint8),
                           take(full[name], r).reshape(-1).view(torch.uint8)), name
    return result

