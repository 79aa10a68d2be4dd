"""Receiving a worker's read set of each version into staging memory on the
worker's own device (GPU memory under CUDA, host memory on CPU), apart from the
model.

Every byte of the read set lands and is checked against the model's layout
before the first parameter changes: a failed pull (dead source, manifest
mismatch, timeout) leaves the engine serving the weights it had.

    update(v) ──▶ withdraw previous replica ─┐
              └─▶ resolve v, check layout ────┴─▶ pull v into staging ──▶ apply
                  (at once: the withdrawal         (serve=True: peers may   (vLLM's layer-
                   drains peers' reads; in an       read it as it fills)     wise reload)
                   engine's share, one Batch for
                   all its workers: engineshare)

With ``serve`` on, the staging buffer stays published as a replica of exactly
those regions of the version the engine runs until the next update, so worker k
of another engine with the same layout can pull its slices from worker k of
this one, even after the trainer withdrew its own copy.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from tensorhub import GroupAnswer, Hub, HubConfig, ManifestMismatch, Publication, PullResult, experts
from tensorhub.client.engineshare import Withdrawal
from tensorhub.manifest import Manifest
from tensorhub_vllm.config import TensorHubInitInfo
from tensorhub_vllm.groupshare import engine_share
from tensorhub_vllm.readset import ReadSet

log = logging.getLogger(__name__)

# safetensors header dtype names -> torch
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def checkpoint_layout(model_dir: str | os.PathLike, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors a version must hold to load into this model: names and shapes
    of its safetensors checkpoint, floating tensors in the engine's ``dtype``.
    Returned as meta tensors (no memory). Reads only the files' headers."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {model_dir}: the tensorhub backend takes the layout of a version from the "
            "model's safetensors checkpoint")
    layout: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                entry = f.get_slice(name)
                stored = _ST_DTYPES[entry.get_dtype()]
                layout[name] = torch.empty(entry.get_shape(), dtype=dtype if stored.is_floating_point else stored,
                                           device="meta")
    return dict(sorted(layout.items()))


def model_dir(model: str, download_dir: str | None = None) -> str:
    """The local directory of a vLLM ``model`` argument (a path or a cached hub id)."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(model, cache_dir=download_dir, local_files_only=True)


