"""Where one worker's update goes, phase by phase: the engine and checkpoint of
``tensorhub bench vllm``, with TensorHub's and NIXL's calls wrapped in timers
inside each TP worker. A measuring tool, not part of the adapter: it wraps
private functions, so it follows their names.

    .venv-vllm/bin/python integrations/vllm/tools/update_phases.py --tp 2 --reps 3

Prints per repetition and worker: pull and apply seconds, then each phase's
seconds and calls (a phase's time includes the phases it calls), and the READ
descriptors posted (count, and how many are under 4 KiB). Calls made on a
helper thread (announce, chunk reports, the withdrawal) are timed where they
run: they add to no other phase's time. With ``--profile DIR``
one more round runs under cProfile in every worker: ``DIR/update-rank{r}.prof``
and ``DIR/disk-rank{r}.prof`` (the update, then vLLM's disk reload), and the top
of rank 0's profiles is printed.
"""

from __future__ import annotations

import argparse

# (module, owner attribute or "", function, label)
PHASES = (
    ("tensorhub_vllm.worker", "", "apply_checkpoint", "apply (vLLM layer-wise reload)"),
    ("tensorhub_vllm.receiver", "VersionReceiver", "_withdraw", "withdraw the previous version (now: start it)"),
    ("tensorhub.client.hub", "Hub", "pull", "hub.pull"),
    ("tensorhub.client.rpc", "ReferenceClient", "resolve", "  rpc resolve"),
    ("tensorhub.client.hub", "", "destination_parts", "  check the destination"),
    ("tensorhub.client.holdings", "Holdings", "open_filling", "  register (+ publish, before 2efad90) the filling replica"),
    ("tensorhub.client.holdings", "Holdings", "announce", "  announce the filling replica (helper thread)"),
    ("tensorhub.client.readlayout", "ReadLayout", "holder_table", "  holder tables (segments)"),
    ("tensorhub.client.readlayout", "ReadLayout", "transfers", "  descriptors per chunk"),
    ("tensorhub.client.puller", "PullJob", "_read_round", "  read rounds"),
    ("nixl._api", "nixl_agent", "initialize_xfer", "    NIXL initialize_xfer"),
    ("nixl._api", "nixl_agent", "transfer", "    NIXL transfer (the READ; synchronous over CMA)"),
    ("nixl._api", "nixl_agent", "check_xfer_state", "    NIXL check_xfer_state"),
    ("tensorhub.client.rpc", "ReferenceClient", "report_chunks", "    rpc report_chunks (landed; helper thread)"),
    ("tensorhub.client.rpc", "ReferenceClient", "unpublish", "  rpc unpublish (the withdrawal; overlaps the resolve)"),
)


def instrument(worker) -> None:  # runs in each worker (collective_rpc)
    import functools
    import importlib
    import time as clock

    import tensorhub
    from tensorhub.transport import nixl

    if hasattr(tensorhub, "_phases"):
        return
    totals: dict[str, list] = {}
    tensorhub._phases = totals
    for module, owner, name, label in PHASES:
        target = importlib.import_module(module)
        target = getattr(target, owner) if owner else target
        fn = getattr(target, name)

        def timed(*a, _fn=fn, _label=label, **k):
            start = clock.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                entry = totals.setdefault(_label, [0.0, 0])
                entry[0] += clock.perf_counter() - start
                entry[1] += 1

        setattr(target, name, functools.wraps(fn)(timed))
    post = nixl.NixlAgent.post

    def counted(self, remote, local, *rest):
        entry = totals.setdefault("READ descriptors (count, under 4 KiB)", [0, 0])
        entry[0] += len(local)
        entry[1] += int((local[:, 1] < 4096).sum())
        return post(self, remote, local, *rest)

    nixl.NixlAgent.post = counted


def collect(worker) -> dict:
    import tensorhub

    out = {k: list(v) for k, v in tensorhub._phases.items()}
    tensorhub._phases.clear()
    return out


def profile_start(worker) -> None:  # runs in each worker (collective_rpc)
    import cProfile

    import tensorhub

    tensorhub._profile = cProfile.Profile()
    tensorhub._profile.enable()


def profile_stop(worker, path: str) -> None:
    import torch

    import tensorhub

    tensorhub._profile.disable()
    tensorhub._profile.dump_stats(path.format(rank=torch.distributed.get_rank()))


def profiled_round(llm, trainer, version: int, state: dict, model_dir, out: str) -> None:
    """One more update and disk reload, each under cProfile in every worker."""
    import pstats
    from pathlib import Path

    from tensorhub_vllm.bench import MODEL

    Path(out).mkdir(parents=True, exist_ok=True)
    pub = trainer.publish(MODEL, version, state)
    llm.collective_rpc(profile_start)
    llm.collective_rpc("tensorhub_update", args=(version,))
    llm.collective_rpc(profile_stop, args=(f"{out}/update-rank{{rank}}.prof",))
    pub.unpublish()
    llm.collective_rpc(profile_start)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir), "is_checkpoint_format": True})
    llm.collective_rpc(profile_stop, args=(f"{out}/disk-rank{{rank}}.prof",))
    for what in ("update", "disk"):
        print(f"--- {what}, rank 0 (cumulative) ---")
        pstats.Stats(f"{out}/{what}-rank0.prof").sort_stats("cumulative").print_stats(40)
        print(f"--- {what}, rank 0 (own time) ---")
        pstats.Stats(f"{out}/{what}-rank0.prof").sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--profile", metavar="DIR", help="one more round under cProfile; profiles written here")
    args = parser.parse_args()
    from tensorhub_vllm.bench import VllmBenchConfig, bench_engine, one_round

    from tensorhub import Hub

    with bench_engine(VllmBenchConfig(tp=args.tp)) as (llm, server, model_dir, state), \
            Hub.connect(server.address, name="bench-trainer") as trainer:
        llm.collective_rpc(instrument)
        for rep in range(args.reps + 1):  # the first is warm-up
            update, disk, stats = one_round(llm, trainer, rep, state, model_dir)
            phases = llm.collective_rpc(collect)  # the disk reload calls none of the timed functions
            if not rep:
                continue
            print(f"rep {rep}: update {update:.3f} s, disk reload {disk:.3f} s")
            for rank, (s, p) in enumerate(zip(stats, phases)):
                print(f"  worker {rank}: pull {s['pull_s']:.3f} s, apply {s['apply_s']:.3f} s, "
                      f"{s['nbytes']} of {s['checkpoint_nbytes']} bytes")
                for label, (value, calls) in p.items():
                    shown = f"{value * 1e3:8.2f} ms" if isinstance(value, float) else f"{value:8d}   "
                    print(f"    {label:52s} {shown} {calls:6d}")
        if args.profile:
            profiled_round(llm, trainer, args.reps + 1, state, model_dir, args.profile)


if __name__ == "__main__":
    main()
