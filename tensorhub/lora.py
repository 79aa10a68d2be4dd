"""LoRA adapters as versions of their own model.

A trainer whose base is frozen publishes only its adapter: the LoRA A/B
matrices (about 1% of the model's bytes) as a version of a model key of its
own, e.g. ``policy/lora/math`` at version = step. The adapter's PEFT settings
(rank, alpha, target modules) travel with the version as one small side tensor,
``ADAPTER_CONFIG`` (the JSON bytes as uint8): a manifest holds tensors only,
and a side tensor needs no change to the wire protocol; it gets the same
checksums, relays and retention as the matrices.

    pub = publish_adapter(hub, "policy/lora/math", step, peft_model)   # in place
    adapter = pull_adapter(hub, "policy/lora/math", "latest")          # -> .tensors, .config

Tensor names are PEFT's saved names (``base_model.model.<module>.lora_A.weight``),
which is what vLLM and PEFT's own loaders read.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from tensorhub.client.hub import Hub, PullResult
from tensorhub.client.publication import Publication
from tensorhub.dtensor import local_part
from tensorhub.manifest import DTYPES, Manifest
from tensorhub.regions import Bounds
from tensorhub.shard import Shard
from tensorhub.staging import one_buffer

# Reserved tensor name of the adapter's settings inside the version.
ADAPTER_CONFIG = "tensorhub.adapter_config"
_LORA_MARKS = (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B")


def _fail(name: str, problem: str) -> ValueError:
    return ValueError(f"AdapterConfig.{name}: {problem}")


@dataclass(frozen=True, kw_only=True)
class AdapterConfig:
    """The PEFT LoRA settings a server needs to apply the matrices."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise _fail("r", f"must be an integer >= 1, not {self.r!r}")
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)) or self.lora_alpha <= 0:
            raise _fail("lora_alpha", f"must be a number > 0, not {self.lora_alpha!r}")
        if isinstance(self.target_modules, str) or not self.target_modules or \
                not all(isinstance(m, str) and m for m in self.target_modules):
            raise _fail("target_modules", f"must be a non-empty list of module names, not {self.target_modules!r}")
        if not isinstance(self.use_rslora, bool):
            raise _fail("use_rslora", f"must be true or false, not {self.use_rslora!r}")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> AdapterConfig:
        """From a PEFT ``adapter_config.json`` (or ``LoraConfig.to_dict()``):
        the fields above are taken, the rest (task type, dropout, ...) ignored.
        A set of target modules (PEFT keeps one) becomes a sorted tuple."""
        missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in values]
        if missing:
            raise _fail(missing[0], "is required")
        if values.get("bias", "none") != "none":
            raise _fail("bias", f"LoRA biases are not supported (vLLM serves none), not {values['bias']!r}")
        targets = values["target_modules"]
        targets = sorted(targets) if isinstance(targets, (set, frozenset)) else targets
        return cls(r=values["r"], lora_alpha=values["lora_alpha"], target_modules=targets,
                   use_rslora=values.get("use_rslora", False), rank_pattern=dict(values.get("rank_pattern") or {}),
                   alpha_pattern=dict(values.get("alpha_pattern") or {}))

    def to_peft_dict(self) -> dict[str, Any]:
        """As PEFT writes ``adapter_config.json``: what vLLM's PEFTHelper reads."""
        return {**asdict(self), "target_modules": list(self.target_modules), "peft_type": "LORA", "bias": "none"}

    def to_tensor(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(json.dumps(self.to_peft_dict(), sort_keys=True).encode()), dtype=torch.uint8)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> AdapterConfig:
        return cls.from_dict(json.loads(bytes(tensor.cpu().numpy().tobytes()).decode()))

    def scale(self) -> float:
        """PEFT's scaling of ``B @ A``: alpha / r (alpha / sqrt(r) with rsLoRA).
        Per-module ranks or alphas (``rank_pattern``, ``alpha_pattern``) are
        refused: merged mode would need PEFT's pattern matching to scale each."""
        if self.rank_pattern or self.alpha_pattern:
            raise ValueError("merging an adapter with rank_pattern or alpha_pattern is not supported: "
                             "serve it as a LoRA adapter instead")
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def base_weight_name(lora_name: str) -> str:
    """The checkpoint weight a PEFT LoRA matrix adapts:
    ``base_model.model.model.layers.0.q_proj.lora_A.weight`` -> ``model.layers.0.q_proj.weight``."""
    for mark in (".lora_A.weight", ".lora_B.weight"):
        if lora_name.endswith(mark):
            return lora_name.removeprefix("base_model.model.").removesuffix(mark) + ".weight"
    raise ValueError(f"{lora_name!r} is not a PEFT LoRA matrix name (no .lora_A.weight or .lora_B.weight)")


