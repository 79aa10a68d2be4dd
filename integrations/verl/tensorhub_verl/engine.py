"""verl checkpoint engine ``tensorhub``: every trainer rank publishes its part
of each step as a shard of one version of a model; every rollout pulls the
version it needs straight out of the memory of whoever holds it (the trainer
ranks, or rollouts that already have it).

Who does what, per weight update that verl's ``CheckpointEngineManager`` runs:

    trainer rank r of n                        each rollout worker
    send_weights(stream, step):                receive_weights(step):
      unpublish step-1 (drains its readers)      wait until a version >= step is
      keep rank r's 1/n of each tensor of        visible (all n shards in), pull
        the stream (split.py) in its buffer      the newest one from all n ranks,
      publish those regions as its shard         yield (name, tensor), keep serving
        of version `step`                        it (serve=True)

No rank holds or sends more than about 1/n of the model: the trainer's egress
is spread over the n ranks' links. verl 0.9.1 gives a checkpoint engine each
rank's stream of full tensors (its FSDP engine also has
``get_per_tensor_param_shard``, the local shards without the gather, but hands
the training engine only to its built-in ``delta_sharded`` backend; see
docs/integrations/verl.md), so each rank copies its rows out of the gathered tensors.

There is no process group: ``build_topology`` returns nothing to dispatch and
``init_process_group`` has nothing to build, so rollouts can join or leave
between updates. A version stays published after ``finalize``: a rollout that
starts late or missed steps pulls the newest one whenever it asks.

``cut: readers`` (off by default) makes the publish collective over the
trainer's torch.distributed world (``cut_group``, default the whole world,
which is verl's FSDP world): each rank also publishes its share of the
readers' cut (``Hub.publish(cut="readers")``). Every rank then publishes,
even one whose split of the stream is empty (refused on every rank at once).

``publish_together: true`` (off by default; with ``delta: off``): the ranks
announce and withdraw each step as one group over the same group
(``Hub.publish(trainer_group=)``): rank 0 sends every rank's announce in one
message and their withdrawals in another, so a step costs the reference server
two messages from the whole trainer instead of two per rank. Collective, with
the cut's rule: every rank holds a part of the step.

``lora: true`` (verl's ``lora_rank > 0``, adapter not merged): the trainer
ranks publish only the adapter, each its FSDP2 shards of the LoRA A/B matrices
in place (``tensorhub.lora.publish_adapter``: PEFT's saved names, the PEFT
settings beside them), as version ``step`` of ``model``; no buffer, no gather,
no ``layered_summon``. The stream verl passes (the base weights) is not read.
The module comes from the calling verl worker (verl_internals.py) unless
``module`` is set. Being in place, the adapter is withdrawn at ``finalize``,
once the rollouts have it (verl calls it before training goes on); rollouts
keep serving their copies (``serve``) to late ones. A rollout's
``receive_weights`` pulls the adapter version into ``adapter`` (a
``tensorhub.lora.PulledAdapter``) and yields nothing: the base is unchanged.
Serving it from vLLM is ``tensorhub_vllm``'s ``AdapterVersions``.
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
from tensorhub.client.trainercut import ranks_holding_nothing
from tensorhub.delta.codec import DeltaEncoder
from tensorhub.lora import PulledAdapter, publish_adapter, pull_adapter
from tensorhub.server.ray_actor import resolve_address
from tensorhub_verl import pull_stats
from tensorhub_verl.buffer import RankBuffer
from tensorhub_verl.config import CONFIG_KEY, TensorHubEngineConfig
from tensorhub_verl.verl_internals import calling_workers_module

log = logging.getLogger(__name__)

BACKEND = "tensorhub"
_RETRY_S = 0.05  # after a version vanished between the wait and the pull


@CheckpointEngineRegistry.register(BACKEND)
class TensorHubCheckpointEngine(CheckpointEngine):
    """Built by verl on every trainer rank (``is_master`` on rank 0) and in every
    rollout worker (``is_master`` left False), with
    ``engine_kwargs["tensorhub"]`` as keyword arguments (see TensorHubEngineConfig).

    Connects to the reference server at construction (``address: auto``: the
    cluster's server actor, started by whichever worker asks first), so a
    wrong address fails the worker's start (ServerUnavailable after
    ``hub.connect_timeout_s``).
    ``bucket_size`` is accepted for verl's constructor contract and unused:
    TensorHub moves fixed-size chunks of its own (``hub.chunk_size``).
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **engine_kwargs: Any) -> None:
        self.config = TensorHubEngineConfig.from_kwargs(engine_kwargs)
        self.is_master = is_master
        self.bucket_size = bucket_size
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        hub_config = self.config.hub_config(f"verl-{'trainer' if is_master else 'worker'}@{self.worker}")
        address = resolve_address(self.config.address, config=self.config.server_config())
        try:
            self.hub: Hub | None = Hub.connect(address, config=hub_config)
        except ValueError as e:  # the address is not host:port
            raise ValueError(f"{e}; set {CONFIG_KEY}.address") from e
        except ServerUnavailable as e:
            raise ServerUnavailable(address, f"address from {CONFIG_KEY}.address={self.config.address}") from e
        # trainer (every rank)
        self._buffer = RankBuffer(self.config.buffer_device)
        self._published: Publication | None = None
        self._next_version = 0
        # (rank, world) of the trainer's process group; None: ask torch.distributed at the first send
        self.rank_and_world: tuple[int, int] | None = None
        # cut: readers gathers over this torch.distributed group, and publish_together announces as it;
        # None: the default (whole) world
        self.cut_group: Any = None
        # lora: the PEFT model whose adapter this rank publishes; None: the calling verl worker's
        self.module: torch.nn.Module | None = None
        # rollout
        self._received: int | None = None
        self._dest: dict[str, torch.Tensor] | None = None
        self._serving: Publication | None = None
        self.last_pull: PullResult | None = None  # of the last receive_weights (delta_from, read_bytes, ...)
        self.adapter: PulledAdapter | None = None  # lora: the adapter version received last

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
        """Keeps the published version (and the buffer) alive: late rollouts
        still pull it. ``lora``: withdraws the adapter published in place
        (verl calls this once the rollouts have it), so the optimizer may
        write the parameters again."""
        if self.config.lora and self._published is not None:
            publication, self._published = self._published, None
            publication.unpublish(self.config.unpublish_timeout_s)

    # ------------------------------------------------------------ trainer

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict[str, float]:
        """Publish this rank's part of the stream as its shard of version
        ``global_steps`` (without a step, the one after the last published).

        Every trainer rank calls it with the same stream (verl's contract), so
        the ranks' shards cover the model and the version becomes visible when
        the last one is in. Returns this rank's figures under
        ``tensorhub/rank{r}/...``; rank 0 adds the step's (version, payload,
        the rollouts' previous pulls), so verl's merge of the ranks' dicts keeps all."""
        rank, world = self.rank_and_world or _rank_and_world()
        version = self._next_version if global_steps is None else int(global_steps)
        if self.config.lora:
            module = self.module if self.module is not None else calling_workers_module()
            getattr(weights, "close", lambda: None)()  # the base weights: an adapter version does not read them
            return await self._send_adapter(module, version, rank, world)
        # Before this step is published: only the pulls of the steps before it.
        pulls = await asyncio.to_thread(pull_stats.take, self.config.model) if rank == 0 else []
        start = time.perf_counter()
        previous = None if self._published is None else self._published.version
        if self._published is not None:
            # The contract: after unpublish returns, no reader touches the buffer.
            await asyncio.to_thread(self._published.unpublish, self.config.unpublish_timeout_s)
            self._published = None
        blocked = time.perf_counter() - start
        allocations = self._buffer.allocations
        delta = (DeltaEncoder(from_version=previous, to_version=version)
                 if previous is not None and self.config.delta == "auto" and previous != version else None)
        covered = await self._buffer.fill(weights, rank, world, delta)
        copied = time.perf_counter() - start - blocked
        delta_bytes = 0
        if self.config.cut is not None or self.config.publish_together:  # collective: every rank publishes
            _every_rank_holds_some(bool(self._buffer.shards), self.cut_group,
                                   "cut" if self.config.cut is not None else "publish_together")
        if self._buffer.shards:
            kwargs: dict[str, Any] = {}
            if delta is not None and covered:
                kwargs = {"delta_from": previous, "delta": delta.finish()}
                delta_bytes = kwargs["delta"].nbytes
            if self.config.cut is not None:
                kwargs.update(cut=self.config.cut, cut_group=self.cut_group,
                              cut_gather_bytes=self.config.cut_gather_bytes)
            if self.config.publish_together:
                kwargs["trainer_group"] = self.cut_group if self.cut_group is not None else torch.distributed.group.WORLD
            self._published = await asyncio.to_thread(self.hub.publish, self.config.model, version,
                                                      self._buffer.shards, manifest=self._buffer.manifest, **kwargs)
        self._next_version = version + 1
        mine = f"tensorhub/rank{rank}"
        metrics = {
            f"{mine}/published_mb": self._buffer.nbytes / 2**20,
            f"{mine}/stall_s": blocked + copied,  # what training waits for: drain + copy
            f"{mine}/unpublish_blocked_s": blocked,
            f"{mine}/copy_s": copied,
            f"{mine}/publish_s": time.perf_counter() - start - blocked - copied,
            f"{mine}/buffer_allocations": float(self._buffer.allocations - allocations),
            f"{mine}/delta_mb": delta_bytes / 2**20,  # its delta from the step before (0: none published)
        }
        cut = None if self._published is None else self._published.cut_report
        if cut is not None:  # cut: readers: its share of the readers' cut (0 when none is known yet)
            metrics.update({f"{mine}/cut_mb": cut.nbytes / 2**20, f"{mine}/cut_s": cut.seconds,
                            f"{mine}/cut_peak_gather_mb": cut.peak_gather_bytes / 2**20})
        if rank == 0:
            model_bytes = self._buffer.manifest.total_bytes
            metrics.update({
                "tensorhub/version": float(version),
                # verl's name (delta engine) for the bytes one update carries
                "checkpoint_engine/payload_mbytes": model_bytes / 2**20,
                "tensorhub/trainer_ranks": float(world),
                "tensorhub/max_rank_share": max(self._buffer.rank_bytes) / max(1, model_bytes),
                **pull_stats.summarize(pulls),
            })
        log.info("rank %d/%d published its %.1f MiB of %r version %d; stalled %.3fs (%.3fs draining step-1)",
                 rank, world, metrics[f"{mine}/published_mb"], self.config.model, version, blocked + copied, blocked)
        return metrics

    async def _send_adapter(self, module: torch.nn.Module, version: int, rank: int, world: int) -> dict[str, float]:
        """Publish this rank's shards of the LoRA matrices of ``module`` in place as ``version``."""
        pulls = await asyncio.to_thread(pull_stats.take, self.config.model) if rank == 0 else []
        start = time.perf_counter()
        if self._published is not None:  # not finalized (a failed update): readers drain first
            await asyncio.to_thread(self._published.unpublish, self.config.unpublish_timeout_s)
            self._published = None
        blocked = time.perf_counter() - start
        self._published = await asyncio.to_thread(publish_adapter, self.hub, self.config.model, version, module)
        self._next_version = version + 1
        mine = f"tensorhub/rank{rank}"
        metrics = {f"{mine}/published_mb": self._published.nbytes / 2**20, f"{mine}/stall_s": blocked,
                   f"{mine}/unpublish_blocked_s": blocked,
                   f"{mine}/publish_s": time.perf_counter() - start - blocked}
        if rank == 0:
            metrics.update({"tensorhub/version": float(version),
                            "checkpoint_engine/payload_mbytes": self._published.manifest.total_bytes / 2**20,
                            "tensorhub/trainer_ranks": float(world), **pull_stats.summarize(pulls)})
        log.info("rank %d/%d published its %.3f MiB of adapter %r version %d in place", rank, world,
                 metrics[f"{mine}/published_mb"], self.config.model, version)
        return metrics

    @property
    def publication(self) -> Publication | None:
        """What this trainer rank publishes now (its shard of the last step)."""
        return self._published

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
        if self.config.lora:
            await asyncio.to_thread(self._pull_newest_adapter, target)
            return  # the base is unchanged: nothing to load into it
        result = await asyncio.to_thread(self._pull_newest, target)
        log.info("received %r version %d (%.1f MiB in %.3fs, %.2f GB/s)", self.config.model, result.version,
                 result.nbytes / 2**20, result.seconds, result.gbps)
        line = pull_stats.PullLine(self.worker, result.version, result.nbytes, result.seconds)
        await asyncio.to_thread(pull_stats.record, self.config.model, line)
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

    def _pull_newest_adapter(self, target: int) -> None:
        """As ``_pull_newest``, for an adapter version: pulled into new memory
        (it is small), served from there; the previous one is withdrawn after."""
        previous = self._serving
        deadline = time.monotonic() + self.config.wait_timeout_s
        while True:
            version = self.hub.wait_for_version(self.config.model, target,
                                                timeout=max(0.0, deadline - time.monotonic()))
            try:
                adapter = pull_adapter(self.hub, self.config.model, version, serve=self.config.serve)
                break
            except VersionNotFound:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(_RETRY_S)
        self.adapter, self.last_pull, self._received = adapter, adapter.result, adapter.version
        self._serving = adapter.result.publication
        if previous is not None:
            previous.unpublish(self.config.unpublish_timeout_s)
        pull_stats.record(self.config.model, pull_stats.PullLine(self.worker, adapter.version,
                                                                 adapter.result.nbytes, adapter.result.seconds))
        log.info("received adapter %r version %d (%.3f MiB in %.3fs)", self.config.model, adapter.version,
                 adapter.result.nbytes / 2**20, adapter.result.seconds)

    def _pull(self, version: int) -> PullResult:
        if self._serving is not None:
            # Our destination is about to be overwritten: stop serving it first.
            self._serving.unpublish(self.config.unpublish_timeout_s)
            self._serving = None
        # The destination holds the version received last: patched from the
        # deltas where the trainer published them (delta: auto).
        have = self._received if self._dest is not None and self.config.delta == "auto" else None
        try:
            result = self.hub.pull(self.config.model, version, into=self._dest, serve=self.config.serve, have=have)
        except ManifestMismatch:
            if self._dest is None:
                raise
            log.warning("%r version %d has another layout than the last one; reallocating", self.config.model, version)
            self._dest = None
            result = self.hub.pull(self.config.model, version, serve=self.config.serve)
        self._dest, self._serving, self._received = result.tensors, result.publication, result.version
        self.last_pull = result
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


def _every_rank_holds_some(holds: bool, group: Any, setting: str) -> None:
    """``cut: readers`` and ``publish_together`` publish collectively: a rank
    with nothing to publish could not join and the others would wait for it.
    Asked of every rank at once, so all refuse together instead."""
    off = "null" if setting == "cut" else "false"
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError(f"TensorHubEngineConfig.{setting}: the ranks publish over the trainer's torch.distributed "
                         f"group, and none is initialized (set {CONFIG_KEY}.{setting} to {off})")
    empty = ranks_holding_nothing(holds, group)
    if empty:
        raise ValueError(f"TensorHubEngineConfig.{setting}: trainer rank(s) {empty} hold nothing of this step (more "
                         f"ranks than elements to split?), and a collective publish needs every rank; set "
                         f"{CONFIG_KEY}.{setting} to {off}")


def _rank_and_world() -> tuple[int, int]:
    """This trainer rank's place in its process group (verl's trainer workers
    initialise torch.distributed before any update); one rank without it."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1
