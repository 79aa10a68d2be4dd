"""OpenRLHF's weight-sync path through TensorHub, across real processes on a
real Ray cluster (CPU): two DeepSpeed ZeRO-3 trainer ranks
(``openrlhf_zero_rank.py``, which says where it differs from a GPU run) and
real vLLM engines made by OpenRLHF's own ``create_vllm_engines`` through the
adapter's wrapper. The reference server is the ``address=auto`` Ray actor.

Checked: each rank publishes exactly its ZeRO-3 partition, in place; engines
load every step byte for byte; versions increase; an engine killed between
steps does not stall the trainer, and one started after it loads the latest
version by itself.
"""

from __future__ import annotations

import json

import pytest
import ray
from conftest import child_pythonpath
from openrlhf_zero_rank import ZeroRank, digest
from tp_reader import pull_read_set, tp_read_set

MODEL = "tiny/policy"
WORLD = 2


@pytest.fixture(scope="module")
def cluster():
    env = {
        "TENSORHUB_ADDRESS": "auto", "TENSORHUB_MODEL": MODEL, "TENSORHUB_UPDATE_TIMEOUT_S": "120",
        "TENSORHUB_UNPUBLISH_TIMEOUT_S": "30", "TENSORHUB_HUB_CONFIG": json.dumps({"chunk_size": 256 << 10}),
        "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1",
    }
    # GPUs are logical here: OpenRLHF places each engine in a {"GPU": 1} bundle.
    ray.init(num_cpus=8, num_gpus=4, object_store_memory=256 << 20, include_dashboard=False,
             runtime_env={"env_vars": env}, log_to_driver=False)
    from tensorhub.server.ray_actor import resolve_address, shutdown_server

    yield resolve_address("auto")
    shutdown_server()
    ray.shutdown()


@pytest.fixture(scope="module")
def dist_env():
    """The trainer ranks' torch.distributed rendezvous, held by this process."""
    from tensorhub.testing import rendezvous

    with rendezvous(WORLD) as env:
        yield env


def engines_of(count: int, model_dir) -> list:
    from tensorhub_openrlhf.engines import create_vllm_engines

    # OpenRLHF's positional arguments: engines, TP, model, seed, full determinism,
    # prefix caching, enforce eager, max length, shared pg, gpu memory, sleep.
    return create_vllm_engines(count, 1, str(model_dir), 7, False, False, True, 256, None, 0.9, False)


def sync(ranks) -> list[dict]:
    stats = ray.get([r.sync.remote() for r in ranks], timeout=300)
    assert len({s["version"] for s in stats}) == 1, stats  # every rank publishes the same version
    return stats


def assert_engines_hold(address: str, ranks, engines, version: int) -> None:
    """The engines hold ``version`` byte for byte as the trainer has it: the
    trainer withdraws, then a fresh reader pulls it, so every byte it gets
    comes from the engines' replicas."""
    for engine in engines:
        assert ray.get(engine.tensorhub_version.remote(), timeout=60) == version
    expected = ray.get([r.full_digests.remote() for r in ranks], timeout=120)[0]
    ray.get([r.withdraw.remote() for r in ranks], timeout=120)
    from tensorhub import Hub

    with Hub.connect(address, name="test-reader") as hub:
        result = hub.pull(MODEL, version, timeout=120)
        assert {n: digest(t) for n, t in result.tensors.items()} == expected
        assert result.bytes_by_source and all(src.startswith("vllm:") for src in result.bytes_by_source), \
            result.bytes_by_source


