"""TensorHub's settings for OpenRLHF, read from ``TENSORHUB_*`` environment
variables.

OpenRLHF's argparse rejects flags it does not know, so nothing of ours can
ride on its command line. The environment reaches every process: the launcher
passes these variables to all Ray workers (``runtime_env``), so the trainer
ranks and the engines read the same settings. A bad value is a ``ValueError``
naming the variable, raised by the launcher before Ray or a model starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tensorhub import HubConfig

PREFIX = "TENSORHUB_"
# variable -> field; the order is the one the docs list them in
VARIABLES = {
    "TENSORHUB_ADDRESS": "address",
    "TENSORHUB_MODEL": "model",
    "TENSORHUB_SERVE": "serve",
    "TENSORHUB_UPDATE_TIMEOUT_S": "update_timeout_s",
    "TENSORHUB_UNPUBLISH_TIMEOUT_S": "unpublish_timeout_s",
    "TENSORHUB_HUB_CONFIG": "hub",
    "TENSORHUB_DELTA": "delta",
    "TENSORHUB_VLLM_QUANTIZATION": "vllm_quantization",
    "TENSORHUB_LORA": "lora",
    "TENSORHUB_LORA_MAX_RANK": "lora_max_rank",
    "TENSORHUB_CUT": "cut",
    "TENSORHUB_CUT_GATHER_BYTES": "cut_gather_bytes",
    "TENSORHUB_PUBLISH_TOGETHER": "publish_together",
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(kw_only=True, slots=True)
class TensorHubSettings:
    address: str  # reference server host:port, or "auto": a Ray actor on the head node
    model: str = "policy"  # model key the trainer publishes under and the engines pull
    # Engines keep serving the version they received to other engines until
    # their next update (pipeline replication; one host copy per worker).
    serve: bool = True
    # Trainer rank 0: longest wait for the engines to load a step. An engine
    # that is slower or dead by then is logged and left behind, not waited for.
    update_timeout_s: float = 600.0
    # Trainer: longest wait for readers of the last step before training
    # overwrites the partitions it published in place.
    unpublish_timeout_s: float = 120.0
    hub: dict[str, Any] = field(default_factory=dict)  # tensorhub.HubConfig fields, as JSON
    # Trainer: ZeRO-3 ranks publish their partitions in place and keep nothing
    # of the step before, so a delta costs a host copy of each rank's
    # partitions (its share of the model) and a copy per step: opt-in.
    # "copy": keep it and publish each step with its delta from the last one
    # (engines holding that step pull only the delta). "off": no delta.
    delta: str = "off"
    # Engines: vLLM's ``quantization`` (OpenRLHF has no flag for it). An online
    # FP8 method (fp8_per_channel, fp8_per_tensor, fp8_per_block) serves FP8 and
    # re-quantizes each bf16 version as it loads; None: the checkpoint's dtype.
    vllm_quantization: str | None = None
    # Trainer: OpenRLHF trains a LoRA adapter (--ds.lora.rank > 0) and each rank
    # publishes only the adapter (its partitions of the A/B matrices, in place)
    # as an adapter version of `model` (tensorhub.lora; name it policy/lora/<name>).
    # Engines, with lora: they serve the adapter versions from memory (vLLM's
    # enable_lora, two resident so requests in flight finish on theirs), each
    # generate naming the newest; the adapter's rank must be at most this
    # (vLLM's max_lora_rank: 1, 8, 16, 32, 64, 128, 256, 320 or 512).
    lora: bool = False
    lora_max_rank: int = 64
    # Trainer: "readers" also publishes each rank's share of the readers' cut
    # (Hub.publish(cut="readers")): the regions the serving engine workers of
    # the last step read (a TP worker's columns of o_proj / down_proj), gathered
    # from the ZeRO-3 flat partitions over the partition group at most
    # cut_gather_bytes at a time and laid out back to back. None: off.
    cut: str | None = None
    cut_gather_bytes: int | None = None  # per rank; None: HubConfig.cut_gather_bytes
    # Trainer: the ranks announce and withdraw each step as one group over the
    # partition group (Hub.publish(trainer_group=)): the first rank sends every
    # rank's announce in one message and their withdrawals in another, two
    # messages a step for the whole trainer. Collective; no deltas, no LoRA.
    publish_together: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TensorHubSettings:
        env = os.environ if environ is None else environ
        unknown = sorted(k for k in env if k.startswith(PREFIX) and k not in VARIABLES)  # typos
        if unknown:
            raise ValueError(f"unknown TensorHub variable(s) {unknown}; known: {list(VARIABLES)}")
        address = env.get("TENSORHUB_ADDRESS", "").strip()
        if not address:
            raise ValueError("TENSORHUB_ADDRESS is not set: give the reference server's host:port, or 'auto' "
                             "to start it as a Ray actor on the cluster's head node")
        values: dict[str, Any] = {"address": address}
        if "TENSORHUB_MODEL" in env:
            values["model"] = _text("TENSORHUB_MODEL", env["TENSORHUB_MODEL"])
        if "TENSORHUB_SERVE" in env:
            values["serve"] = _flag("TENSORHUB_SERVE", env["TENSORHUB_SERVE"])
        for var in ("TENSORHUB_UPDATE_TIMEOUT_S", "TENSORHUB_UNPUBLISH_TIMEOUT_S"):
            if var in env:
                values[VARIABLES[var]] = _seconds(var, env[var])
        if "TENSORHUB_HUB_CONFIG" in env:
            values["hub"] = _hub_config("TENSORHUB_HUB_CONFIG", env["TENSORHUB_HUB_CONFIG"])
        if "TENSORHUB_DELTA" in env:
            values["delta"] = env["TENSORHUB_DELTA"].strip().lower()
            if values["delta"] not in ("off", "copy"):
                raise ValueError(f"TENSORHUB_DELTA must be 'off' or 'copy', not {env['TENSORHUB_DELTA']!r}")
        if "TENSORHUB_LORA" in env:
            values["lora"] = _flag("TENSORHUB_LORA", env["TENSORHUB_LORA"])
            if values["lora"] and values.get("delta") == "copy":
                raise ValueError("TENSORHUB_DELTA=copy does not apply with TENSORHUB_LORA=1: an adapter version "
                                 "is published whole (it is small); set TENSORHUB_DELTA=off")
        if env.get("TENSORHUB_LORA_MAX_RANK", "").strip():
            values["lora_max_rank"] = _lora_rank(env["TENSORHUB_LORA_MAX_RANK"])
        if "TENSORHUB_PUBLISH_TOGETHER" in env:
            values["publish_together"] = _flag("TENSORHUB_PUBLISH_TOGETHER", env["TENSORHUB_PUBLISH_TOGETHER"])
            if values["publish_together"] and values.get("delta") == "copy":
                raise ValueError("TENSORHUB_PUBLISH_TOGETHER=1: the ranks' group announce carries no deltas; set "
                                 "TENSORHUB_DELTA=off with it")
            if values["publish_together"] and values.get("lora"):
                raise ValueError("TENSORHUB_PUBLISH_TOGETHER=1: an adapter version is published by each rank alone "
                                 "(TENSORHUB_LORA=1); set TENSORHUB_PUBLISH_TOGETHER=0")
        values.update(_cut(env, lora=values.get("lora", False)))
        if values.get("cut") and not values.get("serve", True):
            raise ValueError("TENSORHUB_CUT=readers needs TENSORHUB_SERVE=1: the trainer learns its readers' cut "
                             "from the engines that serve what they read, and with TENSORHUB_SERVE=0 none does")
        if env.get("TENSORHUB_VLLM_QUANTIZATION", "").strip():
            values["vllm_quantization"] = env["TENSORHUB_VLLM_QUANTIZATION"].strip()
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The variables that give these settings to another process."""
        return {
            "TENSORHUB_ADDRESS": self.address,
            "TENSORHUB_MODEL": self.model,
            "TENSORHUB_SERVE": "1" if self.serve else "0",
            "TENSORHUB_UPDATE_TIMEOUT_S": repr(self.update_timeout_s),
            "TENSORHUB_UNPUBLISH_TIMEOUT_S": repr(self.unpublish_timeout_s),
            "TENSORHUB_HUB_CONFIG": json.dumps(self.hub, sort_keys=True),
            "TENSORHUB_DELTA": self.delta,
            "TENSORHUB_VLLM_QUANTIZATION": self.vllm_quantization or "",
            "TENSORHUB_LORA": "1" if self.lora else "0",
            "TENSORHUB_LORA_MAX_RANK": str(self.lora_max_rank),
            "TENSORHUB_CUT": self.cut or "off",
            "TENSORHUB_CUT_GATHER_BYTES": "" if self.cut_gather_bytes is None else str(self.cut_gather_bytes),
            "TENSORHUB_PUBLISH_TOGETHER": "1" if self.publish_together else "0",
        }

    def vllm_engine_args(self) -> dict[str, Any]:
        """vLLM engine arguments these settings add to OpenRLHF's: ``quantization``;
        with ``lora``, LoRA on (two versions resident: the one in use and the next)."""
        args: dict[str, Any] = {} if self.vllm_quantization is None else {"quantization": self.vllm_quantization}
        if self.lora:
            args.update(enable_lora=True, max_loras=2, max_lora_rank=self.lora_max_rank)
        return args

    def adapter_init_info(self) -> dict[str, Any]:
        """``init_info`` of the engine workers' adapter side (tensorhub_vllm.config.TensorHubAdapterInfo)."""
        return {"hub": self.address, "hub_config": dict(self.hub)}

    def hub_config(self, name: str) -> HubConfig:
        """The Hub client's settings; ``name`` shows in the server's plans and messages."""
        return HubConfig.from_dict({"name": name, **self.hub})

    def engine_init_info(self, engine_id: str) -> dict[str, Any]:
        """``init_info`` of the vLLM worker extension (tensorhub_vllm.config.TensorHubInitInfo)."""
        return {"hub": self.address, "model": self.model, "serve": self.serve, "engine_id": engine_id,
                "unpublish_timeout_s": self.unpublish_timeout_s, "hub_config": dict(self.hub)}


