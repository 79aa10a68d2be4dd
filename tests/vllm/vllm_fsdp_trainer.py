"""One rank of a 2-rank FSDP2 trainer (gloo, CPU) that sends a version to a
vLLM server through vLLM's own trainer-side API: WeightTransferTrainerFactory
with backend ``tensorhub`` and vLLM's HTTP client. ``DTensor.full_tensor`` is
made to fail, so a gather anywhere fails the run. Writes what it published
(bytes, and the model's parameter names: fused experts for a transformers-5 MoE).
With VERSIONS > 1 it sends that many versions (the same weights) one after
the other; with SETTINGS ``readers`` each rank also publishes its share of the
readers' cut (``TensorHubTrainerInitInfo.cut``), with ``together`` the ranks
publish as one group (``publish_together``; both: ``readers,together``), and after each version rank
0 records the server workers' ``tensorhub_stats`` (the server runs the
worker extension and vLLM's dev routes).
The ranks meet at the rendezvous named by MASTER_ADDR and MASTER_PORT in the
environment (the test's ``tensorhub.testing.rendezvous``).

    python vllm_fsdp_trainer.py HUB SERVER_URL MODEL_DIR MODEL_KEY RANK WORLD OUT_JSON VERSION [VERSIONS [SETTINGS]]
"""

from __future__ import annotations

import json
import sys
import urllib.request

import torch
import torch.distributed as dist

# As conftest.HUB_CONFIG (this script runs outside pytest): registrations may wait on 2 busy cores.
HUB_CONFIG = {"connect_timeout_s": 60.0}


def main(hub: str, url: str, model_dir: str, key: str, rank: int, world: int, out: str, version: int,
         versions: int = 1, cut: str | None = None) -> None:
    settings = (cut or "").split(",")  # "readers": the readers' cut; "together": publish_together
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())

    def no_gather(self, *args, **kwargs):
        raise AssertionError("full_tensor() was called: the trainer side must publish local shards, not gather")

    DTensor.full_tensor = no_gather

    from tensorhub_vllm.trainer import TensorHubTrainerInitInfo
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    engine = WeightTransferTrainerFactory.trainer_init(
        TensorHubTrainerInitInfo(hub=hub, model=key, rank=rank, first_version=version, hub_config=HUB_CONFIG,
                                 engine={"hub_config": HUB_CONFIG}, cut="readers" if "readers" in settings else None,
                                 publish_together="together" in settings),
        client=HTTPVLLMWeightSyncClient(url, timeout=120), source=ModuleSource(model))
    sent = []
    for _ in range(versions):
        engine.send_weights()
        sent.append({"version": engine.version, "published_bytes": engine.published_bytes,
                     "cut_bytes": engine.cut_bytes, "workers": _worker_stats(url) if "readers" in settings and rank == 0 else None})
    with open(out, "w") as f:
        json.dump({"rank": rank, "published_bytes": engine.published_bytes, "version": engine.version,
                   "names": [n for n, _ in model.named_parameters()], "sent": sent}, f)
    engine.shutdown()
    dist.destroy_process_group()


def _worker_stats(url: str) -> list[dict]:
    """Each server worker's last update (``TensorHubWorkerExtension.tensorhub_stats``)."""
    req = urllib.request.Request(url + "/collective_rpc", data=json.dumps(
        {"method": "tensorhub_stats", "args": ["backend"]}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["results"]


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], a[3], int(a[4]), int(a[5]), a[6], int(a[7]), int(a[8]) if len(a) > 8 else 1,
         a[9] if len(a) > 9 else None)
