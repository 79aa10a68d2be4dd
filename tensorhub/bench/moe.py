"""``tensorhub bench pull --layout moe --reader-slice tp8``: the expert tensors
of one Qwen3-30B-A3B layer (128 experts; gate_proj and up_proj [768, 2048],
down_proj [2048, 768], bf16: 1,152 MiB), published by P row-sharded trainer
ranks (rank r holds rows [r R/P, (r+1) R/P) of every tensor, back to back in
one buffer), pulled by the TP rank 0 of 8 as vLLM's loaders read it: rows
0:96 of gate and up (contiguous), columns 0:96 of down (a 192-byte run per
row). The slice is 144 MiB in 262,400 runs. Rows of one run, methods
alternating within each repetition:

* ``tensorhub``: ``Hub.pull`` into the slice's tensors, cost model on
  (``HubConfig.read_cost="auto"``: shared memory here);
* ``tensorhub-exact``: the same with ``read_cost="exact"``: a descriptor per run;
* ``nixl-raw-exact``: raw NIXL READs of the exact runs, a descriptor per run,
  one READ per publisher (no server, no chunks);
* ``nixl-raw-rows``: raw NIXL READs of whole-row spans (each publisher's rows
  of a down_proj in one descriptor) into a scratch buffer, then the columns
  cut out locally (numpy strided copy); gate and up rows exact;
* ``memcpy``: one copy of the slice's bytes in the reader's memory.

Before timing, each reader measures the link's cost per descriptor and
bandwidth (``transport.cost.measure``) and prints it beside the defaults the
cost model uses; every method's bytes are compared with the expected slice.

    publisher 0..P-1 ── its rows of 384 expert tensors, registered in place ──┐
    reference server ◀── publish shards / resolve ──────────────────────────  ├── reader: TP rank 0 of 8
"""

from __future__ import annotations

import os
import statistics
import time

from rich.progress import Progress

from tensorhub import processes
from tensorhub.bench import children
from tensorhub.bench.moe_layout import MoeBenchConfig, held_rows, holder_offsets, tensors
from tensorhub.bench.report import Row, print_table, write_json

MODEL = "bench/moe"
METHODS = ("tensorhub", "tensorhub-exact", "nixl-raw-exact", "nixl-raw-rows", "memcpy")
_TIMEOUT_S = 120.0  # one raw READ at most: a READ that never completes fails the benchmark, not hangs it


def _full(index: int, shape: tuple[int, int]):
    """Tensor ``index``'s deterministic bytes (as bf16), made again wherever needed."""
    import torch

    from tensorhub.bench.payload import pattern

    return pattern(shape[0] * shape[1] * 2, seed=index + 1).view(torch.bfloat16).view(shape)


