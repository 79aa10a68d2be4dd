"""``tensorhub bench server --steady``: the control plane of an RL run in its
steady state, version after version, against one ``tensorhub server`` process.

    holders (a trainer's ranks) ── Publish v (v = 1: regions and memory; later: the layout's digest)
                                └─ Unpublish v-1
    readers (engines of 8 workers, one group each) ── Resolve v, as a pull does: a read
        lease (the last one released on the call), the manifest and the holders'
        layouts it has from version v-1 left out (``known_layouts``: holders come lean);
        shared (the default): one member per engine asks for all (``members``,
        ``Hub.resolve_for_group``), the others send nothing; per worker: every member asks

Per version: the server's CPU for all of it (publishes, unpublishes, every
reader's Resolve), the answers' bytes, and each Resolve's latency from the
reader's side with all readers asking at once (at most ``in_flight`` calls
out per generator process); the first version (cold: every holder sent whole)
is reported apart from the rest. The readers run in a process of their own;
with two CPUs or more the server gets one to itself.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorhub.bench.cpu import cpu_seconds
from tensorhub.bench.server import METADATA_BYTES_PER_TENSOR, MODEL, _manifest, _ms, _pin, _placement


@dataclass(kw_only=True, slots=True, frozen=True)
class SteadyConfig:
    readers: int = 1000
    group: int = 8  # readers per engine (one group)
    holders: int = 100
    tensors: int = 200
    versions: int = 10
    in_flight: int = 64  # Resolves out at once from the readers' process
    pin: bool = True
    shared: bool = True  # one Resolve per engine (ResolveRequest.members); False: one per worker


def _holder(i: int) -> str:
    return f"trainer-{i}"


def _reader(i: int) -> str:
    return f"worker-{i}"


def _publish_request(pb: Any, cfg: SteadyConfig, i: int, version: int, manifest: Any) -> Any:
    """Holder i's replica of ``version``: the same buffers every version."""
    metadata = bytes(METADATA_BYTES_PER_TENSOR * cfg.tensors)
    return pb.PublishRequest(
        agent_id=_holder(i), replica_id=f"{_holder(i)}.{version}", model=MODEL, version=version, manifest=manifest,
        chunk_size=32 << 20, state=pb.REPLICA_STATE_COMPLETE, origin=True,
        memory=pb.ReplicaMemory(kind=pb.MEMORY_KIND_DRAM, nixl_metadata=metadata, regions=[
            pb.MemoryRegion(addr=(1 << 32) + (i << 40) + k * (2 << 20), size=2 << 20) for k in range(cfg.tensors)]))


def _readers_main(conn: Any, address: str, cfg: SteadyConfig, fingerprint: str, cpus: set[int] | None) -> None:
    _pin(__import__("os").getpid(), cpus)
    conn.send(asyncio.run(_readers(conn, address, cfg, fingerprint)))


async def _readers(conn: Any, address: str, cfg: SteadyConfig, fingerprint: str) -> list:
    import grpc

    from tensorhub.proto import tensorhub_pb2 as pb
    from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc

    known: dict[int, list[bytes]] = {}
    numbering: dict[int, str] = {}  # the server's layout numbering each reader has numbers of
    leases: dict[int, str] = {}
    per_version = []
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.ReferenceServiceStub(ch)
        gate = asyncio.Semaphore(cfg.in_flight)
        for i in range(cfg.readers):
            await stub.RegisterAgent(pb.RegisterAgentRequest(agent_id=_reader(i), name=_reader(i), labels=pb.Labels(
                host=f"engine-{i // cfg.group}")), timeout=30)
        conn.send("ready")
        while (version := conn.recv()) is not None:
            latencies, sizes = [], []

            async def ask(i: int, version: int = version, latencies: list = latencies, sizes: list = sizes) -> None:
                first = i - i % cfg.group
                members = [_reader(j) for j in range(first, min(first + cfg.group, cfg.readers)) if j != i]
                async with gate:
                    t0 = time.perf_counter()
                    resp = await stub.Resolve(pb.ResolveRequest(
                        agent_id=_reader(i), model=MODEL, version=version, lease=True, group=f"engine-{i // cfg.group}",
                        group_round=version, known_fingerprint=fingerprint, known_layouts=known.get(i, []),
                        release_leases=[leases[i]] if i in leases else [], layout_ids=numbering.get(i, ""),
                        packed_holders=i in numbering,
                        members=members if cfg.shared else []), timeout=30)
                    numbering[i] = resp.layout_ids  # as client/rpc.py: holders by number from then on
                    latencies.append(time.perf_counter() - t0)
                    sizes.append(resp.ByteSize())
                    leases[i] = resp.lease_id
                    # As client/rpc.py: every layout seen, the latest 1,024 (equal holders rank by their
                    # reads in flight, so the k best move among the holders from one version to the next).
                    seen = dict.fromkeys(known.get(i, []))
                    seen.update(dict.fromkeys(r.layout for r in resp.replicas))
                    known[i] = list(seen)[-1024:]

            started = time.perf_counter()
            await asyncio.gather(*(ask(i) for i in range(0, cfg.readers, cfg.group if cfg.shared else 1)))
            per_version.append({"latencies": latencies, "answer_bytes_max": max(sizes),
                                "all_answered_s": time.perf_counter() - started})
            conn.send("done")
    return per_version


