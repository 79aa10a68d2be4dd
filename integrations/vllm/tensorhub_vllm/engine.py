"""The ``tensorhub`` weight-transfer backend: vLLM's native RL weight-update API
(``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``) with TensorHub as the transport.

Each worker pulls the bytes itself; only the version travels through vLLM's
control plane. ``update_weights`` does the whole update (pull, check, reload):
layer-wise reload starts only once every byte is in, so ``start_weight_update``
and ``finish_weight_update`` have nothing to do and a failed pull leaves the
engine serving its previous weights.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine

from tensorhub_vllm.config import TensorHubInitInfo, TensorHubUpdateInfo
from tensorhub_vllm.vllm_internals import end_weight_update_session
from tensorhub_vllm.worker import NotApplied, WorkerUpdater


class TensorHubWeightTransferEngine(WeightTransferEngine[TensorHubInitInfo, TensorHubUpdateInfo]):
    init_info_cls = TensorHubInitInfo
    update_info_cls = TensorHubUpdateInfo
    supports_draft_weight_update = False  # the layout comes from the main model's checkpoint

    _updater: WorkerUpdater | None = None
    _inits = 0  # every worker sees the same calls, so this agrees across ranks

    def parse_init_info(self, init_dict: dict[str, Any]) -> TensorHubInitInfo:
        return TensorHubInitInfo.from_dict(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> TensorHubUpdateInfo:
        return TensorHubUpdateInfo.from_dict(update_dict)

    def init_transfer_engine(self, init_info: TensorHubInitInfo) -> None:
        if self._updater is not None:  # a new trainer connection replaces the old one
            self._updater.close()
        self._inits += 1
        self._updater = WorkerUpdater(self.vllm_config, self.model, init_info, role=f"backend{self._inits}")

    def start_weight_update(self) -> None:
        """Nothing to prepare: the reload starts inside update_weights, after the pull."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises
        # on CPU; apply_checkpoint synchronizes where there is an accelerator.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except NotApplied:
            # Another worker raises the failure out of this RPC; this one ends
            # its update session as vLLM does when a backend raises.
            if not end_weight_update_session(self):
                raise

    def receive_weights(self, update_info: TensorHubUpdateInfo) -> None:
        if self._updater is None:
            raise RuntimeError("tensorhub: call init_weight_transfer_engine({'hub': ..., 'model': ...}) first")
        self._updater.update(update_info.version)

    def finish_weight_update(self) -> None:
        """Nothing to finalize: update_weights already completed the reload."""

    def shutdown(self) -> None:
        if self._updater is not None:
            self._updater.close()
            self._updater = None
