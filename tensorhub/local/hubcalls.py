"""The calls a ``HubProcess`` answers: each runs in the hub's process as
``handler(hub, held, **kwargs)``, where ``held`` keeps what outlives one call
(publications, their tensors, kept destinations, loaded saved versions)."""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import Any

import torch

from tensorhub.fp8 import companion_specs, companion_tensors
from tensorhub.local.seeded import (
    empty_like_specs,
    make_tensors,
    read_region,
    shard_region,
    stepped_tensors,
    take,
)
from tensorhub.manifest import DTYPES, Manifest
from tensorhub.regions import Region
from tensorhub.shard import Shard


def _publish(hub: Any, held: dict, *, model: str, version: int, specs: list, seed: int, chunk_size: int | None = None,
             fp8: bool = False) -> Any:
    """The manifest's fingerprint; with ``fp8``: and the companion's bytes and quantization seconds."""
    tensors = make_tensors(specs, seed)
    pub = hub.publish(model, version, tensors, chunk_size=chunk_size, fp8=fp8)
    held[(model, version)] = pub
    held[("tensors", model, version)] = (specs, tensors)  # kept after unpublish, for _overwrite
    if fp8:
        return {"fingerprint": pub.manifest.fingerprint, "fp8_bytes": sum(c.nbytes for c in pub.companions),
                "quantize_s": pub.fp8_quantize_s}
    return pub.manifest.fingerprint


def _publish_shard(hub: Any, held: dict, *, model: str, version: int, specs: list, seed: int, how: str,
                   rank: int, world: int, replicated: tuple[str, ...] = (), chunk_size: int | None = None,
                   cut: str | None = None, cut_gather_bytes: int | None = None, together: bool = False) -> dict:
    """Publish rank ``rank``'s regions of the seeded tensors, as one trainer rank
    would. ``cut``: with its share of the readers' cut too (every rank at once,
    over the group ``init_group`` made); ``cut_mismatched`` then names the
    regions of it whose bytes differ from the full tensors'. ``together``:
    every rank at once over that group (``publish(trainer_group=)``)."""
    full = make_tensors(specs, seed)
    shards: dict[str, Shard] = {}
    for name, tensor in full.items():
        region = shard_region(tuple(tensor.shape), "whole" if name in replicated else how, rank, world)
        if region is not None:
            shards[name] = Shard.of(tensor, box=region.box, flat=region.flat)
    extra = ({} if cut is None else {"cut": cut, "cut_gather_bytes": cut_gather_bytes}) | _together(together)
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


def _together(together: bool) -> dict:
    """``publish(trainer_group=)`` over the default group (``init_group``), when ``together``."""
    if not together:
        return {}
    import torch.distributed as dist

    return {"trainer_group": dist.group.WORLD}


def _publish_at(hub: Any, held: dict, *, model: str, version: int, specs: list, seed: int, offsets: list[int],
                chunk_size: int | None = None) -> dict:
    """Publish the seeded tensors, each its own storage at byte ``offsets[i]`` of
    one host buffer this process keeps for its life (the arena): a trainer whose
    allocator hands a later version memory that earlier versions' tensors held,
    cut differently. Returns where each tensor lies in the arena."""
    arena = held.get("arena")
    need = max(o + t.nbytes for o, t in zip(offsets, make_tensors(specs, seed).values()))
    if arena is None or arena.numel() < need:
        arena = held["arena"] = torch.zeros(max(need, 1 << 20), dtype=torch.uint8)
    buffer = arena.numpy()
    tensors = {}
    for offset, (name, tensor) in zip(offsets, make_tensors(specs, seed).items()):
        placed = torch.frombuffer(buffer, dtype=tensor.dtype, count=tensor.numel(), offset=offset)
        tensors[name] = placed.view(tensor.shape)
        tensors[name].copy_(tensor)
    pub = hub.publish(model, version, tensors, chunk_size=chunk_size)
    held[(model, version)] = pub
    return {name: t.data_ptr() - arena.data_ptr() for name, t in tensors.items()}


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
    pub.group = None  # this rank's alone: the tests withdraw one rank's shards at a time
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
               world: int = 1, chunk_size: int | None = None, cut: str | None = None, together: bool = False) -> dict:
    """Publish the buffers of this process's (unpublished) version ``of`` again
    as ``version`` (rank ``rank``'s regions with ``how``): what a trainer does
    every step, after ``overwrite`` put the step's bytes in place."""
    specs, full = held[("tensors", model, of)]
    pub = hub.publish(model, version, _shards(full, how, rank, world), manifest=Manifest.of(full),
                      chunk_size=chunk_size, **({} if cut is None else {"cut": cut}), **_together(together))
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
    regions = _read_regions(specs, read)
    into = {name: Shard(torch.zeros(regions[name].numel(tuple(shape)), dtype=DTYPES[dtype]), tuple(shape),
                        box=regions[name].box, flat=regions[name].flat)
            for name, dtype, shape in specs}
    return into, regions


