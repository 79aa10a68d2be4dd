"""The recipes in recipes/verl compose onto verl's own trainer configs and
yield verl's CheckpointEngineConfig for the ``tensorhub`` backend; the
``verl.plugins`` entry point registers the backend on ``import verl``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import verl
from hydra import compose, initialize_config_dir
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import CheckpointEngineConfig

from tensorhub.server.ray_actor import ensure_server, shutdown_server

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "verl"
VERL_CONFIGS = Path(verl.__file__).parent
KEY = "actor_rollout_ref.rollout.checkpoint_engine"
ADD_ENGINE = f"+checkpoint_engine@{KEY}=tensorhub"  # for trainers whose own config is the primary one
EXPERIMENTAL = {
    "fully_async_ppo_trainer": VERL_CONFIGS / "experimental" / "fully_async_policy" / "config",
    "one_step_off_ppo_trainer": VERL_CONFIGS / "experimental" / "one_step_off_policy" / "config",
}


def compose_engine(config_dir: Path, name: str, overrides: list[str]) -> CheckpointEngineConfig:
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose(config_name=name, overrides=overrides)
    return cfg, omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine)


def test_separate_async_recipe_yields_the_tensorhub_engine(server):
    cfg, engine = compose_engine(RECIPES, "tensorhub_separate_async",
                                 [f"{KEY}.engine_kwargs.tensorhub.address={server.address}"])
    assert isinstance(engine, CheckpointEngineConfig)
    assert (engine.backend, engine.custom_backend_module) == ("tensorhub", "tensorhub_verl.engine")
    assert cfg.trainer.v1.trainer_mode == "separate_async" and cfg.actor_rollout_ref.hybrid_engine is False
    # verl's workers build the engine from exactly these values
    built = CheckpointEngineRegistry.new(engine.backend, bucket_size=engine.update_weights_bucket_megabytes << 20,
                                         **engine.engine_kwargs[engine.backend])
    try:
        assert built.hub.address == server.address and built.config.model == "policy"
        assert built.config.hub == {"connect_timeout_s": 10, "chunk_size": 32 << 20, "read_workers": 4}
    finally:
        built.shutdown()


def test_fp8_recipe_turns_on_verls_fp8_rollout():
    """tensorhub_separate_async_fp8: verl's own rollout switch (``quantization:
    fp8``, which verl's vLLM server turns into vLLM's ``quantization`` and a
    block-FP8 ``quantization_config``) on top of the TensorHub recipe, whose
    checkpoint engine is unchanged: it moves bf16 steps, verl quantizes them."""
    from verl.workers.config import RolloutConfig

    cfg, engine = compose_engine(RECIPES, "tensorhub_separate_async_fp8", [])
    assert (engine.backend, engine.custom_backend_module) == ("tensorhub", "tensorhub_verl.engine")
    assert cfg.trainer.v1.trainer_mode == "separate_async"
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)  # verl's checks of the rollout config
    assert isinstance(rollout, RolloutConfig) and rollout.name == "vllm"
    assert rollout.quantization == "fp8"
    plain, _ = compose_engine(RECIPES, "tensorhub_separate_async", [])
    assert plain.actor_rollout_ref.rollout.quantization is None


def test_lora_recipe_trains_an_adapter_and_publishes_only_it():
    """tensorhub_separate_async_lora: verl builds a PEFT model (``lora_rank``,
    separate adapters), and the engine publishes only the adapter as versions
    of an adapter model key."""
    from tensorhub_verl.config import TensorHubEngineConfig

    cfg, engine = compose_engine(RECIPES, "tensorhub_separate_async_lora", [])
    assert (engine.backend, engine.custom_backend_module) == ("tensorhub", "tensorhub_verl.engine")
    model = cfg.actor_rollout_ref.model
    assert model.lora_rank == 32 and model.lora.merge is False
    settings = TensorHubEngineConfig.from_kwargs(dict(engine.engine_kwargs["tensorhub"]))
    assert settings.lora is True and settings.model == "policy/lora/default" and settings.cut is None
    plain, plain_engine = compose_engine(RECIPES, "tensorhub_separate_async", [])
    assert plain.actor_rollout_ref.model.lora_rank == 0 and plain_engine.engine_kwargs["tensorhub"]["lora"] is False


@pytest.mark.parametrize("trainer", sorted(EXPERIMENTAL))
def test_engine_group_switches_the_experimental_trainers(trainer):
    _, engine = compose_engine(EXPERIMENTAL[trainer], trainer, [
        f"hydra.searchpath=[pkg://verl.trainer.config,file://{RECIPES}]", ADD_ENGINE,
        f"{KEY}.engine_kwargs.tensorhub.address=10.0.0.5:50051",
    ])
    assert engine.backend == "tensorhub"  # their own yaml says nccl: ours comes after
    assert engine.engine_kwargs["tensorhub"]["address"] == "10.0.0.5:50051"


def test_recipe_left_at_auto_finds_the_server_actor(ray_cluster):
    """The recipes' default: no address anywhere; the engine starts (or finds)
    the reference server as a Ray actor. Port 0: not 50051 on a shared machine."""
    _, engine = compose_engine(RECIPES, "tensorhub_separate_async", [f"{KEY}.engine_kwargs.tensorhub.server.port=0"])
    kwargs = engine.engine_kwargs[engine.backend]
    assert kwargs["address"] == "auto" and kwargs["server"] == {"port": 0, "retain": 1}
    built = [CheckpointEngineRegistry.new(engine.backend, bucket_size=1 << 20, **kwargs) for _ in range(2)]
    try:
        assert built[0].hub.address == built[1].hub.address == ensure_server(timeout_s=30)
    finally:
        for b in built:
            b.shutdown()
        assert shutdown_server()


def test_launch_command_and_entry_point():
    """The launch command of docs/integrations/verl.md, up to the composed config (``--cfg job``), in
    a fresh process: ``import verl`` alone must register the backend."""
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "auto"}
    probe = ("import verl; from verl.checkpoint_engine import CheckpointEngineRegistry as R; "
             "print(R.get('tensorhub').__module__)")
    out = subprocess.run([sys.executable, "-c", probe], check=False, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "tensorhub_verl.engine", out.stderr[-3000:]
    launch = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(RECIPES),
         "--config-name", "tensorhub_separate_async", "--cfg", "job", "--package", KEY],
        check=False, env=env, capture_output=True, text=True, timeout=120)
    assert launch.returncode == 0, launch.stderr[-3000:]
    assert "backend: tensorhub" in launch.stdout and "address: auto" in launch.stdout
