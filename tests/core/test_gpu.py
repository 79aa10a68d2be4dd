"""The VRAM path: the same code with CUDA tensors. Needs a CUDA GPU; skipped
on machines without one (the CPU suite covers DRAM with the same code)."""

from __future__ import annotations

import pytest
import torch

from tensorhub import Hub
from tensorhub.server import EmbeddedServer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (VRAM path)"),
]


def test_publish_and_pull_cuda_tensors_in_place():
    with EmbeddedServer() as server, Hub.connect(server.address, name="gpu-trainer") as trainer, \
            Hub.connect(server.address, name="gpu-rollout") as rollout:
        src = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(7, device="cuda", dtype=torch.bfloat16)}
        trainer.publish("m", 1, src)
        into = {k: torch.empty_like(v) for k, v in src.items()}
        result = rollout.pull("m", 1, into=into)
        torch.cuda.synchronize()
        assert all(torch.equal(into[k], src[k]) for k in src)
        assert result.tensors["w"].data_ptr() == into["w"].data_ptr()


def test_cuda_row_shards_pull_a_column_slice_onto_the_device():
    from tensorhub import Manifest, Shard

    full = torch.randn(512, 256, device="cuda")
    with EmbeddedServer() as server, Hub.connect(server.address, name="gpu-rank0") as rank0, \
            Hub.connect(server.address, name="gpu-rank1") as rank1, \
            Hub.connect(server.address, name="gpu-tp0") as reader:
        manifest = Manifest.of({"w": full})
        # Each rank's rows in memory of its own (two agents of one process must not share a buffer).
        rank0.publish("m", 1, {"w": Shard(full[:200].clone(), (512, 256), rows=(0, 200))}, manifest=manifest)
        rank1.publish("m", 1, {"w": Shard(full[200:].clone(), (512, 256), rows=(200, 512))}, manifest=manifest)
        dest = torch.empty(512, 128, device="cuda")
        result = reader.pull("m", 1, into={"w": Shard(dest, (512, 256), cols=(0, 128))})
        torch.cuda.synchronize()
        assert torch.equal(dest, full[:, :128])
        assert result.nbytes == dest.numel() * 4 == sum(result.bytes_by_source.values())
