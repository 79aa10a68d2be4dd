"""``tensorhub bench scale``: the cut rules match vLLM's and FSDP's cuts, the
descriptor count of the first hop is the real overlap code's, the link model
adds up, and a small run through the real server writes the JSON the issue
asks for."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import torch

from tensorhub.bench.scale import cuts, links
from tensorhub.bench.scale.models import MODELS, Config, Tensor, manifest, parameters, tensors
from tensorhub.pacing import ASK_WITH_NEWS_S
from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import wire
from tensorhub.regions import Region, overlap
from tensorhub.regiontable import shapes_of, table_of_rules
from tensorhub.transport.cost import BACKENDS


def test_models_have_their_published_parameter_counts():
    got = {k: round(parameters(tensors(c)) / 1e9, 1) for k, c in MODELS.items()}
    assert got == {"qwen3-30b-a3b": 30.5, "qwen3-235b-a22b": 235.1, "deepseek-v3": 671.0, "kimi-k2": 1026.4}
    assert len(tensors(MODELS["qwen3-30b-a3b"])) == 18_867  # layers * (9 + 3E) + 3, as the checkpoint has


def test_rules_cut_as_torch_chunk_and_vllm_narrow():
    model = [Tensor("a", (512, 64), "rows"), Tensor("b", (64, 512), "cols"), Tensor("k", (512, 64), "kv"),
             Tensor("n", (64,), "whole")]
    shapes = shapes_of(manifest(model))
    kinds = np.array([cuts.KINDS.index(t.tp) for t in model])
    for w in range(cuts.TP):
        table = table_of_rules(*cuts.worker_rules(kinds, 4, w), shapes)
        for k, t in enumerate(model):
            assert table.region(k, shapes) in (Region(box=cuts.worker_box(t, 4, w)), Region())
            if t.tp != "whole":
                assert table.region(k, shapes) == Region(box=cuts.worker_box(t, 4, w))
    dims0 = shapes.dims[:, 0]
    for r in (0, 3, 63):
        table = table_of_rules(*cuts.trainer_rules(dims0, 64, r), shapes)
        for k, i in enumerate(table.tensor.tolist()):
            piece = torch.arange(model[i].shape[0]).chunk(64)[r]  # FSDP2 Shard(0)
            assert table.region(k, shapes).bounds(model[i].shape)[0] == (int(piece[0]), int(piece[-1]) + 1)


def test_first_hop_descriptors_are_the_overlap_codes_runs():
    model = [Tensor("down", (96, 64), "cols"), Tensor("gate", (64, 96), "rows"), Tensor("norm", (96,), "whole")]
    exact = BACKENDS["rdma"].__class__("exact", 0.0, 1.0, 1e30)  # bytes cost everything: no wide reads
    hop = cuts.first_hop(model, 4, 0, 1, exact)
    want = 0
    for t in model:
        reader = Region(box=cuts.worker_box(t, 0, 1))
        for r in range(4):
            piece = torch.arange(t.shape[0]).chunk(4)[r]
            holder = Region.of(t.shape, rows=(int(piece[0]), int(piece[-1]) + 1))
            want += len(overlap(reader.runs(t.shape), holder.runs(t.shape)).start)
    assert hop.exact_descriptors == hop.descriptors == want
    assert hop.wanted_bytes == hop.read_bytes == 2 * (96 * 8 + 8 * 96 + 96)
    wide = cuts.first_hop(model, 4, 0, 1, BACKENDS["rdma"])  # 192-byte rows: whole rows are cheaper
    assert wide.descriptors < want and wide.read_bytes > wide.wanted_bytes


def _tiny_moe(experts: int) -> tuple[Config, list[Tensor]]:
    cfg = Config("tiny", 256, 64, 2, 1, experts, 32, 8, dense_inter=64, shared_experts=1)  # MLA, one dense layer
    return cfg, tensors(cfg)


def test_ep_workers_hold_their_experts_whole_as_torch_chunk_cuts_the_expert_dim():
    """An FSDP2 trainer's fused ``down_proj [E, H, I]`` under vLLM's EP=8: worker w
    holds ``chunk(8, dim=0)[w]`` of the experts, whole, and nothing of the rest;
    the server's rules say the same; everything but routed experts is cut as TP."""
    cfg, model = _tiny_moe(16)
    shapes = shapes_of(manifest(model))
    kinds = np.array([cuts.KINDS.index(t.tp) for t in model])
    owner = cuts.owners(model, cfg.experts)
    held_by = {}
    for w in range(cuts.TP):
        mine = set(torch.arange(cfg.experts).chunk(cuts.TP, dim=0)[w].tolist())
        table = table_of_rules(*cuts.worker_rules(kinds, 0, w, owner), shapes)
        region = {int(i): table.region(k, shapes) for k, i in enumerate(table.tensor.tolist())}
        for i, t in enumerate(model):
            box = cuts.worker_box(t, 0, w, cfg.experts)
            if t.expert < 0:
                assert box == cuts.worker_box(t, 0, w)
            elif t.expert in mine:
                assert box == tuple((0, d) for d in t.shape)
                held_by.setdefault((t.name, t.expert), []).append(w)
            else:
                assert box is None
            if box is None:
                assert i not in region, t.name
            else:
                assert region[i] in (Region(box=box), Region()), t.name
                if box != tuple((0, d) for d in t.shape):
                    assert region[i] == Region(box=box), t.name
    experts = [t for t in model if t.expert >= 0]
    assert len(held_by) == len(experts) and all(len(ws) == 1 for ws in held_by.values())  # each once
    # E not a multiple of 8: vLLM gives the first E % 8 workers one more (torch.chunk would not)
    assert [sum(cuts.expert_owner(e, 10) == w for e in range(10)) for w in range(8)] == [2, 2, 1, 1, 1, 1, 1, 1]