def _read_regions(specs: list, read: tuple[str, int, int]) -> dict[str, Region]:
    """The region of each tensor of ``specs`` that a ``read`` slice pulls (``read_region``)."""
    return {name: read_region(tuple(shape), i, *read) for i, (name, _, shape) in enumerate(specs)}


def _pull(hub: Any, held: dict, *, model: str, version: Any = "latest", specs: list | None = None,
          expect_seed: int | str | None = None, serve: bool = False, pace_s: float = 0.0, group: str = "",
          group_round: int = 0, timeout: float | None = None, progress_file: str | None = None,
          read: tuple[str, int, int] | None = None, keep: str | None = None, have: int | None = None,
          unpublish_first: int | None = None, expect_step: tuple[int, float] | None = None,
          expect_saved: tuple[str, int] | None = None, start_at: float | None = None,
          answer: Any = None, fp8: bool = False, defer_complete: bool = False,
          announce_with: Any = None) -> dict:
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
    their pulls one after another start together, as the raw NIXL rows do.
    ``defer_complete``: the serving pull's last report is held (kept for
    ``member_report``), as a member of an engine's group holds it.
    ``fp8``: pull the FP8 companion (``specs`` are the bf16 version's; the
    destination is the companion's, and ``expect_seed`` compares with
    ``tensorhub.fp8.companion_tensors`` of the seeded tensors)."""
    bf16_specs = specs
    if fp8 and specs is not None:
        specs = companion_specs(specs)
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
                      answer=answer, fp8=fp8, defer_complete=defer_complete, announce_with=announce_with)
    end = time.monotonic()
    if serve:
        held[(model, result.version)] = result.publication
    if defer_complete:
        held[("result", model, result.version)] = result
    out = {"version": result.version, "nbytes": result.nbytes, "seconds": result.seconds, "start": start,
           "end": end, "sources": result.bytes_by_source, "lost": result.lost_sources,
           "read_again": result.sources_read_again,
           "verified": result.verified_bytes, "unverified": result.unverified_bytes,
           "checks_failed": result.checks_failed, "read_bytes": result.read_bytes,
           "descriptors": result.descriptors, "plans_reused": result.plans_reused, "refreshes": result.refreshes, "news_heard": result.news_heard, "subscribers": result.subscribers, "path": result.path, "not_replayed": result.not_replayed, "named": result.named, "chunk_sources": result.chunk_sources, "delta_from": result.delta_from, "delta_bytes": result.delta_bytes,
           "in_place": all(result.tensors[k].data_ptr() == p for k, p in ptrs.items()) if into else None}
    prepared = held.pop(("expected", model, result.version), None)
    if prepared is not None:  # made before the pull (``_prepare_expected``): nothing to compute now
        out["mismatched"] = [k for k in prepared if not _same_bits(result.tensors[k], prepared[k])]
    elif (expect_seed is not None or expect_step is not None or expect_saved is not None) and specs is not None:
        if expect_saved is not None:
            expected = _saved(held, expect_saved[0])[expect_saved[1]]
        elif expect_step is not None:
            expected = stepped_tensors(specs, expect_step[0], result.version, expect_step[1])
        elif fp8:
            expected = companion_tensors(make_tensors(bf16_specs, result.version if expect_seed == "version" else expect_seed))
        else:
            expected = make_tensors(specs, result.version if expect_seed == "version" else expect_seed)
        if regions:
            expected = {k: take(v, regions[k]) for k, v in expected.items()}
        out["mismatched"] = [k for k in expected if not _same_bits(result.tensors[k], expected[k])]
    return out


def _prepare_expected(hub: Any, held: dict, *, model: str, version: int, specs: list,
                      read: tuple[str, int, int] | None = None) -> None:
    """What a pull of ``version`` (seeded with its number) must receive, made
    now, before the pull: the next ``_pull`` of that version compares with it
    instead of making it once its own pull ended. Readers of a relay finish
    one after another; one that seeds 64 MiB of random weights as it ends
    takes a core from the readers still pulling (``bench cluster``: a third of
    a finished reader's samples, on a 2-core machine)."""
    expected = make_tensors(specs, version)
    if read is not None:
        regions = _read_regions(specs, read)
        expected = {k: take(v, regions[k]) for k, v in expected.items()}
    held[("expected", model, version)] = expected


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype != want.dtype or got.numel() != want.numel():
        return False
    # float8 has no eq on CPU; every dtype compares as bytes here, which is what a pull must keep
    return torch.equal(got.flatten().view(torch.uint8), want.flatten().view(torch.uint8))


def _resolve_for_group(hub: Any, held: dict, *, model: str, version: Any = "latest", group: str,
                       members: list[str]) -> Any:
    return hub.resolve_for_group(model, version, group=group, members=members)


def _release_group_answer(hub: Any, held: dict, *, answer: Any) -> None:
    hub.release_group_answer(answer)


def _engine_update(hub: Any, held: dict, *, model: str, version: int, specs: list, rank: int, world: int,
                   seed: int, unpublish_first: int | None = None, fresh: bool = False) -> dict:
    """One worker of an engine (every worker at once, in the process group of
    ``init_group``) takes ``version`` as vLLM's workers do
    (``tensorhub.client.engineshare``): the first resolves for all, each pulls
    its TP slice serving into the same buffers as before, the announces and
    the last reports going to the server in one message each. ``fresh``: into
    new buffers made from ``specs`` this once (other specs: a pull that fails)."""
    from tensorhub.client.engineshare import EngineShare, Withdrawal

    share = held.get("engine share")
    if share is None:
        share = held["engine share"] = EngineShare(None, rank, world, model=model, engine="engine0",
                                                   pull_timeout_s=60.0)
    out: dict = {}
    withdrawal = None
    previous = held.get((model, unpublish_first)) if unpublish_first is not None else None
    if previous is not None:  # withdrawn with the engine's others, before the pull (as tensorhub_vllm's receiver)
        def done(outcome: Any) -> None:
            hub.withdrawn(previous, outcome, 60.0)
            held.pop((model, unpublish_first), None)

        withdrawal = Withdrawal(hub.withdrawal(previous, 60.0), done, previous)

    def pull(answer: Any, announce_with: Any) -> Any:
        out.update(_pull(hub, held, model=model, version=version, specs=specs, expect_seed=seed, serve=True,
                         read=("tp", rank, world), keep=None if fresh else "engine", answer=answer,
                         defer_complete=True,
                         announce_with=announce_with))
        return held[("result", model, version)]

    share.update(hub, version, pull, withdrawal)
    return out


def _announce_ahead(hub: Any, held: dict, *, model: str, of: int, version: int) -> bytes:
    """``Hub.announce_ahead`` of ``version`` in the memory of this process's replica of ``of``."""
    return hub.announce_ahead(held[(model, of)], version)


def _member_report(hub: Any, held: dict, *, model: str, version: int) -> Any:
    """This member's end of a group's update (its pull with ``defer_complete``; none: it failed)."""
    return hub.member_report(held.get(("result", model, version)))


def _send_group_reports(hub: Any, held: dict, *, answer: Any, reports: list) -> list[str]:
    return hub.send_group_reports(answer, reports)


def _report_later(hub: Any, held: dict, *, model: str, version: int) -> None:
    hub.report_later(held.get(("result", model, version)))


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


HANDLERS = {"resolve_for_group": _resolve_for_group, "release_group_answer": _release_group_answer,
            "engine_update": _engine_update, "announce_ahead": _announce_ahead, "member_report": _member_report, "send_group_reports": _send_group_reports,
            "report_later": _report_later,
            "publish": _publish, "publish_at": _publish_at, "publish_shard": _publish_shard, "init_group": _init_group,
            "withdraw_shards": _withdraw_shards, "publish_step": _publish_step,
            "publish_saved": _publish_saved, "republish": _republish, "unpublish": _unpublish, "pull": _pull,
            "pull_latest_loop": _pull_latest_loop, "latest": _latest, "latest_near": _latest_near, "versions": _versions,
            "overwrite": _overwrite, "prepare_expected": _prepare_expected, "free": _free, "corrupt": _corrupt, "wait_for_version": _wait_for_version}

