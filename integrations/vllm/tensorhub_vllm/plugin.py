"""vLLM general plugin (entry point group ``vllm.general_plugins``): registers
the ``tensorhub`` weight-transfer backend in every vLLM process, so
``weight_transfer_config={"backend": "tensorhub"}`` selects it."""

from __future__ import annotations

BACKEND = "tensorhub"


def register() -> None:
    """Idempotent: vLLM loads general plugins in each process, sometimes more than once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "tensorhub_vllm.engine", "TensorHubWeightTransferEngine")
    except ValueError:  # "already registered": the factory has no public lookup, and raises on a second call
        pass
