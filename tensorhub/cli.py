"""``tensorhub`` command line: the reference server, the demo, benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys


def _server(args: argparse.Namespace) -> int:
    from tensorhub.server import ServerConfig, serve
    from tensorhub.server.auth import TlsFiles, read_secret

    try:
        token = read_secret(args.token_file, "token file") if args.token_file else ""
        config = ServerConfig(host=args.host, port=args.port, agent_ttl_s=args.agent_ttl, lease_ttl_s=args.lease_ttl,
                              retain=args.retain, token=token, tls_cert=args.tls_cert or "", tls_key=args.tls_key or "",
                              metrics_port=args.metrics_port)
        if config.tls_cert:
            TlsFiles(config.tls_cert, config.tls_key).credentials()  # unreadable files: say so before starting
    except ValueError as e:
        print(f"tensorhub server: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass
    return 0


def _status(args: argparse.Namespace) -> int:
    import json
    import math
    import os

    from tensorhub.client.rpc import ReferenceClient
    from tensorhub.errors import TensorHubError
    from tensorhub.server.auth import read_secret
    from tensorhub.status import render

    if not (math.isfinite(args.timeout) and args.timeout > 0):
        print(f"tensorhub status: --timeout must be a positive number of seconds, not {args.timeout}", file=sys.stderr)
        return 2
    try:
        token = read_secret(args.token_file, "token file") if args.token_file else os.environ.get("TENSORHUB_TOKEN", "")
        rpc = ReferenceClient(args.address, timeout_s=args.timeout, token=token, tls_root_cert=args.tls_root_cert or "")
    except ValueError as e:
        print(f"tensorhub status: {e}", file=sys.stderr)
        return 2
    try:
        status = rpc.describe(args.model or "")
    except TensorHubError as e:
        print(f"tensorhub status: {e}", file=sys.stderr)
        return 1
    finally:
        rpc.close()
    if args.json:
        print(json.dumps(status.to_json(), indent=2))
    else:
        render(status)
    return 0


def _bench_pull(args: argparse.Namespace) -> int:
    from tensorhub.bench import pull
    from tensorhub.bench.payload import parse_size

    if args.layout == "moe" or args.reader_slice == "tp8":
        return _bench_pull_moe(args)
    if args.fp8:
        return _bench_pull_fp8(args)
    for readers in args.readers:
        cfg = pull.PullBenchConfig(size=parse_size(args.size), readers=readers, publishers=args.publishers or 1,
                                   reader_slice=args.reader_slice, reps=args.reps,
                                   chunk_size=parse_size(args.chunk_size), read_workers=args.read_workers,
                                   verify=not args.no_verify)
        json_path = args.json if len(args.readers) == 1 else (args.json and args.json.replace(".json", f"-r{readers}.json"))
        pull.run(cfg, json_path=json_path)
    return 0


def _bench_pull_fp8(args: argparse.Namespace) -> int:
    from tensorhub.bench import fp8pull
    from tensorhub.bench.payload import parse_size

    if args.publishers not in (None, 1) or args.reader_slice != "whole" or args.no_verify or args.versions != 1:
        print("tensorhub bench pull --fp8: one trainer publishes the whole model (no --publishers, --reader-slice, "
              "--no-verify or --versions)", file=sys.stderr)
        return 2
    for readers in args.readers:
        cfg = fp8pull.Fp8PullBenchConfig(size=parse_size(args.size), readers=readers, reps=args.reps,
                                         chunk_size=parse_size(args.chunk_size), read_workers=args.read_workers)
        json_path = args.json if len(args.readers) == 1 else (args.json and args.json.replace(".json", f"-r{readers}.json"))
        fp8pull.run(cfg, json_path=json_path)
    return 0


def _bench_pull_moe(args: argparse.Namespace) -> int:
    from tensorhub.bench import moe
    from tensorhub.bench.moe_layout import MoeBenchConfig
    from tensorhub.bench.payload import parse_size

    if args.layout != "moe" or args.reader_slice != "tp8" or args.readers != [1]:
        print("tensorhub bench pull: the moe layout is read as --reader-slice tp8 by one reader "
              "(--layout moe --reader-slice tp8)", file=sys.stderr)
        return 2
    cfg = MoeBenchConfig(experts=args.experts, publishers=args.publishers or 2, reps=args.reps,
                         chunk_size=parse_size(args.chunk_size), read_workers=args.read_workers,
                         verify=not args.no_verify, versions=args.versions)
    if args.trainer_cut:
        from tensorhub.bench import moe_cut

        if args.versions != 1 or cfg.publishers < 2:
            print("tensorhub bench pull: --trainer-cut publishes versions 1 and 2 itself (no --versions) from "
                  ">= 2 trainer ranks (--publishers)", file=sys.stderr)
            return 2
        moe_cut.run(cfg, json_path=args.json)
        return 0
    moe.run(cfg, json_path=args.json)
    return 0


def _bench_cluster(args: argparse.Namespace) -> int:
    from tensorhub.bench import cluster, cluster_sweep
    from tensorhub.bench.payload import parse_size

    try:
        counts = cluster_sweep.parse_readers(args.readers)
    except ValueError as e:
        print(f"tensorhub bench cluster: {e}", file=sys.stderr)
        return 2
    if args.hosts is not None and args.hosts != max(counts) + 2:
        print(f"tensorhub bench cluster: --hosts {args.hosts} must be the most --readers + 2 (the server and the "
              f"trainer have a host each): {max(counts) + 2}", file=sys.stderr)
        return 2
    if args.versions < 1:
        print("tensorhub bench cluster: --versions must be >= 1", file=sys.stderr)
        return 2
    sweep = len(counts) > 1 or args.versions > 1
    if sweep and (args.zones != 1 or args.delta):
        print("tensorhub bench cluster: a list of reader counts takes neither --zones nor --delta", file=sys.stderr)
        return 2
    if not sweep and args.plot:
        print("tensorhub bench cluster: --plot needs a list of reader counts (--readers 1,2,4,8,16)", file=sys.stderr)
        return 2
    size = parse_size(args.size) if args.size else None
    chunk = parse_size(args.chunk_size) if args.chunk_size else None
    if sweep:
        cluster_sweep.run(cluster_sweep.SweepConfig(readers=counts, size=size or cluster_sweep.DEFAULT_SIZE,
                                                    link=args.link or cluster_sweep.DEFAULT_LINK,
                                                    chunk=chunk or cluster_sweep.DEFAULT_CHUNK,
                                                    versions=args.versions),
                          json_path=args.json, plot_to=args.plot)
        return 0
    cfg = cluster.ClusterBenchConfig(readers=counts[0], size=size or 256 << 20, link=args.link or "1gbit",
                                     chunk=chunk or cluster.CHUNK, zones=args.zones, zone_link=args.zone_link,
                                     delta=args.delta, delta_lr=args.delta_lr)
    cluster.run(cfg, json_path=args.json)
    return 0


def _bench_rl(args: argparse.Namespace) -> int:
    from tensorhub.bench.rl import cli

    return cli.main(args)


def _bench_server(args: argparse.Namespace) -> int:
    from tensorhub.bench import server

    if args.steady:
        return _bench_server_steady(args)
    try:
        cfg = server.ServerBenchConfig(agents=args.agents, holders=args.holders, tensors=args.tensors,
                                       seconds=args.seconds, resolve_interval_s=args.resolve_interval,
                                       heartbeat_interval_s=args.heartbeat_interval,
                                       sweep=tuple(args.sweep or ()), generators=args.generators,
                                       heartbeats_while_resolving=args.heartbeats_while_resolving,
                                       pin=not args.no_pin)
    except ValueError as e:
        print(f"tensorhub bench server: {e}", file=sys.stderr)
        return 2
    server.run(cfg, json_path=args.json)
    return 0


def _bench_server_steady(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from tensorhub.bench import server_steady

    console = Console()
    results = {}
    # One Resolve per engine (the members get its answer over the engine's channel), and,
    # in the same run for the ratio, one per worker as before.
    for mode in ("shared", "per-worker") if args.steady_mode == "both" else (args.steady_mode,):
        cfg = server_steady.SteadyConfig(readers=args.agents, holders=args.holders, tensors=args.tensors,
                                         versions=args.versions, pin=not args.no_pin, shared=mode == "shared")
        with console.status(f"{mode}: {cfg.readers} readers in groups of {cfg.group}, {cfg.holders} holders, "
                            f"{cfg.versions} versions..."):
            out = results[mode] = server_steady.run(cfg)
        console.print(f"[bold]{mode}[/]: {out['resolves_per_version']:,} Resolves per version")
        for k, v in enumerate(out["versions"], 1):
            console.print(f"version {k:3}: server CPU {v['server_cpu_s']:.3f} s, Resolve p99 "
                          f"{v['resolve_ms']['p99']:.1f} ms, all {cfg.readers} answered in {v['all_answered_s']:.3f} s, "
                          f"answer <= {v['answer_bytes_max']:,} B, holders sent whole {v['holders_full']:,}, "
                          f"lean {v['holders_lean']:,}")
        console.print(f"{mode}, steady state (versions 2-{cfg.versions}, median): server CPU "
                      f"{out['steady_server_cpu_s_per_version']:.3f} s per version (goal <= 0.25), Resolve p99 "
                      f"{out['steady_resolve_p99_ms']:.1f} ms (goal <= 20), answers <= {out['steady_answer_bytes_max']:,} B")
    if len(results) == 2:
        ratio = results["shared"]["steady_server_cpu_s_per_version"] / results["per-worker"]["steady_server_cpu_s_per_version"]
        console.print(f"server CPU per version, one Resolve per engine against one per worker: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _bench_scale(args: argparse.Namespace) -> int:
    from tensorhub.bench.scale import run as scale
    from tensorhub.bench.scale.cuts import LAYOUTS
    from tensorhub.bench.scale.models import MODELS

    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        print(f"tensorhub bench scale: unknown model(s) {unknown}; known: {sorted(MODELS)}", file=sys.stderr)
        return 2
    if args.trainer_ranks and len(args.trainer_ranks) != len(args.engines):
        print("tensorhub bench scale: give one --trainer-ranks entry per --engines entry", file=sys.stderr)
        return 2
    bad = [x for x in args.layouts if x not in LAYOUTS]
    if bad or not args.layouts:
        print(f"tensorhub bench scale: unknown layout(s) {bad}; known: {', '.join(LAYOUTS)}",
              file=sys.stderr)
        return 2
    cfg = scale.ScaleConfig(models=args.models, engines=args.engines, trainer_ranks=args.trainer_ranks,
                            nic_gbit=args.nic_gbit, sample=args.sample, layouts=args.layouts,
                            trainer_cut=args.trainer_cut, named=not args.ranked, trainer_group=args.trainer_group,
                            announce_ahead=not args.announces_apart)
    scale.run(cfg, out=args.out)
    return 0


def _bench_vllm(args: argparse.Namespace) -> int:
    from tensorhub_vllm import bench  # the vLLM adapter: pip install 'tensorhub[vllm]'

    cfg = bench.VllmBenchConfig(hidden=args.hidden, layers=args.layers, vocab=args.vocab, reps=args.reps, tp=args.tp,
                                model=args.model, experts=args.experts, overread=args.overread,
                                lora_rank=args.lora_rank, quantization=args.quantization,
                                announces_apart=args.announces_apart)
    return bench.run(cfg, json_path=args.json)


def _chaos(args: argparse.Namespace) -> int:
    from tensorhub.chaos.campaign import run
    from tensorhub.chaos.config import ChaosConfig

    try:
        cfg = ChaosConfig(minutes=args.minutes, seed=args.seed, readers=args.readers)
    except ValueError as e:
        print(f"tensorhub chaos: {e}", file=sys.stderr)
        return 2
    tally = run(cfg, json_path=args.json)
    print(tally.line())
    if tally.logs:
        print(f"not clean: the workers' logs are kept in {tally.logs}")
    return 0 if tally.clean else 1


def _demo(args: argparse.Namespace) -> int:
    from tensorhub import demo
    from tensorhub.bench.payload import parse_size

    if min(args.versions, args.readers, args.trainer_ranks) < 1:
        print("tensorhub demo: --versions, --readers and --trainer-ranks must each be at least 1", file=sys.stderr)
        return 2
    return demo.run(size=parse_size(args.size), versions=args.versions, readers=args.readers,
                    trainer_ranks=args.trainer_ranks, rl=not args.no_rl)


def _readers(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--readers takes a number or a list like 1,2,4, not {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("--readers must be >= 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensorhub", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    server = sub.add_parser("server", help="run a reference server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=50051, help="port to bind; 0 picks a free one (default 50051)")
    server.add_argument("--agent-ttl", type=float, default=10.0, help="seconds an agent lives without heartbeat")
    server.add_argument("--lease-ttl", type=float, default=10.0, help="seconds a read lease lives without renewal")
    server.add_argument("--retain", type=int, default=1,
                        help="the latest K versions of each model stay pullable after their holders unpublish; "
                             "0 turns retention off (default 1)")
    server.add_argument("--token-file", help="file holding the shared token every client must send (HubConfig.token "
                        "or TENSORHUB_TOKEN); without it, any client that reaches the port is served")
    server.add_argument("--tls-cert", help="PEM certificate chain: serve over TLS (with --tls-key)")
    server.add_argument("--tls-key", help="PEM private key of --tls-cert")
    server.add_argument("--metrics-port", type=int, help="serve Prometheus metrics over HTTP on --host at this port "
                        "(0: a free one, printed at start); counts only, no model names, no token asked")
    server.set_defaults(func=_server)

    status = sub.add_parser("status", help="what a reference server holds: models, versions (complete or filling), "
                            "holders with their labels, readers in flight, leases")
    status.add_argument("--address", required=True, help="the server, host:port")
    status.add_argument("--model", help="only this model (default: every model)")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.add_argument("--token-file", help="file holding the server's shared token (default: TENSORHUB_TOKEN)")
    status.add_argument("--tls-root-cert", help="PEM of the CA that signed the server's certificate: use TLS")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server (default 10)")
    status.set_defaults(func=_status)

    demo = sub.add_parser("demo", help="embedded server, trainer ranks publishing shards, rollouts pulling new versions")
    demo.add_argument("--size", default="256MiB", help="bytes per version (default 256MiB)")
    demo.add_argument("--versions", type=int, default=4, help="versions to publish (default 4)")
    demo.add_argument("--trainer-ranks", type=int, default=2,
                      help="trainer rank processes, each publishing only its rows (default 2)")
    demo.add_argument("--readers", type=int, default=2,
                      help="rollout processes; even ones pull whole tensors, odd ones a TP=2 slice (default 2)")
    demo.add_argument("--no-rl", action="store_true",
                      help="skip the RL loop at the end (broadcast vs TensorHub, as `tensorhub bench rl`)")
    demo.set_defaults(func=_demo)

    chaos = sub.add_parser("chaos", help="a seeded fault campaign on emulated hosts (netns + tc, needs root): "
                           "holder kills, link cuts, server restarts, slow readers, unpublish mid-pull")
    chaos.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected (default 10)")
    chaos.add_argument("--seed", type=int, default=0, help="the fault schedule's seed (default 0)")
    chaos.add_argument("--readers", type=int, default=4, help="relaying reader processes (default 4)")
    chaos.add_argument("--json", help="write the counts here as JSON")
    chaos.set_defaults(func=_chaos)

    bench = sub.add_parser("bench", help="benchmarks against baselines run in the same process tree")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    pull = bench_sub.add_parser("pull", help="TensorHub pull vs raw NIXL READ of the same bytes")
    pull.add_argument("--size", default="1GiB", help="bytes per version (default 1GiB)")
    pull.add_argument("--readers", type=_readers, default=[1], help="reader processes, or a list like 1,2,4")
    pull.add_argument("--layout", choices=["dense", "moe"], default="dense",
                      help="dense: --size bytes of transformer-like tensors; moe: the 384 expert tensors of one "
                           "Qwen3-30B-A3B layer (1,152 MiB; --size does not apply)")
    pull.add_argument("--experts", type=int, default=128,
                      help="moe layout: experts in the layer (default 128, Qwen3-30B-A3B's)")
    pull.add_argument("--publishers", type=int, default=None,
                      help="publisher processes, each holding its rows of every tensor (default 1: the whole model; "
                           "2 for the moe layout)")
    pull.add_argument("--reader-slice", choices=["whole", "tp2", "tp8"], default="whole",
                      help="what each reader pulls: whole tensors, or TP rank 0 of 2 (rows of half the matrices, "
                           "columns of the other half); tp8 (moe layout): rank 0 of 8 as vLLM reads experts, "
                           "rows of gate and up, columns of down, beside raw NIXL READs of the exact runs and of "
                           "whole rows")
    pull.add_argument("--reps", type=int, default=5, help="timed repetitions per method (median reported)")
    pull.add_argument("--versions", type=int, default=1,
                      help="moe layout: then step the publishers through this many versions from the same buffers, "
                           "a fresh reader pulling each: the first (planned) and the replayed rest reported apart")
    pull.add_argument("--trainer-cut", action="store_true",
                      help="moe layout: the publishers are trainer ranks (gloo) that also publish the reader's cut "
                           "(Hub.publish(cut='readers')): version 1 without it, read by a relay, then version 2 with "
                           "it; the reader's pull beside a raw contiguous NIXL READ of the cut, and the cut's cost")
    pull.add_argument("--chunk-size", default="32MiB", help="TensorHub chunk size (default 32MiB)")
    pull.add_argument("--read-workers", type=int, default=2, help="READs in flight per reader: twice this")
    pull.add_argument("--no-verify", action="store_true",
                      help="chunk checksums off (HubConfig.verify_chunks=False); by default they are on, and a "
                           "tensorhub-unchecked row shows what they cost")
    pull.add_argument("--fp8", action="store_true",
                      help="dense layout: the trainer publishes --size bytes of bf16 with its block-FP8 companion "
                           "(Hub.publish(fp8=True)); readers pull bf16 and FP8 in the same run: bytes read, time, "
                           "and the trainer's quantization time apart")
    pull.add_argument("--json", help="write the results here as JSON")
    pull.set_defaults(func=_bench_pull)

    cluster = bench_sub.add_parser("cluster", help="1 trainer and R readers on emulated hosts (netns + tc, needs "
                                   "root): TensorHub with and without relay vs a gloo broadcast")
    cluster.add_argument("--readers", default="4", help="reader hosts (default 4), or a list of reader counts "
                         "(1,2,4,8,16): every count in one run on the hosts of the largest, and a plot")
    cluster.add_argument("--size", help="bytes per version (default 256MiB; 64MiB with a list of --readers)")
    cluster.add_argument("--link", help="every host's link rate, as tc writes it (default 1gbit; 100mbit with a "
                         "list of --readers)")
    cluster.add_argument("--chunk-size", help="the version's chunk, also the raw rows' READ (default 4MiB; 1MiB "
                         "with a list of --readers)")
    cluster.add_argument("--hosts", type=int, help="emulated hosts in all: the most --readers + 2 (a check; the "
                         "default)")
    cluster.add_argument("--zones", type=int, default=1, help="zones (default 1); readers go round-robin, the "
                         "trainer and server in the first; adds cross_zone_bytes")
    cluster.add_argument("--zone-link", default="200mbit", help="the link joining each zone to the first "
                         "(default 200mbit)")
    cluster.add_argument("--delta", action="store_true", help="also move two versions of a small transformer from "
                         "real AdamW steps whole and as a delta (rows tensorhub-whole, tensorhub-delta)")
    cluster.add_argument("--delta-lr", type=float, default=1e-6, help="the learning rate of those steps "
                         "(default 1e-6)")
    cluster.add_argument("--json", help="write the results here as JSON (with a list of --readers, the plot "
                         "beside it: .png)")
    cluster.add_argument("--versions", type=int, default=1,
                         help="versions per reader count (default 1): the later ones from the same trainer buffers "
                              "into the same destinations, the steady state of an RL run (row tensorhub-steady, with "
                              "the server's messages per reader); more than 1 runs the sweep of a list of --readers")
    cluster.add_argument("--plot", help="with a list of --readers: write the plot here (default: beside --json)")
    cluster.set_defaults(func=_bench_cluster)

    rl = bench_sub.add_parser("rl", help="an RL loop (trainer steps, rollouts with stragglers) on emulated hosts: "
                              "scenarios standalone, elastic, crossdc, TensorHub vs broadcast / point-to-point")
    from tensorhub.bench.rl.cli import add_arguments

    add_arguments(rl)
    rl.set_defaults(func=_bench_rl)

    srv = bench_sub.add_parser("server", help="one reference server process under simulated agents that "
                               "heartbeat and resolve: latency p50/p99, memory per agent, where p99 passes 20 ms")
    srv.add_argument("--agents", type=int, default=1000, help="largest agent count of the sweep (default 1000)")
    srv.add_argument("--sweep", type=_readers, help="agent counts to run, e.g. 250,500,1000,2000 "
                     "(default: halvings of --agents down to about 100)")
    srv.add_argument("--holders", type=int, default=100, help="agents holding the version (default 100)")
    srv.add_argument("--tensors", type=int, default=200, help="tensors of the version (default 200)")
    srv.add_argument("--seconds", type=float, default=6.0, help="seconds of load per agent count (default 6)")
    srv.add_argument("--resolve-interval", type=float, default=1.0,
                     help="seconds between one agent's resolves (default 1)")
    srv.add_argument("--heartbeat-interval", type=float, default=1.0,
                     help="seconds between one agent's heartbeats (default 1, HubConfig.heartbeat_interval_s)")
    srv.add_argument("--generators", type=int, default=2, help="load generator processes (default 2)")
    srv.add_argument("--heartbeats-while-resolving", action="store_true",
                     help="readers heartbeat although their resolves keep them alive (the client before it skipped)")
    srv.add_argument("--no-pin", action="store_true",
                     help="let the OS place the server and the load generators (default: the server on a core of "
                          "its own, the generators on the others)")
    srv.add_argument("--steady", action="store_true",
                     help="instead: --agents readers in groups of 8 pull --versions versions from --holders "
                          "holders publishing from the same buffers (tensorhub.bench.server_steady)")
    srv.add_argument("--versions", type=int, default=10, help="with --steady: versions (default 10)")
    srv.add_argument("--steady-mode", choices=("both", "shared", "per-worker"), default="both",
                     help="with --steady: one Resolve per engine for its members (shared), one per worker, or both "
                          "in one run (default)")
    srv.add_argument("--json", help="write the results here as JSON")
    srv.set_defaults(func=_bench_server)

    scale = bench_sub.add_parser("scale", help="a paper-scale update (up to Kimi-K2 on 1,024 GPUs) simulated: the "
                                 "real server in its own process and the real codec, a link model for the bytes")
    scale.add_argument("--models", type=lambda s: s.split(","),
                       default=["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2"],
                       help="comma-separated (default all four)")
    scale.add_argument("--engines", type=_readers, default=[16, 32, 64, 128],
                       help="TP=8 rollout engines per row, e.g. 16,32,64,128 (default)")
    scale.add_argument("--trainer-ranks", type=_readers,
                       help="FSDP ranks per --engines entry (default 2 x engines, within 64-256)")
    scale.add_argument("--nic-gbit", type=float, default=400.0, help="per-GPU NIC rate (default 400 Gbit/s)")
    scale.add_argument("--sample", type=int, default=8, help="readers that resolve for real per stage (default 8)")
    scale.add_argument("--layouts", type=lambda s: [x for x in s.split(",") if x], default=["tp", "ep"],
                       help="rollout layouts, comma-separated: tp (experts TP-sliced), ep (TP=8 with expert "
                            "parallelism: experts whole per worker); default both")
    scale.add_argument("--trainer-cut", action="store_true",
                       help="versions 2 and 3 also published in the readers' cut (Hub.publish(cut='readers')): "
                            "their messages sent for real, the steady first hop read from the cut")
    scale.add_argument("--trainer-group", action="store_true",
                       help="without the cut, the ranks still publish and withdraw together "
                            "(Hub.publish(trainer_group=)): rank 0 sends every rank's announces and withdrawals")
    scale.add_argument("--announces-apart", action="store_true",
                       help="named steady engines send their workers' announces in a Batch of their own, as before "
                            "they went ahead with the engine's Resolve (tensorhub.client.ahead): three messages an "
                            "engine, not two")
    scale.add_argument("--ranked", action="store_true",
                       help="version 3's answers ranked as version 2's (every engine resolving twice), not the "
                            "holders each engine read before, named (the steady state a Hub reaches)")
    scale.add_argument("--out", help="folder for scale.json and scale.png")
    scale.set_defaults(func=_bench_scale)

    vllm = bench_sub.add_parser("vllm", help="vLLM weight update through TensorHub vs vLLM's reload from safetensors")
    vllm.add_argument("--hidden", type=int, default=1024, help="hidden size of the random Qwen2 model")
    vllm.add_argument("--layers", type=int, default=4, help="decoder layers of the random Qwen2 model")
    vllm.add_argument("--vocab", type=int, default=16384, help="vocabulary size of the random Qwen2 model")
    vllm.add_argument("--reps", type=int, default=3, help="timed repetitions (median reported)")
    vllm.add_argument("--tp", type=int, default=1, help="tensor parallelism of the engine (one row per worker)")
    vllm.add_argument("--model", choices=("dense", "moe"), default="dense",
                      help="a random Qwen2 (dense) or Qwen3-MoE (moe) checkpoint")
    vllm.add_argument("--experts", type=int, default=32, help="experts per layer of the random Qwen3-MoE")
    vllm.add_argument("--overread", type=float, default=0.2,
                      help="the engine's overread: at most this share of its read set more, read as whole rows")
    vllm.add_argument("--lora-rank", type=int, default=0,
                      help="> 0: LoRA adapter versions of this rank (all linear layers) instead of base weights, "
                           "against the disk round trip (PEFT files, then vLLM's in-place load)")
    vllm.add_argument("--announces-apart", action="store_true",
                      help="the workers' announces in a round and a Batch of their own every update, as before "
                           "they went with the engine's Resolve in the steady state (HubConfig.announce_ahead)")
    vllm.add_argument("--quantization", default="",
                      help="vLLM's quantization for the engine (e.g. fp8_per_channel): the versions stay bf16 and "
                           "both the update and the reload from disk re-quantize them")
    vllm.add_argument("--json", help="write the results here as JSON")
    vllm.set_defaults(func=_bench_vllm)
    return parser


def _is_override(arg: str) -> bool:
    return not arg.startswith("-") and "=" in arg


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse ends a positional list at the first flag: `bench rl a=1 --no-live b=2`
    # leaves "b=2" over. Hydra overrides may sit anywhere among the flags.
    if extra and isinstance(getattr(args, "overrides", None), list) and all(_is_override(e) for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
