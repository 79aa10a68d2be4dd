"""Worker extension for frameworks that drive engines through ``collective_rpc``
(verl, OpenRLHF): ``--worker-extension-cls tensorhub_vllm.extension.TensorHubWorkerExtension``.

    llm.collective_rpc("tensorhub_init", args=({"hub": "10.0.0.1:50051", "model": "policy"},))
    llm.collective_rpc("tensorhub_update", args=(7,))       # -> [7, 7, ...] one per worker
    llm.collective_rpc("tensorhub_version")                 # -> [7, 7, ...]

Same guarantees as the ``tensorhub`` backend: the whole version is received and
checked before the first parameter changes, all workers of the engine load the
same version (group pull), and the received copy is served until the next update.
Every method starts with ``tensorhub_`` so none clashes with a worker attribute.
"""

from __future__ import annotations

from typing import Any

from tensorhub_vllm.config import TensorHubInitInfo, TensorHubUpdateInfo
from tensorhub_vllm.worker import WorkerUpdater


class TensorHubWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    _tensorhub: WorkerUpdater | None = None
    _tensorhub_inits = 0  # every worker sees the same calls, so this agrees across ranks

    def tensorhub_init(self, init_info: dict[str, Any]) -> None:
        info = TensorHubInitInfo.from_dict(init_info)
        if self._tensorhub is not None:
            self._tensorhub.close()
        self._tensorhub_inits += 1
        self._tensorhub = WorkerUpdater(self.vllm_config, self.model_runner.get_model(),  # type: ignore[attr-defined]
                                        info, role=f"extension{self._tensorhub_inits}")

    def tensorhub_update(self, version: int | str = "latest") -> int:
        """Pull and load ``version``; returns the version this worker now serves."""
        if self._tensorhub is None:
            raise RuntimeError("tensorhub: call collective_rpc('tensorhub_init', args=({...},)) first")
        return self._tensorhub.update(TensorHubUpdateInfo.from_dict({"version": version}).version)

    def tensorhub_version(self) -> int | None:
        return None if self._tensorhub is None else self._tensorhub.version

    def tensorhub_stats(self) -> dict[str, float]:
        """Timings of the last update: seconds pulling (and checking), seconds applying, bytes."""
        u = self._tensorhub
        return {} if u is None else {"pull_s": u.pull_s, "apply_s": u.apply_s, "nbytes": u.nbytes}

    def tensorhub_close(self) -> None:
        if self._tensorhub is not None:
            self._tensorhub.close()
            self._tensorhub = None
