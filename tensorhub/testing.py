"""Helpers for tests of TensorHub and of code built on it: deterministic state
dicts, a Hub in a separate OS process driven over a pipe, and a reference
server in a separate process that can be killed and restarted.

Everything here runs real processes, real NIXL and a real gRPC server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import random
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tensorhub import processes
from tensorhub.manifest import DTYPES, Manifest
from tensorhub.regions import Region
from tensorhub.shard import Shard

if TYPE_CHECKING:
    from typing_extensions import Self

Spec = tuple[str, str, tuple[int, ...]]  # name, dtype name, shape


class GrantingLeases:
    """The lease side of a fake control plane for ``PullJob`` tests: every
    lease is granted, for a minute, and nothing may be reported lost (in
    those tests nothing fails). A fake adds its own ``resolve``."""

    def acquire_lease(self, agent_id: str, replica_ids: list[str]) -> tuple[str, list[str], float]:
        return "lease", list(replica_ids), 60.0

    def renew_lease(self, agent_id: str, lease_id: str) -> float:
        return 60.0

    def release_lease_async(self, agent_id: str, lease_id: str) -> None:
        pass  # nothing to hold: every lease was granted

    def report_lost(self, agent_id: str, replica_id: str, reason: str) -> None:
        raise AssertionError(f"nothing failed, yet {replica_id} was reported lost: {reason}")


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range. A port that range
    hands out (``bind`` to port 0) is the kind the kernel also gives every
    outgoing connection, and on a machine busy with gRPC, UCX and Ray traffic
    one of them can take it before the caller binds it. Another process may
    still choose the same port: for a torch.distributed rendezvous use
    ``rendezvous``, which leaves no gap at all."""
    low = _ephemeral_ports_start()
    for _ in range(200):
        port = random.randrange(max(1024, low - 20000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or lingering from a closed connection
            return port
    with socket.socket() as s:  # every try was taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


@contextlib.contextmanager
def rendezvous(world_size: int) -> Iterator[dict[str, str]]:
    """A torch.distributed rendezvous (``env://``) for ranks in child processes,
    held by this process: a TCPStore bound to a port the OS picks, so no port is
    free one moment and taken the next. (Rank 0 binding a ``free_port`` itself
    failed a CI run with EADDRINUSE, and the other ranks waited for it.)

    Yields the variables to set in every rank's environment, beside RANK and
    WORLD_SIZE: with TORCHELASTIC_USE_AGENT_STORE every rank, rank 0 too, is a
    client of this store, as under torchrun. The store lives until the block ends."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store


def mixed_specs(count: int = 210, *, largest_bytes: int = 64 << 20) -> list[Spec]:
    """``count`` tensors of mixed dtypes, from one element up to ``largest_bytes``."""
    dtypes = ["float32", "bfloat16", "float16", "int64"]
    specs: list[Spec] = [("scalar", "float32", ()), ("one", "int64", (1,)), ("largest", "float32", (largest_bytes // 4,))]
    i = 0
    while len(specs) < count:
        dtype = dtypes[i % len(dtypes)]
        rows = 1 + (i * 37) % 97
        cols = 1 + (i * 13) % 129
        specs.append((f"layers.{i}.{dtype}", dtype, (rows, cols) if i % 3 else (rows * cols,)))
        i += 1
    return specs


def make_tensors(specs: Sequence[Spec], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic contents that differ per seed."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in specs:
        dt = DTYPES[dtype]
        if dt.is_floating_point:
            out[name] = torch.randn(shape, generator=gen, dtype=torch.float32).to(dt)
        else:
            out[name] = torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=torch.int64).to(dt)
    return out


def stepped_tensors(specs: Sequence[Spec], seed: int, step: int, changed: float) -> dict[str, torch.Tensor]:
    """Version ``step`` of a model that starts as ``make_tensors(specs, seed)``:
    each step changes about ``changed`` of every tensor's elements (a delta's
    test payload; ``tensorhub.bench.sparsity`` makes versions from real optimizer steps)."""
    out = make_tensors(specs, seed)
    for s in range(1, step + 1):
        gen = torch.Generator().manual_seed(seed * 7919 + s)
        for t in out.values():
            mask = torch.rand(t.shape, generator=gen) < changed
            if t.dtype.is_floating_point:
                t[mask] = (t[mask].float() + s).to(t.dtype)
            else:
                t[mask] += s
    return out


def empty_like_specs(specs: Sequence[Spec]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape, dtype=DTYPES[dtype]) for name, dtype, shape in specs}


# --------------------------------------------------------------------- shard layouts


def cuts(n: int, world: int, *, uneven: bool = True) -> list[int]:
    """Boundaries splitting ``n`` over ``world`` ranks; uneven by default (rank i
    gets a growing share, e.g. 1000 over 4: 142, 215, 285, 358); may be empty."""
    if not uneven:
        return [n * i // world for i in range(world + 1)]
    return [n * i * (i + 3) // (world * (world + 3)) for i in range(world + 1)]


def shard_region(shape: tuple[int, ...], how: str, rank: int, world: int) -> Region | None:
    """Rank ``rank``'s part of a tensor split ``how`` ("rows", "cols", "flat" or
    "whole" = replicated); None where the split leaves it nothing."""
    if how == "whole" or not shape:
        return Region() if how == "whole" or rank == 0 else None
    if how == "cols" and len(shape) < 2:
        how = "rows"
    size = {"rows": shape[0], "cols": shape[1] if how == "cols" else 0, "flat": int(torch.Size(shape).numel())}[how]
    a, b = cuts(size, world)[rank: rank + 2]
    if a == b:
        return None
    return Region.of(shape, **{how: (a, b)})


def read_region(shape: tuple[int, ...], index: int, read: str, rank: int, world: int) -> Region:
    """What a reader asks of tensor number ``index``: "whole", "flat" (an even
    flat slice), or "tp" (tensor parallel: rows of even-numbered tensors, columns
    of odd-numbered ones, even splits; whole where a split leaves nothing)."""
    if read == "whole" or not shape:
        return Region()
    how = "flat" if read == "flat" else ("cols" if index % 2 and len(shape) >= 2 else "rows")
    size = {"rows": shape[0], "cols": shape[1] if how == "cols" else 0, "flat": int(torch.Size(shape).numel())}[how]
    a, b = cuts(size, world, uneven=False)[rank: rank + 2]
    return Region.of(shape, **{how: (a, b)}) if a < b else Region()


def take(full: torch.Tensor, region: Region) -> torch.Tensor:
    """The elements of ``region`` of ``full``, as a new contiguous tensor."""
    return Shard.of(full, box=region.box, flat=region.flat).tensor.clone()


# --------------------------------------------------------------------- hub process


class RemoteError(Exception):
    """An exception raised inside a HubProcess; ``type_name`` is its class name."""

    def __init__(self, type_name: str, message: str, tb: str) -> None:
        super().__init__(f"{type_name}: {message}\n--- in the hub process ---\n{tb}")
        self.type_name = type_name
        self.message = message


def _hub_main(conn: Any, address: str, config: dict, netns: str | None, env: dict[str, str]) -> None:
    if netns:  # before any thread (NIXL, grpc) starts: they inherit the namespace
        from tensorhub.netns import enter

        enter(netns)
    os.environ.update(env)  # read by UCX when the agent is created
    from tensorhub import Hub

    torch.set_num_threads(1)
    hub = Hub.connect(address, **config)
    held: dict[tuple[str, int], Any] = {}
    conn.send(("ok", hub.agent_id))
    while True:
        method, kwargs = conn.recv()
        try:
            if method == "close":
                hub.close()
                conn.send(("ok", None))
                return
            result = _HANDLERS[method](hub, held, **kwargs)
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001  report every failure to the test
            conn.send(("err", (type(e).__name__, str(e), traceback.format_exc())))


def _publish(hub: Any, held: dict, *, model: str, version: int, specs: list, seed: int, chunk_size: int | None = None) -> str:
    tensors = make_tensors(specs, seed)
    pub = hub.publish(model, version, tensors, chunk_size=chunk_size)
    held[(model, version)] = pub
    held[("tensors", model, version)] = (specs, tensors)  # kept after unpublish, for _overwrite
    return pub.manifest.fingerprint


def _publish_shard(hub: Any, held: dict, *, model: str, version: int, specs: list, seed: int, how: str,
                   rank: int, world: int, replicated: tuple[str, ...] = (), chunk_size: int | None = None,
                   cut: str | None = None, cut_gather_bytes: int | None = None) -> dict:
    """Publish rank ``rank``'s regions of the seeded tensors, as one trainer rank
    would. ``cut``: with its share of the readers' cut too (every rank at once,
    over the group ``init_group`` made); ``cut_mismatched`` then names the
    regions of it whose bytes differ from the full tensors'."""
    full = make_tensors(specs, seed)
    shards: dict[str, Shard] = {}
    for name, tensor in full.items():
        region = shard_region(tuple(tensor.shape), "whole" if name in replicated else how, rank, world)
        if region is not None:
            shards[name] = Shard.of(tensor, box=region.box, flat=region.flat)
    extra = {} if cut is None else {"cut": cut, "cut_gather_bytes": cut_gather_bytes}
    pub = hub.publish(model, version, shards, manifest=Manifest.of(full), chunk_size=chunk_size, **extra)
    held[(model, version)] = pub
    held[("tensors", model, version)] = (specs, full)  # row shards are views of these: see _overwrite
    out = {"fingerprint": pub.manifest.fingerprint, "nbytes": pub.nbytes, "regions": len(pub.parts)}
    if cut is not None:
        out["cut_report"] = dataclasses.asdict(pub.cut_report)
        out["cut_regions"] = [] if pub.cut is None else [(p.name, p.region.describe()) for p in pub.cut.parts]
        out["cut_mismatched"] = [] if pub.cut is None else [
            f"{p.name} {p.region.describe()}" for p in pub.cut.parts
            if not torch.equal(p.tensor.reshape(-1), take(full[p.name], p.region).reshape(-1))]
    return out


