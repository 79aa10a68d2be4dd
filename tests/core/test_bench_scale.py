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
from tensorhub.bench.scale.models import MODELS, Tensor, manifest, parameters, tensors
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


def test_link_model_adds_up():
    link = BACKENDS["rdma"]
    p = links.predict(engines=16, trainer_ranks=64, tp=8, bytes_per_gpu=50 << 30, first_hop_s=1.5,
                      first_hop_read_bytes=60 << 30, chunk=64 << 20, link=link, control_plane_s=0.1)
    assert p.wave0_engines == 8 and p.depth == 1
    assert math.isclose(p.link_limit_s, (50 << 30) / link.bandwidth)
    assert p.predicted_s >= p.link_limit_s + 0.1 and p.first_hop_s >= 1.5


def test_bench_scale_runs_through_the_real_server(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tensorhub.cli", "bench", "scale", "--models", "qwen3-30b-a3b",
                          "--engines", "2", "--trainer-ranks", "16", "--sample", "2", "--out", str(tmp_path)],
                         check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((tmp_path / "scale.json").read_text())
    [row] = data["results"]
    for key in ("model", "gpus", "engines", "trainer_ranks", "predicted_s", "link_limit_s", "control_plane_s",
                "resolve_response_bytes_max", "server_bytes_per_replica_max", "descriptors_per_reader_max"):
        assert key in row, key
    assert (row["gpus"], row["engines"], row["trainer_ranks"]) == (16, 2, 16)
    assert row["resolve_holders_first"] == 16  # every FSDP rank holds some rows a TP worker needs
    assert 0 < row["link_limit_s"] <= row["predicted_s"]
    assert row["publish_request_bytes"] < 8192 < row["publish_request_bytes_first"]  # by fingerprint after the first
    assert (tmp_path / "scale.png").stat().st_size > 10_000
