"""The ``tensorhub`` checkpoint engine against a real reference server and real
NIXL, driven the way verl drives it (send on the trainer, receive on rollouts)."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest
import torch
from tensorhub_verl.engine import TensorHubCheckpointEngine
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl_testlib import assert_identical, make_weights, receive

from tensorhub import ServerUnavailable, VersionNotFound


def send(engine, step, weights=None):
    weights = make_weights(step) if weights is None else weights
    return asyncio.run(engine.send_weights(iter(weights.items()), global_steps=step))


@pytest.fixture
def engines(engine_kwargs):
    made = []

    def make(**overrides):
        engine = CheckpointEngineRegistry.new("tensorhub", bucket_size=1 << 20, **{**engine_kwargs, **overrides})
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.shutdown()


def test_registered_without_a_group():
    assert CheckpointEngineRegistry.get("tensorhub") is TensorHubCheckpointEngine
    assert TensorHubCheckpointEngine.build_topology(2, 4, [{}] * 6) == ({}, {})


def test_every_rollout_receives_each_step_byte_identical(engines):
    trainer = engines(is_master=True)
    rollouts = [engines(), engines()]
    for step in (1, 2, 3):
        weights = make_weights(step)
        metrics = send(trainer, step, weights)
        for tensor in weights.values():  # the trainer trains on: its published copy must not change
            tensor.zero_()
        for rollout in rollouts:
            assert_identical(receive(rollout, step), make_weights(step))
            assert rollout.received_version == step
        assert metrics["tensorhub/version"] == step
        assert metrics["tensorhub/rank0/unpublish_blocked_s"] >= 0
        assert metrics["tensorhub/rank0/stall_s"] >= metrics["tensorhub/rank0/copy_s"]
        # the buffer is allocated at the first step and reused after
        assert metrics["tensorhub/rank0/buffer_allocations"] == (5 if step == 1 else 0)
        # one trainer rank: it holds the whole model
        assert metrics["tensorhub/max_rank_share"] == 1.0 and metrics["tensorhub/trainer_ranks"] == 1
    assert trainer.hub.versions("tiny/policy")[-1] == 3


def test_late_or_skipping_rollout_gets_the_newest(engines):
    trainer = engines(is_master=True)
    early = engines()
    send(trainer, 1)
    assert_identical(receive(early, 1), make_weights(1))
    send(trainer, 2)
    send(trainer, 3)
    # asked for a step it missed: gets the newest, not the one it asked for
    assert_identical(receive(early, 2), make_weights(3))
    assert early.received_version == 3
    late = engines()  # joins after three steps, no group to rebuild
    assert_identical(receive(late, 1), make_weights(3))
    fresh = engines()
    assert_identical(receive(fresh, None), make_weights(3))


def test_receive_waits_for_the_step_being_published(engines):
    """verl runs send and receive concurrently: a rollout may ask first."""
    trainer, rollout = engines(is_master=True), engines()
    send(trainer, 4)
    got = {}
    reader = threading.Thread(target=lambda: got.update(r=receive(rollout, 5)))
    reader.start()
    time.sleep(0.3)
    assert reader.is_alive()  # version 4 is older than asked: keep waiting
    send(trainer, 5)
    reader.join(timeout=20)
    assert_identical(got["r"], make_weights(5))


def test_receive_gives_up_after_wait_timeout_naming_what_it_waited_for(engines, server):
    trainer, rollout = engines(is_master=True), engines(wait_timeout_s=1.0)
    send(trainer, 1)
    start = time.monotonic()
    with pytest.raises(VersionNotFound, match=re.escape(
            f"no version >= 2 of model 'tiny/policy' was published at {server.address} within 1s "
            "(pullable now: [1]); check that the trainer publishes under the same model key")):
        receive(rollout, 2)
    assert 1.0 <= time.monotonic() - start < 10


def test_without_steps_versions_count_up(engines):
    trainer, rollout = engines(is_master=True), engines()
    for step in range(3):
        asyncio.run(trainer.send_weights(iter(make_weights(step).items())))
        assert_identical(receive(rollout, None), make_weights(step))
    assert rollout.received_version == 2


def test_each_trainer_rank_publishes_its_part_and_the_union_is_the_version(engines, server):
    """Two trainer ranks get the same full stream (as verl's FSDP engine gives
    it); each keeps and publishes only its half. The version is visible once
    both are in, and a rollout reads it byte-identical from both."""
    ranks = [engines(is_master=True), engines()]
    for r, engine in enumerate(ranks):
        engine.rank_and_world = (r, 2)
    rollout = engines()
    weights = make_weights(7)
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    seen = []

    def stream():  # a sharded trainer all-gathers per tensor: every rank must iterate
        for item in weights.items():
            seen.append(item[0])
            yield item

    metrics = [asyncio.run(ranks[0].send_weights(stream(), global_steps=7))]
    assert seen == list(weights)
    assert rollout.hub.versions("tiny/policy") == []  # half the model is no version yet
    metrics.append(send(ranks[1], 7, weights))
    assert rollout.hub.wait_for_version("tiny/policy", 7, timeout=10) == 7
    assert_identical(receive(rollout, 7), weights)
    for r, (engine, m) in enumerate(zip(ranks, metrics)):
        registered = engine.publication
        # what the rank registered: about half the model, and no slot anywhere near the model's size
        assert abs(registered.nbytes - model_bytes / 2) <= 16, (r, registered.nbytes, model_bytes)
        assert max(p.nbytes for p in registered.parts) < model_bytes / 3
        assert m[f"tensorhub/rank{r}/published_mb"] * 2**20 == registered.nbytes
    assert "tensorhub/version" not in metrics[1]  # the step's own figures come from rank 0 only
    assert metrics[0]["tensorhub/max_rank_share"] <= 0.5 + 0.05
    assert metrics[0]["checkpoint_engine/payload_mbytes"] * 2**20 == model_bytes


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match=r"model is not set.*engine_kwargs\.tensorhub\.model"):
        TensorHubCheckpointEngine(bucket_size=0, address="127.0.0.1:1", model="")
    with pytest.raises(ValueError, match="no field"):
        TensorHubCheckpointEngine(bucket_size=0, address="127.0.0.1:1", model="m", adress="x")
    with pytest.raises(ValueError, match=r"HubConfig has no field\(s\) \['chunk'\]"):
        TensorHubCheckpointEngine(bucket_size=0, address="127.0.0.1:1", model="m", hub={"chunk": 1})
    with pytest.raises(ValueError, match=r"ServerConfig has no field\(s\) \['prot'\].*tensorhub\.server"):
        TensorHubCheckpointEngine(bucket_size=0, model="m", server={"prot": 1})


def test_auto_address_outside_ray_says_what_to_do():
    """``auto`` (the default) needs the process to be on a Ray cluster, as verl's workers are."""
    with pytest.raises(ServerUnavailable, match=r"not connected to Ray: call ray\.init\(\) first, or give host:port"):
        TensorHubCheckpointEngine(bucket_size=0, model="m")