def _init_group(hub: Any, held: dict, *, rank: int, world: int, env: dict[str, str]) -> None:
    """Join a gloo process group (``rendezvous``'s variables in ``env``): a trainer rank's, for ``cut=``."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))


def _withdraw_shards(hub: Any, held: dict, *, model: str, version: int) -> None:
    """Unpublish this rank's shards of a version published with ``cut=`` and
    keep its cut published (which ``unpublish`` would withdraw first): readers
    can then read the version only from the cut holders."""
    pub = held.pop((model, version))
    cut, pub.cut = pub.cut, None
    pub.unpublish(60.0)
    held[(model, version)] = cut


def _shards(tensors: dict[str, torch.Tensor], how: str | None, rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s regions of ``tensors`` split ``how`` (views); None: the tensors whole."""
    if how is None:
        return dict(tensors)
    out = {}
    for name, tensor in tensors.items():
        region = shard_region(tuple(tensor.shape), how, rank, world)
        if region is not None:
            out[name] = Shard.of(tensor, box=region.box, flat=region.flat)
    return out


def _republish(hub: Any, held: dict, *, model: str, version: int, of: int, how: str | None = None, rank: int = 0,
               world: int = 1, chunk_size: int | None = None, cut: str | None = None) -> dict:
    """Publish the buffers of this process's (unpublished) version ``of`` again
    as ``version`` (rank ``rank``'s regions with ``how``): what a trainer does
    every step, after ``overwrite`` put the step's bytes in place."""
    specs, full = held[("tensors", model, of)]
    pub = hub.publish(model, version, _shards(full, how, rank, world), manifest=Manifest.of(full),
                      chunk_size=chunk_size, **({} if cut is None else {"cut": cut}))
    held[(model, version)] = pub
    held[("tensors", model, version)] = (specs, full)
    out = {"nbytes": pub.nbytes}
    if cut is not None and pub.cut is not None:  # where this rank's cut lies: the same buffer each step?
        out["cut_addr"] = pub.cut.parts[0].tensor.data_ptr()
        out["cut_mismatched"] = [f"{p.name} {p.region.describe()}" for p in pub.cut.parts
                                 if not torch.equal(p.tensor.reshape(-1), take(full[p.name], p.region).reshape(-1))]
    return out