def run(cfg: SteadyConfig) -> dict:
    import grpc

    from tensorhub.local.serverprocess import ServerProcess
    from tensorhub.proto import tensorhub_pb2 as pb
    from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc
    from tensorhub.proto import wire

    server_cpus, reader_cpus = _placement(cfg.pin)
    manifest = _manifest(pb, cfg.tensors)
    fingerprint = wire.manifest_from_wire(manifest).fingerprint
    with ServerProcess(agent_ttl_s=600, lease_ttl_s=600, retain=0) as server, \
            grpc.insecure_channel(server.address) as channel:
        assert server.proc is not None
        pid = server.proc.pid
        _pin(pid, server_cpus)
        stub = pb_grpc.ReferenceServiceStub(channel)
        for i in range(cfg.holders):
            stub.RegisterAgent(pb.RegisterAgentRequest(agent_id=_holder(i), name=_holder(i),
                                                       labels=pb.Labels(host=f"trainer-{i // 8}")), timeout=30)
        parent, child = mp.get_context("spawn").Pipe()
        proc = mp.get_context("spawn").Process(target=_readers_main, daemon=True,
                                               args=(child, server.address, cfg, fingerprint, reader_cpus))
        proc.start()
        if not parent.poll(120) or parent.recv() != "ready":
            raise TimeoutError("the readers' process did not start")
        versions = []
        for v in range(1, cfg.versions + 1):
            cpu0 = cpu_seconds(pid)
            before = stub.Describe(pb.DescribeRequest(model="none"), timeout=30).control
            for i in range(cfg.holders):
                request = _publish_request(pb, cfg, i, v, manifest)
                if v > 1:  # the same buffers: name the layout, as client/rpc.py does
                    layout = wire.publish_layout(request)
                    for name in ("held", "held_table", "memory"):
                        request.ClearField(name)
                    request.layout = layout
                    request.ClearField("manifest")
                    request.manifest_fingerprint = fingerprint
                stub.Publish(request, timeout=30)
                if v > 1:
                    stub.Unpublish(pb.UnpublishRequest(agent_id=_holder(i), replica_id=f"{_holder(i)}.{v - 1}",
                                                       drain_timeout_s=0, force=True), timeout=30)
            parent.send(v)
            if not parent.poll(300) or parent.recv() != "done":
                raise TimeoutError(f"the readers did not resolve version {v}")
            after = stub.Describe(pb.DescribeRequest(model="none"), timeout=30).control
            versions.append({"server_cpu_s": cpu_seconds(pid) - cpu0,
                             "holders_full": after.holders_full - before.holders_full,
                             "holders_lean": after.holders_lean - before.holders_lean})
        parent.send(None)
        per_version = parent.recv() if parent.poll(60) else []
        proc.join(timeout=10)
    for mine, theirs in zip(versions, per_version):
        mine.update(resolve_ms=_ms(theirs["latencies"]), answer_bytes_max=theirs["answer_bytes_max"],
                    all_answered_s=theirs["all_answered_s"])
    steady = versions[1:] or versions
    return {
        "readers": cfg.readers, "groups": -(-cfg.readers // cfg.group), "holders": cfg.holders, "tensors": cfg.tensors,
        "shared": cfg.shared, "resolves_per_version": -(-cfg.readers // cfg.group) if cfg.shared else cfg.readers,
        "versions": versions,
        "first": versions[0],
        "steady_server_cpu_s_per_version": float(np.median([x["server_cpu_s"] for x in steady])),
        "steady_resolve_p99_ms": float(np.median([x["resolve_ms"]["p99"] for x in steady])),
        "steady_answer_bytes_max": max(x["answer_bytes_max"] for x in steady),
        "steady_all_answered_s": float(np.median([x["all_answered_s"] for x in steady])),
        "steady_holders_full": sum(x["holders_full"] for x in steady),
    }