def test_unreachable_address_fails_at_start_not_at_first_step():
    start = time.monotonic()
    with pytest.raises(ServerUnavailable, match=r"127\.0\.0\.1:9.*engine_kwargs\.tensorhub\.address"):
        TensorHubCheckpointEngine(bucket_size=0, address="127.0.0.1:9", model="m", hub={"connect_timeout_s": 1.0})
    assert time.monotonic() - start < 10
    with pytest.raises(ValueError, match="host:port"):
        TensorHubCheckpointEngine(bucket_size=0, address="no-port-here", model="m")


def test_layout_change_reallocates(engines):
    trainer, rollout = engines(is_master=True), engines()
    send(trainer, 1)
    receive(rollout, 1)
    grown = {**make_weights(2), "lm_head.weight": torch.ones(8, 8)}
    metrics = send(trainer, 2, grown)
    assert metrics["tensorhub/rank0/buffer_allocations"] == 1
    assert_identical(receive(rollout, 2), grown)
    # the pull that found the old layout leased the trainer's replica and read
    # nothing: that lease must not hold the trainer's next unpublish
    assert send(trainer, 3)["tensorhub/rank0/unpublish_blocked_s"] < 2


def test_a_step_that_changed_little_moves_as_its_delta(engines):
    """delta: auto (the default). The trainer's buffer holds step 1 when step 2
    is copied over it: the delta is taken then, with no second buffer; a rollout
    holding step 1 reads only that and patches its copy, byte-exact."""
    trainer, rollout = engines(is_master=True), engines()
    first = make_weights(1)
    send(trainer, 1, first)
    assert_identical(receive(rollout, 1), make_weights(1))
    assert rollout.last_pull.delta_from is None
    second = {name: t.clone() for name, t in first.items()}
    second["embed.weight"][3, :5] += 1  # a few elements of two tensors change
    second["layers.0.mlp.weight"][100] = 7
    metrics = send(trainer, 2, second)
    assert 0 < metrics["tensorhub/rank0/delta_mb"] * 2**20 < 2048
    assert_identical(receive(rollout, 2), second)
    pulled = rollout.last_pull
    assert pulled.delta_from == 1 and pulled.read_bytes == pulled.delta_bytes < 0.2 * pulled.nbytes
    # delta: off moves every byte
    whole = engines(delta="off")
    assert_identical(receive(whole, 2), second)
    assert whole.last_pull.delta_from is None