def test_ep_first_hop_is_one_contiguous_read_per_rank_and_expert():
    """Whole experts out of FSDP rows: each rank's rows of an expert are one run
    on both sides, so EP reads them exactly, one descriptor each, where TP reads
    a column per row (or whole rows, more bytes)."""
    cfg, model = _tiny_moe(16)
    ranks = 4
    exact = BACKENDS["rdma"].__class__("exact", 0.0, 1.0, 1e30)
    experts_only = [t for t in model if t.expert >= 0]
    hop = cuts.first_hop(experts_only, ranks, 0, 1, exact, cfg.experts)
    want = 0
    for t in experts_only:
        box = cuts.worker_box(t, 0, 1, cfg.experts)
        if box is None:
            continue
        for r in range(ranks):
            piece = torch.arange(t.shape[0]).chunk(ranks)[r]
            holder = Region.of(t.shape, rows=(int(piece[0]), int(piece[-1]) + 1))
            assert len(overlap(Region(box=box).runs(t.shape), holder.runs(t.shape)).start) == 1
            want += 1
    mine = [t for t in experts_only if cuts.expert_owner(t.expert, cfg.experts) == 1]
    assert want == ranks * len(mine) == hop.exact_descriptors == hop.descriptors
    assert hop.wanted_bytes == hop.read_bytes == 2 * sum(math.prod(t.shape) for t in mine)
    rdma = cuts.first_hop(experts_only, ranks, 0, 1, BACKENDS["rdma"], cfg.experts)
    assert (rdma.descriptors, rdma.read_bytes) == (hop.descriptors, hop.wanted_bytes)  # nothing to widen
    tp = cuts.first_hop(experts_only, ranks, 0, 1, exact)
    assert tp.wanted_bytes == hop.wanted_bytes and tp.exact_descriptors > 10 * hop.exact_descriptors


def test_link_model_adds_up():
    link = BACKENDS["rdma"]
    p = links.predict(engines=16, trainer_ranks=64, tp=8, bytes_per_gpu=50 << 30, first_hop_s=1.5,
                      first_hop_read_bytes=60 << 30, chunk=64 << 20, link=link, control_plane_s=0.1)
    assert p.wave0_engines == 8 and p.depth == 1
    assert math.isclose(p.link_limit_s, (50 << 30) / link.bandwidth)
    assert p.predicted_s >= p.link_limit_s + 0.1 and p.first_hop_s >= 1.5


