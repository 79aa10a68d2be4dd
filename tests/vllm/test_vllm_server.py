"""The OpenAI-compatible server (multiprocess engine, as users run it), updated
through vLLM's own weight-update HTTP routes. It is a second engine: it pulls the
version from the first engine's replica after the trainer withdrew its own. It
runs with tensor parallelism 2 where two cores are free, so its two workers pull
as one group. Its reference text is its own on the same bytes pulled from the
trainer: at TP=2 vLLM rounds differently from the TP=1 engine (bf16 partial sums),
so the two engines' texts agree token for token only when the server runs TP=1."""

from __future__ import annotations

import urllib.error

import pytest
from conftest import HUB_CONFIG, MODEL_KEY, PROMPT, update
from vllm_server import Server, fsdp_trainer_send

from tensorhub.client.rpc import ReferenceClient


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    s = Server(tiny_model, tmp_path_factory.mktemp("server") / "vllm-server.log")
    s.base = s.complete(PROMPT)  # the text of the weights in its files
    yield s
    s.close()


def test_fsdp_trainer_sends_through_vllms_trainer_api(server, hub_server, tiny_model, tmp_path):
    """2 FSDP2 ranks (gloo) drive an update of the server through vLLM's
    WeightTransferTrainerFactory (backend ``tensorhub``) and its HTTP client:
    each rank publishes its local shards in place, about half of the model,
    nothing is gathered, and the server then runs the trainer's bytes exactly
    (the text of the same weights loaded from its files). It runs first: after
    a failed update at TP=2, vLLM 0.32's multiprocess executor answers the next
    collective_rpc with the other worker's stale error."""
    reports = fsdp_trainer_send(hub_server.address, server, tiny_model, MODEL_KEY, 40, tmp_path)
    import torch
    from tensorhub_vllm.receiver import checkpoint_layout

    checkpoint = sum(t.numel() * t.element_size() for t in checkpoint_layout(tiny_model, torch.bfloat16).values())
    for got in reports:
        assert got["version"] == 40
        assert 0.4 * checkpoint <= got["published_bytes"] <= 0.6 * checkpoint, (got, checkpoint)
    assert server.get("/weight_info") == {"weight_version": "40"}
    assert server.complete(PROMPT) == server.base


def test_fsdp_trainer_with_the_readers_cut(server, hub_server, tiny_model, tmp_path):
    """``TensorHubTrainerInitInfo(cut="readers")``: the 2 FSDP2 ranks send 2
    versions to the serving TP=2 server. The first has no readers yet and goes
    as row shards: a TP worker reads whole rows of the row-parallel tensors
    (more bytes than its read set) or a READ per row. From the second the ranks also publish the
    workers' read sets, gathered over gloo (still no ``full_tensor()``), and
    each worker reads its read set's bytes and no more; the server then runs
    the weights of its files exactly. A model key of its own: no reader of it
    before the first version. Before the replica test below: its failed
    update would answer the next collective_rpc with a stale error."""
    if server.tp == 1:
        pytest.skip("one core: the server runs TP=1, whose read set is every tensor whole (nothing to cut)")
    key = MODEL_KEY + "-cut"
    reports = fsdp_trainer_send(hub_server.address, server, tiny_model, key, 1, tmp_path, versions=2, cut="readers")
    for got in reports:
        assert [s["version"] for s in got["sent"]] == [1, 2]
        first, second = got["sent"]
        assert first["cut_bytes"] == 0 < second["cut_bytes"], got["sent"]  # a share of the cut for each rank
    # the cut holds no element twice: at most the model (the ranks' shards together)
    assert sum(r["sent"][1]["cut_bytes"] for r in reports) <= sum(r["sent"][1]["published_bytes"] for r in reports)
    first, second = reports[0]["sent"][0]["workers"], reports[0]["sent"][1]["workers"]
    assert len(first) == len(second) == server.tp
    for w, (w1, w2) in enumerate(zip(first, second)):
        print(f"worker {w}: read {w1['read_bytes']} B in {w1['descriptors']} READs for {w1['nbytes']} B from the "
              f"shards, {w2['read_bytes']} B in {w2['descriptors']} READs for {w2['nbytes']} B with the cut")
        assert w1["nbytes"] == w2["nbytes"] == w2["read_set_nbytes"]
        # From the shards a worker's columns cost whole rows or a READ per row; from the cut neither.
        assert w2["read_bytes"] <= 1.05 * w2["nbytes"], w2
        assert w2["read_bytes"] <= w1["read_bytes"], (w1, w2)
        assert w2["read_bytes"] < w1["read_bytes"] or w2["descriptors"] < w1["descriptors"], (w1, w2)
        assert sum(w2["bytes_by_source"].values()) == w2["nbytes"]
    assert server.get("/weight_info") == {"weight_version": "2"}
    assert server.complete(PROMPT) == server.base


