"""The launcher runs OpenRLHF's own train_ppo_ray on a stock command line,
with TensorHub's classes wired in and its settings passed to every Ray worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import HERE, child_pythonpath

# A command line as OpenRLHF's examples write it (examples/scripts/train_ppo_ray_*.sh).
STOCK = [
    "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "2",
    "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2",
    "--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "1",
    "--train.colocate_actor_ref",
    "--actor.model_name_or_path", "OpenRLHF/Llama-3-8b-sft-mixture",
    "--reward.model_name_or_path", "OpenRLHF/Llama-3-8b-rm-700k",
    "--ckpt.output_dir", "/tmp/ckpt/llama3-8b-rlhf",
    "--train.micro_batch_size", "8", "--train.batch_size", "128",
    "--rollout.micro_batch_size", "16", "--rollout.batch_size", "1024",
    "--data.max_samples", "100000", "--train.max_epochs", "1",
    "--data.max_len", "2048", "--rollout.max_new_tokens", "1024",
    "--ds.zero_stage", "3", "--ds.param_dtype", "bf16",
    "--actor.adam.lr", "5e-7", "--critic.adam.lr", "9e-6", "--algo.kl.init_coef", "0.01",
    "--data.prompt_dataset", "OpenRLHF/prompt-collection-v0.1", "--data.input_key", "context_messages",
    "--data.apply_chat_template", "--actor.gradient_checkpointing_enable",
]


def run_probe(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TENSORHUB_")}
    environ.update(PYTHONPATH=child_pythonpath(), **env)
    return subprocess.run([sys.executable, str(HERE / "openrlhf_launch_probe.py"), *argv], env=environ,
                          check=False, capture_output=True, text=True, timeout=240)


def test_stock_command_line_runs_with_tensorhub_classes():
    done = run_probe(STOCK, TENSORHUB_ADDRESS="10.0.0.5:50051", TENSORHUB_MODEL="llama3-8b/policy",
                     TENSORHUB_HUB_CONFIG='{"chunk_size": 1048576}')
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["script"] == "__main__"  # OpenRLHF's script itself, run as the main module
    assert seen["PolicyModelActor"] == "tensorhub_openrlhf.actors._TensorHubPolicyModelActor"
    assert seen["create_vllm_engines"] == "tensorhub_openrlhf.engines.create_vllm_engines"
    assert seen["args"] == {
        "actor.model_name_or_path": "OpenRLHF/Llama-3-8b-sft-mixture", "ds.zero_stage": 3,
        "vllm.num_engines": 2, "vllm.tensor_parallel_size": 1, "rollout.batch_size": 1024,
        "train.async_enable": False, "actor.adam.lr": 5e-7,
    }
    env_vars = seen["runtime_env"]["env_vars"]
    assert env_vars["NCCL_DEBUG"] == "WARN"  # OpenRLHF's own variables are kept
    assert env_vars["TENSORHUB_ADDRESS"] == "10.0.0.5:50051"
    assert env_vars["TENSORHUB_MODEL"] == "llama3-8b/policy"
    assert json.loads(env_vars["TENSORHUB_HUB_CONFIG"]) == {"chunk_size": 1048576}


def test_missing_or_bad_settings_fail_before_anything_starts():
    def launch(**env: str) -> subprocess.CompletedProcess:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("TENSORHUB_")}
        return subprocess.run([sys.executable, "-m", "tensorhub_openrlhf.train_ppo_ray", *STOCK],
                              env={**environ, **env}, check=False, capture_output=True, text=True, timeout=60)

    done = launch()
    assert done.returncode == 1 and "TENSORHUB_ADDRESS is not set" in done.stderr
    done = launch(TENSORHUB_ADDRESS="auto", TENSORHUB_SERVE="maybe")
    assert done.returncode == 1 and "TENSORHUB_SERVE must be one of" in done.stderr
    done = launch(TENSORHUB_ADDRESS="auto", TENSORHUB_ADRESS="typo:1")
    assert done.returncode == 1 and "TENSORHUB_ADRESS" in done.stderr
    assert "Traceback" not in done.stderr


def test_unknown_stock_flag_is_rejected_by_openrlhf_itself():
    done = run_probe([*STOCK, "--tensorhub.address", "x:1"], TENSORHUB_ADDRESS="10.0.0.5:50051")
    assert done.returncode == 2 and "unrecognized arguments: --tensorhub.address" in done.stderr


def test_recipe_renders_a_command_the_launcher_takes():
    from tensorhub_openrlhf.recipe import compose, render

    recipes = HERE.parents[1] / "recipes" / "openrlhf"
    env, argv = render(compose(str(recipes), "ppo_ray", [
        "tensorhub.address=10.0.0.5:50051", "openrlhf.actor.model_name_or_path=/models/policy",
        "openrlhf.data.prompt_dataset=/data/prompts", "openrlhf.reward.model_name_or_path=/models/rm",
        "+openrlhf.train.async_enable=true"]))
    done = run_probe(argv, **env)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["args"]["actor.model_name_or_path"] == "/models/policy"
    assert seen["args"]["ds.zero_stage"] == 3 and seen["args"]["train.async_enable"] is True
    assert seen["runtime_env"]["env_vars"]["TENSORHUB_ADDRESS"] == "10.0.0.5:50051"