def _publish_step(hub: Any, held: dict, *, model: str, version: int, specs: list, seed: int, changed: float,
                  delta_from: int | None = None, previous_step: int | None = None, how: str | None = None,
                  rank: int = 0, world: int = 1, chunk_size: int | None = None) -> dict:
    """Publish ``stepped_tensors(specs, seed, version, changed)`` in fresh
    buffers (rank ``rank``'s regions with ``how``), with its delta from
    ``delta_from`` (this process's replica of it; ``previous_step``: against
    that step's bytes instead, as a trainer with a wrong copy would)."""
    full = stepped_tensors(specs, seed, version, changed)

    def regions_of(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return _shards(tensors, how, rank, world)

    previous = None
    if previous_step is not None:
        previous = regions_of(stepped_tensors(specs, seed, previous_step, changed))
    pub = hub.publish(model, version, regions_of(full), manifest=Manifest.of(full), chunk_size=chunk_size,
                      delta_from=delta_from, previous=previous)
    held[(model, version)] = pub
    return {"nbytes": pub.nbytes, "deltas": list(pub.deltas),
            "delta_bytes": sum(c.nbytes for c in pub.companions)}


def _saved(held: dict, path: str) -> list[dict[str, torch.Tensor]]:
    """The versions ``tensorhub.bench.sparsity.save_versions`` wrote to ``path`` (loaded once per process)."""
    if ("saved", path) not in held:
        from tensorhub.bench.sparsity import load_versions

        held[("saved", path)] = load_versions(path)
    return held[("saved", path)]


def _publish_saved(hub: Any, held: dict, *, model: str, version: int, path: str, index: int,
                   delta_from: int | None = None, chunk_size: int | None = None) -> dict:
    """Publish the ``index``-th saved version as ``version`` (with its delta from
    ``delta_from``: this process's replica of it, another saved version)."""
    pub = hub.publish(model, version, _saved(held, path)[index], chunk_size=chunk_size, delta_from=delta_from)
    held[(model, version)] = pub
    return {"nbytes": pub.nbytes, "delta_bytes": sum(c.nbytes for c in pub.companions)}


def _unpublish(hub: Any, held: dict, *, model: str, version: int, timeout: float = 60.0) -> dict:
    start = time.monotonic()
    held.pop((model, version)).unpublish(timeout)
    return {"start": start, "end": time.monotonic()}


def _destination(specs: list, read: tuple[str, int, int] | None) -> tuple[dict, dict[str, Region]]:
    if read is None:
        return empty_like_specs(specs), {}
    regions = {name: read_region(tuple(shape), i, *read) for i, (name, _, shape) in enumerate(specs)}
    into = {name: Shard(torch.zeros(regions[name].numel(tuple(shape)), dtype=DTYPES[dtype]), tuple(shape),
                        box=regions[name].box, flat=regions[name].flat)
            for name, dtype, shape in specs}
    return into, regions


def _pull(hub: Any, held: dict, *, model: str, version: Any = "latest", specs: list | None = None,
          expect_seed: int | str | None = None, serve: bool = False, pace_s: float = 0.0, group: str = "",
          group_round: int = 0, timeout: float | None = None, progress_file: str | None = None,
          read: tuple[str, int, int] | None = None, keep: str | None = None, have: int | None = None,
          unpublish_first: int | None = None, expect_step: tuple[int, float] | None = None,
          expect_saved: tuple[str, int] | None = None, start_at: float | None = None,
          answer: Any = None) -> dict:
    """``read``: ("tp" | "flat" | "whole", rank, world) pulls that slice (see read_region).
    ``answer``: a ``GroupAnswer`` another member resolved (``resolve_for_group``).
    ``expect_seed="version"``: the publisher seeded each version with its number.
    ``keep``: the destination is kept under that key and pulled into again by
    the next pull with the same key (``have``: the version it holds then).
    ``unpublish_first``: that version's replica of this process is unpublished
    before the pull writes (``before_write``). ``expect_step=(seed, changed)``:
    compare with ``stepped_tensors``; ``expect_saved=(path, index)``: with
    that saved version (``specs`` then default to its tensors'). ``start_at``: a
    ``time.monotonic()`` instant (the clock is the machine's, shared by every
    process) to start at once the destination is ready, so that readers sent
    their pulls one after another start together, as the raw NIXL rows do."""
    if expect_saved is not None and specs is None:
        specs = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
                 for n, t in _saved(held, expect_saved[0])[expect_saved[1]].items()]
    kept = held.get(("into", keep)) if keep else None
    into, regions = kept if kept is not None else (
        _destination(specs, read) if specs is not None else (None, {}))
    if keep:
        held[("into", keep)] = (into, regions)
    ptrs = {k: (v.tensor if isinstance(v, Shard) else v).data_ptr() for k, v in into.items()} if into else {}

    def pace(done: int, total: int) -> None:
        if progress_file:  # lets a test act at a known point of the pull
            with open(progress_file, "w") as f:
                f.write(str(done))
        time.sleep(pace_s)

    if start_at is not None:
        time.sleep(max(0.0, start_at - time.monotonic()))
    start = time.monotonic()
    before_write = None
    if unpublish_first is not None:
        def before_write() -> None:
            held.pop((model, unpublish_first)).unpublish(60.0)

    result = hub.pull(model, version, into=into, serve=serve, progress=pace if pace_s or progress_file else None,
                      group=group, group_round=group_round, timeout=timeout, have=have, before_write=before_write,
                      answer=answer)
    end = time.monotonic()
    if serve:
        held[(model, result.version)] = result.publication
    out = {"version": result.version, "nbytes": result.nbytes, "seconds": result.seconds, "start": start,
           "end": end, "sources": result.bytes_by_source, "lost": result.lost_sources,
           "verified": result.verified_bytes, "unverified": result.unverified_bytes,
           "checks_failed": result.checks_failed, "read_bytes": result.read_bytes,
           "descriptors": result.descriptors, "plans_reused": result.plans_reused, "refreshes": result.refreshes, "path": result.path, "not_replayed": result.not_replayed, "chunk_sources": result.chunk_sources, "delta_from": result.delta_from, "delta_bytes": result.delta_bytes,
           "in_place": all(result.tensors[k].data_ptr() == p for k, p in ptrs.items()) if into else None}
    if (expect_seed is not None or expect_step is not None or expect_saved is not None) and specs is not None:
        if expect_saved is not None:
            expected = _saved(held, expect_saved[0])[expect_saved[1]]
        elif expect_step is not None:
            expected = stepped_tensors(specs, expect_step[0], result.version, expect_step[1])
        else:
            expected = make_tensors(specs, result.version if expect_seed == "version" else expect_seed)
        if regions:
            expected = {k: take(v, regions[k]) for k, v in expected.items()}
        out["mismatched"] = [k for k in expected if not torch.equal(result.tensors[k].flatten(), expected[k].flatten())]
    return out


