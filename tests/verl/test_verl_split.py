"""The rule that decides which part of each tensor a trainer rank keeps
(tensorhub_verl/split.py): the ranks' parts tile every tensor exactly, and no
rank keeps much more than 1/n of a model."""

from __future__ import annotations

import math

import pytest
import torch
from tensorhub_verl.split import bytes_per_rank, rank_region, region_numel

from tensorhub import Shard

SHAPES = [(), (1,), (3,), (7, 5), (1, 4096), (2, 3), (64, 32), (96,), (5, 1, 3), (0, 4)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_the_ranks_parts_tile_every_tensor_exactly_once(world):
    for index, shape in enumerate(SHAPES):
        full = torch.arange(math.prod(shape)).reshape(shape)
        covered = torch.zeros(math.prod(shape), dtype=torch.int64)
        for rank in range(world):
            region = rank_region(shape, index, rank, world)
            if region is None:
                continue
            shard = Shard.of(full, **region)  # a region Shard accepts, holding those elements
            assert shard.tensor.numel() == region_numel(shape, region)
            covered[shard.tensor.reshape(-1)] += 1
        assert covered.eq(1).all(), (shape, world)


def test_a_model_splits_into_near_equal_shares():
    specs = [((151936, 896), 2), ((896,), 2), ((4864, 896), 2), ((896, 4864), 2), ((), 8), ((1, 896), 4)] * 24
    total = sum(math.prod(shape) * size for shape, size in specs)
    for world in (2, 4, 8):
        shares = bytes_per_rank(specs, world)
        assert sum(shares) == total
        assert max(shares) <= total / world * 1.05, (world, max(shares) / total)


def test_scalars_spread_over_the_ranks():
    owners = [next(r for r in range(4) if rank_region((), i, r, 4) is not None) for i in range(8)]
    assert owners == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="outside"):
        rank_region((4,), 0, 4, 4)
    assert bytes_per_rank([((), 8)], 1) == [8]
