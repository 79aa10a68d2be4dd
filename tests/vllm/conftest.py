"""Shared fixtures of the vLLM suite: a tiny model built once, a reference
server, and a trainer process that publishes versions on command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Before vLLM is imported anywhere: a small KV cache (the default takes most of
# RAM and the worker is OOM-killed) and spawned, not forked, workers.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

HERE = Path(__file__).parent
MODEL_KEY = "tiny-qwen2/policy"
# The engine's workers spin on both cores of the CI machine: a registration with
# the reference server once took past the default 10 s (DEADLINE_EXCEEDED), so
# the tests let a Hub retry it longer (HubConfig.connect_timeout_s).
HUB_CONFIG = {"connect_timeout_s": 60.0}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(HERE))
    from vllm_tiny_model import build

    return build(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def hub_server():
    """The reference server in its own process: in the pytest process (an
    EmbeddedServer) it once answered engine workers' registrations too late
    (DEADLINE_EXCEEDED) while this process ran an engine of its own."""
    from tensorhub.testing import ServerProcess

    with ServerProcess() as server:
        yield server


class Trainer:
    """Drives vllm_trainer.py in its own process."""

    def __init__(self, address: str, model_dir: Path, chunk_size: int = 1 << 20, model_key: str = MODEL_KEY) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "vllm_trainer.py"), address, str(model_dir), model_key, str(chunk_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def _expect(self, reply: str) -> None:
        line = self.proc.stdout.readline().strip()
        assert line == reply, f"trainer said {line!r}, expected {reply!r}"

    def publish(self, version: int, kind: str, model_dir: Path | None = None, delta_from: int | None = None) -> None:
        """``kind`` original|perturbed|sparse|wrong-vocab|missing, or hf with the ``model_dir`` to load;
        ``delta_from``: with its delta from that version (still published)."""
        extra = ("" if model_dir is None else f" {model_dir}") + ("" if delta_from is None else f" delta-from {delta_from}")
        self.proc.stdin.write(f"publish {version} {kind}{extra}\n")
        self.proc.stdin.flush()
        self._expect(f"published {version}")

    def corrupt(self, version: int, name: str, index: int) -> None:
        """Change element ``index`` of ``name`` in version ``version``'s published
        memory: readers' checks against the publisher's checksums fail."""
        self.proc.stdin.write(f"corrupt {version} {name} {index}\n")
        self.proc.stdin.flush()
        self._expect(f"corrupted {version}")

    def unpublish(self, version: int) -> None:
        self.proc.stdin.write(f"unpublish {version}\n")
        self.proc.stdin.flush()
        self._expect(f"unpublished {version}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def trainer(hub_server, tiny_model):
    t = Trainer(hub_server.address, tiny_model)
    yield t
    t.close()


MOE_KEY = "tiny-qwen3-moe/policy"


@pytest.fixture(scope="session")
def moe_model(tmp_path_factory):
    """A tiny Qwen3-MoE (vllm_tiny_model.build_moe): 8 experts, top-2."""
    sys.path.insert(0, str(HERE))
    from vllm_tiny_model import build_moe

    return build_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"))


@pytest.fixture(scope="session")
def moe_perturbed(moe_model, tmp_path_factory):
    return perturbed_copy(moe_model, tmp_path_factory.mktemp("tiny-qwen3-moe-perturbed"))


@pytest.fixture(scope="module")
def moe_trainer(hub_server, moe_model):
    t = Trainer(hub_server.address, moe_model, model_key=MOE_KEY)
    yield t
    t.close()


PROMPT = "the quick brown"


def greedy(llm) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def greedy_many(llm, prompts: list[str]) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="session")
def engine(tiny_model, hub_server):
    """One in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0: starts in seconds)
    with the tensorhub backend and the worker extension, initialized on the hub.
    The multiprocess path is covered by the HTTP server test."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    llm = LLM(model=str(tiny_model), dtype="bfloat16", max_model_len=256, enforce_eager=True,
              weight_transfer_config={"backend": "tensorhub"},
              worker_extension_cls="tensorhub_vllm.extension.TensorHubWorkerExtension")
    llm.init_weight_transfer_engine({"init_info": {"hub": hub_server.address, "model": MODEL_KEY,
                                                 "hub_config": HUB_CONFIG}})
    yield llm
    llm.shutdown_weight_transfer_engine()