def _resolve_for_group(hub: Any, held: dict, *, model: str, version: Any = "latest", group: str,
                       members: list[str]) -> Any:
    return hub.resolve_for_group(model, version, group=group, members=members)


def _release_group_answer(hub: Any, held: dict, *, answer: Any) -> None:
    hub.release_group_answer(answer)


def _pull_latest_loop(hub: Any, held: dict, *, model: str, specs: list, times: int,
                      read: tuple[str, int, int] | None = None) -> dict:
    """Pull ``latest`` again and again; every result must equal the version it
    claims (published with seed = version): no hole, no mix of two versions."""
    versions: dict[int, int] = {}
    bad: list[tuple[int, list[str]]] = []
    for _ in range(times):
        got = _pull(hub, held, model=model, specs=specs, expect_seed="version", read=read)
        versions[got["version"]] = versions.get(got["version"], 0) + 1
        if got["mismatched"]:
            bad.append((got["version"], got["mismatched"][:5]))
    return {"versions": versions, "bad": bad}


def finish_transfer(agent: Any, pending: Any, timeout_s: float = 10.0) -> None:
    """Poll a posted transfer (NixlAgent.post) until it ends, then release it;
    TransferFailed as poll raises it, AssertionError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    try:
        while not agent.poll(pending):
            assert time.monotonic() < deadline, f"transfer did not finish in {timeout_s} s"
            time.sleep(0.001)
    finally:
        agent.release(pending)


def wait_for_progress(path: str, *, at_least: int = 1, timeout: float = 60.0) -> int:
    """Wait until a pull started with ``progress_file=path`` has landed bytes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done = int(Path(path).read_text() or 0)
        except (FileNotFoundError, ValueError):
            done = 0
        if done >= at_least:
            return done
        time.sleep(0.01)
    raise TimeoutError(f"the pull reported no progress within {timeout} s")


