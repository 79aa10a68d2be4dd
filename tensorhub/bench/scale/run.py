"""``tensorhub bench scale``: a paper-scale update simulated with the real
reference server (its own process) and the real wire codec, the data path
replaced by the link model (``links.py``).

Per model, layout and size (FSDP ranks -> TP=8 engines), on a fresh server.
Two layouts of the engines (``cuts.py``): ``tp``, experts TP-sliced (rows of
gate/up, columns of down); ``ep``, TP=8 with ``enable_expert_parallel``
(experts whole on one worker each, the rest TP-sliced as before).


    1. every FSDP rank publishes its rows of every tensor (rules; the first with
       the manifest, the rest by fingerprint)             -> server CPU, request bytes
    2. a sample of TP workers resolve                      -> response bytes, server CPU each,
       and decode the answer and plan their reads (box       the client's decode + planning time
       overlaps with every holder, per group of tensors)
    3. every engine's workers publish as relays, a sample of late workers resolve
    4. the link model turns bytes, descriptors and the measured control plane
       into a predicted update time against the link limit

The server's work for all readers is, per stage (each reader resolves twice:
at the start and when relays appear), the stage's first resolve (it also builds
the coverage keys of every new holder, kept while the grouping stands), the
sample's CPU per engine's first resolve times the other engines (the workers
of an engine ask as one ``group``: one ranking and coverage search), and a
second worker's resolve (a lookup) times the other workers, done one after
another on its one core.

    5. the steady state: versions 2 and 3 from the same buffers; every message
       of every holder and reader sent for real (lean: layouts named, holders
       sent by number), the server's CPU for all of them -> steady_* figures
       (version 3), steady_first_* (version 2, which still pays once for the
       groups version 1's relays split); with ``trainer_cut`` the ranks also
       publish the readers' cut (rank 0 asks ``ReaderCuts``; in full in version
       2, by layout after) and the first hop reads it: one contiguous READ per
       region, after the ranks gathered their shares (``cuts.cut_hop``)

Planning is per reader and in parallel: one reader's. What is not the real code: the holders publish no bytes (their NIXL
metadata is a placeholder of 2 KB), and planning here intersects boxes per
group of alike tensors, as the server's coverage does; today's ReadLayout
expands every region into element runs, which for a TP=8 worker of Kimi-K2
would be 10^8 runs (the next step for the client, noted in the results).
"""

from __future__ import annotations

import json
import math
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np
from rich.console import Console
from rich.table import Table

from tensorhub import pacing
from tensorhub.bench.cpu import cpu_seconds
from tensorhub.bench.scale import cuts, links
from tensorhub.bench.scale.models import MODELS, Config, manifest, parameters, tensors
from tensorhub.local.serverprocess import ServerProcess
from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc
from tensorhub.proto import wire
from tensorhub.regions import Region
from tensorhub.regiontable import RegionTable, shapes_of
from tensorhub.server.state import held_bytes
from tensorhub.transport.cost import BACKENDS

NIXL_METADATA = b"\0" * 2048  # what a real agent's partial metadata is about (a placeholder: no bytes move)
CHUNK = 64 << 20


@dataclass
class ScaleConfig:
    models: list[str] = field(default_factory=lambda: list(MODELS))
    engines: list[int] = field(default_factory=lambda: [16, 32, 64, 128])
    trainer_ranks: list[int] | None = None  # per engines entry; default 2 x engines, in [64, 256]
    nic_gbit: float = 400.0
    sample: int = 8  # readers that resolve for real per stage
    link: str = "rdma"
    layouts: list[str] = field(default_factory=lambda: list(cuts.LAYOUTS))
    trainer_cut: bool = False  # steady versions also published in the readers' cut (Hub.publish(cut="readers"))
    # Without the cut, the ranks still publish and withdraw together (Hub.publish(trainer_group=)):
    # their messages sent by rank 0, a few Batches a step instead of a Publish and an Unpublish a rank
    trainer_group: bool = False
    # The steady state's answers name the holders each engine read before (``server/named.py``; from the
    # step after one that was steady: version 3 here); False: ranked, every engine resolving twice (as version 2)
    named: bool = True
    # Named engines' workers' announces go with the engine's Resolve (``tensorhub.client.ahead``): two messages
    # an engine and step; False: in a Batch of their own, as before (three)
    announce_ahead: bool = True

    def ranks_for(self, engines: int, i: int) -> int:
        if self.trainer_ranks:
            return self.trainer_ranks[i]
        return min(256, max(64, 2 * engines))


def run(cfg: ScaleConfig, out: str | None = None, console: Console | None = None) -> list[dict]:
    console = console or Console()
    base = BACKENDS[cfg.link]
    link = type(base)(base.name, base.per_descriptor_s, cfg.nic_gbit * 1e9 / 8, base.cut_bandwidth)
    rows: list[dict] = []
    for name in cfg.models:
        model_cfg = MODELS[name]
        model = tensors(model_cfg)
        for layout in cfg.layouts:
            for i, engines in enumerate(cfg.engines):
                ranks = cfg.ranks_for(engines, i)
                with console.status(f"{model_cfg.name}: {ranks} FSDP ranks -> {engines} TP=8 engines ({layout})"):
                    row = _one(model_cfg, model, engines, ranks, cfg, link, layout)
                rows.append(row)
                console.print(f"{row['model']:16} {layout} {row['gpus']:5} GPUs  predicted {row['predicted_s']:.2f} s  "
                              f"link limit {row['link_limit_s']:.2f} s  ({row['predicted_over_limit']:.2f}x)  "
                              f"control plane {row['control_plane_s']:.3f} s ({row['control_plane_share']:.1%})")
    _table(rows, console)
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "scale.json").write_text(json.dumps({"link": asdict(link), "sample_readers": cfg.sample,
                                                       "results": rows}, indent=1))
        _plot(rows, folder / "scale.png")
        console.print(f"wrote {folder / 'scale.json'} and {folder / 'scale.png'}")
    return rows