def perturbed_copy(model_dir: Path, path: Path, kind: str = "perturbed") -> Path:
    """``model_dir`` with the trainer's ``kind`` weights in its files, at ``path``."""
    from safetensors.torch import save_file
    from vllm_trainer import weights

    shutil.copytree(model_dir, path, dirs_exist_ok=True)
    save_file(weights(model_dir, kind), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tp_env():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("TP=2 needs two cores")
    cores = sorted(os.sched_getaffinity(0))[:2]
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    # vLLM's automatic binding wants one NUMA node per worker; bind one core each instead
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}|{cores[1]}"
    import vllm.envs

    vllm.envs.disable_envs_cache()  # an engine started earlier in this session cached the old value
    yield
    if old is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


def tp_engine(model_dir: Path, hub_address: str, model_key: str = MODEL_KEY, tp: int = 2, **engine_args):
    """A TP engine (workers in their own processes; needs ``tp_env``) on the tensorhub backend."""
    from vllm import LLM

    llm = LLM(model=str(model_dir), dtype="bfloat16", max_model_len=256, enforce_eager=True, tensor_parallel_size=tp,
              weight_transfer_config={"backend": "tensorhub"}, **engine_args,
              worker_extension_cls="tensorhub_vllm.extension.TensorHubWorkerExtension")
    llm.init_weight_transfer_engine({"init_info": {"hub": hub_address, "model": model_key,
                                                 "hub_config": HUB_CONFIG}})
    return llm


def engines_on(models: list[Path], hub_address: str, model_key: str = MODEL_KEY, **engine_args):
    """Yield a TP engine on each of ``models``, in order; shut their transfer engines down after."""
    llms = [tp_engine(m, hub_address, model_key, **engine_args) for m in models]
    yield llms
    for llm in llms:
        llm.shutdown_weight_transfer_engine()


def engine_pair(first: Path, second: Path, hub_address: str, model_key: str = MODEL_KEY, **engine_args):
    """Yield two TP engines (A on ``first``, B on ``second``); shut their transfer engines down after."""
    yield from engines_on([first, second], hub_address, model_key, **engine_args)


def update(llm, version, weight_version: str | None = None) -> None:
    """One update through vLLM's native API."""
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": version}})
    llm.finish_weight_update(weight_version=weight_version)


def update_and_relay(a, b, trainer, versions: tuple[int, int], prompts: list[str], share: float):
    """The TP flow both engine suites check: A (started on the original weights)
    updated to the perturbed ones generates what B (a fresh engine on those)
    generates, token for token, each worker pulling at most ``share`` of the
    checkpoint; A back to the original; then, with the trainer's copy withdrawn,
    B pulls it from A's workers, worker k mostly from worker k. Returns (A's
    original tokens, B's fresh tokens, A's agents)."""
    perturbed, original = versions
    base = greedy_many(a, prompts)
    fresh_perturbed = greedy_many(b, prompts)
    assert base != fresh_perturbed

    trainer.publish(perturbed, "perturbed")
    update(a, perturbed, str(perturbed))
    assert greedy_many(a, prompts) == fresh_perturbed  # token for token
    for s in a.collective_rpc("tensorhub_stats", args=("backend",)):
        assert 0 < s["nbytes"] <= share * s["checkpoint_nbytes"], s
    trainer.unpublish(perturbed)

    trainer.publish(original, "original")
    update(a, original, str(original))
    assert greedy_many(a, prompts) == base
    trainer.unpublish(original)  # from now on only A's workers hold it, each its slices

    update(b, original, str(original))
    assert greedy_many(b, prompts) == base
    a_agents = [s["agent"] for s in a.collective_rpc("tensorhub_stats", args=("backend",))]
    for rank, s in enumerate(b.collective_rpc("tensorhub_stats", args=("backend",))):
        sources = s["bytes_by_source"]
        assert set(sources) <= set(a_agents) and sum(sources.values()) == s["nbytes"], (rank, sources, a_agents)
        # its slices only worker k of A holds; replicated tensors (norms) either A worker may give
        assert max(sources, key=sources.get) == a_agents[rank], (rank, sources, a_agents)
    return base, fresh_perturbed, a_agents
