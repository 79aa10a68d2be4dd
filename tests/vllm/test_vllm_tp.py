"""Two real TP=2 engines (CPU): each worker pulls only the slices its loaders
read (its read set, from a dry run of the loaders at init), and serves exactly
those, so worker k of the second engine pulls from worker k of the first with
the trainer's copy withdrawn.

Engine A starts from the original weights; engine B, a fresh engine, from the
perturbed ones. A updated to the perturbed version must then generate what B
generates from its own files, token for token (same TP, same rounding), and
B updated to the original version what A generated at start.

Both engines serve LoRA adapters too (one engine start each covers the LoRA
check at TP=2): A serves an adapter version from TensorHub, each worker
pulling only its shard of each A and B matrix, and generates what B generates
with the same adapter loaded from PEFT files by vLLM's own disk path; in
merged mode, A merges an adapter version into its base and generates what B
generates with the merged weights loaded as a base version."""

from __future__ import annotations

import sys

import pytest
from conftest import HERE, HUB_CONFIG, MODEL_KEY, engine_pair, perturbed_copy, update, update_and_relay

sys.path.insert(0, str(HERE))
from vllm_tiny_adapter import HIDDEN, INTERMEDIATE, KV, LAYERS, adapter, config, save_merged, save_peft

PROMPTS = ["the quick brown", "weights move from", "tensorhub pulls versions"]
LORA_ARGS = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
LORA_KEY = "tiny-qwen2/lora/tp"


@pytest.fixture(scope="module")
def perturbed_model(tiny_model, tmp_path_factory):
    """The tiny model's directory with the trainer's "perturbed" weights in its files."""
    return perturbed_copy(tiny_model, tmp_path_factory.mktemp("tiny-qwen2-perturbed"))


@pytest.fixture(scope="module")
def engines(tp_env, tiny_model, perturbed_model, hub_server):
    yield from engine_pair(tiny_model, perturbed_model, hub_server.address, **LORA_ARGS)


def test_each_worker_reads_its_slices_only(engines):
    a, _ = engines
    stats = a.collective_rpc("tensorhub_stats", args=("backend",))
    sets = a.collective_rpc("tensorhub_read_set", args=("backend",))
    assert len(stats) == 2
    for s in stats:
        assert s["read_set_nbytes"] <= 0.6 * s["checkpoint_nbytes"], s
    # the TP-split tensors are read in complementary halves: rows for column-parallel
    # layers (embedding, qkv, gate_up, lm_head), columns for row-parallel ones
    b0, b1 = (s["boxes"] for s in sets)
    assert b0["model.embed_tokens.weight"] == [[[0, 256], [0, 128]]]
    assert b1["model.embed_tokens.weight"] == [[[256, 512], [0, 128]]]
    assert b0["model.layers.1.mlp.down_proj.weight"] == [[[0, 128], [0, 128]]]
    assert b1["model.layers.1.mlp.down_proj.weight"] == [[[0, 128], [128, 256]]]
    assert "model.norm.weight" not in b0  # replicated: read whole
    assert sets[0]["fallbacks"] == sets[1]["fallbacks"] == {}
    # Columns are rows of 128-256 B, one READ descriptor each: within the 0.2
    # over-read budget the narrowest are read as whole rows instead (o_proj's
    # 128 B gaps, then layer 0's down_proj), the loaders viewing their columns.
    for s in sets:
        assert s["widened"] == {"model.layers.0.self_attn.o_proj.weight": 128 * 64 * 2,
                                "model.layers.1.self_attn.o_proj.weight": 128 * 64 * 2,
                                "model.layers.0.mlp.down_proj.weight": 128 * 128 * 2}, s["widened"]
        assert not set(s["widened"]) & set(s["boxes"])  # whole tensors now


def _control(address: str):
    from tensorhub.client.rpc import ReferenceClient

    client = ReferenceClient(address)
    try:
        return client.describe().control
    finally:
        client.close()


def test_update_matches_a_fresh_engine_and_serves_slices_to_the_next(engines, trainer, hub_server):
    a, b = engines
    before = _control(hub_server.address)
    update_and_relay(a, b, trainer, (31, 32), PROMPTS, share=0.6)
    # Three updates of TP=2 engines, one Resolve each: the first worker resolves
    # for both (groupshare), the second adopts its answer. A pull slower than
    # its refresh interval asks again mid-pull (a loaded machine; ``PullResult.refreshes``),
    # so the Resolves are 3 and a few; one per worker would be 6.
    after = _control(hub_server.address)
    assert after.answers_shared - before.answers_shared == 3
    assert 3 <= after.resolves - before.resolves < 6, after.resolves - before.resolves
    # And the rest of each update is two messages from the first worker: both
    # workers' announces in one Batch before any READ, then their last reports,
    # pulled bytes and the answer's lease in another; no worker publishes alone.
    # An engine that served a version before withdraws it first, both workers'
    # withdrawals with its Resolve (ResolveRequest.withdrawals), and no worker alone.
    def sent(method: str) -> int:
        return after.calls.get(method, 0) - before.calls.get(method, 0)

    assert sent("Batch") == 6, sent("Batch")
    assert sent("Unpublish") == 2  # the trainer's two versions only
    assert sent("Publish") == 2  # the trainer's two versions only


