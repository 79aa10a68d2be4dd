"""``tensorhub bench rl [KEY=VALUE ...] [--flags]``: Hydra overrides of
``recipes/bench/rl.yaml``, and the flag forms the other benchmarks take
(``--size``, ``--readers``, ``--link``, ``--json``), which become overrides.
Nothing heavy is imported here: ``tensorhub --help`` stays fast."""

from __future__ import annotations

import argparse
import shutil
import sys

# flag -> config key; each given flag becomes the override KEY=VALUE
FLAGS = {"scenario": "scenario", "size": "size", "readers": "rollouts", "rollouts": "rollouts", "link": "link",
         "zone_link": "zone_link", "steps": "steps", "hosts": "hosts", "out": "out", "seed": "seed",
         "lora_rank": "lora_rank"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="Hydra overrides, e.g. scenario=crossdc rollouts=8 size=256MiB step_s=3 "
                             "(keys: recipes/bench/rl.yaml and recipes/bench/scenario/*.yaml)")
    parser.add_argument("--scenario", choices=["standalone", "elastic", "crossdc"], help="same as scenario=...")
    parser.add_argument("--size", help="bytes per version, e.g. 256MiB")
    parser.add_argument("--readers", "--rollouts", dest="rollouts", type=int, help="rollout processes (R)")
    parser.add_argument("--link", help="every host's link rate, as tc writes it (e.g. 1gbit)")
    parser.add_argument("--zone-link", dest="zone_link", help="crossdc: the link between the zones (e.g. 100mbit)")
    parser.add_argument("--steps", type=int, help="trainer steps per method")
    parser.add_argument("--seed", type=int, help="seed of the stragglers and preemptions (same for every method)")
    parser.add_argument("--hosts", choices=["netns", "local"],
                        help="netns: emulated hosts with capped links (root); local: this host, no caps")
    parser.add_argument("--lora-rank", dest="lora_rank", type=int,
                        help="> 0: LoRA mode, the base published once and each step only an all-linear adapter "
                             "of this rank (standalone, elastic)")
    parser.add_argument("--out", help="folder for the JSON, Markdown table and PNG plot")
    parser.add_argument("--json", help="also write the results here as JSON")
    parser.add_argument("--config-dir", help="the recipes folder (default: recipes/bench of the source tree)")
    parser.add_argument("--no-live", action="store_true", help="no live view, only the results")


def overrides(args: argparse.Namespace) -> list[str]:
    out = list(args.overrides)
    for flag, key in FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            out.append(f"{key}={value}")
    return out


def main(args: argparse.Namespace) -> int:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from tensorhub.bench.rl.config import compose
    from tensorhub.bench.rl.runner import run

    try:
        cfg = compose(overrides(args), config_dir=args.config_dir)
    except (HydraException, OmegaConfBaseException, ValueError, FileNotFoundError) as e:  # the user's to fix
        print(f"tensorhub bench rl: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    run(cfg, live=not args.no_live)
    if args.json:
        from pathlib import Path

        shutil.copyfile(Path(cfg.out) / f"rl-{cfg.scenario}.json", args.json)
    return 0