def test_a_layout_change_publishes_no_delta(engines):
    trainer, rollout = engines(is_master=True), engines()
    send(trainer, 1)
    receive(rollout, 1)
    grown = {**make_weights(2), "extra.weight": torch.ones(8)}
    metrics = send(trainer, 2, grown)
    assert metrics["tensorhub/rank0/delta_mb"] == 0
    assert_identical(receive(rollout, 2), grown)
    assert rollout.last_pull.delta_from is None


def _tp_reader_pull(hub, step, weights, *, serve, worker=0):
    """A TP reader (worker ``worker`` of 2: rows of even-numbered tensors, columns of
    odd-numbered ones), as a vLLM TP worker reads, checked byte-exact."""
    from tensorhub import Shard
    from tensorhub.testing import read_region, take

    regions = {name: read_region(tuple(t.shape), i, "tp", worker, 2) for i, (name, t) in enumerate(weights.items())}
    into = {name: Shard(torch.zeros(regions[name].numel(tuple(t.shape)), dtype=t.dtype), tuple(t.shape),
                        box=regions[name].box, flat=regions[name].flat) for name, t in weights.items()}
    result = hub.pull("tiny/policy", step, into=into, serve=serve)
    for name, t in weights.items():
        got = into[name].tensor.reshape(-1).view(torch.uint8)
        assert torch.equal(got, take(t, regions[name]).reshape(-1).view(torch.uint8)), name
    return result


