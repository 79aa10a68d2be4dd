"""Receiving whole versions into host memory, apart from the model.

Every byte of a version lands in a staging buffer and is checked against the
model's layout before the first parameter changes: a failed pull (dead source,
manifest mismatch, timeout) leaves the engine serving the weights it had.

    update(v) ──▶ withdraw previous replica ──▶ pull v into staging ──▶ apply
                  (peers' reads drained)        (serve=True: peers may   (vLLM's layer-
                                                 read it as it fills)     wise reload)

With ``serve`` on, the staging buffer stays published as a replica of the
version the engine runs until the next update, so other engines can pull it
even after the trainer withdrew its own copy.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

from tensorhub import Hub, HubConfig, Manifest, Publication, PullResult
from tensorhub_vllm.config import TensorHubInitInfo

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
    """Pulls whole versions of one model for one worker of an engine.

    All workers of an engine share ``group`` and call ``receive`` once per
    update, in the same order, so the counter they pass as ``group_round``
    agrees and the hub hands each of them the same version.
    """

    def __init__(self, info: TensorHubInitInfo, layout: dict[str, torch.Tensor], *, group: str, name: str) -> None:
        self.info = info
        self.group = group
        self._layout = layout
        self._staging: dict[str, torch.Tensor] | None = None
        self._publication: Publication | None = None
        self._round = 0
        self.version: int | None = None  # the version applied last
        self.hub = Hub.connect(info.hub, config=HubConfig.from_dict({"name": name, **info.hub_config}))

    def receive(self, version: int | str) -> PullResult:
        """Pull ``version`` (or ``"latest"``) completely and check it. Raises
        the hub's typed errors (VersionNotFound, ManifestMismatch, SourceLost,
        TransferStalled, ...); the model is untouched either way."""
        self._round += 1
        self._withdraw()
        if not self.info.serve:
            # Fresh memory the hub frees after the pull; checked before it is applied.
            result = self.hub.pull(self.info.model, version, group=self.group, group_round=self._round)
            Manifest.of(result.tensors).check_destination(self._layout, model=self.info.model, version=result.version)
            return result
        if self._staging is None:
            self._staging = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in self._layout.items()}
        result = self.hub.pull(self.info.model, version, into=self._staging, serve=True,
                               group=self.group, group_round=self._round)
        self._publication = result.publication
        return result

    def _withdraw(self) -> None:
        """Stop serving the previous version, so its memory can be re-filled."""
        if self._publication is not None:
            # On UnpublishTimeout the replica is withdrawn but may still be read:
            # keep it, so the next update waits again instead of overwriting it.
            self._publication.unpublish(timeout=self.info.unpublish_timeout_s)
            self._publication = None

    def close(self) -> None:
        self.hub.close()
        self._publication = self._staging = None
