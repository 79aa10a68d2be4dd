"""Loading a received version into a running vLLM model."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.model_loader.reload.inplace import reload_weights

from tensorhub_vllm.vllm_internals import moe_finalize_on_update


def apply_checkpoint(vllm_config: VllmConfig, model: torch.nn.Module,
                     weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-format ``weights`` into ``model`` with vLLM's layer-wise
    reload (initialize, load, finalize): the model's own loaders run on them
    (on ``readset.ViewTensor``s where only slices were pulled). On CPU this is
    the path that works: linear layers repack their weights after loading and
    leave an empty parameter behind, so a bare ``model.load_weights`` fails or
    changes nothing. MoE layers on CPU also repack their experts, which vLLM's
    reload alone skips (``vllm_internals.moe_finalize_on_update``)."""
    with set_current_vllm_config(vllm_config), torch.no_grad(), moe_finalize_on_update(model):
        reload_weights(vllm_config, model, weights_iterator=iter(weights), weights_path=None,
                       is_checkpoint_format=True)
    if torch.accelerator.is_available():  # CPU-only builds have none, and synchronize() raises there
        torch.accelerator.synchronize()  # the next step must see the new weights