def _text(var: str, value: str) -> str:
    if not value.strip():
        raise ValueError(f"{var} is empty")
    return value.strip()


def _flag(var: str, value: str) -> bool:
    low = value.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{var} must be one of {_TRUE + _FALSE}, not {value!r}")


def _cut(env: Mapping[str, str], *, lora: bool) -> dict[str, Any]:
    """TENSORHUB_CUT and its gather bound; empty means unset (a recipe's null)."""
    values: dict[str, Any] = {}
    cut = env.get("TENSORHUB_CUT", "").strip().lower()
    if cut not in ("", "off", "readers"):
        raise ValueError(f"TENSORHUB_CUT must be 'readers' or 'off', not {env['TENSORHUB_CUT']!r}")
    if cut == "readers":
        if lora:
            raise ValueError("TENSORHUB_CUT=readers does not apply with TENSORHUB_LORA=1: the readers' cut is for "
                             "base weights, an adapter version is read whole; set TENSORHUB_CUT=off")
        values["cut"] = "readers"
    gather = env.get("TENSORHUB_CUT_GATHER_BYTES", "").strip()
    if gather:
        try:
            values["cut_gather_bytes"] = int(gather)
        except ValueError:
            values["cut_gather_bytes"] = 0
        if values["cut_gather_bytes"] <= 0:
            raise ValueError(f"TENSORHUB_CUT_GATHER_BYTES must be a positive number of bytes, not {gather!r}")
        if "cut" not in values:
            raise ValueError("TENSORHUB_CUT_GATHER_BYTES only means something with TENSORHUB_CUT=readers")
    return values


_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks


def _lora_rank(value: str) -> int:
    try:
        rank = int(value.strip())
    except ValueError:
        rank = -1
    if rank not in _VLLM_LORA_RANKS:
        raise ValueError(f"TENSORHUB_LORA_MAX_RANK must be one of vLLM's {list(_VLLM_LORA_RANKS)} (at least the "
                         f"adapter's rank, --ds.lora.rank), not {value!r}")
    return rank


def _seconds(var: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{var} must be a number of seconds > 0, not {value!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{var} must be a number of seconds > 0, not {value!r}")
    return seconds


def _hub_config(var: str, value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value) if value.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{var} must be a JSON object of tensorhub.HubConfig fields: {e}") from None
    if not isinstance(parsed, dict):
        # ValueError like every other bad setting: the launcher reports those without a traceback
        raise ValueError(f"{var} must be a JSON object of tensorhub.HubConfig fields, not {value!r}")  # noqa: TRY004
    try:
        HubConfig.from_dict(dict(parsed))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{var}: {e}") from None
    return parsed