def merge_lora(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale * (lora_b @ lora_a)`` as a new tensor of ``weight``'s
    dtype: computed in float32, rounded once. ``weight`` may be a box of the
    full weight, with the rows of B and the columns of A of that box."""
    return (weight.float() + scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)


def _peft_name(param_name: str, adapter_name: str) -> str:
    """A PEFT model's parameter name as PEFT saves it: without the adapter's
    name (``q_proj.lora_A.default.weight`` -> ``q_proj.lora_A.weight``)."""
    return param_name.replace(f".{adapter_name}.", ".").removesuffix(f".{adapter_name}")


def lora_parameters(model: torch.nn.Module, adapter_name: str = "default") -> dict[str, torch.nn.Parameter]:
    """The LoRA parameters of a PEFT-wrapped module (the live ones, DTensors
    under FSDP2) by PEFT's saved names."""
    return {_peft_name(n, adapter_name): p for n, p in model.named_parameters()
            if any(m in n for m in _LORA_MARKS) and f".{adapter_name}" in n}


def adapter_config_of(model: torch.nn.Module, adapter_name: str = "default") -> AdapterConfig:
    """A PEFT module's settings of ``adapter_name`` (``model.peft_config[adapter_name]``)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or adapter_name not in configs:
        raise ValueError(f"the module has no PEFT adapter {adapter_name!r} (no peft_config entry): pass a PEFT "
                         "model, or a dict of LoRA tensors with its AdapterConfig")
    peft_config = configs[adapter_name]
    return AdapterConfig.from_dict(peft_config.to_dict() if hasattr(peft_config, "to_dict") else vars(peft_config))


def adapter_of(model: torch.nn.Module, adapter_name: str = "default") -> tuple[dict[str, torch.Tensor | Shard],
                                                                               AdapterConfig]:
    """What this process holds of a PEFT-wrapped module's LoRA tensors (its
    live parameters, not copies: published in place) under PEFT's saved names,
    and its settings. An FSDP2 (DTensor) parameter gives this rank's local
    shard as a ``Shard`` of the full matrix, or nothing where it holds none."""
    config = adapter_config_of(model, adapter_name)
    parts = {n: local_part(n, p) for n, p in lora_parameters(model, adapter_name).items()}
    return {n: part for n, part in parts.items() if part is not None}, config


def _shape(entry: torch.Tensor | Shard) -> tuple[int, ...]:
    return tuple(entry.full_shape) if isinstance(entry, Shard) else tuple(entry.shape)


def check_adapter(tensors: Mapping[str, torch.Tensor | Shard], config: AdapterConfig) -> None:
    """Raise ValueError (naming the tensor) unless ``tensors`` are LoRA
    matrices whose A and B come in pairs of ``config``'s rank (a Shard is
    checked by its full shape; meta tensors do as well as real ones)."""
    if not tensors:
        raise ValueError("the adapter has no tensors")
    if ADAPTER_CONFIG in tensors:
        raise ValueError(f"{ADAPTER_CONFIG!r} is a reserved name (the adapter's settings)")
    for name, t in tensors.items():
        shape = _shape(t)
        if ".lora_A." in name:
            partner, rank = name.replace(".lora_A.", ".lora_B."), shape[0]
        elif ".lora_B." in name:
            partner, rank = name.replace(".lora_B.", ".lora_A."), shape[-1]
        elif "lora_embedding_" in name:
            continue
        else:
            raise ValueError(f"{name!r} is not a LoRA matrix (no .lora_A. or .lora_B. in its name)")
        if partner not in tensors:
            raise ValueError(f"{name!r} has no partner {partner!r}")
        if len(shape) != 2:
            raise ValueError(f"{name!r} has shape {list(shape)}, not a matrix")
        if not config.rank_pattern and rank != config.r:
            raise ValueError(f"{name!r} has rank {rank}, the config says r={config.r}")


def publish_adapter(hub: Hub, model: str, version: int,
                    adapter: torch.nn.Module | Mapping[str, torch.Tensor | Shard],
                    config: AdapterConfig | Mapping | None = None, *, adapter_name: str = "default",
                    **publish_kwargs: Any) -> Publication:
    """Publish a LoRA adapter as ``version`` of ``model``, in place: a PEFT
    model's own parameters (its config from ``peft_config``), or a dict of
    PEFT-named tensors with ``config``. Do not modify them until the returned
    publication is unpublished. ``publish_kwargs`` go to ``Hub.publish``
    (``delta_from``, ``chunk_size``, ...).

    Sharded trainers: each rank passes what it holds (a module whose LoRA
    parameters are FSDP2 DTensors publishes its local shards; a dict may hold
    ``Shard``s) and the version is visible once the ranks cover every matrix.
    A dict of Shards passes ``manifest=`` (the whole adapter's names and
    shapes) when a rank may hold none of some matrix; the settings tensor is
    published whole by every rank."""
    try:
        manifest = publish_kwargs.pop("manifest", None)
        if isinstance(adapter, torch.nn.Module):
            tensors, own = adapter_of(adapter, adapter_name)
            config = own if config is None else config
            if manifest is None:  # the whole adapter, also what other ranks hold
                manifest = {n: torch.empty(p.shape, dtype=p.dtype, device="meta")
                            for n, p in lora_parameters(adapter, adapter_name).items()}
        else:
            tensors = dict(adapter)
            if config is None:
                raise ValueError("a dict of LoRA tensors needs its config (AdapterConfig or PEFT's dict)")
        config = config if isinstance(config, AdapterConfig) else AdapterConfig.from_dict(config)
        check_adapter(tensors if manifest is None else manifest, config)
    except ValueError as e:
        raise ValueError(f"{e}; nothing was published") from None
    side = _side_tensor(config)
    if manifest is not None:
        publish_kwargs["manifest"] = {**manifest, ADAPTER_CONFIG: side}
    return hub.publish(model, version, {**tensors, ADAPTER_CONFIG: side}, **publish_kwargs)


# The settings tensor published per PEFT settings, kept: every version of an
# adapter then publishes the same memory, so the publisher's registration and
# NIXL metadata do not change between versions and readers replay their plans
# (a new 223-byte tensor per version made each pull plan afresh and load the
# trainer's NIXL metadata again: ~3 ms of a 1.6 MB pull). Read-only once made.
_SIDES: OrderedDict[bytes, torch.Tensor] = OrderedDict()
_SIDES_KEPT = 64
_SIDES_LOCK = threading.Lock()


def _side_tensor(config: AdapterConfig) -> torch.Tensor:
    fresh = config.to_tensor()
    key = bytes(fresh.numpy())
    with _SIDES_LOCK:
        kept = _SIDES.pop(key, fresh)
        _SIDES[key] = kept  # most recent last; a publication holds its own reference
        while len(_SIDES) > _SIDES_KEPT:
            _SIDES.popitem(last=False)
    return kept


@dataclass(frozen=True)
class PulledAdapter:
    version: int
    config: AdapterConfig
    tensors: dict[str, torch.Tensor]  # PEFT names -> LoRA matrices
    result: PullResult  # bytes, sources, timing of the pull

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


# (name, full shape, dtype) -> the box of the matrix to read, or None: all of it
PartFn = Callable[[str, tuple[int, ...], torch.dtype], Bounds | None]
# Staging memory a caller keeps between pulls of one adapter (pull_adapter's ``staging``)
AdapterStaging = dict[str, dict[str, torch.Tensor | list[Shard]]]


def pull_adapter(hub: Hub, model: str, version: int | Literal["latest"] = "latest", *, parts: PartFn | None = None,
                 staging: AdapterStaging | None = None, **pull_kwargs: Any) -> PulledAdapter:
    """Pull an adapter version into new memory (checked chunk by chunk like
    any version) and split off its settings. Raises the hub's typed errors, or
    ValueError when the version is not an adapter; nothing is kept either way.

    ``parts``: read only a box of each matrix (a TP worker's shard: the
    engine's LoRA layers cut the full matrix themselves); the returned
    matrices have their full shapes, zeros outside the boxes read.
    ``staging``: a dict kept by the caller across pulls: the version lands in
    one buffer kept there per layout (names, shapes, dtypes), so every later
    version of the same layout reuses its registration and read plan, and the
    returned matrices are copies of it. Without it a new buffer is returned."""
    staged: dict[str, torch.Tensor | list[Shard]] = {}

    def destination(manifest: Manifest) -> dict[str, torch.Tensor | list[Shard]]:
        kept = None if staging is None else staging.get(manifest.fingerprint)
        if kept is None:
            kept = _allocate(manifest, parts)
            if staging is not None:
                staging.clear()  # a new layout: the old buffer is not read again
                staging[manifest.fingerprint] = kept
        staged.update(kept)
        return kept

    result = hub.pull(model, version, into=destination, **pull_kwargs)
    tensors = {n: _in_full(v, copy=staging is not None) for n, v in staged.items()}
    side = tensors.pop(ADAPTER_CONFIG, None)
    if side is None:
        raise ValueError(f"{model!r} version {result.version} is not a LoRA adapter (no {ADAPTER_CONFIG!r} tensor)")
    return PulledAdapter(result.version, AdapterConfig.from_tensor(side), tensors, result)


def _allocate(manifest: Manifest, parts: PartFn | None) -> dict[str, torch.Tensor | list[Shard]]:
    """Staging for ``manifest`` (a box of each matrix where ``parts`` says so):
    views of one buffer, so the hub registers one region, not one per matrix."""
    pieces = []
    for spec in manifest.tensors:
        dtype = DTYPES[spec.dtype]
        box = None if parts is None or spec.name == ADAPTER_CONFIG else parts(spec.name, spec.shape, dtype)
        pieces.append((spec.name, dtype, box, list(spec.shape) if box is None else [b - a for a, b in box]))
    return one_buffer(pieces, {spec.name: tuple(spec.shape) for spec in manifest.tensors})


def _in_full(value: torch.Tensor | list[Shard], *, copy: bool) -> torch.Tensor:
    """A pulled matrix in memory of its own where ``copy``; a pulled box laid
    into a zero matrix of its full shape."""
    if isinstance(value, torch.Tensor):
        return value.clone() if copy else value
    (shard,) = value
    full = torch.zeros(shard.full_shape, dtype=shard.tensor.dtype)
    full[tuple(slice(a, b) for a, b in shard.region.box)] = shard.tensor
    return full
