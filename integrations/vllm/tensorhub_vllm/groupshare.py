"""One Resolve per engine and version: the first worker resolves for the
engine's workers and hands the answer over the engine's own CPU group
(``tensorhub.client.groupanswer``).

    every worker, each update, in the same order (collective_rpc):
      first worker ── Hub.resolve_for_group ──▶ answer ─┐
                                                        ├─ broadcast (gloo CPU group) ─▶ all: pull(answer=)
      a failed resolve: None, each resolves on its own ─┘
      all: barrier (bounded) ──▶ the first worker releases the answer's lease

The answer is a few KiB in the steady state (holders come lean), so the
broadcast costs less than the Resolve each worker would send. The lease must
outlive every worker's reads, hence the barrier before its release; it is
bounded by the pull's own deadline, so a worker that died cannot hang the
others past it.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch.distributed as dist

from tensorhub import GroupAnswer, Hub
from tensorhub_vllm.vllm_internals import engine_cpu_group

log = logging.getLogger(__name__)

_BARRIER_SLACK_S = 60.0  # beyond the pull's own deadline: the slowest worker's apply-free end of its pull


class EngineShare:
    """This worker's part in sharing one Resolve among its engine's workers."""

    def __init__(self, group: Any, rank: int, world: int, *, model: str, engine: str, pull_timeout_s: float) -> None:
        self._group, self.rank, self.world = group, rank, world
        self._model, self._engine = model, engine
        self._timeout = datetime.timedelta(seconds=pull_timeout_s + _BARRIER_SLACK_S)
        self._members: list[str] | None = None  # every worker's agent id, learnt at the first update

    @classmethod
    def of_engine(cls, world_size: int, *, model: str, engine: str, pull_timeout_s: float) -> EngineShare | None:
        """The share among this engine's ``world_size`` workers, or None when it
        is one worker or its CPU group spans more than this engine."""
        found = engine_cpu_group(world_size)
        if found is None:
            return None
        return cls(*found, model=model, engine=engine, pull_timeout_s=pull_timeout_s)

    def exchange(self, hub: Hub, version: int | str) -> tuple[GroupAnswer | None, BaseException | None]:
        """Every worker calls this once per update: the first resolves for all.
        Returns (the answer or None, the first worker's own failure to raise)."""
        if self._members is None:
            members: list[Any] = [None] * self.world
            dist.all_gather_object(members, hub.agent_id, group=self._group)
            self._members = [str(m) for m in members]
        failure: BaseException | None = None
        sent: list[Any] = [None]
        if self.rank == 0:
            try:
                sent[0] = hub.resolve_for_group(self._model, version, group=self._engine, members=self._members)
            except Exception as e:  # noqa: BLE001  the others resolve on their own and meet it too
                failure = e
        dist.broadcast_object_list(sent, src=0, group=self._group)
        return sent[0], failure

    def finish(self, hub: Hub, answer: GroupAnswer | None) -> None:
        """Every worker's pull is over (landed or failed): the lease goes."""
        try:
            dist.monitored_barrier(group=self._group, timeout=self._timeout)
        finally:
            if self.rank == 0 and answer is not None:
                hub.release_group_answer(answer)
