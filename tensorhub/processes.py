"""How TensorHub starts the Python processes of its tests, benchmarks and fault
campaign (hub processes, trainer and rollout roles, chaos workers).

    parent ──(once)──> fork server: imports torch and tensorhub.local.hubprocess, then waits
    parent ──start()──> fork server ──fork──> child: the parent's environment,
                                              sys.path and working directory, then target(*args)

A child forked from the fork server starts with torch already imported: it
runs its target 14-17 ms after ``start()``, where a spawned child spent 2.6-4.5 s
importing torch again on these 2-core machines (measured here), and a test run
starts hundreds of them (tests/core/test_shards.py and test_contract.py: 207 s
spawned, 86 s forked).

Plain fork is not an option: the parent runs threads (gRPC, NIXL progress,
UCX) that a fork would copy in the middle of their locks. The fork server is
single-threaded: it only imports modules that start no thread (nothing here
creates a NIXL agent or a gRPC channel at import), and a child sets up NIXL,
UCX and gRPC itself.

A fork server's child inherits the fork server's environment, frozen when it
started; a spawned one the parent's at the time it starts. ``context().Process``
keeps the second: the child takes the parent's environment as it is when the
child is made (UCX and token variables a test sets before starting a child).
Its sys.path and working directory multiprocessing sends along, as for spawn.
"""

from __future__ import annotations

import os
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

# Imported by the fork server before it forks anything: what every child needs and
# nothing that starts a thread (NIXL and gRPC are imported by the children).
PRELOAD = ["torch", "numpy", "tensorhub.local.hubprocess"]


class _AsParentProcess(ForkServerProcess):
    """A fork server's process that runs its target in the parent's environment
    as it was when the process was made."""

    def __init__(self, group: Any = None, target: Any = None, name: str | None = None, args: tuple = (),
                 kwargs: dict | None = None, *, daemon: bool | None = None) -> None:
        super().__init__(group, _as_parent, name, (dict(os.environ), target, args, kwargs or {}),
                         daemon=daemon)


class _Context(ForkServerContext):
    Process = _AsParentProcess


_CONTEXT = _Context()


def context() -> ForkServerContext:
    """Use as ``multiprocessing.get_context(...)``: its Process, Pipe, Queue,
    Event, Lock, Value and Array."""
    _CONTEXT.set_forkserver_preload(PRELOAD)  # read when the fork server starts: once per parent process
    return _CONTEXT


def _as_parent(env: dict[str, str], target: Any, args: tuple, kwargs: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args, **kwargs)
