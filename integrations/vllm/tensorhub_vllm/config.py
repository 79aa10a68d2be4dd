"""Typed settings of the ``tensorhub`` weight-transfer backend.

Plain dicts travel on the wire (``init_weight_transfer_engine``, HTTP bodies,
``collective_rpc`` args); these dataclasses are what the workers act on. Parsing
turns a bad dict into a ``ValueError`` that names the class and the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from tensorhub import HubConfig


def _fail(cls: type, name: str, problem: str) -> ValueError:
    return ValueError(f"{cls.__name__}.{name}: {problem}")


def _parse(cls: type, values: Any, checks: Mapping[str, Any]) -> dict[str, Any]:
    """Check ``values`` against the dataclass ``cls``: a mapping, no unknown keys,
    every required field present, each value passing ``checks[name]``."""
    if not isinstance(values, Mapping):
        # ValueError, not TypeError: vLLM's parse_*_info contract for any bad payload
        raise ValueError(f"{cls.__name__} must be a dict, not {type(values).__name__}")  # noqa: TRY004
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}; known: {sorted(known)}")
    out = {}
    for name, f in known.items():
        if name not in values:
            if f.default is f.default_factory is MISSING:
                raise _fail(cls, name, "is required")
            continue
        out[name] = checks[name](cls, name, values[name])
    return out


def _text(cls: type, name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(cls, name, f"must be a non-empty string, not {value!r}")
    return value


def _optional_text(cls: type, name: str, value: Any) -> str:
    return "" if value in ("", None) else _text(cls, name, value)


def _flag(cls: type, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(cls, name, f"must be true or false, not {value!r}")
    return value


def _seconds(cls: type, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise _fail(cls, name, f"must be a number of seconds > 0, not {value!r}")
    return float(value)


def _fraction(cls: type, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise _fail(cls, name, f"must be a number from 0 to 1, not {value!r}")
    return float(value)


def _delta(cls: type, name: str, value: Any) -> str:
    if value not in ("auto", "off"):
        raise _fail(cls, name, f"must be 'auto' or 'off', not {value!r}")
    return value


def _hub_config(cls: type, name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(cls, name, f"must be a dict of HubConfig fields, not {value!r}")
    try:
        HubConfig.from_dict(dict(value))
    except (TypeError, ValueError) as e:
        raise _fail(cls, name, str(e)) from None
    return dict(value)


def _version(cls: type, name: str, value: Any) -> int | Literal["latest"]:
    if value == "latest" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise _fail(cls, name, f"must be an integer >= 0 or 'latest', not {value!r}")


@dataclass(kw_only=True, slots=True)
class TensorHubInitInfo(WeightTransferInitInfo):
    """Where to pull from, and how. Given once per engine (``init_weight_transfer_engine``)."""

    hub: str  # reference server, host:port
    model: str  # model key the trainer publishes under
    serve: bool = True  # keep the received version pullable by other engines until the next one
    engine_id: str = ""  # group of the engine's workers; default: vLLM's instance id (+ DP rank)
    unpublish_timeout_s: float = 60.0  # wait for peers' reads of our replica before re-filling it
    hub_config: dict[str, Any] = field(default_factory=dict)  # tensorhub.HubConfig fields
    # Extra bytes a worker may read (and hold) beyond its read set, as a share of
    # it, to read columns of row-parallel weights as whole rows (readset.ReadSet.coalesced).
    overread: float = 0.2
    # "auto": a serving worker, whose staging holds the version it runs, pulls
    # only the next version's deltas from it where the trainer published them
    # (publish(delta_from=...)); "off": every version whole.
    delta: Literal["auto", "off"] = "auto"
    # One Resolve per engine and version: the first worker resolves for all and
    # hands the answer over the engine's CPU group (groupshare); off: each worker asks.
    share_resolve: bool = True
    # Merged mode, for an engine served without LoRA support: the model key of
    # a LoRA adapter (tensorhub.lora) whose versions it merges into its weights
    # (``tensorhub_update_adapter``: only the adapter is pulled; W + scale·B·A
    # from the base version in the staging, reloaded as a base update is).
    merge_adapter: str = ""

    @classmethod
    def from_dict(cls, values: Any) -> TensorHubInitInfo:
        info = cls(**_parse(cls, values, {
            "hub": _text, "model": _text, "serve": _flag, "engine_id": _optional_text,
            "unpublish_timeout_s": _seconds, "hub_config": _hub_config, "overread": _fraction, "delta": _delta,
            "share_resolve": _flag, "merge_adapter": _optional_text,
        }))
        if info.merge_adapter and not info.serve:
            raise _fail(cls, "merge_adapter", "needs serve: true (the base version it merges onto stays in the "
                                              "staging only while the worker serves it)")
        if info.merge_adapter == info.model:
            raise _fail(cls, "merge_adapter", f"must be the adapter's model key, not the base model's {info.model!r}")
        return info


@dataclass(kw_only=True, slots=True)
class TensorHubUpdateInfo(WeightTransferUpdateInfo):
    """Which version to load (``update_weights``)."""

    version: int | Literal["latest"] = "latest"

    @classmethod
    def from_dict(cls, values: Any) -> TensorHubUpdateInfo:
        return cls(**_parse(cls, values, {"version": _version}))


@dataclass(kw_only=True, slots=True)
class TensorHubAdapterInfo:
    """Where an engine's workers pull LoRA adapter versions from
    (``collective_rpc("tensorhub_adapters_init", ...)``, sent by ``AdapterVersions``)."""

    hub: str  # reference server, host:port
    hub_config: dict[str, Any] = field(default_factory=dict)  # tensorhub.HubConfig fields

    @classmethod
    def from_dict(cls, values: Any) -> TensorHubAdapterInfo:
        return cls(**_parse(cls, values, {"hub": _text, "hub_config": _hub_config}))