def test_zero3_partitions_reach_engines_each_step(cluster, dist_env, tiny_model):
    address = cluster
    engines = engines_of(2, tiny_model)
    rank_actor = ray.remote(num_cpus=1)(ZeroRank)
    ranks = [rank_actor.remote(r, WORLD, dist_env, str(tiny_model), engines) for r in range(WORLD)]
    partitions = ray.get([r.partitions.remote() for r in ranks], timeout=300)
    assert ray.get([r.differs_from_checkpoint.remote(str(tiny_model)) for r in ranks]) == [[], []]
    total_bytes = 2 * sum(numel for numel, _, _ in partitions[0].values())  # bf16

    # Step 0 (before training): each rank publishes its ZeRO-3 partition only.
    stats = sync(ranks)
    version0 = stats[0]["version"]
    for rank, (s, parts) in enumerate(zip(stats, partitions)):
        mine = sum(max(0, min(numel, (rank + 1) * per) - rank * per) for numel, per, _ in parts.values())
        assert s["published_bytes"] == 2 * mine  # its partitions without ZeRO's padding, nothing else
    assert sum(s["published_bytes"] for s in stats) == total_bytes
    assert stats[0]["engines_loaded"] == [0, 1] and not stats[0]["engines_failed"]
    assert_engines_hold(address, ranks, engines, version0)

    # A training step changes the weights in place (same memory: published in place, not copied).
    steps = ray.get([r.train_step.remote() for r in ranks], timeout=300)
    assert ray.get([r.partitions.remote() for r in ranks]) == partitions
    # Engine 1 dies between steps: the sync goes on without it and without waiting.
    ray.kill(engines[1])
    stats = sync(ranks)
    version1 = stats[0]["version"]
    assert version1 > version0 and version1 >= steps[0]
    assert stats[0]["engines_loaded"] == [0] and list(stats[0]["engines_failed"]) == [1]

    # An engine started now loads the latest version by itself: no group to rebuild.
    # Its first answer waits for the actor to start: vLLM's start-up, then its pull.
    (late,) = engines_of(1, tiny_model)
    assert ray.get(late.tensorhub_version.remote(), timeout=300) == version1
    assert_engines_hold(address, ranks, [engines[0], late], version1)

    engines = [engines[0], engines[1], late]  # the dead one stays in OpenRLHF's list
    ray.get([r.set_engines.remote(engines) for r in ranks])
    ray.get([r.train_step.remote() for r in ranks], timeout=300)
    stats = sync(ranks)
    version2 = stats[0]["version"]
    assert version2 > version1
    assert stats[0]["engines_loaded"] == [0, 2] and list(stats[0]["engines_failed"]) == [1]
    assert_engines_hold(address, ranks, [engines[0], late], version2)


def test_lora_ranks_publish_only_the_adapter(cluster, tiny_model):
    """OpenRLHF's own LoRA (``Actor(lora_rank=8)``, all linear layers) under
    ZeRO-3 with ``TENSORHUB_LORA=1``: each rank publishes its partitions of the
    A/B matrices only, and a reader of the adapter version gets PEFT's own
    state dict (names and bytes) with its settings, reading the adapter's bytes."""
    from tensorhub import Hub
    from tensorhub.lora import ADAPTER_CONFIG, pull_adapter
    from tensorhub.testing import rendezvous

    key = "tiny/lora/default"
    rank_actor = ray.remote(num_cpus=1)(ZeroRank)
    with rendezvous(WORLD) as env, Hub.connect(cluster, name="test-reader") as hub:
        env = {**env, "TENSORHUB_LORA": "1", "TENSORHUB_MODEL": key}
        ranks = [rank_actor.remote(r, WORLD, env, str(tiny_model), [], lora_rank=8) for r in range(WORLD)]
        try:
            base_bytes = ray.get(ranks[0].base_bytes.remote(), timeout=300)
            # ZeRO-3 loaded the checkpoint (NaN weights from a racy load made the step's adapter NaN)
            assert ray.get([r.differs_from_checkpoint.remote(str(tiny_model)) for r in ranks]) == [[], []]
            for _ in range(2):
                stats = sync(ranks)
                peft = ray.get([r.adapter_state.remote() for r in ranks], timeout=120)[0]
                adapter_bytes = sum(t.numel() * t.element_size() for t in peft.values())
                assert sum(s["published_bytes"] for s in stats) == adapter_bytes  # partitions, once each
                got = pull_adapter(hub, key, stats[0]["version"], timeout=120)
                assert set(got.tensors) == set(peft)  # PEFT's saved names
                # bytes, not values: torch.equal fails NaN == NaN however exact the copy
                assert {n: (t.dtype, t.shape, digest(t)) for n, t in got.tensors.items()} == \
                    {n: (t.dtype, t.shape, digest(t)) for n, t in peft.items()}
                assert got.config.r == 8 and got.config.lora_alpha == 16
                assert got.result.nbytes == adapter_bytes + got.result.tensors[ADAPTER_CONFIG].numel()
                assert got.result.nbytes < base_bytes / 4, (got.result.nbytes, base_bytes)
                print(json.dumps({"version": stats[0]["version"], "adapter_bytes": adapter_bytes,  # docs/history
                                  "read_bytes": got.result.nbytes, "base_bytes": base_bytes,
                                  "published_bytes": [s["published_bytes"] for s in stats]}))
                ray.get([r.train_step.remote() for r in ranks], timeout=300)  # withdraws, then trains the adapter
        finally:
            for r in ranks:
                ray.kill(r)


