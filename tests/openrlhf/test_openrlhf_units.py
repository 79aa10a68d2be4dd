"""Settings, partition arithmetic and recipe rendering, on their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensorhub_openrlhf.partitions import partition_range, replica_region
from tensorhub_openrlhf.recipe import compose, render
from tensorhub_openrlhf.settings import TensorHubSettings

RECIPES = Path(__file__).parents[2] / "recipes" / "openrlhf"


def test_partition_ranges_cover_each_element_once_as_zero3_cuts():
    # ZeRO-3 pads to a multiple of the group and gives each rank ceil(n / W).
    assert [partition_range(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [partition_range(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    for n in (1, 7, 64, 1001):
        for world in (1, 2, 3, 8):
            ranges = [partition_range(n, r, world) for r in range(world)]
            assert sum(b - a for a, b in ranges) == n and ranges[0][0] == 0 and ranges[-1][1] == n
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        partition_range(10, 2, 2)


def test_replica_region_is_a_view_not_a_copy():
    weight = torch.nn.Parameter(torch.arange(30, dtype=torch.float32).reshape(5, 6))
    shards = [replica_region(weight, r, 4) for r in range(4)]
    assert [s.region.flat for s in shards] == [(0, 8), (8, 16), (16, 24), (24, 30)]
    for s in shards:
        assert s.tensor.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    with torch.no_grad():
        weight[4, 5] = -1.0  # training writes in place: the published region sees it
    assert shards[3].tensor[-1].item() == -1.0
    assert replica_region(torch.nn.Parameter(torch.zeros(2)), 3, 4) is None  # nothing left for rank 3


def test_settings_from_the_environment():
    s = TensorHubSettings.from_env({"TENSORHUB_ADDRESS": "10.0.0.5:50051", "TENSORHUB_SERVE": "off",
                                    "TENSORHUB_HUB_CONFIG": '{"chunk_size": 1024}', "PATH": "/bin"})
    assert (s.address, s.model, s.serve, s.hub) == ("10.0.0.5:50051", "policy", False, {"chunk_size": 1024})
    assert TensorHubSettings.from_env(s.to_env()) == s
    assert s.hub_config("x").chunk_size == 1024
    assert s.vllm_quantization is None and s.vllm_engine_args() == {}
    q = TensorHubSettings.from_env({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_VLLM_QUANTIZATION": "fp8_per_channel"})
    assert q.vllm_engine_args() == {"quantization": "fp8_per_channel"} and TensorHubSettings.from_env(q.to_env()) == q
    assert s.cut is None and s.cut_gather_bytes is None  # off by default
    c = TensorHubSettings.from_env({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_CUT": "Readers",
                                    "TENSORHUB_CUT_GATHER_BYTES": "1048576", "TENSORHUB_DELTA": "copy"})
    assert (c.cut, c.cut_gather_bytes, c.delta) == ("readers", 1 << 20, "copy")
    assert TensorHubSettings.from_env(c.to_env()) == c
    # a recipe's null renders as empty: off
    assert TensorHubSettings.from_env({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_CUT": ""}).cut is None


def test_lora_recipe_renders_the_setting_and_openrlhfs_lora_flags():
    env, argv = render(compose(str(RECIPES), "ppo_ray_lora", [
        "openrlhf.actor.model_name_or_path=/models/p", "openrlhf.data.prompt_dataset=/data/d",
        "openrlhf.reward.model_name_or_path=/rm"]))
    settings = TensorHubSettings.from_env(env)
    assert settings.lora is True and settings.model == "policy/lora/default"
    # the engines serve adapter versions from memory: LoRA on, ranks up to the recipe's 32
    assert settings.lora_max_rank == 32 and TensorHubSettings.from_env(settings.to_env()) == settings
    assert settings.vllm_engine_args() == {"enable_lora": True, "max_loras": 2, "max_lora_rank": 32}
    joined = " ".join(argv)
    assert "--ds.lora.rank 32" in joined and "--ds.lora.alpha 32" in joined
    assert "--ds.lora.target_modules all-linear" in joined and "--ds.zero_stage 3" in joined
    plain, _ = render(compose(str(RECIPES), "ppo_ray", [
        "openrlhf.actor.model_name_or_path=/models/p", "openrlhf.data.prompt_dataset=/data/d",
        "openrlhf.reward.model_name_or_path=/rm"]))
    assert TensorHubSettings.from_env(plain).lora is False


@pytest.mark.parametrize(("env", "message"), [
    ({}, "TENSORHUB_ADDRESS is not set"),
    ({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_MODLE": "x"}, r"unknown TensorHub variable\(s\) \['TENSORHUB_MODLE'\]"),
    ({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_UPDATE_TIMEOUT_S": "-1"}, "TENSORHUB_UPDATE_TIMEOUT_S must be"),
    ({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_HUB_CONFIG": "[1]"}, "TENSORHUB_HUB_CONFIG must be a JSON object"),
    ({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_HUB_CONFIG": '{"chunks": 1}'}, r"HubConfig has no field\(s\)"),
    ({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_LORA": "maybe"}, "TENSORHUB_LORA must be one of"),
    ({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_LORA": "1", "TENSORHUB_LORA_MAX_RANK": "24"},
     r"TENSORHUB_LORA_MAX_RANK must be one of vLLM's \[1, 8, 16, 32, 64, 128, 256, 320, 512\]"),
    ({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_LORA": "1", "TENSORHUB_DELTA": "copy"},
     "TENSORHUB_DELTA=copy does not apply with TENSORHUB_LORA=1"),
    ({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_CUT": "reader"}, "TENSORHUB_CUT must be 'readers' or 'off', not 'reader'"),
    ({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_CUT": "readers", "TENSORHUB_CUT_GATHER_BYTES": "1e9"},
     "TENSORHUB_CUT_GATHER_BYTES must be a positive number of bytes, not '1e9'"),
    ({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_CUT": "readers", "TENSORHUB_CUT_GATHER_BYTES": "0"},
     "TENSORHUB_CUT_GATHER_BYTES must be a positive"),
    ({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_CUT_GATHER_BYTES": "1024"},
     "TENSORHUB_CUT_GATHER_BYTES only means something with TENSORHUB_CUT=readers"),
    ({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_LORA": "1", "TENSORHUB_CUT": "readers"},
     "TENSORHUB_CUT=readers does not apply with TENSORHUB_LORA=1"),
    ({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_SERVE": "0", "TENSORHUB_CUT": "readers"},
     "TENSORHUB_CUT=readers needs TENSORHUB_SERVE=1"),
])
def test_bad_settings_name_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        TensorHubSettings.from_env(env)


def test_recipe_renders_variables_and_stock_flags():
    config = compose(str(RECIPES), "ppo_ray", ["openrlhf.actor.model_name_or_path=/models/p",
                                              "openrlhf.data.prompt_dataset=/data/d", "openrlhf.reward.model_name_or_path=/rm",
                                              "tensorhub.address=h:1", "openrlhf.ckpt.output_dir=null",
                                              "+openrlhf.actor.adam.betas=[0.9,0.95]"])
    env, argv = render(config)
    assert env["TENSORHUB_ADDRESS"] == "h:1" and env["TENSORHUB_SERVE"] == "1"
    assert json.loads(env["TENSORHUB_HUB_CONFIG"]) == {}
    joined = " ".join(argv)
    assert "--actor.model_name_or_path /models/p" in joined and "--ds.zero_stage 3" in joined
    assert "--actor.adam.betas 0.9 0.95" in joined
    assert "--data.apply_chat_template --" in joined  # a switch, no value
    assert "--ckpt.output_dir" not in joined  # null: left out


def test_fp8_recipe_reaches_the_engine_arguments(tiny_model):
    """ppo_ray_fp8: OpenRLHF has no quantization flag, so the recipe's
    ``tensorhub.vllm_quantization`` becomes TENSORHUB_VLLM_QUANTIZATION, which
    every engine (``TensorHubRolloutRayActor``, through ``engine_args``) adds to
    the arguments OpenRLHF hands vLLM; vLLM builds its engine config from them
    and takes the method on this platform."""
    from tensorhub_openrlhf.engines import WORKER_EXTENSION, engine_args
    from vllm import AsyncEngineArgs

    env, argv = render(compose(str(RECIPES), "ppo_ray_fp8", [
        "openrlhf.actor.model_name_or_path=/models/p", "openrlhf.data.prompt_dataset=/data/d",
        "openrlhf.reward.model_name_or_path=/rm"]))
    assert env["TENSORHUB_VLLM_QUANTIZATION"] == "fp8_per_channel"
    assert "--ds.zero_stage 3" in " ".join(argv)  # the rest of ppo_ray, unchanged
    # what OpenRLHF's create_vllm_engines gives the actor (a few of them), then ours
    stock = {"model": str(tiny_model), "dtype": "bfloat16", "max_model_len": 256, "enforce_eager": True}
    args = engine_args(stock, TensorHubSettings.from_env(env))
    assert args == {**stock, "worker_extension_cls": WORKER_EXTENSION, "quantization": "fp8_per_channel"}
    config = AsyncEngineArgs(**args).create_engine_config()
    assert config.model_config.quantization == "fp8_per_channel"
    assert type(config.quant_config).__name__ == "OnlineQuantizationConfig"
    # the plain recipe leaves vLLM's quantization alone
    plain, _ = render(compose(str(RECIPES), "ppo_ray", [
        "openrlhf.actor.model_name_or_path=/models/p", "openrlhf.data.prompt_dataset=/data/d",
        "openrlhf.reward.model_name_or_path=/rm"]))
    assert plain["TENSORHUB_VLLM_QUANTIZATION"] == "" and TensorHubSettings.from_env(plain).vllm_engine_args() == {}


def test_recipe_mistakes_are_caught_before_launch():
    with pytest.raises(Exception, match="model_name_or_path"):  # Hydra: a required value (???) is missing
        compose(str(RECIPES), "ppo_ray", [])
    with pytest.raises(ValueError, match=r"recipe node 'tensorhub' has no key\(s\) \['adress'\]"):
        render({"tensorhub": {"adress": "x"}})
    with pytest.raises(ValueError, match="TENSORHUB_SERVE must be one of"):
        render({"tensorhub": {"address": "auto", "serve": "maybe"}})


def test_the_bench_stops_at_once_when_a_rank_fails():
    import time
    from types import SimpleNamespace

    import torch.multiprocessing as mp
    from tensorhub_openrlhf.bench import _collect

    queue = mp.get_context("spawn").Queue()
    running, done, failed = SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=0), SimpleNamespace(exitcode=1)
    queue.put(("published", 0))
    queue.put(("published", 1))
    assert sorted(_collect(queue, [running, done], "publish")) == [("published", 0), ("published", 1)]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(exit code 1\) failed during gather"):
        _collect(queue, [running, failed], "gather")
    assert time.monotonic() - start < 10  # not the 120 s a silent rank gets


def test_delta_copy_publishes_each_step_with_its_delta_from_the_last():
    """TENSORHUB_DELTA=copy: a rank keeps a host copy of its partitions (they
    are published in place, so the step before is gone from them) and
    publishes the next step with its delta; an engine holding the last step
    reads only that."""
    from tensorhub_openrlhf.publisher import WeightPublisher

    from tensorhub import Hub
    from tensorhub.server import EmbeddedServer

    with EmbeddedServer(retain=0) as server:
        settings = TensorHubSettings.from_env({"TENSORHUB_ADDRESS": server.address, "TENSORHUB_DELTA": "copy"})
        assert TensorHubSettings.from_env(settings.to_env()) == settings
        params = {"w": torch.nn.Parameter(torch.randn(256, 64).to(torch.bfloat16)),
                  "b": torch.nn.Parameter(torch.randn(64))}
        publisher = WeightPublisher(settings, rank=0, world=1)
        try:
            first = publisher.publish(1, params.items())
            assert first.delta_bytes == 0  # nothing before it
            with Hub.connect(server.address, name="engine") as engine:
                got = engine.pull("policy", 1)
                with torch.no_grad():
                    params["w"][7, :3] += 1  # a training step, in place, that changed little
                second = publisher.publish(2, params.items())
                assert 0 < second.delta_bytes < 0.1 * second.nbytes
                patched = engine.pull("policy", 2, into=got.tensors, have=1)
                assert patched.delta_from == 1 and patched.read_bytes == patched.delta_bytes
                for name, p in params.items():
                    assert torch.equal(patched.tensors[name].view(torch.uint8), p.data.view(torch.uint8)), name
        finally:
            publisher.close()


def test_the_readers_cut_goes_beside_the_delta():
    """TENSORHUB_CUT=readers with TENSORHUB_DELTA=copy, one rank (a gloo world
    of one; ZeRO-0/1/2 replicas: the world is the partition group). Step 1:
    partitions only; a TP reader serves its read set. Step 2, which changed
    little: the rank publishes its delta and the reader's cut; a fresh TP
    reader reads exactly its bytes, and an engine holding step 1 only the delta."""
    import torch.distributed as dist
    from tensorhub_openrlhf.publisher import WeightPublisher
    from tp_reader import pull_read_set, tp_read_set

    from tensorhub import Hub
    from tensorhub.server import EmbeddedServer

    params = {"self_attn.o_proj.weight": torch.nn.Parameter(torch.randn(64, 256).to(torch.bfloat16)),
              "mlp.up_proj.weight": torch.nn.Parameter(torch.randn(256, 64).to(torch.bfloat16)),
              "norm.weight": torch.nn.Parameter(torch.randn(64))}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with EmbeddedServer(retain=0) as server:
        settings = TensorHubSettings.from_env({"TENSORHUB_ADDRESS": server.address, "TENSORHUB_DELTA": "copy",
                                               "TENSORHUB_CUT": "readers"})
        publisher = WeightPublisher(settings, rank=0, world=1)
        try:
            full = {n: p.data.clone() for n, p in params.items()}
            read_set = tp_read_set(full, worker=1)
            first = publisher.publish(1, params.items())
            assert first.cut_bytes == first.delta_bytes == 0
            with Hub.connect(server.address, name="tp1") as tp1, Hub.connect(server.address, name="engine") as engine:
                from_shards = pull_read_set(tp1, "policy", 1, full, read_set, serve=True)
                whole = engine.pull("policy", 1)
                with torch.no_grad():
                    params["mlp.up_proj.weight"][7, :3] += 1  # a step that changed little
                second = publisher.publish(2, params.items())
                assert 0 < second.delta_bytes < 0.1 * second.nbytes
                assert second.cut_bytes == from_shards.nbytes and second.cut_peak_gather_bytes > 0
                full = {n: p.data.clone() for n, p in params.items()}
                with Hub.connect(server.address, name="tp1-next") as fresh:
                    got = pull_read_set(fresh, "policy", 2, full, read_set, serve=False)
                assert got.read_bytes == got.nbytes < from_shards.read_bytes  # from the cut, not whole rows
                patched = engine.pull("policy", 2, into=whole.tensors, have=1)
                assert patched.delta_from == 1 and patched.read_bytes == patched.delta_bytes
        finally:
            publisher.close()
            dist.destroy_process_group()


def test_ranks_publishing_together_send_two_messages_a_step():
    """TENSORHUB_PUBLISH_TOGETHER=1, one rank (a gloo world of one: the world
    is the partition group): from the second step the rank's withdrawal of the
    step before and its announce go as the group's two Batches, no Publish or
    Unpublish of its own, and an engine pulls each step byte-exact."""
    import torch.distributed as dist
    from tensorhub_openrlhf.publisher import WeightPublisher

    from tensorhub import Hub
    from tensorhub.client.rpc import ReferenceClient
    from tensorhub.server import EmbeddedServer

    params = {"self_attn.o_proj.weight": torch.nn.Parameter(torch.randn(64, 256).to(torch.bfloat16)),
              "norm.weight": torch.nn.Parameter(torch.randn(64))}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with EmbeddedServer(retain=0) as server:
        settings = TensorHubSettings.from_env({"TENSORHUB_ADDRESS": server.address,
                                               "TENSORHUB_PUBLISH_TOGETHER": "1"})
        assert settings.publish_together and settings.to_env()["TENSORHUB_PUBLISH_TOGETHER"] == "1"
        publisher = WeightPublisher(settings, rank=0, world=1)
        rpc = ReferenceClient(server.address)
        try:
            with Hub.connect(server.address, name="engine") as engine:
                for step in (1, 2, 3):
                    with torch.no_grad():
                        for p in params.values():
                            p.add_(1)
                    before = dict(rpc.describe().control.calls)
                    publisher.publish(step, params.items())
                    after = dict(rpc.describe().control.calls)
                    sent = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
                    sent.pop("Heartbeat", None)
                    if step == 1:  # the first announce goes whole, on its own
                        assert sent.get("Publish") == 1 and "Unpublish" not in sent, sent
                    else:  # step-1's withdrawal and this step's announce, each in the group's Batch
                        assert sent.get("Batch") == 2 and "Publish" not in sent and "Unpublish" not in sent, sent
                    got = engine.pull("policy", step)
                    for name, p in params.items():
                        assert torch.equal(got.tensors[name].view(torch.uint8), p.data.view(torch.uint8)), name
        finally:
            rpc.close()
            publisher.close()
            dist.destroy_process_group()


def test_publish_together_setting_is_checked():
    with pytest.raises(ValueError, match="TENSORHUB_PUBLISH_TOGETHER=1: the ranks' group announce carries no deltas"):
        TensorHubSettings.from_env({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_DELTA": "copy",
                                    "TENSORHUB_PUBLISH_TOGETHER": "1"})
    with pytest.raises(ValueError, match="TENSORHUB_PUBLISH_TOGETHER=1: an adapter version"):
        TensorHubSettings.from_env({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_LORA": "1",
                                    "TENSORHUB_PUBLISH_TOGETHER": "1"})
    with pytest.raises(ValueError, match="TENSORHUB_PUBLISH_TOGETHER"):
        TensorHubSettings.from_env({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_PUBLISH_TOGETHER": "maybe"})


def test_delta_setting_is_checked():
    with pytest.raises(ValueError, match="TENSORHUB_DELTA must be"):
        TensorHubSettings.from_env({"TENSORHUB_ADDRESS": "auto", "TENSORHUB_DELTA": "on"})