class VersionReceiver:
    """Pulls one worker's read set of each version of one model (the whole
    checkpoint when no ``read_set`` is given).

    All workers of an engine share ``group`` and call ``receive`` once per
    update, in the same order, so the counter they pass as ``group_round``
    agrees and the hub hands each of them the same version; with
    ``share_resolve`` (and ``world_size`` > 1) the first resolves for all
    (``groupshare``).
    """

    def __init__(self, info: TensorHubInitInfo, layout: dict[str, torch.Tensor], *, group: str, name: str,
                 read_set: ReadSet | None = None, device: torch.device | str = "cpu", world_size: int = 1) -> None:
        self.info = info
        self.group = group
        self.read_set = read_set or ReadSet(layout=layout, boxes={}, fallbacks={})
        self.device = torch.device(device)
        self._staging: dict | None = None
        self._staging_holds: int | None = None  # the version the serving staging holds whole
        self._publication: Publication | None = None
        self.staged: dict | None = None  # what the last receive pulled into
        self._round = 0
        self.version: int | None = None  # the version applied last
        self._withdrawals = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensorhub-withdraw")
        self.hub = Hub.connect(info.hub, config=HubConfig.from_dict({"name": name, **info.hub_config}))
        # One Resolve, one Batch of announces and one of last reports for the
        # engine's ``world_size`` workers (None: each sends its own).
        self._share = engine_share(world_size, model=info.model, engine=group,
                                   pull_timeout_s=self.hub.config.pull_timeout_s) if info.share_resolve else None

    def receive(self, version: int | str) -> PullResult:
        """Pull the read set of ``version`` (or ``"latest"``) completely; the
        regions, shapes and dtypes are checked against the version's manifest
        before any byte moves. Raises the hub's typed errors (VersionNotFound,
        ManifestMismatch, SourceLost, TransferStalled, ...); the model is
        untouched either way. ``result.tensors`` is the staging (a list of
        Shards' tensors where a name is read in parts); ``self.staged`` the
        ``into`` mapping it was pulled into."""
        self._round += 1
        if self._share is None:
            return self._receive(version, self._withdraw(), None)
        # The previous version's withdrawal goes with the engine's others, at the update's start.
        return self._share.update(self.hub, version, lambda answer, announce_with: self._receive(
            version, lambda: None, answer, announce_with), self._group_withdrawal())

    def _receive(self, version: int | str, withdrawn: Callable[[], None], answer: GroupAnswer | None,
                 announce_with: Callable[[bytes], bool] | None = None) -> PullResult:
        if not self.info.serve:
            # Fresh memory each time, dropped by the caller after the apply.
            self.staged = self.read_set.allocate(self.device)
            try:
                return self._pull(version, self.staged, answer=answer, announce_with=announce_with)
            except BaseException:
                self.staged = None  # nothing to apply: free it now, not at the next update
                raise
        if self._staging is None:
            self._staging = self.read_set.allocate(self.device)
        self.staged = self._staging
        have = self._staging_holds if self.info.delta == "auto" else None
        self._staging_holds = None  # until this pull ends: it writes into the staging
        result = self._pull(version, self._staging, serve=True, before_write=withdrawn, have=have, answer=answer,
                            announce_with=announce_with)
        self._publication = result.publication
        self._staging_holds = result.version
        return result

    def _pull(self, version: int | str, staging: dict, **kwargs) -> PullResult:
        """Pull into ``staging`` (checkpoint names), whichever naming of the
        experts the publisher used (``tensorhub.experts``: fused experts are
        read into the per-expert staging as boxes of the fused tensors)."""
        seen: list[Manifest] = []

        def onto(manifest: Manifest) -> dict:
            seen.append(manifest)
            return experts.onto(staging, manifest)

        try:
            # In an engine's share, the announce and the last report go with the others' (one message per engine).
            return self.hub.pull(self.info.model, version, into=onto, group=self.group, group_round=self._round,
                                 defer_complete=self._share is not None, **kwargs)
        except ManifestMismatch as e:
            hint = experts.mismatch_hint(list(staging), seen[0]) if seen else None
            if hint is None:
                raise
            raise ManifestMismatch(f"{e} {hint}") from None

    def done(self) -> None:
        """The update was applied (or abandoned): without serving, free the staging now."""
        if not self.info.serve:
            self.staged = None

    def _withdraw(self) -> Callable[[], None]:
        """Start withdrawing the previous version, so its memory can be
        re-filled; the returned call waits until it is (the pull calls it once
        the next version is resolved, before it writes a byte)."""
        pub = self._publication
        if pub is None:
            return lambda: None
        pending = self._withdrawals.submit(pub.unpublish, timeout=self.info.unpublish_timeout_s)

        def withdrawn() -> None:
            # On UnpublishTimeout the replica is withdrawn but may still be read:
            # keep it, so the next update waits again instead of overwriting it.
            pending.result()
            if self._publication is pub:
                self._publication = None

        return withdrawn

    def _group_withdrawal(self) -> Withdrawal | None:
        """``_withdraw`` in an engine's share: the message goes with the other
        workers' (``EngineShare.exchange``), which finishes it before the pull."""
        pub = self._publication
        if pub is None:
            return None
        timeout = self.info.unpublish_timeout_s

        def done(outcome: object) -> None:
            # Drained: closed; else unpublished alone, here. On UnpublishTimeout the
            # replica is withdrawn but may still be read: keep it (see ``_withdraw``).
            self.hub.withdrawn(pub, outcome, timeout)
            if self._publication is pub:
                self._publication = None

        try:
            message = self.hub.withdrawal(pub, timeout)
        except Exception:  # never skip the engine's rounds: ``done`` then withdraws it alone
            log.warning("could not encode the withdrawal of %s; it goes alone", pub.replica_id, exc_info=True)
            message = b""
        return Withdrawal(message, done, pub)

    def close(self) -> None:
        self._withdrawals.shutdown(wait=True)
        self.hub.close()
        self._publication = self._staging = self.staged = None