def test_the_readers_cut_reaches_the_publish(engines, server):
    """``cut: readers``: the trainer's publish gathers over its torch.distributed
    world (here one gloo rank) and, once a reader with a partial read set
    serves the step before, publishes that read set as a trainer-cut replica
    beside its shard; a reader of the same read set then reads exactly its
    bytes. The first step has no readers' cut yet."""
    import torch.distributed as dist

    from tensorhub.client.rpc import ReferenceClient

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = engines(is_master=True, cut="readers", cut_gather_bytes=1 << 20)
        tp0, tp0_next = engines(), engines()
        first = send(trainer, 1)
        assert trainer.publication.cut is None and first["tensorhub/rank0/cut_mb"] == 0
        from_shards = _tp_reader_pull(tp0.hub, 1, make_weights(1), serve=True)  # its read set, with the server

        second = send(trainer, 2)
        cut = trainer.publication.cut
        assert cut is not None and trainer.publication.cut_report.read_sets == 1
        assert second["tensorhub/rank0/cut_mb"] * 2**20 == from_shards.nbytes  # one rank: all of the read set
        assert 0 < second["tensorhub/rank0/cut_peak_gather_mb"] * 2**20 <= 1 << 20
        rpc = ReferenceClient(server.address)
        try:
            (v2,) = [v for m in rpc.describe("tiny/policy").models for v in m.versions if v.version == 2]
        finally:
            rpc.close()
        assert sorted(r.trainer_cut for r in v2.replicas if r.origin) == [False, True]
        from_cut = _tp_reader_pull(tp0_next.hub, 2, make_weights(2), serve=False)
        assert from_cut.read_bytes == from_cut.nbytes == from_shards.nbytes
        # from the shards the column tensors cost whole rows or a READ per row; from the cut neither
        assert from_cut.read_bytes < from_shards.read_bytes or from_cut.descriptors < from_shards.descriptors
    finally:
        dist.destroy_process_group()


def test_a_bad_cut_setting_names_the_field():
    with pytest.raises(ValueError, match=r"TensorHubEngineConfig\.cut must be 'readers' or null, not 'reader'.*"
                                         r"engine_kwargs\.tensorhub\.cut"):
        TensorHubCheckpointEngine(bucket_size=0, address="127.0.0.1:1", model="m", cut="reader")
    with pytest.raises(ValueError, match=r"TensorHubEngineConfig\.cut_gather_bytes must be a positive"):
        TensorHubCheckpointEngine(bucket_size=0, address="127.0.0.1:1", model="m", cut="readers", cut_gather_bytes=0)
    with pytest.raises(ValueError, match=r"cut_gather_bytes only means something with cut: readers"):
        TensorHubCheckpointEngine(bucket_size=0, address="127.0.0.1:1", model="m", cut_gather_bytes=1 << 20)


