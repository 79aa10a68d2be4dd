"""The OpenAI-compatible vLLM server in its own process (multiprocess engine,
TP=2 where two cores are free, the ``tensorhub`` weight-transfer backend), and
the 2-rank FSDP2 trainer (vllm_fsdp_trainer.py) that updates it through vLLM's
trainer-side API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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
             "--weight-transfer-config", json.dumps({"backend": "tensorhub"}),
             # its workers' tensorhub_stats, through the dev route /collective_rpc
             "--worker-extension-cls", "tensorhub_vllm.extension.TensorHubWorkerExtension"],
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


def fsdp_trainer_send(hub_address: str, server: Server, model_dir: Path, model_key: str, version: int,
                      out_dir: Path, versions: int = 1, cut: str | None = None) -> list[dict]:
    """2 FSDP2 ranks (gloo) loading ``model_dir`` send it to ``server`` as
    ``version`` (and the next ``versions - 1``, with ``cut`` the trainer's cut
    setting) through vLLM's WeightTransferTrainerFactory; each rank's report
    (what it published)."""
    with rendezvous(2) as dist_env:
        env = {**os.environ, **dist_env, "OMP_NUM_THREADS": "1"}
        ranks = [subprocess.Popen([sys.executable, str(HERE / "vllm_fsdp_trainer.py"), hub_address, server.url,
                                   str(model_dir), model_key, str(rank), "2", str(out_dir / f"{rank}.json"),
                                   str(version), str(versions), *([cut] if cut else [])], env=env)
                 for rank in range(2)]
        try:
            assert [r.wait(timeout=300) for r in ranks] == [0, 0]
        finally:
            for r in ranks:
                r.kill()
    return [json.loads((out_dir / f"{rank}.json").read_text()) for rank in range(2)]