def _tokens(llm, lora=None) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), lora_request=lora, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _share(r: int) -> int:
    """The bytes of a rank-``r`` adapter of vllm_tiny_adapter one TP=2 worker
    keeps: q_proj, v_proj (column-parallel) all of A, half of B's rows;
    down_proj (row-parallel) half of A's columns, all of B. bf16."""
    q = r * HIDDEN + HIDDEN * r // 2
    v = r * HIDDEN + KV * r // 2
    down = r * INTERMEDIATE // 2 + HIDDEN * r
    return 2 * LAYERS * (q + v + down)


def test_an_adapter_version_at_tp2_generates_what_the_adapter_from_disk_does(engines, hub_server, tmp_path):
    """After the test above both engines serve the original weights (checked
    again here). B has never been given an adapter: it loads this one from
    PEFT files, vLLM's own path, as a fresh engine would."""
    from tensorhub_vllm.adapter_versions import AdapterVersions
    from vllm.lora.request import LoRARequest

    from tensorhub import Hub
    from tensorhub.lora import AdapterConfig, publish_adapter

    a, b = engines
    base = _tokens(a)
    assert base == _tokens(b)
    disk = LoRARequest("disk", 1, str(save_peft(tmp_path / "peft", adapter(1), config())))
    from_disk = _tokens(b, disk)
    assert from_disk != base  # the adapter changes the tokens: the check below can fail
    with Hub.connect(hub_server.address, name="tp-lora-trainer") as hub:
        pub = publish_adapter(hub, LORA_KEY, 1, adapter(1), config())
        adapters = AdapterVersions(a, hub=hub_server.address, model=LORA_KEY, hub_config=HUB_CONFIG)
        try:
            assert _tokens(a, adapters.load(1)) == from_disk
            stats = [s["last"] for s in adapters.stats()]
        finally:
            adapters.close()
            pub.unpublish()
    side = AdapterConfig.from_dict(config()).to_tensor().numel()  # the settings, read whole by each
    assert len(stats) == 2
    for s in stats:
        assert s["nbytes"] == _share(8) + side < 0.75 * s["adapter_nbytes"], s
    # complementary halves: B's rows of a column-parallel layer, A's columns of a row-parallel one
    q_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    down_a = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    p0, p1 = (s["parts"] for s in stats)
    assert p0[q_b] == [[0, 64], [0, 8]] and p1[q_b] == [[64, 128], [0, 8]]
    assert p0[down_a] == [[0, 8], [0, 128]] and p1[down_a] == [[0, 8], [128, 256]]
    assert not [n for n in p0 if ".lora_A." in n and "_proj" in n and "down_proj" not in n]  # all of A: whole


def test_merged_mode_at_tp2_matches_the_merged_weights_loaded_as_a_base(engines, trainer, hub_server, tiny_model,
                                                                        tmp_path):
    """A merges adapter version 2 (through its worker extension, in merged
    mode) onto base version 41; B loads the merged weights (the same merge
    computed on the checkpoint, published by the trainer as version 42)
    through the base update checked above against a fresh engine."""
    from tensorhub import Hub
    from tensorhub.lora import publish_adapter

    a, b = engines
    trainer.publish(41, "original")
    trainer.publish(42, "hf", model_dir=save_merged(tiny_model, tmp_path / "merged", adapter(1), config()))
    a.collective_rpc("tensorhub_init", args=({"hub": hub_server.address, "model": MODEL_KEY,
                                              "merge_adapter": LORA_KEY, "hub_config": HUB_CONFIG},))
    try:
        assert a.collective_rpc("tensorhub_update", args=(41,)) == [41, 41]
        with Hub.connect(hub_server.address, name="tp-lora-trainer") as hub:
            pub = publish_adapter(hub, LORA_KEY, 2, adapter(1), config())
            assert a.collective_rpc("tensorhub_update_adapter", args=(2,)) == [2, 2]
            stats = a.collective_rpc("tensorhub_stats")
            pub.unpublish()
        base = _tokens(b)  # the original weights (the tests above)
        update(b, 42)
        a.reset_prefix_cache()
        b.reset_prefix_cache()
        assert _tokens(a) == _tokens(b) != base
        whole = sum(t.numel() * t.element_size() for t in adapter(1).values())
        for s in stats:  # only adapter bytes, and only the rows of B and columns of A this worker's boxes need
            assert set(s["bytes_by_source"]) == {"tp-lora-trainer"} and s["nbytes"] < 0.85 * whole, s
    finally:
        a.collective_rpc("tensorhub_close")
        trainer.unpublish(41)
        trainer.unpublish(42)