def test_two_trainer_ranks_publish_the_readers_cut(engines, server):
    """Two trainer ranks of the engine, each in its own process (gloo world,
    as verl's FSDP workers), with ``cut: readers``. Step 1 goes as row shards,
    and two TP readers read it (the column tensors as whole rows) and serve
    it. Step 2: the ranks gather and publish those read sets beside their
    shards (a trainer-cut replica each), and new TP readers read exactly their
    bytes, byte-exact."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tensorhub.testing import rendezvous

    script = Path(__file__).with_name("verl_cut_rank.py")
    with rendezvous(2) as dist_env:  # the ranks' store lives as long as their group
        env = {**os.environ, **dist_env, "OMP_NUM_THREADS": "1"}
        ranks = [subprocess.Popen([sys.executable, str(script), server.address, str(r), "2"], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(2)]
        try:
            _two_ranks_cut(ranks, engines, server)
        finally:
            for proc in ranks:
                proc.kill()


def test_two_trainer_ranks_publish_together(engines, server):
    """``publish_together: true`` (with ``delta: off``): two trainer ranks in
    their own processes (gloo world) announce each step as one group and
    withdraw it as one: from the second step the server gets two Batches a
    step from the whole trainer and no Publish or Unpublish of a rank, and a
    rollout receives every step byte-exact."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tensorhub.client.rpc import ReferenceClient
    from tensorhub.testing import ask_ranks, rank_result, rendezvous

    script = Path(__file__).with_name("verl_cut_rank.py")
    rollout = engines()
    rpc = ReferenceClient(server.address)
    with rendezvous(2) as dist_env:
        env = {**os.environ, **dist_env, "OMP_NUM_THREADS": "1"}
        ranks = [subprocess.Popen([sys.executable, str(script), server.address, str(r), "2", "together"], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(2)]
        try:
            assert [rank_result(proc) for proc in ranks] == ["ready", "ready"]
            for step in (1, 2, 3):
                before = dict(rpc.describe().control.calls)
                ask_ranks(ranks, str(step))
                after = dict(rpc.describe().control.calls)
                sent = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
                sent.pop("Describe", None)
                sent.pop("Heartbeat", None)  # on their clock
                if step == 1:  # the first announces go whole, each rank its own
                    assert sent.get("Publish") == 2 and "Unpublish" not in sent, sent
                else:  # step-1 withdrawn by rank 0 for both in a Batch, both announces in another
                    assert sent.get("Batch") == 2 and "Publish" not in sent and "Unpublish" not in sent, sent
                assert_identical(receive(rollout, step), make_weights(step))
            for proc in ranks:
                proc.stdin.close()
            assert [proc.wait(timeout=120) for proc in ranks] == [0, 0]
        finally:
            rpc.close()
            for proc in ranks:
                proc.kill()


def test_publish_together_settings_name_the_field():
    with pytest.raises(ValueError, match=r"TensorHubEngineConfig\.publish_together: the ranks' group announce "
                                         r"carries no deltas; set .*engine_kwargs\.tensorhub\.delta to off"):
        TensorHubCheckpointEngine(bucket_size=0, address="127.0.0.1:1", model="m", publish_together=True)
    with pytest.raises(ValueError, match=r"TensorHubEngineConfig\.publish_together must be true or false"):
        TensorHubCheckpointEngine(bucket_size=0, address="127.0.0.1:1", model="m", publish_together="yes",
                                  delta="off")
    with pytest.raises(ValueError, match=r"TensorHubEngineConfig\.publish_together: an adapter version"):
        TensorHubCheckpointEngine(bucket_size=0, address="127.0.0.1:1", model="m", publish_together=True,
                                  delta="off", lora=True)


def _two_ranks_cut(ranks, engines, server):
    from tensorhub.client.rpc import ReferenceClient
    from tensorhub.testing import ask_ranks, rank_result

    def step(n):
        return ask_ranks(ranks, str(n))

    assert [rank_result(proc) for proc in ranks] == ["ready", "ready"]
    first = step(1)
    assert [m[f"tensorhub/rank{r}/cut_mb"] for r, m in enumerate(first)] == [0, 0]  # no readers yet
    readers = [engines(), engines()]
    from_shards = [_tp_reader_pull(h.hub, 1, make_weights(1), serve=True, worker=w) for w, h in enumerate(readers)]

    second = step(2)
    cut_bytes = [m[f"tensorhub/rank{r}/cut_mb"] * 2**20 for r, m in enumerate(second)]
    assert all(b > 0 for b in cut_bytes), cut_bytes  # a share for each rank
    rpc = ReferenceClient(server.address)
    try:
        (v2,) = [v for m in rpc.describe("tiny/policy").models for v in m.versions if v.version == 2]
    finally:
        rpc.close()
    assert sorted(r.trainer_cut for r in v2.replicas if r.origin) == [False, False, True, True]
    for w, p1 in enumerate(from_shards):
        got = _tp_reader_pull(engines().hub, 2, make_weights(2), serve=False, worker=w)
        print(f"reader {w}: step 1 (shards) {p1.read_bytes} B in {p1.descriptors} READs, step 2 (shards and "
              f"cuts) {got.read_bytes} B in {got.descriptors} READs, for {got.nbytes} B")
        assert got.nbytes == p1.nbytes
        # Exactly its bytes: reader 0's first chunk is the embedding's rows
        # (one cut holder) and a column slice (the other), all of it in rank
        # 0's row shard too; the two cut holders rank before that whole holder
        # (planner rule 2), which read wide was 1.16x the read set.
        assert got.read_bytes == got.nbytes < p1.read_bytes, (w, got.read_bytes, got.nbytes, p1.read_bytes)
    for proc in ranks:
        proc.stdin.close()
    assert [proc.wait(timeout=120) for proc in ranks] == [0, 0]
