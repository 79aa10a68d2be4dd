"""``tensorhub bench pull --fp8``: one trainer process publishes a bf16 model
with its block-FP8 companion (``Hub.publish(fp8=True)``), R reader processes
pull it both ways in the same run, alternating within each repetition:

* ``bf16``: the version itself (``hub.pull(model, 1)``), the baseline;
* ``fp8``: its companion (``hub.pull(model, 1, fp8=True)``): e4m3 weights and
  fp32 scales per 128x128 block, norms and biases as they are.

Reported: the bytes each reader's pull read (goal: fp8 <= 0.55x bf16), the
time (goal: fp8 no slower) and, apart, the trainer's quantization time (on its
device: the CPU here). Both pulls are checked once, bit for bit, against what
the reader computes from the same seeded weights.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from tensorhub import processes
from tensorhub.bench import children
from tensorhub.bench.report import Row, print_table, write_json

MODEL = "bench/fp8"
METHODS = ("bf16", "fp8")


@dataclass(kw_only=True, slots=True)
class Fp8PullBenchConfig:
    size: int = 256 << 20
    readers: int = 1
    reps: int = 5
    warmup: int = 1
    chunk_size: int = 32 << 20
    read_workers: int = 2


def _model(size: int):
    """The bench's transformer-like layout, with random bf16 weights (a real
    model's range: the quantization's time and scales are a real one's)."""
    import torch

    from tensorhub.bench.payload import layout, shaped, views

    tensors = shaped(views(torch.zeros(size, dtype=torch.uint8), layout(size)))
    gen = torch.Generator().manual_seed(1)
    for t in tensors.values():
        if t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.02)
    return tensors


def _publisher(conn, address: str, cfg: Fp8PullBenchConfig) -> None:
    import torch

    from tensorhub import Hub

    torch.set_num_threads(1)
    tensors = _model(cfg.size)
    with Hub.connect(address, name="trainer", chunk_size=cfg.chunk_size) as hub:
        pub = hub.publish(MODEL, 1, tensors, fp8=True)
        conn.send((pub.fp8_quantize_s, sum(c.nbytes for c in pub.companions)))
        conn.recv()  # stop


def _reader(conn, address: str, cfg: Fp8PullBenchConfig, index: int) -> None:
    import torch

    from tensorhub import Hub
    from tensorhub.fp8 import companion_tensors

    torch.set_num_threads(1)
    bf16 = _model(cfg.size)
    fp8 = companion_tensors(bf16)
    expected = {"bf16": {n: t.clone() for n, t in bf16.items()}, "fp8": {n: t.clone() for n, t in fp8.items()}}
    into = {"bf16": bf16, "fp8": fp8}  # preallocated once: no page faults in the timing
    with Hub.connect(address, name=f"reader-{index}", read_workers=cfg.read_workers) as hub:
        conn.send("ready")
        while True:
            cmd, start_at = conn.recv()
            if cmd == "stop":
                break
            method = cmd.removeprefix("verify-")
            if cmd.startswith("verify"):
                for t in into[method].values():
                    t.view(torch.uint8).zero_()
            while time.monotonic() < start_at:  # common start instant for all readers
                time.sleep(0.0005)
            start = time.monotonic()
            read = hub.pull(MODEL, 1, into=into[method], fp8=method == "fp8").read_bytes
            end = time.monotonic()
            ok = all(torch.equal(t.view(torch.uint8), expected[method][n].view(torch.uint8))
                     for n, t in into[method].items()) if cmd.startswith("verify") else True
            conn.send((start, end, ok, read))


def run(cfg: Fp8PullBenchConfig, *, json_path: str | None = None, quiet: bool = False) -> list[Row]:
    """Run the benchmark; returns its rows (also printed, and written to ``json_path``)."""
    from tensorhub.server import EmbeddedServer

    ctx = processes.context()
    with EmbeddedServer() as server:
        pub_conns, publishers = children.start(ctx, _publisher, [(server.address, cfg)])
        quantize_s, companion_bytes = children.receive(pub_conns, 300, "the benchmark trainer did not publish")[0]
        conns, procs = children.start(ctx, _reader, [(server.address, cfg, i) for i in range(cfg.readers)])
        children.receive(conns, 300, "a benchmark reader did not start")
        most_read: dict[str, int] = {}

        def round_(cmd: str) -> float:
            start_at = time.monotonic() + 0.05
            for conn in conns:
                conn.send((cmd, start_at))
            results = children.receive(conns, 300, f"a reader did not finish {cmd}")
            if not all(ok for _, _, ok, _ in results):
                raise RuntimeError(f"{cmd}: a reader received wrong bytes")
            method = cmd.removeprefix("verify-")
            most_read[method] = max(most_read.get(method, 0), *(r for _, _, _, r in results))
            return max(e for _, e, _, _ in results) - min(s for s, _, _, _ in results)

        for method in METHODS:
            round_(f"verify-{method}")
        samples: dict[str, list[float]] = {m: [] for m in METHODS}
        for rep in range(cfg.warmup + cfg.reps):
            for method in METHODS if rep % 2 == 0 else METHODS[::-1]:
                seconds = round_(method)
                if rep >= cfg.warmup:
                    samples[method].append(seconds)
        children.stop(conns, ("stop", None), pub_conns, [*procs, *publishers])
    rows = [Row.of(m, cfg.readers, most_read[m], samples[m], read_bytes_per_reader=most_read[m], model_bytes=cfg.size)
            for m in METHODS]
    byte_ratio = most_read["fp8"] / most_read["bf16"]
    time_ratio = rows[1].seconds / rows[0].seconds
    if not quiet:
        print_table(f"pull of a {cfg.size:,}-byte bf16 model and its FP8 companion, {cfg.readers} reader(s), "
                    f"median of {cfg.reps}", rows, {})
        print(f"fp8 / bf16 bytes read per reader: {byte_ratio:.3f} (goal <= 0.55); fp8 / bf16 pull time: "
              f"{time_ratio:.2f}x (goal <= 1.0); the trainer's quantization: {quantize_s:.3f} s "
              f"({companion_bytes:,} companion bytes, on its CPU, once per version, not in the pull's time)")
    if json_path:
        write_json(json_path, rows, benchmark="pull-fp8", chunk_size=cfg.chunk_size, read_workers=cfg.read_workers,
                   quantize_s=quantize_s, companion_bytes=companion_bytes, byte_ratio=byte_ratio,
                   time_ratio=time_ratio, median_fp8_s=statistics.median(samples["fp8"]))
    return rows
