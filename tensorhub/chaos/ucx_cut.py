"""A standalone check of the UCX fault behind the fault campaign's crashes.

Over TCP, UCX has no one-sided GET: a NIXL READ is emulated with active
messages, and the *holder's* progress thread sends the bytes back
("get(multi) ... software emulation tcp" in UCX's own warnings). Two paths of
that emulation in UCX 1.23 (bundled with nixl 1.5.1, and unchanged on UCX's
main branch as read on 2026-12-01) kill the serving process when its reader's
connection fails mid-reply, so no caller can catch it:

* ``ucp_progress_get_reply`` (``src/ucp/rma/rma_sw.c``) returns the send error
  to ``ucp_request_try_send``, which calls ``ucs_fatal("unexpected error: %s")``
  for anything but OK / in progress / no resource: the campaign's
  ``ucp_request.inl:356 Fatal: unexpected error: Endpoint timeout`` (exit -6);
* purging the replies still queued when the failed endpoint is discarded
  (``uct_tcp_ep_pending_purge`` -> ``ucp_request_send_state_ff`` ->
  ``ucp_request_memory_dereg``) dereferences a memory handle the emulated reply
  never set: a segfault (exit -11).

This script makes the fault happen on purpose, on two emulated hosts (network
namespaces, 1 Gbit/s): a holder process serves 256 MiB; in each trial a fresh
reader READs all of it in 4 MiB pieces, its link is cut mid-transfer for
``--cut-s`` seconds, every other trial the reader is killed during the cut,
and the link comes back. It reports after how many trials the holder died.
Measured here with TensorHub's UCX settings (``transport/nixl.py``): the holder
died of the segfault at trial 9 in four runs of four, and at trial 5 with
``UCX_TCP_USER_TIMEOUT=inf`` alone; with TCP's failure detection off too
(``UCX_TCP_KEEPIDLE=inf`` ...) it survived 12 of 12. ``UCX_PROTO_ENABLE=n``
is no way out: NIXL's READs then fail with "Unsupported operation".

    sudo python -m tensorhub.chaos.ucx_cut --trials 12 --cut-s 8 [--env UCX_X=y ...]

Its processes are forked like the benchmarks' (``processes.context``) and each
joins its emulated host first (``netns.enter``), as ``bench rl``'s do.

Needs root (namespaces); takes about 20 s a trial. Use it to check a newer
NIXL/UCX, or a UCX setting, before a ten-minute campaign.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from multiprocessing.connection import Connection

from tensorhub import netns, processes
from tensorhub.bench import children
from tensorhub.bench.rl.places import NETNS_ENV

_SIZE = 256 << 20
_PIECE = 4 << 20
_START_S = 180.0  # a child's imports and NIXL agent on a busy 2-core machine
_READ_S = 40.0  # a reader's READs end by then or are reported as still out


def _join(namespace: str, env: dict[str, str]) -> None:
    """Join the emulated host (before any thread starts) and take the UCX settings."""
    import faulthandler

    netns.enter(namespace)
    os.environ.update(env)
    faulthandler.enable()  # a crash prints the Python stacks beside UCX's backtrace


def _holder(conn: Connection, namespace: str, env: dict[str, str]) -> None:
    _join(namespace, env)
    import torch

    from tensorhub.transport.nixl import new_agent

    memory = torch.ones(_SIZE, dtype=torch.uint8)
    agent = new_agent("ucx-cut-holder")
    agent.register_memory(memory)
    conn.send((agent.get_agent_metadata(), memory.data_ptr()))
    conn.recv()  # serves (its NIXL progress thread does) until the parent kills it


def _reader(conn: Connection, namespace: str, env: dict[str, str], metadata: bytes, address: int,
            trial: int) -> None:
    _join(namespace, env)
    import torch

    from tensorhub.transport.nixl import new_agent

    dest = torch.zeros(_SIZE, dtype=torch.uint8)
    agent = new_agent(f"ucx-cut-reader-{trial}")
    agent.register_memory(dest)
    peer = agent.add_remote_agent(metadata)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    handles = []
    for offset in range(0, _SIZE, _PIECE):
        local = agent.get_xfer_descs([(dest.data_ptr() + offset, _PIECE, 0)], "DRAM")
        remote = agent.get_xfer_descs([(address + offset, _PIECE, 0)], "DRAM")
        handle = agent.initialize_xfer("READ", local, remote, peer)
        agent.transfer(handle)
        handles.append(handle)
    conn.send("posted")
    deadline, states = time.monotonic() + _READ_S, ["PROC"]
    while "PROC" in states and time.monotonic() < deadline:
        try:
            states = [agent.check_xfer_state(h) for h in handles]
        except Exception as e:  # noqa: BLE001 - a failed READ is an answer here, reported as such
            states = [type(e).__name__]
        time.sleep(0.05)
    conn.send(", ".join(f"{states.count(s)} {s}" for s in sorted(set(states))))
    os._exit(0)  # no teardown: NIXL may still hold READs of a cut link


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorhub.chaos.ucx_cut", description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--cut-s", type=float, default=8.0, help="how long each trial's link cut lasts")
    parser.add_argument("--env", action="append", default=[], metavar="K=V", help="a setting for both processes")
    args = parser.parse_args(argv)
    if (why := netns.available()) is not None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    env = {**NETNS_ENV, "UCX_HANDLE_ERRORS": "bt", **dict(kv.split("=", 1) for kv in args.env)}
    ctx = processes.context()
    survived, procs = 0, []
    with netns.Hosts(["holder", "reader"], rate="1gbit") as hosts:
        try:
            (holder_conn,), procs = children.start(ctx, _holder, [(hosts.netns("holder"), env)])
            holder = procs[0]
            metadata, address = children.receive([holder_conn], _START_S, "the holder did not start")[0]
            for trial in range(args.trials):
                killed = trial % 2 == 1
                (conn,), (reader,) = children.start(
                    ctx, _reader, [(hosts.netns("reader"), env, metadata, address, trial)])
                procs.append(reader)
                children.receive([conn], _START_S, f"trial {trial}'s reader did not post its READs")
                time.sleep(0.5)  # its READs are flowing
                hosts.cut("reader")
                time.sleep(args.cut_s)
                if killed:
                    reader.kill()
                hosts.restore("reader")
                said = "" if killed else children.receive([conn], _READ_S + 15, f"trial {trial}'s reader hung")[0]
                reader.join(timeout=15)
                time.sleep(3)  # the holder notices the reader's fate
                fate = f"reader {'killed during the cut' if killed else 'kept'}" + (f"; its READs: {said}" if said else "")
                if not holder.is_alive():
                    print(f"trial {trial}: HOLDER DIED (exit {holder.exitcode}); {fate}", flush=True)
                    break
                survived += 1
                print(f"trial {trial}: holder alive; {fate}", flush=True)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=15)
    print(f"the holder survived {survived} of {args.trials} trials")
    return 0 if survived == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
