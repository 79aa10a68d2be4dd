"""Settings of the ``tensorhub`` checkpoint engine: the dict verl passes as
``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.tensorhub``.

Plain values only, so a Hydra node maps onto it one to one. A bad dict is a
``ValueError`` that names this class and the offending key, raised when the
worker starts, not at the first weight update.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tensorhub import HubConfig
from tensorhub.server.config import ServerConfig

CONFIG_KEY = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.tensorhub"


@dataclass(kw_only=True, slots=True)
class TensorHubEngineConfig:
    # Reference server: "auto" finds (or starts) the cluster's server as a named
    # Ray actor; or the host:port of a `tensorhub server --host H --port P`.
    address: str = "auto"
    model: str = ""  # model key the trainer publishes under, e.g. "qwen2.5-7b/policy"
    # Trainer: where the publication buffer lives. "cpu" keeps the trainer's
    # accelerator memory free (pinned host memory when CUDA is present).
    buffer_device: str = "cpu"
    # Rollout: keep serving the version it received to other rollouts until its
    # next update (pipeline replication), so the trainer's link is read once.
    serve: bool = True
    # "auto": the trainer publishes each step with its delta from the step
    # before (computed as each tensor is copied over its previous bytes: no
    # second buffer), and a rollout holding that step pulls only the delta.
    # "off": every step whole.
    delta: str = "auto"
    # "readers": each trainer rank also publishes its share of the readers' cut
    # (Hub.publish(cut="readers")): the regions the serving readers of the last
    # version read, gathered over the trainer's torch.distributed world at most
    # cut_gather_bytes at a time and laid out back to back, so a reader with a
    # partial read set (a TP worker) reads contiguous bytes. None (null): off.
    cut: str | None = None
    cut_gather_bytes: int | None = None  # per rank; None: HubConfig.cut_gather_bytes
    # true: the trainer ranks announce and withdraw each step as one group
    # (Hub.publish(trainer_group=), over cut_group, default the whole world): rank 0
    # sends every rank's announce in one message and their withdrawals in another,
    # two messages a step for the whole trainer instead of two per rank. Collective:
    # every rank holds a part of the step; no deltas (set delta: off).
    publish_together: bool = False
    # true: verl trains a LoRA adapter (actor_rollout_ref.model.lora_rank > 0) and
    # each trainer rank publishes only the adapter, its FSDP shards of the A/B
    # matrices in place, as an adapter version of `model` (tensorhub.lora; name
    # the key like "policy/lora/<name>"); rollouts pull the adapter version.
    lora: bool = False
    wait_timeout_s: float = 600.0  # rollout: longest wait for the asked step to be published
    unpublish_timeout_s: float = 120.0  # trainer: longest wait for readers of the previous step to drain
    hub: dict[str, Any] = field(default_factory=dict)  # HubConfig fields: connect_timeout_s, chunk_size, labels, ...
    # ServerConfig fields for the server that `address: auto` starts (port, retain,
    # ...); used by the worker that starts it, ignored once it runs.
    server: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, values: dict[str, Any]) -> TensorHubEngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"TensorHubEngineConfig has no field(s) {unknown} (under {CONFIG_KEY}); "
                             f"known: {sorted(known)}")
        config = cls(**{k: (dict(v) if k in ("hub", "server") else v) for k, v in values.items()})
        for key in ("address", "model"):
            if not isinstance(getattr(config, key), str) or not getattr(config, key):
                raise ValueError(f"TensorHubEngineConfig.{key} is not set: set {CONFIG_KEY}.{key}")
        if config.buffer_device not in ("cpu", "cuda"):
            raise ValueError(
                f"TensorHubEngineConfig.buffer_device must be 'cpu' or 'cuda', not {config.buffer_device!r}")
        if not isinstance(config.lora, bool):
            raise ValueError(f"TensorHubEngineConfig.lora must be true or false, not {config.lora!r} "  # noqa: TRY004
                             f"(under {CONFIG_KEY}.lora)")
        if config.lora and config.cut is not None:
            raise ValueError(f"TensorHubEngineConfig.cut: the readers' cut is for base weights; an adapter is "
                             f"read whole (set {CONFIG_KEY}.cut to null with lora: true)")
        if not isinstance(config.publish_together, bool):
            raise ValueError(f"TensorHubEngineConfig.publish_together must be true or false, not "  # noqa: TRY004
                             f"{config.publish_together!r} (under {CONFIG_KEY}.publish_together)")
        if config.publish_together and config.lora:
            raise ValueError(f"TensorHubEngineConfig.publish_together: an adapter version is published by each rank "
                             f"alone (lora: true); set {CONFIG_KEY}.publish_together to false")
        if config.publish_together and config.delta != "off":
            raise ValueError(f"TensorHubEngineConfig.publish_together: the ranks' group announce carries no deltas; "
                             f"set {CONFIG_KEY}.delta to off with it")
        if config.delta not in ("auto", "off"):
            raise ValueError(f"TensorHubEngineConfig.delta must be 'auto' or 'off', not {config.delta!r}")
        if config.cut not in (None, "readers"):
            raise ValueError(f"TensorHubEngineConfig.cut must be 'readers' or null, not {config.cut!r} "
                             f"(under {CONFIG_KEY}.cut)")
        gather = config.cut_gather_bytes
        if gather is not None and (isinstance(gather, bool) or not isinstance(gather, int) or gather <= 0):
            raise ValueError(f"TensorHubEngineConfig.cut_gather_bytes must be a positive number of bytes or null, "
                             f"not {gather!r} (under {CONFIG_KEY}.cut_gather_bytes)")
        if gather is not None and config.cut is None:
            raise ValueError(f"TensorHubEngineConfig.cut_gather_bytes only means something with cut: readers "
                             f"(under {CONFIG_KEY})")
        config.server_config()  # a bad server dict fails here, not when the server starts
        return config

    def hub_config(self, name: str) -> HubConfig:
        """The Hub client's settings; ``name`` shows in the server's plans and messages."""
        return HubConfig.from_dict({"name": name, **self.hub})

    def server_config(self) -> ServerConfig:
        """Settings of the server ``address: auto`` starts: all interfaces, port 50051 unless set."""
        try:
            return ServerConfig(host="0.0.0.0").replace(**self.server)
        except ValueError as e:
            raise ValueError(f"{e} (under {CONFIG_KEY}.server)") from None