def _one(model_cfg: Config, model: list, engines: int, ranks: int, cfg: ScaleConfig, link, layout: str) -> dict:
    man = manifest(model)
    shapes = shapes_of(man)
    fingerprint = man.fingerprint
    wire_manifest = wire.manifest_to_wire(man)
    dims0 = shapes.dims[:, 0]
    kinds = np.array([cuts.KINDS.index(t.tp) for t in model], np.int64)
    kv_heads = model_cfg.kv_heads
    ep_experts = model_cfg.experts if layout == "ep" else 0
    owner = cuts.owners(model, ep_experts) if ep_experts else None

    def publish_request(agent: str, rules, rule_of, base_addr: int, origin: bool, with_manifest: bool,
                        version: int = 1):
        held = pb.HeldRegions(rules=[pb.HeldRule(dim=d, parts=n, part=k) for d, n, k in rules],
                              rule_of=zlib.compress(rule_of.tobytes(), 6))
        req = pb.PublishRequest(agent_id=agent, replica_id=f"{agent}.{version}", model="m", version=version,
                                chunk_size=CHUNK,
                                state=pb.REPLICA_STATE_COMPLETE, origin=origin, held_table=held,
                                memory=pb.ReplicaMemory(kind=pb.MEMORY_KIND_VRAM, packed=True, region_gap=[base_addr],
                                                        nixl_metadata=NIXL_METADATA))
        if with_manifest:
            req.manifest.CopyFrom(wire_manifest)
        else:
            req.manifest_fingerprint = fingerprint
        return req

    def cut_request(rank: int, version: int) -> pb.PublishRequest:
        """Rank ``rank``'s share of the readers' cut: the read boxes of the tensors it owns, back to back."""
        agent = f"rank{rank}"
        # Named as a Hub names every replica it publishes ("<agent id>.<n>": the cut is one more of the
        # rank's), so an answer names it by number as it does the shards (``ReplicaInfo.replica_suffix``).
        return pb.PublishRequest(agent_id=agent, replica_id=f"{agent}.{1000 + version}", model="m", version=version,
                                 chunk_size=CHUNK, state=pb.REPLICA_STATE_COMPLETE, origin=True, trainer_cut=True,
                                 held_table=cut_held[rank], manifest_fingerprint=fingerprint,
                                 memory=pb.ReplicaMemory(kind=pb.MEMORY_KIND_VRAM, packed=True,
                                                         region_gap=[(1 << 42) + (rank << 36)],
                                                         nixl_metadata=NIXL_METADATA))

    cut_held: list[pb.HeldRegions] = []
    if cfg.trainer_cut:
        owner_of = cuts.cut_owners(model, ranks)
        held: list[list] = [[] for _ in range(ranks)]
        for index, (t, rank) in enumerate(zip(model, owner_of)):
            held[rank] += [(index, Region(box=box)) for box in cuts.read_boxes(t, kv_heads, ep_experts)]
        cut_held = [wire.held_to_wire(RegionTable.from_held(h, shapes), shapes) for h in held]

    readers = engines * cuts.TP
    sample = min(cfg.sample, readers)
    out: dict = {"model": model_cfg.name, "layout": layout, "parameters": parameters(model), "tensors": len(model),
                 "gpus": readers, "engines": engines, "trainer_ranks": ranks, "sample_readers": sample,
                 "trainer_group": cfg.trainer_group, "announce_ahead": cfg.announce_ahead}
    with ServerProcess(agent_ttl_s=3600, lease_ttl_s=3600, retain=0) as server, \
            grpc.insecure_channel(server.address, options=[("grpc.max_receive_message_length", 256 << 20),
                                                           ("grpc.max_send_message_length", 256 << 20)]) as ch:
        stub = pb_grpc.ReferenceServiceStub(ch)
        pid = server.proc.pid

        # 1. the trainer's ranks
        request_bytes = []
        cpu0 = cpu_seconds(pid)
        for r in range(ranks):
            agent = f"rank{r}"
            stub.RegisterAgent(pb.RegisterAgentRequest(agent_id=agent, name=agent,
                                                       labels=pb.Labels(host=f"t{r // 8}", rack="trainer")), timeout=60)
            req = publish_request(agent, *cuts.trainer_rules(dims0, ranks, r), 1 << 40, True, r == 0)
            request_bytes.append(req.ByteSize())
            stub.Publish(req, timeout=120)
            if r == 0:
                rss_after_first, cpu_first = _rss(pid), cpu_seconds(pid)
        publish_cpu = cpu_seconds(pid) - cpu0
        out.update(publish_request_bytes_first=request_bytes[0],
                   publish_request_bytes=int(np.median(request_bytes[1:])) if ranks > 1 else request_bytes[0],
                   server_cpu_publish_s=publish_cpu,
                   server_cpu_publish_per_rank_s=(cpu_seconds(pid) - cpu_first) / max(1, ranks - 1),
                   server_bytes_per_trainer_replica=(_rss(pid) - rss_after_first) / max(1, ranks - 1))

        # 2. a sample of TP workers resolve from the trainer alone
        first = _resolve_sample(stub, pid, [f"w{e}.{w}" for e, w in _spread(engines, sample)], fingerprint, shapes)

        # 3. every engine's workers publish as relays; late workers resolve
        for e in range(engines):
            for w in range(cuts.TP):
                agent = f"engine{e}.{w}"
                stub.RegisterAgent(pb.RegisterAgentRequest(agent_id=agent, name=agent,
                                                           labels=pb.Labels(host=f"e{e}", rack=f"r{e // 16}")),
                                   timeout=60)
        # What each engine is told of version 1 as it starts, the trainer's ranks alone holding it (not
        # measured: the sample above is version 1's cost); it knows their layouts from then on.
        numbering: dict[int, str] = {}  # per engine: the server's layout numbering it has numbers of
        knows = {e: {info.layout for info in _engine_resolve(stub, e, 1, fingerprint, set(), numbering).replicas}
                 for e in range(engines)}
        rss0, cpu0 = _rss(pid), cpu_seconds(pid)
        for e in range(engines):  # an engine's workers' first announces in one Batch (engineshare)
            taken = stub.Batch(pb.BatchRequest(publishes=[
                publish_request(f"engine{e}.{w}", *cuts.worker_rules(kinds, kv_heads, w, owner), 1 << 41, False,
                                False) for w in range(cuts.TP)]), timeout=120)
            if any(o.code for o in taken.publishes):
                raise RuntimeError(f"the server refused engine {e}'s first announces: {taken.publishes}")
        relay_cpu = cpu_seconds(pid) - cpu0
        out.update(server_cpu_relay_publish_per_replica_s=relay_cpu / readers,
                   server_bytes_per_relay_replica=(_rss(pid) - rss0) / readers)
        late = _resolve_sample(stub, pid, [f"late{e}.{w}" for e, w in _spread(engines, sample)], fingerprint, shapes)

        # 5. the steady state: versions 2 and 3 from the same buffers, every reader's messages for real.
        # Version 2 is the first: it still pays once for what version 1's relays changed on the server
        # (their regions split its groups of alike tensors, so every holder's coverage keys are computed
        # again); version 3 is every later step's cost.
        # 4, made here: the reader's READs and the link model. How long a steady pull lasts at the
        # least (no control plane): its own reports go during it, at the pace the client keeps and
        # the server sets. The steady versions' first hop: from the cut, if any (the first had none).
        t0 = time.perf_counter()
        hop = cuts.first_hop(model, ranks, kv_heads, 0, link, ep_experts)  # worker 0: every worker reads alike
        plan_s = time.perf_counter() - t0
        steady_hop: cuts.FirstHop | cuts.CutHop = cuts.cut_hop(model, ranks, kv_heads, 0, link, ep_experts) \
            if cfg.trainer_cut else hop

        def predict(control_plane_s: float, first: cuts.FirstHop | cuts.CutHop = hop) -> links.Prediction:
            return links.predict(engines=engines, trainer_ranks=ranks, tp=cuts.TP, bytes_per_gpu=hop.wanted_bytes,
                                 first_hop_s=first.seconds, first_hop_read_bytes=first.read_bytes, chunk=CHUNK,
                                 link=link, control_plane_s=control_plane_s)

        pull_s = predict(0.0, steady_hop).predicted_s
        relay_chunks = [-(-int(held_bytes(man, wire.held_from_wire(
            publish_request("w", *cuts.worker_rules(kinds, kv_heads, w, owner), 0, False, False).held_table,
            shapes)).sum()) // CHUNK) for w in range(cuts.TP)]
        first_steady, steady = (
            _steady(stub, pid, ranks, engines, fingerprint, knows, numbering, version, relay_chunks,
                    lambda r, v=version: publish_request(f"rank{r}", *cuts.trainer_rules(dims0, ranks, r), 1 << 40,
                                                         True, False, version=v),
                    lambda e, w, v=version: publish_request(f"engine{e}.{w}",
                                                            *cuts.worker_rules(kinds, kv_heads, w, owner), 1 << 41,
                                                            False, False, version=v),
                    (lambda r, v=version: cut_request(r, v)) if cfg.trainer_cut else None,
                    named=cfg.named and version == 3, together=cfg.trainer_group, pull_s=pull_s,
                    ahead=cfg.announce_ahead)
            for version in (2, 3))

    # 4. the reader's READs and the link model (``hop``, ``steady_hop``, ``predict``: above)
    planning_s = max(first["decode_s"], late["decode_s"]) + plan_s
    resolve_cpu = max(first["cpu_per_resolve_s"], late["cpu_per_resolve_s"])
    # A stage's first resolve also builds every new holder's coverage keys (kept per grouping epoch):
    # counted once per stage, the rest once per reader.
    # Per stage: the first group's resolve and every other engine's first worker's (a ranking and a
    # coverage search per group). The other 7 workers of an engine send nothing: vLLM's take the first
    # worker's answer over the engine's CPU group (tensorhub_vllm's groupshare, on by default). Their
    # cost had they asked (a lookup each) is reported apart: server_cpu_per_member_*.
    server_s = publish_cpu + relay_cpu + sum(s["cpu_first_s"] + (engines - 1) * s["cpu_per_resolve_s"]
                                             for s in (first, late))
    control_s = server_s + planning_s
    p = predict(control_s)
    out.update(
        predicted_s=p.predicted_s, link_limit_s=p.link_limit_s, predicted_over_limit=p.predicted_s / p.link_limit_s,
        control_plane_s=control_s, control_plane_share=control_s / p.link_limit_s,
        server_cpu_s=server_s, planning_s=planning_s, planning_boxes_s=plan_s,
        server_cpu_per_resolve_s=resolve_cpu,
        # per stage: an EP layout doubles the server's coverage groups (each expert shape splits by its owner)
        server_cpu_per_resolve_first_s=first["cpu_per_resolve_s"],
        server_cpu_per_member_first_s=first["cpu_per_member_s"], server_cpu_per_member_late_s=late["cpu_per_member_s"],
        server_cpu_per_resolve_late_s=late["cpu_per_resolve_s"],
        server_cpu_opening_resolve_first_s=first["cpu_first_s"], server_cpu_opening_resolve_late_s=late["cpu_first_s"],
        resolve_request_bytes=max(first["request_bytes"], late["request_bytes"]),
        resolve_response_bytes_max=max(first["response_bytes_max"], late["response_bytes_max"]),
        resolve_holders_first=first["holders"], resolve_holders_late=late["holders"],
        server_bytes_per_replica_max=max(out["server_bytes_per_trainer_replica"], out["server_bytes_per_relay_replica"]),
        bytes_per_gpu=hop.wanted_bytes, first_hop_read_bytes=hop.read_bytes,
        descriptors_per_reader_max=hop.descriptors, descriptors_exact_runs=hop.exact_descriptors,
        descriptors_relay=math.ceil(hop.wanted_bytes / CHUNK),
        first_hop_s=p.first_hop_s, relay_hop_s=p.relay_hop_s, depth=p.depth, wave0_engines=p.wave0_engines,
        trainer_egress_bytes=p.trainer_egress_bytes, relay_bytes=p.relay_bytes,
    )
    # The steady state: the same first hop and relays; the control plane is what the server spent on
    # every message of version 2, one after another on its core, plus one reader's parse of its answers
    # (its plans come from the plan cache: nothing to decode or plan).
    steady_control_s = steady["server_cpu_s"] + steady["parse_s"]
    first_steady_control_s = first_steady["server_cpu_s"] + first_steady["parse_s"]
    if cfg.trainer_cut:
        out.update(trainer_cut=True, cut_descriptors_per_reader=steady_hop.descriptors,
                   cut_read_s=steady_hop.read_s, cut_gather_s=steady_hop.gather_s,
                   cut_share_bytes_max=steady_hop.share_bytes_max)

    ps = predict(steady_control_s, steady_hop)
    out.update(
        steady_control_plane_s=steady_control_s, steady_control_plane_share=steady_control_s / ps.link_limit_s,
        steady_messages=sum(steady["messages"].values()), steady_messages_by_method=steady["messages"],
        # of them, what the relay workers sent on their own while pulling (reports, asks: ``_pull_messages``)
        steady_pull_reports=steady["pull_messages"]["reports"], steady_pull_asks=steady["pull_messages"]["asks"],
        steady_pull_s=pull_s,
        steady_server_cpu_s=steady["server_cpu_s"], steady_answer_bytes_max=steady["answer_bytes_max"],
        # the largest steady answer: its holders, how many of them packed, and its bytes a holder
        steady_answer_holders=steady["answer_holders"], steady_answer_holders_packed=steady["answer_holders_packed"],
        steady_answer_bytes_per_holder=steady["answer_bytes_per_holder"],
        steady_request_bytes_max=steady["request_bytes_max"], steady_resolves=steady["resolves"],
        steady_answers_named=steady["answers_named"],
        steady_holders_full=steady["holders_full"], steady_holders_lean=steady["holders_lean"],
        steady_server_cpu_publish_s=steady["publish_cpu_s"], steady_server_cpu_resolve_s=steady["resolve_cpu_s"],
        steady_server_cpu_withdraw_s=steady["withdraw_cpu_s"],
        # of the publishes': the trainer's announces (its cut and shards; with the readers' cut ask)
        steady_server_cpu_trainer_publish_s=steady["trainer_publish_cpu_s"],
        steady_parse_s=steady["parse_s"], steady_predicted_s=ps.predicted_s,
        steady_predicted_over_limit=ps.predicted_s / ps.link_limit_s,
        # version 2, the first from the same buffers (``steady_*``: version 3)
        steady_first_control_plane_s=first_steady_control_s,
        steady_first_server_cpu_publish_s=first_steady["publish_cpu_s"],
        steady_first_server_cpu_resolve_s=first_steady["resolve_cpu_s"],
        steady_first_resolves=first_steady["resolves"],
        steady_first_predicted_s=predict(first_steady_control_s, steady_hop).predicted_s,
        steady_first_hop_s=ps.first_hop_s,
    )
    return out


def _steady(stub, pid: int, ranks: int, engines: int, fingerprint: str, knows: dict[int, set[bytes]],
            numbering: dict[int, str], version: int, relay_chunks: list[int],
            trainer_request, relay_request, cut_request=None, named: bool = False, together: bool = False,
            pull_s: float = 0.0, ahead: bool = True) -> dict:
    """``version`` from the same buffers as the one before, as an RL step makes
    it: every holder of the version before withdraws it (a trainer rank its
    shards; with the cut, every rank's cut and shards sent by rank 0,
    ``MAX_BATCH`` a Batch; an engine's relay workers with its first Resolve),
    the trainer's ranks
    publish naming their earlier layout, every engine resolves once
    for its 8 workers (the first asks for all, ``members``, with a read lease,
    as vLLM's workers do: ``groupshare``) knowing the holders' layouts from its
    version-1 answers, the workers announce what they pull as relays (naming
    their layouts too: one Batch per engine), each engine reports them
    complete in another (``relay_chunks``: worker w's chunks; with their
    pulled bytes and the answer's lease: ``engineshare``), and every engine resolves
    again. Every message is sent
    for real, none sampled, and the server's CPU for all of them is measured.

    ``named``: the steady state from the step after (a Hub names the holders
    its previous pull read from once that pull was steady: ``server/named.py``).
    Each engine's Resolve names the holders it read the version before from
    (wave 0: the trainer's cut, or its shards; engine e past it: engine
    e - wave0's relays, ``links.wave0_engines``) and is answered with them
    alone; it carries its workers' announces (``client/ahead.py``; with
    ``ahead=False`` they go in a Batch of their own after it, as before), so
    an engine's step is two messages: the Resolve and its end. The engines
    resolve wave by wave, each wave after the one it relays from announced
    (the server holds a named Resolve until its holders announce: here they
    already have), and no engine resolves again.

    While they pull (``pull_s``, the link model's time), every named relay
    worker sends what a real named pull sends on its own (``_pull_messages``):
    its chunk reports at the pace of its client and of the server's answer.
    An unnamed pull's own are not sent (ranked, version 2): it reports and
    asks every ``pacing.ASK_WITH_NEWS_S`` once news flows, after every round
    before, each ask a ranking of every holder: ~10 a worker over a Kimi-K2
    pull, tens of seconds of the server's CPU to send here."""
    full = lean = 0
    answers, requests, resolve_cpu = [], [], 0.0
    per_holder = (0.0, 0, 0)  # the largest answer's bytes a holder, its holders, how many packed
    parse_s = 0.0
    read_before = _read_before(stub, ranks, engines, version - 1, cut_request is not None) if named else {}
    for e, layouts in read_before.items():
        knows[e] |= set(layouts)  # it read from them: it has their layouts

    def took(e: int, answer: pb.ResolveResponse) -> None:
        """An engine's answer's size, its bytes a holder (the largest's), the layouts it makes known."""
        nonlocal per_holder
        answers.append(answer.ByteSize())
        holders = len(answer.replicas) + len(answer.packed.flags)
        if answers[-1] == max(answers) and holders:  # the largest answer's bytes a holder (packed or not)
            bare = pb.ResolveResponse()
            bare.CopyFrom(answer)
            bare.ClearField("replicas")
            bare.ClearField("packed")
            per_holder = ((answers[-1] - bare.ByteSize()) / holders, holders, len(answer.packed.flags))
        knows[e] |= {info.layout for info in answer.replicas if info.layout}  # as a Hub keeps them
    # What each engine was told of the version before (``knows``: as it started; not measured, that was
    # that version's cost), then once relays held it: the trainer's holders and the relays its answer named,
    # the agents this version's answers name. Its workers know the same: they all took its answers
    # (``groupshare``).
    for e in range(engines):
        before = _engine_resolve(stub, e, version - 1, fingerprint, knows[e], numbering)
        knows[e] |= {info.layout for info in before.replicas}
    calls0 = _calls(stub)
    # Every holder of the version before withdraws it before its buffers take this one: a trainer rank
    # its shards (an Unpublish), or, publishing with the cut, every rank's cut and shards sent by rank 0
    # (``Holdings.withdraw_together(group=)``); an engine's relays with its first Resolve (below).
    cpu0 = cpu_seconds(pid)
    together = together or cut_request is not None  # ranks that publish with the cut are a group too
    if together:  # the ranks withdraw together: rank 0 sends them all
        every = [(f"rank{r}", f"rank{r}.{v}") for r in range(ranks)
                 for v in ((1000 + version - 1, version - 1) if cut_request is not None and version > 2
                           else (version - 1,))]
        for start in range(0, len(every), wire.MAX_BATCH):
            _withdraw(stub, every[start:start + wire.MAX_BATCH], batch=True)
    for r in range(ranks) if not together else ():
        _withdraw(stub, [(f"rank{r}", f"rank{r}.{version - 1}")])
    withdraw_cpu = cpu_seconds(pid) - cpu0  # the trainer's; an engine's relays' go with its Resolve (below)
    cpu0 = cpu_seconds(pid)
    if cut_request is not None:  # rank 0 asks for the readers' cut (its ranks share the answer)
        stub.ReaderCuts(pb.ReaderCutsRequest(model="m", fingerprint=fingerprint), timeout=120)
    batched = together and (cut_request is None or version > 2)
    if batched:  # as Hub.publish(cut=... or trainer_group=...): every rank's share of the cut (if any) and
        # its shards, naming their layouts, sent by the group's first rank (``Holdings.announce_together``)
        kinds = (trainer_request,) if cut_request is None else (cut_request, trainer_request)
        announces = [_lean(request(r)) for r in range(ranks) for request in kinds]
        for start in range(0, len(announces), wire.MAX_BATCH):
            announced = stub.Batch(pb.BatchRequest(publishes=announces[start:start + wire.MAX_BATCH]), timeout=120)
            if any(o.code for o in announced.publishes):
                raise RuntimeError(f"the server refused the ranks' publishes: {announced.publishes}")
    for r in range(ranks) if not batched else ():
        if cut_request is not None:  # the first cut goes whole, alone; then the shards by their layout
            stub.Publish(cut_request(r), timeout=120)
        _publish_lean(stub, trainer_request(r))
    publish_cpu = trainer_publish_cpu = cpu_seconds(pid) - cpu0
    leases: dict[int, str] = {}  # each engine's first answer's lease: it goes with the engine's Batch
    paces: dict[int, float] = {}  # each engine's first answer's pace (``ResolveResponse.pace_s``)
    pulling: dict[int, dict[str, int]] = {}  # each engine's workers' own messages while they pull
    answered_named = 0
    if named:
        counters0 = stub.Describe(pb.DescribeRequest(model="none"), timeout=60).control
        wave0 = links.wave0_engines(engines, ranks, cuts.TP)
        for start in range(0, engines, wave0):
            wave = range(start, min(engines, start + wave0))
            cpu = cpu_seconds(pid)
            for e in wave:
                answer = _engine_resolve(stub, e, version, fingerprint, knows[e], numbering, sizes=requests,
                                         release=False, named=read_before[e], withdrawals=[
                                             (f"engine{e}.{w}", f"engine{e}.{w}.{version - 1}") for w in range(cuts.TP)],
                                         announces=[_filling(relay_request(e, w)) for w in range(cuts.TP)]
                                         if ahead else ())
                if not answer.named:
                    raise RuntimeError(f"engine {e}'s answer is not the {len(read_before[e])} holders it named")
                leases[e] = answer.lease_id
                paces[e] = answer.pace_s
                took(e, answer)
            resolve_cpu += cpu_seconds(pid) - cpu
            cpu = cpu_seconds(pid)
            for e in wave if not ahead else ():  # they start their pulls: the next wave's holders
                _announce(stub, [relay_request(e, w) for w in range(cuts.TP)])
            publish_cpu += cpu_seconds(pid) - cpu
        cpu = cpu_seconds(pid)
        for e in range(engines):
            pulling[e] = _pull_messages(stub, e, version, relay_chunks, pull_s, paces[e])
        for e in range(engines):
            _end(stub, [relay_request(e, w) for w in range(cuts.TP)], relay_chunks, leases.pop(e))
        publish_cpu += cpu_seconds(pid) - cpu
        counters = stub.Describe(pb.DescribeRequest(model="none"), timeout=60).control
        full, lean = counters.holders_full - counters0.holders_full, counters.holders_lean - counters0.holders_lean
        answered_named = counters.answers_named - counters0.answers_named
        t0 = time.perf_counter()  # one reader's parse of its answer
        pb.ResolveResponse.FromString(answer.SerializeToString())
        parse_s = time.perf_counter() - t0
    for stage in range(0 if named else 2):
        if stage == 1:
            cpu = cpu_seconds(pid)
            for e in range(engines):  # (their own reports and asks between: not sent, see the docstring)
                _relay_messages(stub, [relay_request(e, w) for w in range(cuts.TP)], relay_chunks, leases.pop(e))
            publish_cpu += cpu_seconds(pid) - cpu
        counters0 = stub.Describe(pb.DescribeRequest(model="none"), timeout=60).control
        cpu = cpu_seconds(pid)
        for e in range(engines):
            answer = _engine_resolve(stub, e, version, fingerprint, knows[e], numbering, sizes=requests,
                                     release=stage == 1, withdrawals=[] if stage else [
                                         (f"engine{e}.{w}", f"engine{e}.{w}.{version - 1}") for w in range(cuts.TP)])
            if stage == 0:
                leases[e] = answer.lease_id
            took(e, answer)
        resolve_cpu += cpu_seconds(pid) - cpu
        counters = stub.Describe(pb.DescribeRequest(model="none"), timeout=60).control
        full += counters.holders_full - counters0.holders_full
        lean += counters.holders_lean - counters0.holders_lean
        t0 = time.perf_counter()  # one reader's parse of its answer (the rebinding is a few attributes a holder)
        answer = pb.ResolveResponse.FromString(answer.SerializeToString())
        parse_s += time.perf_counter() - t0
    calls = _calls(stub)
    messages = {name: n - calls0.get(name, 0) for name, n in calls.items() if n > calls0.get(name, 0)}
    return {"messages": messages,
            "pull_messages": {kind: sum(p[kind] for p in pulling.values()) for kind in ("reports", "asks")},
            "server_cpu_s": withdraw_cpu + publish_cpu + resolve_cpu, "publish_cpu_s": publish_cpu,
            "trainer_publish_cpu_s": trainer_publish_cpu,
            "resolve_cpu_s": resolve_cpu, "withdraw_cpu_s": withdraw_cpu,
            "answer_bytes_max": max(answers), "request_bytes_max": max(requests), "resolves": len(answers),
            "answer_bytes_per_holder": per_holder[0], "answer_holders": per_holder[1],
            "answer_holders_packed": per_holder[2],
            "holders_full": full, "holders_lean": lean, "parse_s": parse_s, "answers_named": answered_named}


def _withdraw(stub, replicas: list[tuple[str, str]], batch: bool = False) -> None:
    """The withdrawals of (agent, replica of the version before): one Unpublish,
    or a Batch of several, or of any number (``batch``: a group's, sent by its
    first member; nobody reads them by now: no drain)."""
    requests = _unpublish_requests(replicas)
    if len(requests) == 1 and not batch:
        answer = stub.Unpublish(requests[0], timeout=120)
        if not answer.drained:
            raise RuntimeError(f"{replicas[0][1]} did not drain: {answer}")
    else:
        _check_withdrawn(replicas, stub.Batch(pb.BatchRequest(withdrawals=requests), timeout=120).withdrawals)


def _unpublish_requests(replicas: list[tuple[str, str]]) -> list[pb.UnpublishRequest]:
    """The withdrawals of (agent, replica of the version before)."""
    return [pb.UnpublishRequest(agent_id=a, replica_id=r, drain_timeout_s=10) for a, r in replicas]


def _check_withdrawn(replicas: list[tuple[str, str]], outcomes) -> None:
    """Every withdrawal sent together answered, taken and drained."""
    if len(outcomes) != len(replicas) or any(o.code or not o.unpublished.drained for o in outcomes):
        raise RuntimeError(f"withdrawals of {[r for _, r in replicas][:3]}...: {list(outcomes)[:3]}")


def _calls(stub) -> dict[str, int]:
    """The messages the server received so far, by method, the Describe asking left out."""
    calls = dict(stub.Describe(pb.DescribeRequest(model="none"), timeout=60).control.calls)
    calls.pop("Describe", None)
    return calls


def _relay_messages(stub, requests: list[pb.PublishRequest], chunks: list[int], lease_id: str) -> None:
    """An engine's relays' messages for a version, the fewest serving pulls
    send, as vLLM's workers share them (``tensorhub.client.engineshare``):
    one Batch of every worker's announce (Publish FILLING, naming its
    layout), then one of every worker's last report (all its chunks,
    complete) and the bytes it read, and the release of the engine's
    answer's lease. A pull slower than the server's answers sends reports
    between them (``_steady``'s docstring); the engine's workers'
    withdrawals of their previous version went with its first Resolve."""
    _announce(stub, requests)
    _end(stub, requests, chunks, lease_id)


def _pull_messages(stub, e: int, version: int, chunks: list[int], pull_s: float, pace_s: float) -> dict[str, int]:
    """What engine ``e``'s named relay workers send on their own while they
    pull for ``pull_s``, as the client does (``client/landed.py``,
    ``PullJob.server_pace_s``): each reports the chunks it landed so far every
    ``pacing.news_pace`` of its engine's answer's pace (``pace_s``), the first
    a pace in; a named pull asks only when it has nothing to read, which a
    relay a chunk behind the one it reads, told its chunks (it subscribed),
    never is. The last report is the engine's end (``_end``). Returns the
    messages sent, by kind."""
    sent = {"reports": 0, "asks": 0}
    pace = pacing.news_pace(pace_s)
    for w in range(cuts.TP):
        agent = f"engine{e}.{w}"
        t = pace
        while t < pull_s:
            landed = min(chunks[w], int(chunks[w] * t / pull_s) + 1)
            stub.ReportChunks(pb.ReportChunksRequest(agent_id=agent, replica_id=f"{agent}.{version}",
                                                     chunks=range(landed)), timeout=120)
            sent["reports"] += 1
            t += pace
    return sent


def _filling(request: pb.PublishRequest) -> pb.PublishRequest:
    """A worker's announce: its replica, FILLING, by layout (in place)."""
    request.state = pb.REPLICA_STATE_FILLING
    return _lean(request)


def _announce(stub, requests: list[pb.PublishRequest]) -> None:
    """An engine's workers' announces (Publish FILLING, by layout) in one Batch."""
    announced = stub.Batch(pb.BatchRequest(publishes=[_filling(r) for r in requests]), timeout=120)
    refused = [o.detail for o in announced.publishes if o.code]
    if refused:
        raise RuntimeError(f"the server refused an engine's announces in part: {refused[:3]}")


def _end(stub, requests: list[pb.PublishRequest], chunks: list[int], lease_id: str) -> None:
    """An engine's workers' last reports (complete), the bytes they read and the
    release of the engine's answer's lease, in one Batch."""
    pulled = wire.pulled_to_wire({(1, True): 1 << 30})  # from a peer on its host (tier 1) and the trainer
    batch = pb.BatchRequest(
        reports=[pb.ReportChunksRequest(agent_id=r.agent_id, replica_id=r.replica_id, chunks=range(chunks[w]),
                                        complete=True) for w, r in enumerate(requests)],
        releases=[pb.ReleaseReadLeaseRequest(agent_id=r.agent_id, pulled=pulled) for r in requests])
    batch.releases.append(pb.ReleaseReadLeaseRequest(agent_id=requests[0].agent_id, lease_id=lease_id))
    answer = stub.Batch(batch, timeout=120)
    refused = [o.detail for o in (*answer.reports, *answer.releases) if o.code]
    if refused:
        raise RuntimeError(f"the server refused an engine's Batch in part: {refused[:3]}")


def _engine_resolve(stub, e: int, version: int, fingerprint: str, knows: set[bytes], numbering: dict[int, str],
                    sizes: list[int] | None = None, release: bool = True,
                    withdrawals: list[tuple[str, str]] = (), named: list[bytes] = (),
                    announces: list[pb.PublishRequest] = ()) -> pb.ResolveResponse:
    """Engine ``e``'s one Resolve of ``version``: its first worker asks for all
    of them with a read lease (``Hub.resolve_for_group``), released as the
    pulls end (``release``; else the caller releases it with the engine's Batch),
    with its workers' ``withdrawals`` of (agent, replica) of the version before
    and, in the steady state, their ``announces`` of this one (``client/ahead.py``)."""
    request = pb.ResolveRequest(agent_id=f"engine{e}.0", model="m", version=version, group=f"engine{e}",
                                known_fingerprint=fingerprint, known_layouts=sorted(knows), lease=True,
                                members=[f"engine{e}.{m}" for m in range(1, cuts.TP)],
                                layout_ids=numbering.get(e, ""), packed_holders=e in numbering,
                                withdrawals=_unpublish_requests(withdrawals), named_layouts=named,
                                announces=announces)
    answer = stub.Resolve(request, timeout=120)
    _check_withdrawn(withdrawals, answer.withdrawals)
    refused = [o.detail for o in answer.announces if o.code]
    if refused or len(answer.announces) != len(announces):
        raise RuntimeError(f"engine {e}'s announces with its Resolve were not all taken: {refused[:3]}")
    numbering[e] = answer.layout_ids  # as client/rpc.py: lean holders by number (packed) from the next answer on
    if release:
        stub.ReleaseReadLease(pb.ReleaseReadLeaseRequest(agent_id=request.agent_id, lease_id=answer.lease_id),
                              timeout=120)
    if sizes is not None:
        sizes.append(request.ByteSize())
    return answer


def _read_before(stub, ranks: int, engines: int, version: int, cut: bool) -> dict[int, list[bytes]]:
    """What each engine read ``version`` from, by layout (``ReplicaInfo.layout``),
    as its Hub remembers it (``Hub.named_layouts``): wave 0 the trainer's cut
    (or its shards), engine e past it engine e - wave0's relays. Learnt from
    probes' answers, not measured: a probe on the trainer's side is told of
    every trainer holder (the cut always, every shard to cover), one on engine
    u's host of u's relays first (the same host ranks first)."""
    def layouts(probe: str, labels: pb.Labels, mine, want: int) -> list[bytes]:
        stub.RegisterAgent(pb.RegisterAgentRequest(agent_id=probe, name=probe, labels=labels), timeout=60)
        answer = stub.Resolve(pb.ResolveRequest(agent_id=probe, model="m", version=version), timeout=120)
        found = [info.layout for info in answer.replicas if mine(info.replica_id)]
        if len(found) != want:
            raise RuntimeError(f"{probe} was told of {len(found)} of the {want} holders it looks for")
        return found

    suffix = f".{1000 + version if cut else version}"
    trainer = layouts("probe-trainer", pb.Labels(host="probe", rack="trainer"),
                      lambda rid: rid.startswith("rank") and rid.endswith(suffix), ranks)
    wave0 = links.wave0_engines(engines, ranks, cuts.TP)
    return {e: trainer if e < wave0 else layouts(f"probe{e - wave0}", pb.Labels(host=f"e{e - wave0}",
                                                                                 rack=f"r{(e - wave0) // 16}"),
                                                 lambda rid, u=e - wave0: rid.startswith(f"engine{u}."), cuts.TP)
            for e in range(engines)}


def _publish_lean(stub, request: pb.PublishRequest) -> None:
    """Publish naming the layout of the request's earlier version (it must be known)."""
    stub.Publish(_lean(request), timeout=120)


def _lean(request: pb.PublishRequest) -> pb.PublishRequest:
    """``request`` naming its layout instead of its regions and memory (in place)."""
    layout = wire.publish_layout(request)
    for name in ("held", "held_table", "memory"):
        request.ClearField(name)
    request.layout = layout
    return request


def _spread(engines: int, sample: int) -> list[tuple[int, int]]:
    """``sample`` (engine, worker) pairs spread over the engines and the 8 workers."""
    step = max(1, engines * cuts.TP // sample)
    return [divmod(k * step, cuts.TP) for k in range(sample)]


def _resolve_sample(stub, pid: int, agents: list[str], fingerprint: str, shapes) -> dict:
    """Each sampled worker asks as the first of its engine (``group``, as vLLM's
    workers ask: the server ranks and searches coverage once per group), then a
    second worker of the same engine asks (a lookup): their CPU apart."""
    response, holders, decode = [], [], []
    marks = [cpu_seconds(pid)]  # the server's CPU before the sample and after each group's first resolve
    members = 0.0  # the server's CPU for the second workers' resolves
    request = None
    for agent in agents:
        group = f"engine-of-{agent}"
        for who in (agent, agent + "-peer"):
            stub.RegisterAgent(pb.RegisterAgentRequest(agent_id=who, name=who, labels=pb.Labels(host=agent)),
                               timeout=60)
        marks[-1] = cpu_seconds(pid)  # registering is not resolving
        request = pb.ResolveRequest(agent_id=agent, model="m", version=1, known_fingerprint=fingerprint, group=group)
        answer = stub.Resolve(request, timeout=120)
        marks.append(cpu_seconds(pid))
        stub.Resolve(pb.ResolveRequest(agent_id=agent + "-peer", model="m", version=1, known_fingerprint=fingerprint,
                                       group=group), timeout=120)
        members += cpu_seconds(pid) - marks[-1]
        response.append(answer.ByteSize())
        holders.append(len(answer.replicas))
        t0 = time.perf_counter()  # the client's decode: every holder's regions and memory
        for info in answer.replicas:
            table = wire.held_from_wire(info.held_table, shapes)
            wire.memory_regions_from_wire(info.memory, table.nbytes(shapes))
        decode.append(time.perf_counter() - t0)
        marks.append(cpu_seconds(pid))
    # The first resolve is apart: it builds the coverage keys of every holder new since the grouping last
    # changed. Clock ticks (10 ms) over the whole sample: a mean, not a per-call figure.
    first_s = marks[1] - marks[0]
    groups = (sum(marks[k + 1] - marks[k] for k in range(2, len(marks) - 1, 2)) / (len(agents) - 1)
              if len(agents) > 1 else first_s)
    return {"response_bytes_max": max(response), "holders": max(holders), "decode_s": max(decode),
            "cpu_first_s": first_s, "cpu_per_resolve_s": groups, "cpu_per_member_s": members / len(agents),
            "request_bytes": request.ByteSize() if request else 0}


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _table(rows: list[dict], console: Console) -> None:
    table = Table(title="tensorhub bench scale: predicted update time (link model) over the real server and codec")
    for col in ("model", "layout", "GPUs", "FSDP ranks", "predicted s", "link limit s", "x limit", "control plane",
                "Resolve max", "server B/replica", "descriptors/reader", "depth"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        table.add_row(r["model"], r["layout"], str(r["gpus"]), str(r["trainer_ranks"]), f"{r['predicted_s']:.2f}",
                      f"{r['link_limit_s']:.2f}", f"{r['predicted_over_limit']:.2f}",
                      f"{r['control_plane_s']:.3f} s ({r['control_plane_share']:.1%})",
                      _size(r["resolve_response_bytes_max"]), _size(r["server_bytes_per_replica_max"]),
                      f"{r['descriptors_per_reader_max']:,}", str(r["depth"]))
    console.print(table)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    style = {"tp": ("-", "o"), "ep": ("--", "s")}
    for k, name in enumerate(dict.fromkeys(r["model"] for r in rows)):
        color = f"C{k}"
        for layout, (ls, marker) in style.items():
            mine = [r for r in rows if r["model"] == name and r["layout"] == layout]
            if mine:
                ax.plot([r["gpus"] for r in mine], [r["predicted_s"] for r in mine], ls=ls, marker=marker,
                        color=color, label=f"{name} {layout.upper()}")
                if all("steady_predicted_s" in r for r in mine):  # the next version from the same buffers
                    ax.plot([r["gpus"] for r in mine], [r["steady_predicted_s"] for r in mine], ls=ls, marker=marker,
                            color=color, alpha=0.45, lw=0.9, markerfacecolor="none",
                            label=f"{name} {layout.upper()}, steady")
        # the link limit is the same for both layouts: each worker holds 1/8 of every expert's bytes either way
        mine = [r for r in rows if r["model"] == name and r["layout"] == rows[0]["layout"]]
        ax.plot([r["gpus"] for r in mine], [r["link_limit_s"] for r in mine], ls=":", color=color, alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rollout GPUs (TP=8 engines x 8)")
    ax.set_ylabel("update time, s")
    ax.set_title("Predicted update time at paper scale (link model, real server)\n"
                 "solid TP, dashed EP; pale: the next version (steady state); dotted: link limit", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
