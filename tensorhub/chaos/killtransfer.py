"""Kill a random side of a transfer mid-flight, many times, and check that the
other side lives: the property pull by push exists for
(tensorhub.transport.transfermode).

Each round forks a fresh holder (32 MiB registered) and a fresh reader, which
moves it all in 1 MiB requests, four out at once, over UCX's TCP transport on
loopback (``UCX_TLS=tcp``: the transport whose READ is emulated). A random
0-``--window-ms`` after the reader posts its first request, the holder or the
reader (a coin toss) is SIGKILLed. Then the survivor is asked to finish: a
reader ends its pull (done, or failed over its dead holder), a holder lets
its WRITEs end, and both close their agent and must exit 0. A pull that
completed must be byte-exact.

    python -m tensorhub.chaos.killtransfer --rounds 40 --mode push
    python -m tensorhub.chaos.killtransfer --rounds 40 --mode read   # the control: READ emulated over TCP
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection

import numpy as np
import torch

from tensorhub import processes

NBYTES = 32 << 20
PIECE = 1 << 20
IN_FLIGHT = 4
SILENCE_S = 0.5  # the readers' push.SILENCE_S here: a dead holder is noticed fast (nothing else waits on it)
_FINISH_S = 15.0  # a survivor that has not finished this long after the kill is counted as hung


def _pattern() -> torch.Tensor:
    """Bytes where a misplaced piece shows: each 8 bytes hold their own index."""
    return torch.arange(NBYTES // 8, dtype=torch.int64).view(torch.uint8)


def _agent(role: str, mode: str):  # type: ignore[no-untyped-def]
    from tensorhub.transport import push
    from tensorhub.transport.nixl import NixlAgent

    push.SILENCE_S = SILENCE_S
    return NixlAgent(f"kt-{role}-{os.getpid()}", mode)


def _holder(conn: Connection, mode: str) -> None:
    agent = _agent("holder", mode)
    source = _pattern()
    registration = agent.register([source])
    conn.send((registration.metadata, source.data_ptr()))
    conn.recv()  # finish
    until = time.monotonic() + _FINISH_S
    while agent.writes_out() and time.monotonic() < until:  # its WRITEs end: done, or failed with their reader
        time.sleep(0.01)
    if mode == "read":
        time.sleep(0.2)  # the emulated replies in UCX's progress thread get their chance to fail
    agent.close()
    conn.send("closed")


def _reader(conn: Connection, mode: str, piece: int, in_flight: int) -> None:
    from tensorhub.transport.memory import MemoryKind
    from tensorhub.transport.nixl import TransferFailed

    agent = _agent("reader", mode)
    dest = torch.zeros(NBYTES, dtype=torch.uint8)
    agent.register([dest])
    metadata, address = conn.recv()  # the holder's: its agent started meanwhile
    remote = agent.connect("holder.1", metadata)
    base = dest.data_ptr()
    pieces = list(range(0, NBYTES, piece))
    flying = []
    outcome = "exact"
    conn.send("posting")
    deadline = time.monotonic() + _FINISH_S
    try:
        while pieces or flying:
            while pieces and len(flying) < in_flight:
                at = pieces.pop()
                flying.append(agent.post(remote, np.array([[base + at, piece, 0]]), MemoryKind.DRAM,
                                         np.array([[address + at, piece, 0]]), MemoryKind.DRAM))
            for pending in list(flying):
                if agent.poll(pending):
                    agent.release(pending)
                    flying.remove(pending)
            if time.monotonic() > deadline:
                raise TransferFailed(remote, "no end before the round's deadline", stalled=True)
            time.sleep(0.0005)
    except TransferFailed as e:
        outcome = f"failed: {e}"
    finally:
        for pending in flying:
            agent.release(pending)
    if outcome == "exact" and not torch.equal(dest, _pattern()):
        outcome = "mismatch"
    conn.send(outcome)
    conn.recv()  # finish
    agent.close()
    conn.send("closed")


@dataclass
class Tally:
    mode: str
    rounds: int = 0
    killed: dict[str, int] = field(default_factory=lambda: {"holder": 0, "reader": 0})
    survivors_lost: list[str] = field(default_factory=list)  # "round 3: holder exit -6"
    completed: int = 0  # pulls that ended with every byte in
    exact: int = 0
    failed_over: int = 0  # readers whose pull failed (their holder was killed)
    seconds: float = 0.0


def _finish(conn: Connection, process, timeout_s: float) -> int | None:  # type: ignore[no-untyped-def]
    """Ask a survivor to finish and close; its exit code (None: hung, killed)."""
    try:
        conn.send("finish")
        if conn.poll(timeout_s):
            conn.recv()
    except (EOFError, BrokenPipeError, OSError):
        pass  # died meanwhile: its exit code says how
    process.join(timeout_s)
    if process.is_alive():
        os.kill(process.pid, signal.SIGKILL)
        process.join(5)
        return None
    return process.exitcode


def run_rounds(rounds: int, mode: str, *, seed: int = 0, window_ms: float = 60.0, piece: int = PIECE,
               in_flight: int = IN_FLIGHT) -> Tally:
    """The campaign, from this process (which starts no NIXL agent itself)."""
    rng = random.Random(seed)
    ctx = processes.context()
    tally = Tally(mode)
    started = time.monotonic()
    with _ucx_over_tcp():
        for number in range(rounds):
            _round(number, ctx, rng, mode, window_ms, piece, in_flight, tally)
    tally.seconds = round(time.monotonic() - started, 1)
    return tally


@contextlib.contextmanager
def _ucx_over_tcp() -> Iterator[None]:
    """UCX_TLS=tcp for the children started meanwhile (they take the environment
    as it is when they start), and the caller's own setting back afterwards."""
    before = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = "tcp"
    try:
        yield
    finally:
        if before is None:
            del os.environ["UCX_TLS"]
        else:
            os.environ["UCX_TLS"] = before