def test_fsdp_trainer_publishing_together_sends_no_message_per_rank(server, hub_server, tiny_model, tmp_path):
    """``TensorHubTrainerInitInfo(publish_together=True)``: the 2 FSDP2 ranks
    announce each version as one group and withdraw it as one, rank 0 sending
    both ranks' messages (``Hub.publish(trainer_group=)``): two versions cost
    the server no Publish and no Unpublish of a rank, and the serving TP
    engine runs the weights of its files exactly."""
    key = MODEL_KEY + "-together"
    rpc = ReferenceClient(hub_server.address)
    try:
        before = dict(rpc.describe().control.calls)
        reports = fsdp_trainer_send(hub_server.address, server, tiny_model, key, 1, tmp_path, versions=2,
                                    cut="together")
        after = dict(rpc.describe().control.calls)
    finally:
        rpc.close()
    sent = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
    assert [[s["version"] for s in r["sent"]] for r in reports] == [[1, 2], [1, 2]]
    # Each rank alone would send a Publish and an Unpublish a version (4 each here). The first version's
    # announces go whole, each rank its own; from the second, rank 0 sends both ranks' in a Batch, and
    # every withdrawal went in the group's Batches. An engine's workers that served another model's
    # version before (a test before this one) withdraw that one alone: at most one Unpublish each.
    assert sent.get("Publish", 0) == 2 and sent.get("Unpublish", 0) <= server.tp, sent
    assert sent["Batch"] >= 4, sent
    assert server.get("/weight_info") == {"weight_version": "2"}
    assert server.complete(PROMPT) == server.base


def test_server_updates_from_another_engines_replica(server, engine, trainer, hub_server):
    server.post("/init_weight_transfer_engine", {"init_info": {"hub": hub_server.address, "model": MODEL_KEY,
                                                                 "hub_config": HUB_CONFIG}})
    base = server.complete(PROMPT)
    trainer.publish(19, "perturbed")  # the reference: these bytes, pulled from the trainer
    server.update(19)
    want = server.complete(PROMPT)
    assert want != base
    trainer.unpublish(19)

    trainer.publish(20, "perturbed")  # the same bytes again
    update(engine, 20, "20")
    if server.tp == 1:  # same TP, same rounding: the first engine's text is a reference too
        assert engine.generate([PROMPT], _greedy_params(), use_tqdm=False)[0].outputs[0].text == want
    trainer.unpublish(20)  # from now on only the first engine holds version 20

    server.update(20)
    assert server.get("/weight_info") == {"weight_version": "20"}
    assert server.complete(PROMPT) == want

    # Every worker keeps what it received pullable: the first engine's one
    # worker and each of the server's TP workers hold a complete replica of 20.
    rpc = ReferenceClient(hub_server.address)
    try:
        (v20,) = [v for v in rpc.list_versions(MODEL_KEY) if v.version == 20]
    finally:
        rpc.close()
    assert v20.complete_replicas == 1 + server.tp

    # A version nobody holds: the route fails, says why, and the server keeps serving 20.
    server.post("/start_weight_update")
    with pytest.raises(urllib.error.HTTPError) as err:
        server.post("/update_weights", {"update_info": {"version": 999}})
    assert err.value.code >= 400
    assert "version 999 has no complete replica" in err.value.read().decode()  # the hub's reason reaches the client
    assert server.get("/weight_info") == {"weight_version": "20"}
    assert server.complete(PROMPT) == want


def _greedy_params():
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=16)