def _overwrite(hub: Any, held: dict, *, model: str, version: int, seed: int) -> None:
    """Overwrite the tensors of an unpublished version in place (what a trainer's optimizer does)."""
    specs, tensors = held[("tensors", model, version)]
    for name, new in make_tensors(specs, seed).items():
        tensors[name].copy_(new)


def _free(hub: Any, held: dict, *, model: str, version: int) -> None:
    """Drop this process's tensors of an unpublished version (a trainer freeing
    a step's buffers): the allocator may hand their addresses to the next."""
    held.pop(("tensors", model, version), None)
    gc.collect()


def _corrupt(hub: Any, held: dict, *, model: str, version: int, tensor: str, byte: int = 0) -> None:
    """Flip the bits of one byte of a published tensor in place, behind the hub's back
    (what a memory fault or a stray write does): its chunk checksum no longer matches."""
    flat = held[(model, version)].tensors[tensor].view(-1).view(torch.uint8)  # published, or served by a pull
    flat[byte] ^= 0xFF


def _latest(hub: Any, held: dict, *, model: str) -> int:
    return hub.latest(model)


def _latest_near(hub: Any, held: dict, *, model: str) -> int:
    return hub.latest_near(model)


def _versions(hub: Any, held: dict, *, model: str) -> list[int]:
    return hub.versions(model)