def test_bench_scale_runs_through_the_real_server(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tensorhub.cli", "bench", "scale", "--models", "qwen3-30b-a3b",
                          "--engines", "4", "--trainer-ranks", "16", "--sample", "2", "--trainer-cut",
                          "--out", str(tmp_path)],
                         check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((tmp_path / "scale.json").read_text())
    rows = {row["layout"]: row for row in data["results"]}
    assert len(data["results"]) == 2 and set(rows) == {"tp", "ep"}  # both layouts by default
    for row in rows.values():
        for key in ("model", "gpus", "engines", "trainer_ranks", "predicted_s", "link_limit_s", "control_plane_s",
                    "resolve_response_bytes_max", "server_bytes_per_replica_max", "descriptors_per_reader_max"):
            assert key in row, key
        assert (row["gpus"], row["engines"], row["trainer_ranks"]) == (32, 4, 16)
        assert row["wave0_engines"] == 2  # engines 2 and 3 relay from 0 and 1
        assert row["resolve_holders_first"] == 16  # every FSDP rank holds some rows any worker needs
        assert 0 < row["link_limit_s"] <= row["predicted_s"]
        assert row["publish_request_bytes"] < 8192 < row["publish_request_bytes_first"]  # by fingerprint after the first
        # The steady stage: every reader's messages sent for real, every holder lean, small answers.
        # Version 2 ranked: one Resolve per engine (its first worker asks for all), at the start and
        # once relays hold it. Version 3 (the steady state): one, naming the holders it read before.
        engines, ranks = row["engines"], row["trainer_ranks"]
        assert row["steady_first_resolves"] == 2 * engines and row["steady_resolves"] == engines
        assert row["steady_answers_named"] == engines
        # Every message of a steady version, as the server counted them: one Batch of every trainer
        # rank's withdrawals of its cut and its shards of the version before, sent by rank 0 (32 of them
        # here, MAX_BATCH a Batch); one Batch of every rank's shards and share of the readers' cut
        # (--trainer-cut), sent by rank 0, and its ask for the cut; per engine
        # one Resolve (with its relays' withdrawals of the version before and their announces of this
        # one: tensorhub.client.ahead) and one Batch (their complete reports and pulled bytes with the
        # answer's lease: tensorhub.client.engineshare).
        assert 2 * ranks <= wire.MAX_BATCH and row["announce_ahead"]
        assert row["steady_messages_by_method"] == {"ReaderCuts": 1, "Batch": 2 + engines, "Resolve": engines}
        assert row["steady_messages"] == 3 + 2 * engines
        # Their pulls are shorter than a pace: no report or ask of their own between (``_pull_messages``)
        assert row["steady_pull_s"] < ASK_WITH_NEWS_S and row["steady_pull_reports"] == row["steady_pull_asks"] == 0
        assert row["steady_server_cpu_withdraw_s"] >= 0  # measured apart (in 10 ms ticks: it may read 0 here)
        # The cut: one contiguous READ per region read (a tensor each), after the ranks gathered their shares.
        assert row["trainer_cut"] and 0 < row["cut_descriptors_per_reader"] <= row["tensors"]
        assert row["cut_gather_s"] > 0 and row["cut_share_bytes_max"] * ranks >= 2 * row["parameters"]  # bf16
        # Cut holders hold each tensor in its readers' boxes, alike per shape: the server keeps few groups,
        # so a steady version's publishes and resolves stay cheap (before: a group per tensor, 2 s here).
        assert row["steady_server_cpu_s"] < 1.0
        assert row["steady_holders_full"] == 0 and row["steady_holders_lean"] > 0
        assert row["steady_answer_bytes_max"] <= 4096 < row["resolve_response_bytes_max"]
        # Every holder of the largest steady answer sent packed, ~7 bytes each (one CRC a chunk is 4 of
        # them): at Kimi-K2's 512 holders that kept a ranked answer under 4 KiB (issue 47).
        # Named (version 3): wave 0 is told of the cut alone, the engines behind it of their relay's 8 workers.
        assert 0 < row["steady_answer_holders_packed"] == row["steady_answer_holders"] <= ranks
        # A relay's row while it fills carries its bitmap too (a bit a 64 MiB chunk: ~15 B here).
        assert row["steady_answer_bytes_per_holder"] <= 32, row["steady_answer_bytes_per_holder"]
        assert row["steady_server_cpu_s"] >= 0 and row["steady_predicted_s"] <= row["predicted_s"]
    tp, ep = rows["tp"], rows["ep"]
    assert ep["bytes_per_gpu"] == tp["bytes_per_gpu"]  # 1/8 of every expert's bytes either way
    assert ep["descriptors_per_reader_max"] < tp["descriptors_per_reader_max"]
    assert ep["first_hop_read_bytes"] < tp["first_hop_read_bytes"] and ep["first_hop_s"] < tp["first_hop_s"]
    # Under TP the cut spares the first hop its whole rows: the steady versions' first hop is shorter.
    assert tp["steady_first_hop_s"] < tp["first_hop_s"] and tp["cut_descriptors_per_reader"] == tp["tensors"] < \
        tp["descriptors_exact_runs"]
    assert (tmp_path / "scale.png").stat().st_size > 10_000


