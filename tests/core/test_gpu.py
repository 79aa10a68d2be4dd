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
