"""The OpenAI-compatible server (multiprocess engine, as users run it), updated
through vLLM's own weight-update HTTP routes. It is a second engine: it pulls the
version from the first engine's replica after the trainer withdrew its own. It
runs with tensor parallelism 2 where two cores are free, so its two workers pull
as one group. Its reference text is its own on the same bytes pulled from the
trainer: at TP=2 vLLM rounds differently from the TP=1 engine (bf16 partial sums),
so the two engines' texts agree token for token only when the server runs TP=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import HUB_CONFIG, MODEL_KEY, PROMPT, update

from tensorhub.client.rpc import ReferenceClient
from tensorhub.testing import free_port, rendezvous

HERE = Path(__file__).parent


class Server:
    def __init__(self, model_dir, log_path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the default, multiprocess engine
        self.tp = tp = 2 if len(os.sched_getaffinity(0)) >= 2 else 1
        if tp == 2:  # vLLM's automatic binding wants one NUMA node per worker; bind one core each instead
            cores = sorted(os.sched_getaffinity(0))[:2]
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}|{cores[1]}"
        self._log = open(log_path, "w")  # noqa: SIM115  the server writes it until stop() closes it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
             "--dtype", "bfloat16", "--max-model-len", "256", "--enforce-eager",
             "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], "--tensor-parallel-size", str(tp),
             "--weight-transfer-config", json.dumps({"backend": "tensorhub"})],
            env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"vLLM server did not come up; see {log_path}") from None
                time.sleep(1)

    def get(self, route: str) -> dict:
        with urllib.request.urlopen(self.url + route, timeout=120) as resp:
            return json.loads(resp.read())

    def post(self, route: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(self.url + route, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    def update(self, version: int) -> None:
        """One update through vLLM's weight-update routes."""
        self.post("/start_weight_update")
        self.post("/update_weights", {"update_info": {"version": version}})
        self.post("/finish_weight_update", {"weight_version": str(version)})

    def complete(self, prompt: str) -> str:
        """Greedy text for ``prompt``, computed afresh: no prompt KV cached from earlier weights."""
        assert self.post("/reset_prefix_cache") == {"success": True}
        model = self.get("/v1/models")["data"][0]["id"]
        got = self.post("/v1/completions", {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": 16})
        return got["choices"][0]["text"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    s = Server(tiny_model, tmp_path_factory.mktemp("server") / "vllm-server.log")
    s.base = s.complete(PROMPT)  # the text of the weights in its files
    yield s
    s.close()


def test_fsdp_trainer_sends_through_vllms_trainer_api(server, hub_server, tiny_model, tmp_path):
    """2 FSDP2 ranks (gloo) drive an update of the server through vLLM's
    WeightTransferTrainerFactory (backend ``tensorhub``) and its HTTP client:
    each rank publishes its local shards in place, about half of the model,
    nothing is gathered, and the server then runs the trainer's bytes exactly
    (the text of the same weights loaded from its files). It runs first: after
    a failed update at TP=2, vLLM 0.32's multiprocess executor answers the next
    collective_rpc with the other worker's stale error."""
    with rendezvous(2) as dist_env:
        env = {**os.environ, **dist_env, "OMP_NUM_THREADS": "1"}
        ranks = [subprocess.Popen([sys.executable, str(HERE / "vllm_fsdp_trainer.py"), hub_server.address,
                                   server.url, str(tiny_model), MODEL_KEY, str(rank), "2",
                                   str(tmp_path / f"{rank}.json"), "40"], env=env) for rank in range(2)]
        try:
            assert [r.wait(timeout=300) for r in ranks] == [0, 0]
        finally:
            for r in ranks:
                r.kill()
    import torch
    from tensorhub_vllm.receiver import checkpoint_layout

    checkpoint = sum(t.numel() * t.element_size() for t in checkpoint_layout(tiny_model, torch.bfloat16).values())
    for rank in range(2):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got["version"] == 40
        assert 0.4 * checkpoint <= got["published_bytes"] <= 0.6 * checkpoint, (got, checkpoint)
    assert server.get("/weight_info") == {"weight_version": "40"}
    assert server.complete(PROMPT) == server.base


def test_server_updates_from_another_engines_replica(server, engine, trainer, hub_server):
    server.post("/init_weight_transfer_engine", {"init_info": {"hub": hub_server.address, "model": MODEL_KEY,
                                                                 "hub_config": HUB_CONFIG}})
    base = server.complete(PROMPT)
    trainer.publish(19, "perturbed")  # the reference: these bytes, pulled from the trainer
    server.update(19)
    want = server.complete(PROMPT)
    assert want != base
    trainer.unpublish(19)

    trainer.publish(20, "perturbed")  # the same bytes again
    update(engine, 20, "20")
    if server.tp == 1:  # same TP, same rounding: the first engine's text is a reference too
        assert engine.generate([PROMPT], _greedy_params(), use_tqdm=False)[0].outputs[0].text == want
    trainer.unpublish(20)  # from now on only the first engine holds version 20

    server.update(20)
    assert server.get("/weight_info") == {"weight_version": "20"}
    assert server.complete(PROMPT) == want

    # Every worker keeps what it received pullable: the first engine's one
    # worker and each of the server's TP workers hold a complete replica of 20.
    rpc = ReferenceClient(hub_server.address)
    try:
        (v20,) = [v for v in rpc.list_versions(MODEL_KEY) if v.version == 20]
    finally:
        rpc.close()
    assert v20.complete_replicas == 1 + server.tp

    # A version nobody holds: the route fails, says why, and the server keeps serving 20.
    server.post("/start_weight_update")
    with pytest.raises(urllib.error.HTTPError) as err:
        server.post("/update_weights", {"update_info": {"version": 999}})
    assert err.value.code >= 400
    assert "version 999 has no complete replica" in err.value.read().decode()  # the hub's reason reaches the client
    assert server.get("/weight_info") == {"weight_version": "20"}
    assert server.complete(PROMPT) == want


def _greedy_params():
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=16)