def test_bench_scale_refuses_an_unknown_layout():
    out = subprocess.run([sys.executable, "-m", "tensorhub.cli", "bench", "scale", "--layouts", "tp,dp"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown layout" in out.stderr, out.stderr


def test_ranks_publishing_together_without_the_cut_send_two_batches_a_step(tmp_path):
    """``--trainer-group`` (``Hub.publish(trainer_group=)``): no cut, but every
    rank's withdrawals and announces go in Batches sent by rank 0, not a
    Publish and an Unpublish per rank. (With ``--announces-apart``, as before
    the engines' announces went with their Resolve.)"""
    out = subprocess.run([sys.executable, "-m", "tensorhub.cli", "bench", "scale", "--models", "qwen3-30b-a3b",
                          "--engines", "2", "--trainer-ranks", "16", "--sample", "2", "--layouts", "ep",
                          "--trainer-group", "--announces-apart", "--out", str(tmp_path)],
                         check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = json.loads((tmp_path / "scale.json").read_text())["results"]
    engines = row["engines"]
    assert row["trainer_group"] and row["steady_answers_named"] == engines and not row["announce_ahead"]
    # (--announces-apart: each engine's relays' announces in a Batch of their own, beside its end's)
    assert row["steady_messages_by_method"] == {"Batch": 2 + 2 * engines, "Resolve": engines}


class _Stub:
    """The server's side of ``_pull_messages``: what it was sent, and a pace in each answer."""

    def __init__(self, pace_s: float) -> None:
        self.pace_s, self.reports, self.asks = pace_s, [], 0

    def ReportChunks(self, request, timeout):
        self.reports.append((request.agent_id, len(request.chunks)))

    def Resolve(self, request, timeout):
        self.asks += 1
        return pb.ResolveResponse(pace_s=self.pace_s)


def test_a_named_relays_own_reports_follow_the_clients_pace_and_the_servers():
    from tensorhub.bench.scale.run import _pull_messages
    from tensorhub.pacing import ASK_WITH_NEWS_S

    chunks = [100] * 8
    # The engine's answer said 0: the client's own pace, from one pace in; no asks (named)
    stub = _Stub(0.0)
    sent = _pull_messages(stub, 0, 3, chunks, 7.0, 0.0)
    times = [k * ASK_WITH_NEWS_S for k in range(1, 100) if k * ASK_WITH_NEWS_S < 7.0]
    assert sent == {"reports": len(times) * 8, "asks": 0} and stub.asks == 0
    assert [n for agent, n in stub.reports if agent == "engine0.0"] == [int(100 * t / 7.0) + 1 for t in times]
    # The server's pace longer than the pull (1,024 relays: ~20 s): nothing between the announce and the end
    assert _pull_messages(_Stub(0.0), 0, 3, chunks, 7.0, 20.0) == {"reports": 0, "asks": 0}
    # In between: every 3 s
    assert _pull_messages(_Stub(0.0), 0, 3, chunks, 7.0, 3.0)["reports"] == 2 * 8
