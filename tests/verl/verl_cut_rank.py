"""One trainer rank of verl's ``tensorhub`` checkpoint engine with
``cut: readers`` (MODE ``together``: ``publish_together: true`` instead), in its own process (the cut's gather is collective over the
ranks' gloo group, met at MASTER_ADDR / MASTER_PORT in the environment). Reads
a step number per line on stdin, sends ``make_weights(step)`` as verl does
(every rank the same full stream) and answers with ``result <metrics json>``.

    python verl_cut_rank.py ADDRESS RANK WORLD [MODE]
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch.distributed as dist


def main(address: str, rank: int, world: int, mode: str = "readers") -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from tensorhub_verl.engine import TensorHubCheckpointEngine
    from verl_testlib import make_weights

    settings = {"cut": "readers", "cut_gather_bytes": 1 << 20} if mode == "readers" else \
        {"publish_together": True, "delta": "off"}
    engine = TensorHubCheckpointEngine(bucket_size=1 << 20, is_master=rank == 0, address=address,
                                       model="tiny/policy", hub={"connect_timeout_s": 30.0, "chunk_size": 4096},
                                       **settings)
    print("result ready", flush=True)
    for line in sys.stdin:
        step = int(line)
        metrics = asyncio.run(engine.send_weights(iter(make_weights(step).items()), global_steps=step))
        print("result " + json.dumps(metrics), flush=True)
    engine.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5])