def test_zero3_ranks_publish_the_readers_cut(cluster, tiny_model):
    """TENSORHUB_CUT=readers (with TENSORHUB_DELTA=copy beside it): two real
    ZeRO-3 ranks publish step 1 as flat partitions only (no readers yet); two
    readers standing in for the TP=2 workers of an engine read their read sets
    from them (the columns of o_proj / down_proj as whole rows) and serve
    them. Step 2, after a real optimizer step: the ranks gather those read sets
    from their flat partitions, within the gather bound, and publish them
    beside the partitions; fresh TP readers read ≤ 1.05x their bytes, exact."""
    from tensorhub import Hub
    from tensorhub.testing import rendezvous

    key, bound = "tiny/cut", 256 << 10  # the largest tensor (embedding, lm_head) is 128 KiB
    rank_actor = ray.remote(num_cpus=1)(ZeroRank)
    with rendezvous(WORLD) as env:
        env = {**env, "TENSORHUB_MODEL": key, "TENSORHUB_CUT": "readers", "TENSORHUB_CUT_GATHER_BYTES": str(bound),
               "TENSORHUB_DELTA": "copy"}
        ranks = [rank_actor.remote(r, WORLD, env, str(tiny_model), []) for r in range(WORLD)]
        try:
            first = sync(ranks)
            assert [s["cut_bytes"] for s in first] == [0, 0]  # no readers' cut yet: the partitions only
            full = ray.get([r.full_parameters.remote() for r in ranks], timeout=120)[0]
            read_sets = [tp_read_set(full, w) for w in range(2)]
            with Hub.connect(cluster, name="tp0") as tp0, Hub.connect(cluster, name="tp1") as tp1:
                from_shards = [pull_read_set(h, key, first[0]["version"], full, read_sets[w], serve=True)
                               for w, h in enumerate((tp0, tp1))]
                ray.get([r.train_step.remote() for r in ranks], timeout=300)
                second = sync(ranks)
                full = ray.get([r.full_parameters.remote() for r in ranks], timeout=120)[0]
                # TENSORHUB_DELTA=copy rides along (its delta is computed; a step at
                # lr 0.05 changes every element, so it is not worth publishing here:
                # test_openrlhf_units.py checks the delta beside the cut)
                distinct = {(name, region) for regions in read_sets for name, region in regions.items()}
                assert sum(s["cut_bytes"] for s in second) == sum(
                    region.numel(tuple(full[name].shape)) * full[name].element_size() for name, region in distinct)
                assert all(s["cut_bytes"] > 0 and 0 < s["cut_peak_gather_bytes"] <= bound for s in second), second
                for w, p1 in enumerate(from_shards):
                    with Hub.connect(cluster, name=f"tp{w}-next") as fresh:
                        got = pull_read_set(fresh, key, second[0]["version"], full, read_sets[w], serve=False)
                    print(json.dumps({"worker": w, "read_set_bytes": got.nbytes,  # docs/history
                                      "step1_read_bytes": p1.read_bytes, "step1_reads": p1.descriptors,
                                      "step2_read_bytes": got.read_bytes, "step2_reads": got.descriptors,
                                      "cut_bytes": [s["cut_bytes"] for s in second],
                                      "peak_gather_bytes": [s["cut_peak_gather_bytes"] for s in second]}))
                    assert got.nbytes == p1.nbytes < p1.read_bytes  # from flat partitions: whole rows
                    assert got.read_bytes <= 1.05 * got.nbytes, (w, got.read_bytes, got.nbytes)
        finally:
            for r in ranks:
                ray.kill(r)
