"""The CUDA path: a worker's read set pulled into staging in GPU memory (no
detour through host memory) and replayed into a model on the GPU. Skipped
without a CUDA GPU; on CPU the same code runs with host staging (the TP=2
engine tests)."""

from __future__ import annotations

import pytest
import torch
from tensorhub_vllm.readset import dry_run
from test_vllm_readset import CHECKPOINT, Toy, _expected

from tensorhub import Hub
from tensorhub.server import EmbeddedServer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device staging)"),
]


@pytest.mark.parametrize("overread", [0.0, 1.0])  # exact boxes; columns read as whole rows
@pytest.mark.parametrize("rank", [0, 1])
def test_read_set_is_pulled_into_gpu_memory_and_replayed(rank, overread):
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    device = torch.device("cuda")
    with device:
        model = Toy(rank).to(device)
        record_metadata_for_reloading(model)
    layout = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in CHECKPOINT.items()}
    read_set = dry_run(model, layout, device).coalesced(overread)
    staged = read_set.allocate(device)
    assert all(s.tensor.is_cuda for v in staged.values() for s in (v if isinstance(v, list) else []))
    with EmbeddedServer() as server, Hub.connect(server.address, name="trainer") as trainer, \
            Hub.connect(server.address, name="worker") as worker:
        trainer.publish("toy", 1, CHECKPOINT)  # host memory; the worker reads it into VRAM
        result = worker.pull("toy", 1, into=staged)
        assert result.nbytes == read_set.nbytes() < read_set.checkpoint_nbytes()
    with device:
        initialize_layerwise_reload(model)
        model.load_weights(read_set.weights(staged, device))
        finalize_layerwise_reload(model, None)
    for name, want in _expected(rank).items():
        assert torch.equal(getattr(model, name).cpu(), want), name
