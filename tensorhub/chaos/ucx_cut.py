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
died of the segfault at trial 9 in three runs of three, and at trial 5 with
``UCX_TCP_USER_TIMEOUT=inf`` alone; with TCP's failure detection off too
(``UCX_TCP_KEEPIDLE=inf`` ...) it survived 12 of 12. ``UCX_PROTO_ENABLE=n``
is no way out: NIXL's READs then fail with "Unsupported operation".

    sudo python -m tensorhub.chaos.ucx_cut --trials 12 --cut-s 8 [--env UCX_X=y ...]

Needs root (namespaces); takes about 20 s a trial. Use it to check a newer
NIXL/UCX, or a UCX setting, before a ten-minute campaign.
"""

from __future__ import annotations

import argparse
import os
import pickle
import select
import subprocess
import sys
import time

_SIZE = 256 << 20
_PIECE = 4 << 20
_ROLE_ENV = "TENSORHUB_UCX_CUT_ROLE"


def _holder() -> None:
    import torch

    from tensorhub.transport.nixl import new_agent

    memory = torch.ones(_SIZE, dtype=torch.uint8)
    agent = new_agent("ucx-cut-holder")
    agent.register_memory(memory)
    sys.stdout.buffer.write(pickle.dumps((agent.get_agent_metadata(), memory.data_ptr())))
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # EOF for the parent; NIXL may still print
    while True:  # serves until killed; its progress thread does the work
        time.sleep(1)


def _reader(trial: str) -> None:
    import torch

    from tensorhub.transport.nixl import new_agent

    metadata, address = pickle.loads(sys.stdin.buffer.read())
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
    print("posted", flush=True)
    deadline, states = time.monotonic() + 40, ["PROC"]
    while "PROC" in states and time.monotonic() < deadline:
        try:
            states = [agent.check_xfer_state(h) for h in handles]
        except Exception as e:  # noqa: BLE001 - a failed READ is an answer here, reported as such
            states = [type(e).__name__]
        time.sleep(0.05)
    print(f"reader {trial}: " + ", ".join(f"{states.count(s)} {s}" for s in sorted(set(states))), flush=True)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    role = os.environ.get(_ROLE_ENV)
    if role == "holder":
        _holder()
    if role is not None:
        _reader(role)
    parser = argparse.ArgumentParser(prog="python -m tensorhub.chaos.ucx_cut", description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--cut-s", type=float, default=8.0, help="how long each trial's link cut lasts")
    parser.add_argument("--env", action="append", default=[], metavar="K=V", help="a setting for both processes")
    args = parser.parse_args(argv)

    from tensorhub import netns
    from tensorhub.bench.rl.places import NETNS_ENV

    if (why := netns.available()) is not None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    env = dict(os.environ, **NETNS_ENV, PYTHONFAULTHANDLER="1", UCX_HANDLE_ERRORS="bt")
    env.update(kv.split("=", 1) for kv in args.env)
    me = [sys.executable, "-m", "tensorhub.chaos.ucx_cut"]
    with netns.Hosts(["holder", "reader"], rate="1gbit") as hosts:
        holder = subprocess.Popen(["ip", "netns", "exec", hosts.netns("holder"), *me],
                                  env={**env, _ROLE_ENV: "holder"}, stdout=subprocess.PIPE)
        metadata = holder.stdout.read()  # EOF once sent (or the holder died)
        survived, reader = 0, None
        try:
            if not metadata:
                print(f"the holder did not start (exit {holder.wait()})", file=sys.stderr)
                return 2
            for trial in range(args.trials):
                killed = trial % 2 == 1
                reader = subprocess.Popen(["ip", "netns", "exec", hosts.netns("reader"), *me],
                                          env={**env, _ROLE_ENV: str(trial)}, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE)
                reader.stdin.write(metadata)
                reader.stdin.close()
                if not select.select([reader.stdout], [], [], 60)[0] or not reader.stdout.readline():
                    reader.kill()  # never posted: nothing to test this trial with
                    print(f"trial {trial}: the reader did not post its READs (exit {reader.wait()})", file=sys.stderr)
                    return 2
                time.sleep(0.5)  # its READs are flowing
                hosts.cut("reader")
                time.sleep(args.cut_s)
                if killed:
                    reader.kill()
                hosts.restore("reader")
                try:
                    reader.wait(timeout=45)
                    said = reader.stdout.read().decode().strip()
                except subprocess.TimeoutExpired:
                    reader.kill()
                    said = "reader hung: killed"
                time.sleep(3)  # the holder notices the reader's fate
                if holder.poll() is not None:
                    print(f"trial {trial}: HOLDER DIED (exit {holder.returncode}); the reader was "
                          f"{'killed during the cut' if killed else 'kept'}", flush=True)
                    break
                survived += 1
                print(f"trial {trial}: holder alive; reader {'killed during the cut' if killed else 'kept'}"
                      + (f"; {said}" if said else ""), flush=True)
        finally:
            for proc in (reader, holder):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
    print(f"the holder survived {survived} of {args.trials} trials")
    return 0 if survived == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
