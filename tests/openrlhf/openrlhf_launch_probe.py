"""Runs the launcher on a stock command line (argv) up to the first thing
OpenRLHF's ``train`` does after Ray: ``get_strategy(args)``. The probe stands in
for ``ray.init`` (no cluster is started) and for ``get_strategy`` (it records
what the stock script parsed and bound, then stops the run), and prints
that as one JSON line. Everything between, OpenRLHF's parser, its checks and
the launcher's wiring, is the real code."""

from __future__ import annotations

import json
import sys


class Stop(Exception):
    pass


def main() -> None:
    import openrlhf.utils
    import ray

    seen: dict = {}

    def fake_ray_init(*args, **kwargs):  # stands in for a cluster: what OpenRLHF asked for
        seen["runtime_env"] = kwargs.get("runtime_env")

    def probe_get_strategy(args):
        script = sys._getframe(1).f_globals  # the stock script's module, run as __main__
        seen["script"] = script["__name__"]
        seen["PolicyModelActor"] = _qualname(script["PolicyModelActor"])
        seen["create_vllm_engines"] = _qualname(script["create_vllm_engines"])
        seen["args"] = {
            "actor.model_name_or_path": args.actor.model_name_or_path,
            "ds.zero_stage": args.ds.zero_stage,
            "vllm.num_engines": args.vllm.num_engines,
            "vllm.tensor_parallel_size": args.vllm.tensor_parallel_size,
            "rollout.batch_size": args.rollout.batch_size,
            "train.async_enable": args.train.async_enable,
            "actor.adam.lr": args.actor.adam.lr,
        }
        raise Stop

    ray.init = fake_ray_init
    ray.is_initialized = lambda: False
    openrlhf.utils.get_strategy = probe_get_strategy

    from tensorhub_openrlhf.train_ppo_ray import main as launch

    try:
        launch(sys.argv[1:])
    except Stop:
        pass
    print(json.dumps(seen))


def _qualname(obj) -> str:
    cls = getattr(obj, "__ray_actor_class__", obj)
    return f"{cls.__module__}.{cls.__qualname__}"


if __name__ == "__main__":
    main()