def _round(number: int, ctx, rng: random.Random, mode: str, window_ms: float, piece: int,  # type: ignore[no-untyped-def]
           in_flight: int, tally: Tally) -> None:
    """One round: a fresh holder and reader, one of them killed mid-transfer."""
    holder_conn, child = ctx.Pipe()
    holder = ctx.Process(target=_holder, args=(child, mode), daemon=True)
    reader_conn, reader_child = ctx.Pipe()
    reader = ctx.Process(target=_reader, args=(reader_child, mode, piece, in_flight), daemon=True)
    holder.start()
    reader.start()  # both create their agent at once (~0.5 s each here)
    if not holder_conn.poll(60):
        raise RuntimeError(f"round {number}: the holder did not start (exit {holder.exitcode})")
    reader_conn.send(holder_conn.recv())
    if not reader_conn.poll(60):
        raise RuntimeError(f"round {number}: the reader did not start (exit {reader.exitcode})")
    reader_conn.recv()  # posting
    time.sleep(rng.uniform(0, window_ms) / 1000)
    victim = rng.choice(("holder", "reader"))
    tally.killed[victim] += 1
    os.kill((holder if victim == "holder" else reader).pid, signal.SIGKILL)
    (holder if victim == "holder" else reader).join(10)
    if victim == "holder":
        outcome = reader_conn.recv() if reader_conn.poll(_FINISH_S) else "hung"
        tally.completed += outcome in ("exact", "mismatch")
        tally.exact += outcome == "exact"
        tally.failed_over += outcome.startswith("failed")
        code = _finish(reader_conn, reader, _FINISH_S)
        if outcome == "hung" or code != 0:
            tally.survivors_lost.append(f"round {number}: reader {outcome[:80]}, exit {code}")
    else:
        code = _finish(holder_conn, holder, _FINISH_S)
        if code != 0:
            tally.survivors_lost.append(f"round {number}: holder exit {code}")
    tally.rounds += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorhub.chaos.killtransfer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--mode", choices=("push", "read"), default="push")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window-ms", type=float, default=60.0, help="the kill comes 0 to this many ms after the "
                                                                       "first request (default 60)")
    parser.add_argument("--piece-kib", type=int, default=PIECE >> 10, help="bytes per request, KiB (default 1024)")
    parser.add_argument("--in-flight", type=int, default=IN_FLIGHT, help="requests out at once (default 4)")
    args = parser.parse_args(argv)
    tally = run_rounds(args.rounds, args.mode, seed=args.seed, window_ms=args.window_ms, piece=args.piece_kib << 10,
                       in_flight=args.in_flight)
    print(json.dumps(asdict(tally), indent=1))
    return 1 if tally.survivors_lost or tally.exact != tally.completed else 0


if __name__ == "__main__":
    sys.exit(main())