def _wanted(cfg: MoeBenchConfig, shape: tuple[int, int], how: str):
    from tensorhub import Region

    dim = 0 if how == "rows" else 1
    return Region.of(shape, **{how: (0, shape[dim] // cfg.tp)})


def rank_shards(cfg: MoeBenchConfig, rank: int):
    """Publisher ``rank``'s row shards of every tensor, back to back in one
    buffer: (the buffer, the shards by name, the manifest)."""
    import torch

    from tensorhub import Manifest, Shard

    specs = tensors(cfg)
    offsets = holder_offsets(cfg, rank)
    buffer = torch.empty(offsets[-1], dtype=torch.uint8)
    held = {}
    for i, (name, shape, _) in enumerate(specs):
        a, b = held_rows(shape, rank, cfg.publishers)
        local = buffer[offsets[i]: offsets[i + 1]].view(torch.bfloat16).view(b - a, shape[1])
        local.copy_(_full(i, shape)[a:b])
        held[name] = Shard(local, shape, rows=(a, b))
    manifest = Manifest.of({name: torch.empty(shape, dtype=torch.bfloat16, device="meta") for name, shape, _ in specs})
    return buffer, held, manifest


def _publisher(conn, address: str, cfg: MoeBenchConfig, rank: int) -> None:
    import torch

    from tensorhub import Hub
    from tensorhub.transport.nixl import new_agent

    torch.set_num_threads(1)
    buffer, held, manifest = rank_shards(cfg, rank)
    raw = new_agent(f"raw-moe-pub-{rank}-{os.getpid()}")  # configured as the hub's agents are
    raw.register_memory([(buffer.data_ptr(), buffer.numel(), 0, "")], "DRAM")
    with Hub.connect(address, name=f"publisher-{rank}", chunk_size=cfg.chunk_size, verify_chunks=cfg.verify) as hub:
        pub = hub.publish(MODEL, 1, held, manifest=manifest)
        conn.send((raw.get_agent_metadata(), buffer.data_ptr()))
        while (cmd := conn.recv()) != "stop":  # ("step", v): the trainer's next version, the same buffers
            pub.unpublish(timeout=60)
            pub = hub.publish(MODEL, cmd[1], held, manifest=manifest)
            conn.send("ok")


def _reader(conn, address: str, cfg: MoeBenchConfig, raw_infos: list) -> None:
    import numpy as np
    import torch

    from tensorhub import Hub, Shard
    from tensorhub.bench.moe_raw import RawReads
    from tensorhub.transport.cost import BACKENDS, measure

    torch.set_num_threads(1)
    specs = tensors(cfg)
    regions = [_wanted(cfg, shape, how) for _, shape, how in specs]
    sizes = [r.numel(shape) * 2 for r, (_, shape, _) in zip(regions, specs)]
    dest = torch.zeros(sum(sizes), dtype=torch.uint8)
    expected = torch.cat([Shard.of(_full(i, shape), box=r.box).tensor.reshape(-1).view(torch.uint8)
                          for i, ((_, shape, _), r) in enumerate(zip(specs, regions))])
    source = expected.clone()  # the memcpy row's source: the slice's bytes, already in memory
    into, at = {}, 0
    for (name, shape, _), region, nbytes in zip(specs, regions, sizes):
        local = dest[at: at + nbytes].view(torch.bfloat16).view(region.local_shape(shape))
        into[name] = Shard(local, shape, box=region.box)
        at += nbytes
    raw = RawReads(cfg, dest, raw_infos, _TIMEOUT_S)
    measured = measure("shm", raw.probe, probes=raw.probes())
    documented = BACKENDS["shm"]
    with (Hub.connect(address, name="reader", read_workers=cfg.read_workers, verify_chunks=cfg.verify) as hub,
          Hub.connect(address, name="reader-exact", read_workers=cfg.read_workers, verify_chunks=cfg.verify,
                      read_cost="exact") as exact):
        conn.send(("ready", dest.numel(), raw.runs, (measured.per_descriptor_s, measured.bandwidth),
                   (documented.per_descriptor_s, documented.bandwidth)))
        steady = None
        while True:
            cmd, check = conn.recv()
            if cmd == "stop":
                break
            if isinstance(cmd, tuple):  # ("version", v): a fresh Hub's pull of version v, its CPU and path
                if steady is None:
                    steady = Hub.connect(address, name="reader-steady", read_workers=cfg.read_workers,
                                         verify_chunks=cfg.verify)
                dest.zero_()
                cpu, start = time.process_time(), time.perf_counter()
                result = steady.pull(MODEL, cmd[1], into=into)
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                conn.send((seconds, torch.equal(dest, expected), result.read_bytes, result.descriptors, cpu,
                           result.path, result.not_replayed, result.named, result.refreshes))
                continue
            dest.zero_()
            start = time.perf_counter()
            read, descriptors = dest.numel(), 0
            if cmd in ("tensorhub", "tensorhub-exact"):
                result = (hub if cmd == "tensorhub" else exact).pull(MODEL, 1, into=into)
                read, descriptors = result.read_bytes, result.descriptors
            elif cmd == "nixl-raw-exact":
                raw.exact()
                descriptors = raw.runs
            elif cmd == "nixl-raw-rows":
                read, descriptors = raw.rows()
            else:
                np.copyto(dest.numpy(), source.numpy())
            seconds = time.perf_counter() - start
            conn.send((seconds, not check or torch.equal(dest, expected), read, descriptors))
        if steady is not None:
            steady.close()
    raw.close()


def _versions(cfg: MoeBenchConfig, reader, publishers: list, progress: Progress) -> list[tuple]:
    """Versions 2..versions+1 from the same buffers, each pulled by a fresh Hub in
    the reader: (row name, seconds, read bytes, descriptors, median CPU s) for
    the first version and for the replayed rest."""
    task = progress.add_task("versions", total=cfg.versions)
    first, rest = None, []
    for v in range(2, cfg.versions + 2):
        for conn in publishers:
            conn.send(("step", v))
        children.receive(publishers, 120, f"a publisher did not publish version {v}")
        reader.send((("version", v), True))
        seconds, ok, read, descriptors, cpu, path, why, named, refreshes = children.receive(
            [reader], 300, f"version {v}")[0]
        if not ok:
            raise RuntimeError(f"version {v}: the reader received wrong bytes")
        if first is None:
            first = (seconds, read, descriptors, cpu, named, refreshes)
        else:
            if path != "replayed":
                raise RuntimeError(f"version {v} from the same buffers was not replayed: {why}")
            rest.append((seconds, read, descriptors, cpu, named, refreshes))
        progress.advance(task)
    out = [("tensorhub-first-version", [first[0]], first[1], first[2], first[3],
            {"named": [first[4]], "refreshes": [first[5]]})]
    if rest:  # from the third version on, the server names the holders the one before read from
        out.append(("tensorhub-replayed", [r[0] for r in rest], rest[-1][1], rest[-1][2],
                    statistics.median(r[3] for r in rest),
                    {"named": [r[4] for r in rest], "refreshes": [r[5] for r in rest]}))
    return out


def run(cfg: MoeBenchConfig, *, json_path: str | None = None, quiet: bool = False) -> list[Row]:
    """Run the benchmark; returns its rows (also printed, and written to ``json_path``)."""
    from tensorhub.server import EmbeddedServer

    ctx = processes.context()
    rows: list[Row] = []
    with EmbeddedServer() as server, Progress(disable=quiet, transient=True) as progress:
        task = progress.add_task("starting processes", total=(cfg.warmup + cfg.reps) * len(METHODS))
        pub_conns, publishers = children.start(ctx, _publisher,
                                               [(server.address, cfg, rank) for rank in range(cfg.publishers)])
        raw_infos = children.receive(pub_conns, 180, "a benchmark publisher did not start")
        conns, procs = children.start(ctx, _reader, [(server.address, cfg, raw_infos)])
        _, requested, runs, measured, documented = children.receive(conns, 300, "the benchmark reader did not start")[0]
        samples: dict[str, list[float]] = {m: [] for m in METHODS}
        reads: dict[str, tuple[int, int]] = {}
        for rep in range(cfg.warmup + cfg.reps):
            order = METHODS if rep % 2 == 0 else METHODS[::-1]
            for method in order:
                progress.update(task, description=f"{method} rep {rep + 1 - cfg.warmup}" if rep >= cfg.warmup
                                else f"{method} warm-up (bytes checked)")
                conns[0].send((method, rep < cfg.warmup))
                seconds, ok, read, descriptors = children.receive(conns, 300, f"the reader did not finish {method}")[0]
                if not ok:
                    raise RuntimeError(f"{method}: the reader received wrong bytes")
                reads[method] = (read, descriptors)
                if rep >= cfg.warmup:
                    samples[method].append(seconds)
                progress.advance(task)
        shape = {"layout": "moe", "reader_slice": f"tp{cfg.tp}", "publishers": cfg.publishers,
                 "requested_bytes": requested, "runs": runs, "experts": cfg.experts}
        for method, values in samples.items():
            rows.append(Row.of(method, 1, requested, values, **shape, read_bytes=reads[method][0],
                               descriptors=reads[method][1]))
        steady = _versions(cfg, conns[0], pub_conns, progress) if cfg.versions > 1 else []
        for name, values, read, descriptors, cpu, how in steady:
            rows.append(Row.of(name, 1, requested, values, **shape, read_bytes=read, descriptors=descriptors,
                               cpu_s_per_version=cpu, **how))
        children.stop(conns[:1], ("stop", False), pub_conns, [*procs, *publishers])
    by = {r.method: r for r in rows}
    cheaper_raw = min(by["nixl-raw-exact"].seconds, by["nixl-raw-rows"].seconds)
    if "tensorhub-replayed" in by:
        ratios_steady = {"first_version_vs_raw_rows": by["tensorhub-first-version"].seconds / by["nixl-raw-rows"].seconds,
                         "replayed_vs_raw_rows": by["tensorhub-replayed"].seconds / by["nixl-raw-rows"].seconds,
                         "cpu_s_first_version": by["tensorhub-first-version"].extra["cpu_s_per_version"],
                         "cpu_s_replayed": by["tensorhub-replayed"].extra["cpu_s_per_version"]}
    else:
        ratios_steady = {}
    # Each repetition's pull against the raw rows beside it: paired, so that
    # machine noise which hits a whole repetition cancels.
    paired = [th / min(a, b) for th, a, b in zip(samples["tensorhub"], samples["nixl-raw-exact"],
                                                 samples["nixl-raw-rows"])]
    ratios = {"vs_cheaper_raw": by["tensorhub"].seconds / cheaper_raw,
              "vs_cheaper_raw_paired": statistics.median(paired),
              "memcpy_fraction": by["memcpy"].seconds / by["tensorhub"].seconds,
              "measured_per_descriptor_s": measured[0], "measured_bandwidth": measured[1],
              "model_per_descriptor_s": documented[0], "model_bandwidth": documented[1]}
    if not quiet:
        print_table(f"pull the TP rank 0 of {cfg.tp} slice of a Qwen3-30B-A3B MoE layer ({cfg.experts} experts): "
                    f"{requested:,} bytes in {runs:,} runs, from {cfg.publishers} row-sharded publisher(s), "
                    f"median of {cfg.reps}", rows,
                    {"tensorhub": "nixl-raw-rows", "tensorhub-exact": "nixl-raw-exact", "memcpy": "tensorhub",
                     "tensorhub-first-version": "nixl-raw-rows", "tensorhub-replayed": "nixl-raw-rows"})
        for row in rows:
            print(f"  {row.method}: {row.extra['read_bytes']:,} bytes read in {row.extra['descriptors']:,} descriptors")
        print(f"tensorhub / the cheaper raw row: {ratios['vs_cheaper_raw']:.2f}x (goal <= 1.3), "
              f"{ratios['vs_cheaper_raw_paired']:.2f}x paired (the median of each repetition's ratio); "
              f"tensorhub vs a memcpy of the slice: 1/{1 / ratios['memcpy_fraction']:.1f} (goal >= 1/16)")
        print(f"link cost measured here: {measured[0] * 1e6:.2f} us per descriptor, {measured[1] / 1e9:.1f} GB/s "
              f"(the cost model's shared memory: {documented[0] * 1e6:.2f} us, {documented[1] / 1e9:.1f} GB/s)")
        if ratios_steady:
            print(f"versions from the same buffers, a fresh reader: the first {ratios_steady['first_version_vs_raw_rows']:.2f}x "
                  f"the raw rows, {ratios_steady['cpu_s_first_version']:.3f} CPU s; replayed "
                  f"{ratios_steady['replayed_vs_raw_rows']:.2f}x (goal <= 1.05), "
                  f"{ratios_steady['cpu_s_replayed']:.3f} CPU s per version (the reader process's, NIXL's threads too)")
    if json_path:
        write_json(json_path, rows, benchmark="pull", layout="moe", reader_slice=f"tp{cfg.tp}",
                   publishers=cfg.publishers, chunk_size=cfg.chunk_size, read_workers=cfg.read_workers,
                   verify_chunks=cfg.verify, versions=cfg.versions, **ratios, **ratios_steady)
    return rows
