"""``python -m tensorhub_openrlhf.train_ppo_ray <OpenRLHF's flags>``: OpenRLHF's
own ``openrlhf.cli.train_ppo_ray``, run unchanged as ``__main__`` (its parser,
its checks, its ``train``), with TensorHub in place of the NCCL weight sync.

Before the stock script runs, the launcher
1. reads the ``TENSORHUB_*`` settings (a bad one fails here, before Ray starts);
2. points the names the script imports at TensorHub's classes:
   ``create_vllm_engines`` (engines with TensorHub's worker extension) and
   ``PolicyModelActor`` (the trainer that publishes ZeRO-3 partitions);
3. adds the ``TENSORHUB_*`` variables to the ``runtime_env`` that OpenRLHF
   passes to ``ray.init``, so every Ray worker on every node reads the same
   settings. With ``TENSORHUB_ADDRESS=auto`` the first process that needs the
   reference server starts it as a detached Ray actor on the head node
   (``tensorhub.server.ray_actor``); the launcher asks for it right after
   ``ray.init``, so a server that cannot start fails the launch.
"""

from __future__ import annotations

import functools
import logging
import runpy
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tensorhub_openrlhf.settings import TensorHubSettings

log = logging.getLogger(__name__)

STOCK_MODULE = "openrlhf.cli.train_ppo_ray"


def install() -> None:
    """Point the names OpenRLHF's script imports at TensorHub's classes (the
    script does ``from openrlhf.trainer.ray import create_vllm_engines`` and
    ``from openrlhf.trainer.ray.ppo_actor import PolicyModelActor`` when it runs)."""
    import openrlhf.trainer.ray as trainer_ray
    from openrlhf.trainer.ray import ppo_actor

    from tensorhub_openrlhf.actors import TensorHubPolicyModelActor
    from tensorhub_openrlhf.engines import create_vllm_engines

    trainer_ray.create_vllm_engines = create_vllm_engines
    ppo_actor.PolicyModelActor = TensorHubPolicyModelActor


def ray_init_with(settings: TensorHubSettings, init: Callable[..., Any]) -> Callable[..., Any]:
    """``init`` (``ray.init``) with the settings added to its runtime_env's env_vars."""

    @functools.wraps(init)
    def ray_init(*args: Any, **kwargs: Any) -> Any:
        runtime_env = dict(kwargs.get("runtime_env") or {})
        runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **settings.to_env()}
        kwargs["runtime_env"] = runtime_env
        context = init(*args, **kwargs)
        if settings.address.strip().lower() == "auto":
            from tensorhub.server.ray_actor import resolve_address

            log.warning("tensorhub: reference server at %s (address 'auto')", resolve_address("auto"))
        return context

    return ray_init


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    settings = None if {"-h", "--help"} & set(argv) else TensorHubSettings.from_env()
    import ray

    install()
    stock_init = ray.init
    if settings is not None:
        ray.init = ray_init_with(settings, stock_init)
    sys.argv = [STOCK_MODULE.replace(".", "/") + ".py", *argv]
    try:
        runpy.run_module(STOCK_MODULE, run_name="__main__", alter_sys=True)
    finally:
        ray.init = stock_init


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a TENSORHUB_* setting: say which, without a traceback
        if "TENSORHUB_" not in str(e):
            raise
        sys.exit(f"tensorhub_openrlhf: {e}")
