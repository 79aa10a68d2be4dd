"""Worker extension for frameworks that drive engines through ``collective_rpc``
(verl, OpenRLHF): ``--worker-extension-cls tensorhub_vllm.extension.TensorHubWorkerExtension``.

    llm.collective_rpc("tensorhub_init", args=({"hub": "10.0.0.1:50051", "model": "policy"},))
    llm.collective_rpc("tensorhub_update", args=(7,))       # -> [7, 7, ...] one per worker
    llm.collective_rpc("tensorhub_version")                 # -> [7, 7, ...]

Merged mode, for engines served without LoRA support: with ``"merge_adapter":
"policy/lora/math"`` in the init info, ``tensorhub_update_adapter(v)`` pulls
only adapter version v and loads the base (the version last updated to, kept
in the staging) merged with it; base updates after it keep it merged.

LoRA adapter versions (``tensorhub_adapters_*``) are driven by
``tensorhub_vllm.adapter_versions.AdapterVersions``, not by hand.

Same guarantees as the ``tensorhub`` backend: the whole version is received and
checked before the first parameter changes, all workers of the engine load the
same version (group pull), and the received copy is served until the next update.
Every method starts with ``tensorhub_`` so none clashes with a worker attribute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensorhub import PullResult
from tensorhub_vllm.adapters import WorkerAdapters
from tensorhub_vllm.config import TensorHubAdapterInfo, TensorHubInitInfo, TensorHubUpdateInfo
from tensorhub_vllm.worker import NotApplied, WorkerUpdater


class TensorHubWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    _tensorhub: WorkerUpdater | None = None
    _tensorhub_adapters: WorkerAdapters | None = None
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
        try:
            return self._tensorhub.update(TensorHubUpdateInfo.from_dict({"version": version}).version)
        except NotApplied:  # the engine's last worker raises the failure out of this RPC
            return self._tensorhub.version

    def tensorhub_update_adapter(self, version: int | str = "latest") -> int | None:
        """Merged mode (``merge_adapter`` in the init info): pull only adapter
        ``version`` and load the base merged with it; returns the adapter
        version this worker now has merged."""
        if self._tensorhub is None:
            raise RuntimeError("tensorhub: call collective_rpc('tensorhub_init', args=({...},)) first")
        try:
            return self._tensorhub.update_adapter(TensorHubUpdateInfo.from_dict({"version": version}).version)
        except NotApplied:  # the engine's last worker raises the failure out of this RPC
            return None if self._tensorhub.adapter is None else self._tensorhub.adapter.version

    def tensorhub_version(self) -> int | None:
        return None if self._tensorhub is None else self._tensorhub.version

    def _tensorhub_updater(self, which: str) -> WorkerUpdater | None:
        if which == "extension":
            return self._tensorhub
        if which == "backend":  # the weight-transfer backend's, when the engine runs ours
            return getattr(getattr(self, "weight_transfer_engine", None), "_updater", None)
        raise ValueError(f"tensorhub: which must be 'extension' or 'backend', not {which!r}")

    def tensorhub_stats(self, which: str = "extension") -> dict[str, Any]:
        """The last update of this worker (through the extension or the
        ``tensorhub`` backend): seconds pulling (and checking), seconds
        applying, bytes pulled and from whom (agent name -> bytes); this worker's
        read set against the checkpoint; its own agent name; ``delta_from``:
        the version whose deltas it patched (None: read whole), and the bytes
        it read (``read_bytes``: the deltas' then, against ``nbytes``) and the
        READ descriptors that took (``descriptors``); the pull's ``path``
        ("replayed": an earlier pull's plan), whether the server answered with
        the holders it named (``named``), its ``refreshes``, and why it was not
        replayed (``not_replayed``)."""
        u = self._tensorhub_updater(which)
        return {} if u is None else {
            "pull_s": u.pull_s, "apply_s": u.apply_s, "nbytes": u.nbytes, "bytes_by_source": dict(u.bytes_by_source),
            "read_set_nbytes": u.read_set.nbytes(), "checkpoint_nbytes": u.read_set.checkpoint_nbytes(),
            "agent": u.receiver.hub.name, "delta_from": u.delta_from, "read_bytes": u.read_bytes,
            "descriptors": u.descriptors, **_pull_path(u.last_pull)}

    def tensorhub_read_set(self, which: str = "extension") -> dict[str, Any]:
        """This worker's read set: the boxes it reads per tensor (absent: whole),
        why a tensor is read whole although its loader may need less, the
        bytes read beyond the loaders' boxes to read whole rows (``widened``),
        and the tensors no loader of this worker reads (``unread``: one element each)."""
        u = self._tensorhub_updater(which)
        return {} if u is None else {"boxes": {n: [[list(r) for r in b] for b in bs] for n, bs in u.read_set.boxes.items()},
                                     "fallbacks": dict(u.read_set.fallbacks), "widened": dict(u.read_set.widened),
                                     "unread": list(u.read_set.unread)}

    def tensorhub_close(self) -> None:
        if self._tensorhub is not None:
            self._tensorhub.close()
            self._tensorhub = None

    # ------------------------------------------------------------ LoRA adapters

    def tensorhub_adapters_init(self, info: dict[str, Any]) -> None:
        parsed = TensorHubAdapterInfo.from_dict(info)
        if self._tensorhub_adapters is not None:
            self._tensorhub_adapters.close()
        self._tensorhub_adapters = WorkerAdapters(self, parsed)

    def _tensorhub_adapters_or_fail(self) -> WorkerAdapters:
        if self._tensorhub_adapters is None:
            raise RuntimeError("tensorhub: call collective_rpc('tensorhub_adapters_init', args=({...},)) first")
        return self._tensorhub_adapters

    def tensorhub_adapters_load(self, model: str, version: int, drop: Sequence[int] = ()) -> int:
        """Drop the retired versions ``drop`` of ``model`` (the driver's, no use
        holds them), then pull ``version`` and register it; on error the
        versions held and not dropped stay served."""
        adapters = self._tensorhub_adapters_or_fail()
        for retired in drop:
            adapters.drop(model, retired)
        return adapters.load(model, version)

    def tensorhub_adapters_drop(self, model: str, versions: int | Sequence[int]) -> bool:
        """Forget ``versions`` of ``model`` (one, or several in one RPC); whether any was held."""
        adapters = self._tensorhub_adapters_or_fail()
        dropped = [adapters.drop(model, v) for v in ([versions] if isinstance(versions, int) else versions)]  # every one
        return any(dropped)

    def tensorhub_adapters_stats(self) -> dict[str, Any]:
        """Adapter ids this worker holds in memory, those in vLLM's adapter
        cache now (``list_loras``), and the last load's bytes and timing."""
        a = self._tensorhub_adapters
        return {} if a is None else {"held": a.held_ids(), "cached": sorted(self.list_loras()),  # type: ignore[attr-defined]
                                     "last": dict(a.last), "agent": a.hub.name}

    def tensorhub_adapters_close(self) -> None:
        if self._tensorhub_adapters is not None:
            self._tensorhub_adapters.close()
            self._tensorhub_adapters = None


def _pull_path(pull: PullResult | None) -> dict[str, Any]:
    """How the last pull went: its path, whether its holders were named, its refreshes, why not replayed."""
    if pull is None:
        return {"path": "", "named": False, "refreshes": 0, "not_replayed": ""}
    return {"path": pull.path, "named": pull.named, "refreshes": pull.refreshes, "not_replayed": pull.not_replayed}
