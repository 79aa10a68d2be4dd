"""Hydra recipes for OpenRLHF with TensorHub, rendered to the launcher command.

A recipe (``recipes/openrlhf/*.yaml``) has two nodes:

* ``tensorhub``: the fields of TensorHubSettings; they become ``TENSORHUB_*``
  variables (``hub`` as JSON).
* ``openrlhf``: OpenRLHF's own flags as a tree: the path of a key is the flag
  (``actor: {adam: {lr: 5e-7}}`` is ``--actor.adam.lr 5e-7``); ``true`` is a
  bare switch, ``false`` and ``null`` leave the flag out, a list gives
  several values (``nargs``).

    python -m tensorhub_openrlhf.recipe --config-dir recipes/openrlhf --config-name ppo_ray \\
        openrlhf.actor.model_name_or_path=/models/llama3-8b          # prints the command
    python -m tensorhub_openrlhf.recipe ... --run                     # runs it

Overrides are Hydra's (``key=value``, ``+key=value`` for a flag the recipe
does not list). The launcher, not the recipe, checks the flags: OpenRLHF's
parser rejects one it does not know.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tensorhub_openrlhf.settings import VARIABLES, TensorHubSettings

LAUNCHER = ["python", "-m", "tensorhub_openrlhf.train_ppo_ray"]


def render(config: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """``(environment, argv)`` of a recipe: TENSORHUB_* variables and OpenRLHF's flags."""
    unknown = sorted(set(config) - {"tensorhub", "openrlhf"})
    if unknown:
        raise ValueError(f"recipe has top-level key(s) {unknown}; known: ['openrlhf', 'tensorhub']")
    env = TensorHubSettings.from_env(_variables(config.get("tensorhub") or {})).to_env()  # the launcher's checks
    return env, _flags(config.get("openrlhf") or {}, "")


def _variables(node: Mapping[str, Any]) -> dict[str, str]:
    """The recipe's ``tensorhub`` node as the TENSORHUB_* variables it stands for."""
    by_field = {name: var for var, name in VARIABLES.items()}
    unknown = sorted(set(node) - set(by_field))
    if unknown:
        raise ValueError(f"recipe node 'tensorhub' has no key(s) {unknown}; known: {list(by_field)}")
    env = {}
    for key, value in node.items():
        if isinstance(value, bool):
            env[by_field[key]] = "1" if value else "0"
        elif isinstance(value, Mapping):
            env[by_field[key]] = json.dumps(dict(value), sort_keys=True)
        else:
            env[by_field[key]] = "" if value is None else str(value)
    return env


def _flags(node: Mapping[str, Any], prefix: str) -> list[str]:
    argv: list[str] = []
    for key, value in node.items():
        flag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            argv += _flags(value, f"{flag}.")
        elif value is True:
            argv.append(f"--{flag}")
        elif value is False or value is None:
            continue
        elif isinstance(value, Sequence) and not isinstance(value, str):
            argv += [f"--{flag}", *(str(v) for v in value)]
        else:
            argv += [f"--{flag}", str(value)]
    return argv


def command(env: Mapping[str, str], argv: Sequence[str]) -> str:
    """One shell line: the variables, then the launcher with the flags."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *LAUNCHER, *map(shlex.quote, argv)])


def compose(config_dir: str, config_name: str, overrides: Sequence[str]) -> dict[str, Any]:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tensorhub_openrlhf.recipe", description=__doc__.split("\n")[0])
    parser.add_argument("--config-dir", default="recipes/openrlhf")
    parser.add_argument("--config-name", default="ppo_ray")
    parser.add_argument("--run", action="store_true", help="run the command instead of printing it")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, key=value")
    args = parser.parse_args(argv)
    env, flags = render(compose(args.config_dir, args.config_name, args.overrides))
    if not args.run:
        print(command(env, flags))
        return
    os.execvpe(sys.executable, [sys.executable, *LAUNCHER[1:], *flags], {**os.environ, **env})


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        sys.exit(f"tensorhub_openrlhf.recipe: {e}")
