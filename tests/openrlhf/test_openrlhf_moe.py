"""OpenRLHF's weight sync on a tiny Qwen3-MoE: two DeepSpeed ZeRO-3 ranks
publish their flat partitions of the model's own parameters, whose experts
transformers 5 holds fused (``mlp.experts.gate_up_proj`` [E, 2I, H]); a real
vLLM engine made by OpenRLHF's ``create_vllm_engines``, whose checkpoint names
every expert apart, reads them as boxes of the fused tensors. Byte for byte:
a fresh reader then pulls the whole version from the engine alone."""

from __future__ import annotations

import sys

import pytest
import ray
from conftest import HERE
from openrlhf_zero_rank import ZeroRank
from test_openrlhf_sync import WORLD, assert_engines_hold, cluster, engines_of, sync  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    sys.path.insert(0, str(HERE.parent / "vllm"))
    from vllm_tiny_model import build_moe

    return build_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"))


def test_zero3_partitions_of_fused_experts_reach_the_engine(cluster, moe_model):  # noqa: F811
    from tensorhub.testing import rendezvous

    (engine,) = engines_of(1, moe_model)
    rank_actor = ray.remote(num_cpus=1)(ZeroRank)
    with rendezvous(WORLD) as dist_env:
        ranks = [rank_actor.remote(r, WORLD, dist_env, str(moe_model), [engine]) for r in range(WORLD)]
        try:
            partitions = ray.get([r.partitions.remote() for r in ranks], timeout=300)
            assert any(n.endswith(".mlp.experts.gate_up_proj") for n in partitions[0]), list(partitions[0])
            stats = sync(ranks)
            assert stats[0]["engines_loaded"] == [0] and not stats[0]["engines_failed"], stats[0]
            assert_engines_hold(cluster, ranks, [engine], stats[0]["version"])
        finally:
            for actor in (*ranks, engine):
                ray.kill(actor)