def _wait_for_version(hub: Any, held: dict, *, model: str, at_least: int, timeout: float = 60.0) -> int:
    return hub.wait_for_version(model, at_least, timeout)


_HANDLERS = {"resolve_for_group": _resolve_for_group, "release_group_answer": _release_group_answer,
             "publish": _publish, "publish_shard": _publish_shard, "init_group": _init_group,
             "withdraw_shards": _withdraw_shards, "publish_step": _publish_step,
             "publish_saved": _publish_saved, "republish": _republish, "unpublish": _unpublish, "pull": _pull,
             "pull_latest_loop": _pull_latest_loop, "latest": _latest, "latest_near": _latest_near, "versions": _versions,
             "overwrite": _overwrite, "free": _free, "corrupt": _corrupt, "wait_for_version": _wait_for_version}


class HubProcess:
    """A Hub in its own OS process. Calls block until the child answers or the
    timeout passes (then TimeoutError); child exceptions come back as RemoteError."""

    def __init__(self, address: str, *, name: str, start_timeout: float = 180.0, netns: str | None = None,
                 env: dict[str, str] | None = None, **config: Any) -> None:
        ctx = processes.context()
        self._conn, child = ctx.Pipe()
        self.name = name
        self.process = ctx.Process(target=_hub_main,
                                   args=(child, address, {"name": name, **config}, netns, env or {}),
                                   name=f"hub-{name}", daemon=True)
        self.process.start()
        self.agent_id = self._wait(start_timeout)

    def _wait(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"hub process {self.name} did not answer within {timeout} s")
        status, payload = self._conn.recv()
        if status == "err":
            raise RemoteError(*payload)
        return payload

    def send(self, method: str, **kwargs: Any) -> None:
        """Start a call without waiting; collect it with ``result()``."""
        self._conn.send((method, kwargs))

    def result(self, timeout: float = 120.0) -> Any:
        return self._wait(timeout)

    def call(self, method: str, timeout: float = 120.0, **kwargs: Any) -> Any:
        self.send(method, **kwargs)
        return self.result(timeout)

    def kill(self) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=10)

    def close(self, timeout: float = 30.0) -> None:
        if self.process.is_alive():
            # A child that cannot close cleanly is killed below.
            with contextlib.suppress(TimeoutError, EOFError, BrokenPipeError, RemoteError):
                self.call("close", timeout=timeout)
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------- server process


class ServerProcess:
    """``tensorhub server`` as a subprocess on a fixed port, so that it can be
    killed and started again at the same address."""

    def __init__(self, port: int | None = None, *, agent_ttl_s: float = 10.0, lease_ttl_s: float = 10.0,
                 host: str = "127.0.0.1", netns: str | None = None, retain: int = 1) -> None:
        self.port = port or free_port()
        self.address = f"{host}:{self.port}"
        self._args = [sys.executable, "-m", "tensorhub.cli", "server", "--host", host, "--port", str(self.port),
                      "--agent-ttl", str(agent_ttl_s), "--lease-ttl", str(lease_ttl_s), "--retain", str(retain)]
        if netns:
            self._args = ["ip", "netns", "exec", netns, *self._args]
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout: float = 30.0) -> None:
        self.proc = subprocess.Popen(self._args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "listening on" in line:
                return
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError(f"tensorhub server did not start on {self.address}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
