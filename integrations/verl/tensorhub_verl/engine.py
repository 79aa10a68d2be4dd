"""verl checkpoint engine ``tensorhub``: the trainer publishes each step as a
version of a model; every rollout pulls the version it needs straight out of
the memory of whoever holds it (the trainer, or rollouts that already have it).

Who does what, per weight update that verl's ``CheckpointEngineManager`` runs:

    trainer rank 0 (is_master)        trainer ranks > 0        each rollout worker
    send_weights(stream, step):       send_weights(stream):    receive_weights(step):
      unpublish step-1 (drains          consume the stream       wait until a version >= step
        its readers)                    (its collectives         is pullable, pull the newest
      copy stream -> buffer             need every rank)         one, yield (name, tensor),
      publish buffer as `step`                                   keep serving it (serve=True)

There is no process group: ``build_topology`` returns nothing to dispatch and
``init_process_group`` has nothing to build, so rollouts can join or leave
between updates. A version stays published after ``finalize``: a rollout that
starts late or missed steps pulls the newest one whenever it asks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from tensorhub import Hub, ManifestMismatch, Publication, PullResult, ServerUnavailable, VersionNotFound
from tensorhub_verl.buffer import PublicationBuffer, aiter_pairs
from tensorhub_verl.config import CONFIG_KEY, TensorHubEngineConfig

log = logging.getLogger(__name__)

BACKEND = "tensorhub"
_RETRY_S = 0.05  # after a version vanished between the wait and the pull


@CheckpointEngineRegistry.register(BACKEND)
class TensorHubCheckpointEngine(CheckpointEngine):
    """Built by verl on every trainer rank (``is_master`` on rank 0) and in every
    rollout worker (``is_master`` left False), with
    ``engine_kwargs["tensorhub"]`` as keyword arguments (see TensorHubEngineConfig).

    Connects to the reference server at construction, so a wrong address fails
    the worker's start (ServerUnavailable after ``hub.connect_timeout_s``).
    ``bucket_size`` is accepted for verl's constructor contract and unused:
    TensorHub moves fixed-size chunks of its own (``hub.chunk_size``).
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **engine_kwargs: Any) -> None:
        self.config = TensorHubEngineConfig.from_kwargs(engine_kwargs)
        self.is_master = is_master
        self.bucket_size = bucket_size
        role = "trainer" if is_master else "worker"
        hub_config = self.config.hub_config(f"verl-{role}@{socket.gethostname()}:{os.getpid()}")
        try:
            self.hub: Hub | None = Hub.connect(self.config.address, config=hub_config)
        except ValueError as e:  # the address is not host:port
            raise ValueError(f"{e}; set {CONFIG_KEY}.address") from e
        except ServerUnavailable as e:
            raise ServerUnavailable(self.config.address, f"address from {CONFIG_KEY}.address") from e
        # trainer (rank 0)
        self._buffer = PublicationBuffer(self.config.buffer_device)
        self._published: Publication | None = None
        self._next_version = 0
        # rollout
        self._received: int | None = None
        self._dest: dict[str, torch.Tensor] | None = None
        self._serving: Publication | None = None

    # ------------------------------------------------------------ topology

    def prepare(self) -> dict[str, Any]:
        """Nothing to allocate per update; the metadata only names this agent."""
        return {"agent": self.hub.agent_id if self.hub else None}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """No group to build: the reference server tells readers where versions are."""
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        """No collective group: rollouts join and leave without a rebuild."""

    def finalize(self) -> None:
        """Keeps the published version (and the buffer) alive: late rollouts still pull it."""

    # ------------------------------------------------------------ trainer

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict[str, float]:
        """Publish the stream as version ``global_steps`` (rank 0 only; without a
        step, the one after the last published). Other ranks consume the stream
        and return no metrics, so verl's merge keeps rank 0's."""
        if not self.is_master:
            async for _ in aiter_pairs(weights):
                pass
            self._close_hub()  # a non-master trainer rank never needs the hub again
            return {}
        version = self._next_version if global_steps is None else int(global_steps)
        start = time.perf_counter()
        if self._published is not None:
            # The contract: after unpublish returns, no reader touches the buffer.
            await asyncio.to_thread(self._published.unpublish, self.config.unpublish_timeout_s)
            self._published = None
        blocked = time.perf_counter() - start
        allocations = self._buffer.allocations
        await self._buffer.fill(weights)
        copied = time.perf_counter() - start - blocked
        self._published = await asyncio.to_thread(self.hub.publish, self.config.model, version, self._buffer.tensors)
        self._next_version = version + 1
        metrics = {
            "tensorhub/version": float(version),
            "tensorhub/unpublish_blocked_s": blocked,
            "tensorhub/copy_s": copied,
            "tensorhub/publish_s": time.perf_counter() - start - blocked - copied,
            "tensorhub/published_mb": self._buffer.nbytes / 2**20,
            "tensorhub/buffer_allocations": float(self._buffer.allocations - allocations),
        }
        log.info("published %r version %d (%.1f MiB); blocked %.3fs draining the previous version",
                 self.config.model, version, metrics["tensorhub/published_mb"], blocked)
        return metrics

    # ------------------------------------------------------------ rollout

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yield the tensors of the newest version >= ``global_steps`` (without a
        step: newer than the last one received), waiting up to
        ``wait_timeout_s`` for the trainer to publish it. A rollout that
        missed steps gets the newest version, not the one it asked for."""
        if global_steps is not None:
            target = int(global_steps)
        else:
            target = 0 if self._received is None else self._received + 1
        result = await asyncio.to_thread(self._pull_newest, target)
        log.info("received %r version %d (%.1f MiB in %.3fs, %.2f GB/s)", self.config.model, result.version,
                 result.nbytes / 2**20, result.seconds, result.gbps)
        for name, tensor in result.tensors.items():
            yield name, tensor

    @property
    def received_version(self) -> int | None:
        """The version the last ``receive_weights`` delivered."""
        return self._received

    def _pull_newest(self, target: int) -> PullResult:
        """Wait for a version >= ``target`` (the server's long poll answers as soon
        as one is pullable) and pull the newest one."""
        model, timeout = self.config.model, self.config.wait_timeout_s
        deadline = time.monotonic() + timeout
        version = None
        while True:
            try:
                version = self.hub.wait_for_version(model, target, timeout=max(0.0, deadline - time.monotonic()))
                return self._pull(version)
            except VersionNotFound as e:
                if time.monotonic() >= deadline:
                    raise VersionNotFound(model, target, (
                        f"no version >= {target} of model {model!r} was published at {self.hub.address} "
                        f"within {timeout:.0f}s (pullable now: {self.hub.versions(model) or 'none'}); "
                        f"check that the trainer publishes under the same model key ({CONFIG_KEY}.model)")) from e
                log.debug("version %s went away before the pull; waiting again", version)
                time.sleep(_RETRY_S)  # it may still look visible for a moment

    def _pull(self, version: int) -> PullResult:
        if self._serving is not None:
            # Our destination is about to be overwritten: stop serving it first.
            self._serving.unpublish(self.config.unpublish_timeout_s)
            self._serving = None
        try:
            result = self.hub.pull(self.config.model, version, into=self._dest, serve=self.config.serve)
        except ManifestMismatch:
            if self._dest is None:
                raise
            log.warning("%r version %d has another layout than the last one; reallocating", self.config.model, version)
            self._dest = None
            result = self.hub.pull(self.config.model, version, serve=self.config.serve)
        self._dest, self._serving, self._received = result.tensors, result.publication, result.version
        return result

    # ------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        """Unpublish what this process holds (draining readers) and disconnect."""
        self._published = self._serving = None
        self._close_hub()

    def _close_hub(self) -> None:
        if self.hub is not None:
            self.hub.close(timeout=self.config.unpublish_timeout_s)
            self.hub = None
