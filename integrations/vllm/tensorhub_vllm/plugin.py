"""vLLM general plugin (entry point group ``vllm.general_plugins``): registers
the ``tensorhub`` weight-transfer backend in every vLLM process, so
``weight_transfer_config={"backend": "tensorhub"}`` selects it; and its trainer
side with ``WeightTransferTrainerFactory``. On CPU it also asks Linux for the
AMX tile state that vLLM's kernels use without asking (``cpu_amx``)."""

from __future__ import annotations

import logging

from tensorhub_vllm.cpu_amx import request_amx_tile_state

BACKEND = "tensorhub"
SUPPORTED_VLLM = "0.32."  # vLLM's weight-transfer API changes between minor releases

log = logging.getLogger(__name__)


def register() -> None:
    """Idempotent: vLLM loads general plugins in each process, sometimes more than once."""
    import vllm
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # vLLM's CPU kernels use AMX without asking Linux for it (SIGILL): see cpu_amx
        request_amx_tile_state()

    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        log.warning("tensorhub_vllm is tested with vLLM %sx only; this is vLLM %s", SUPPORTED_VLLM, vllm.__version__)

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "tensorhub_vllm.engine", "TensorHubWeightTransferEngine")
    except ValueError:  # "already registered": the factory has no public lookup, and raises on a second call
        log.debug("weight-transfer backend %r was already registered", BACKEND)
    register_trainer()


def register_trainer() -> None:
    """The trainer side (``WeightTransferTrainerFactory``), idempotent. Trainer
    processes load no vLLM plugins: importing ``tensorhub_vllm.trainer`` calls this."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    try:
        WeightTransferTrainerFactory.register_engine(BACKEND, "tensorhub_vllm.trainer",
                                                     "TensorHubTrainerWeightTransferEngine")
    except ValueError:
        log.debug("trainer weight-transfer backend %r was already registered", BACKEND)
