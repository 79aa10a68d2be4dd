"""A trainer group's messages, sent by its first rank.

    every rank (collective, same order)       first rank                     server
      its items ── all_gather ──────────────▶ every rank's, in rank order
                                               send(all) ─────────────────▶  one message (or a few,
                                                           ◀── one result    ``MAX_BATCH`` each)
                                                               per item
      its own results ◀── broadcast ────────── split by rank

A trainer's ranks publish with ``cut=`` together (the cut is gathered over
their group), so each step they also announce and withdraw together; sent by
each rank that is 256 messages twice a step at 256 ranks, sent by the first
rank a few (``tensorhub bench scale --trainer-cut``). An engine's workers share
theirs the same way over the engine's own group (``engineshare``).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from tensorhub.errors import TensorHubError


class GroupRoundFailed(TensorHubError):
    """A rank of the group did not come to the round in time: nothing was sent
    for anyone; each rank sends its own."""


def sent_by_first(mine: list, group: Any, send: Callable[[list], list], *, bound_s: float | None = None) -> list:
    """Every rank of ``group`` (a torch.distributed process group; None: the default one) calls this
    at once with its ``mine``; the first rank calls ``send`` with every rank's
    items in rank order, which answers one picklable result per item, and each
    rank gets its own items' results. ``bound_s``: on a gloo group, a rank that
    does not come within that many seconds fails the round for every rank
    (``GroupRoundFailed``), so no rank waits on a dead one past it; other
    backends wait as long as the group's own timeout."""
    import torch.distributed as dist

    if bound_s is not None and dist.get_backend(group) == "gloo":
        try:
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=max(bound_s, 0.001)))
        except RuntimeError as e:
            raise GroupRoundFailed(f"a rank of the group did not come within {bound_s:.1f}s: {e}") from e
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    box: list[Any] = [None]
    failure: BaseException | None = None
    if dist.get_rank(group) == 0:
        try:
            results, at, box[0] = send([item for items in every for item in items]), 0, []
            for items in every:
                box[0].append(results[at:at + len(items)])
                at += len(items)
        except BaseException as e:  # noqa: BLE001  the others must not wait on a broadcast that never comes
            box[0], failure = None, e
    dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    if failure is not None:
        raise failure
    if box[0] is None:
        raise GroupRoundFailed("the group's first rank could not send the round's messages")
    return box[0][dist.get_rank(group)]
