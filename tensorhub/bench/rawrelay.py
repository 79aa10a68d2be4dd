"""Raw NIXL rows of ``tensorhub bench cluster``: the same version moved with no
reference server, no checks, no reports and no plans, so TensorHub's rows have
what the links allow beside them, in the same run.

* ``nixl-raw-single``: one reader READs the whole version from the trainer
  alone (a lone copy: the least any reader's update can take);
* ``nixl-raw-all``: every reader READs the whole version from the trainer at
  once (the elastic scenario's ``p2p``: one copy per reader over the trainer's link);
* ``nixl-raw-relay``: reader ``i`` of the ``R`` in the run (the first ``R``
  of the cluster's readers) READs the chunks ``c`` with ``c % R == i`` from the trainer, and every other chunk from the reader that
  READ it, as soon as that reader has it. Who has what is a bitmap in shared
  memory that every reader sees at once: a relay with no lag at all (no check,
  no report, no resolve), on a fixed schedule (``next_reads``). Its time
  against ``nixl-raw-all`` is about the best ratio a relaying wave of ``R``
  joiners can reach against point-to-point on these links (``bench rl``'s
  elastic goal asks TensorHub's for 3x with waves of 3).

    trainer (pattern, registered) ◀── READ own chunks ── r0, r1, r2 ...
                                      r_i ◀── READ chunk c once r_(c % R) has it ── r_j

Every reader compares its bytes with the trainer's after each run (outside the
timing), and counts the bytes it READ from the trainer: a relay run moves one
copy over the trainer's link.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensorhub import netns, processes
from tensorhub.bench import children

if TYPE_CHECKING:
    from typing_extensions import Self

METHODS = ("nixl-raw-single", "nixl-raw-all", "nixl-raw-relay")
IN_FLIGHT = 4  # READs in flight per reader (TensorHub's default, HubConfig.read_workers)
OWN = 1  # a relaying reader's READs from the trainer in flight (see next_reads)
TIMEOUT_S = 120.0  # one run, at most: a READ that never completes fails the benchmark, not hangs it
_POLL_S = 200e-6


def next_reads(reader: int, readers: int, needed: Sequence[int], has: Callable[[int, int], bool], free: int,
               own_flying: int, own: int = 1) -> list[int]:
    """The chunks reader ``reader`` READs next, in the order to post them.

    ``needed``: its chunks not landed nor in flight, in ascending order;
    ``has(j, c)``: reader ``j`` holds chunk ``c``; ``free``: READ slots free;
    ``own_flying``: its READs from the trainer in flight. Its own chunks
    (``c % readers == reader``) come from the trainer, ``own`` of them in
    flight while any is left: few, so that each lands soon and its peers can
    read it (the trainer's link is shared by every reader's READs: the more
    are in flight on it, the later each one lands). The other slots go to
    chunks their owners hold, oldest first."""
    if free <= 0:
        return []
    mine = [c for c in needed if c % readers == reader]
    first = mine[: max(0, min(free, own - own_flying))]
    ready = [c for c in needed if c % readers != reader and has(c % readers, c)]
    return first + ready[: free - len(first)]


@dataclass(frozen=True, slots=True)
class Place:
    """Where a benchmark process runs: a network namespace (None: this host as
    it is) and the environment it sets before creating its NIXL agent."""

    netns: str | None
    env: tuple[tuple[str, str], ...] = ()


def _enter(place: Place) -> None:
    if place.netns is not None:
        netns.enter(place.netns)  # before any thread starts
    os.environ.update(dict(place.env))


def _trainer_main(conn: Any, place: Place, size: int) -> None:
    _enter(place)
    from tensorhub.bench.payload import pattern
    from tensorhub.transport.nixl import new_agent

    buf = pattern(size, seed=7).clone()
    agent = new_agent(f"raw-trainer-{os.getpid()}")
    agent.register_memory(buf)
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    conn.recv()  # stop


def _reader_main(conn: Any, place: Place, index: int, readers: int, size: int, chunk: int, bitmap: Any) -> None:
    _enter(place)
    import torch

    from tensorhub.bench.payload import pattern
    from tensorhub.transport.nixl import new_agent

    chunks = -(-size // chunk)
    buf = torch.zeros(size, dtype=torch.uint8)
    agent = new_agent(f"raw-reader-{index}-{os.getpid()}")
    agent.register_memory(buf)
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    infos = conn.recv()  # [(metadata, address)] of the trainer, then of every reader
    names: list[str] = []
    for k, (metadata, _) in enumerate(infos):
        if k == 1 + index:  # itself: never read from
            names.append("")
            continue
        name = agent.add_remote_agent(metadata)
        names.append(name.decode() if isinstance(name, bytes) else name)
    expected = pattern(size, seed=7)

    def post(c: int, source: int) -> Any:
        n = min(chunk, size - c * chunk)
        local = agent.get_xfer_descs([(buf.data_ptr() + c * chunk, n, 0)], "DRAM")
        far = agent.get_xfer_descs([(infos[source][1] + c * chunk, n, 0)], "DRAM")
        handle = agent.initialize_xfer("READ", local, far, names[source])
        if agent.transfer(handle) == "ERR":
            raise RuntimeError(f"raw NIXL READ of chunk {c} failed when posted")
        return handle

    def run(method: str, in_flight: int, own: int, relaying: int, timeout_s: float) -> int:
        """Read the version as ``method`` says (a relay among the first
        ``relaying`` readers); the bytes READ from the trainer."""
        relay = method == "nixl-raw-relay"
        needed = list(range(chunks))
        flying: list[tuple[int, int, Any]] = []  # (chunk, source: 0 the trainer, 1 + j reader j, handle)
        from_trainer = 0
        deadline = time.monotonic() + timeout_s

        def has(j: int, c: int) -> bool:
            return bool(bitmap[j * chunks + c])

        try:
            while needed or flying:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{method}: reader {index} still missed {len(needed) + len(flying)} chunk(s) "
                                       f"after {timeout_s:.0f} s")
                free = in_flight - len(flying)
                if relay:
                    own_flying = sum(1 for _, source, _ in flying if source == 0)
                    picks = next_reads(index, relaying, needed, has, free, own_flying, own)
                else:
                    picks = needed[:free]
                for c in picks:
                    source = 0 if not relay or c % relaying == index else 1 + c % relaying
                    flying.append((c, source, post(c, source)))
                    needed.remove(c)
                still = []
                for c, source, handle in flying:
                    state = agent.check_xfer_state(handle)
                    if state == "ERR":
                        raise RuntimeError(f"{method}: raw NIXL READ of chunk {c} failed")
                    if state != "DONE":
                        still.append((c, source, handle))
                        continue
                    agent.release_xfer_handle(handle)
                    bitmap[index * chunks + c] = 1
                    if source == 0:
                        from_trainer += min(chunk, size - c * chunk)
                if len(still) == len(flying):
                    time.sleep(_POLL_S)
                flying = still
        finally:
            for _, _, handle in flying:  # a failed run: wait for the rest (a deadline), then let go
                while agent.check_xfer_state(handle) not in ("DONE", "ERR") and time.monotonic() < deadline + 10:
                    time.sleep(0.001)
                agent.release_xfer_handle(handle)
        return from_trainer

    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        method, start_at, in_flight, own, relaying, timeout_s = cmd
        buf.zero_()
        while time.monotonic() < start_at:  # a common start instant for all readers
            time.sleep(0.0005)
        start = time.monotonic()
        from_trainer = run(method, in_flight, own, relaying, timeout_s)
        end = time.monotonic()
        conn.send((start, end, bool(torch.equal(buf, expected)), from_trainer))


@dataclass(kw_only=True, slots=True)
class RawRun:
    method: str
    readers: int
    seconds: float  # the first reader's start until every reader is done
    ok: bool  # every reader's bytes equal the trainer's
    trainer_bytes: int  # bytes READ from the trainer, all readers together
    per_reader_s: list[float]


class RawCluster:
    """A trainer and readers with raw NIXL agents, started once, run per method."""

    def __init__(self, trainer: Place, readers: list[Place], size: int, chunk: int) -> None:
        ctx = processes.context()
        self.readers = len(readers)
        self._bitmap = ctx.Array("b", self.readers * -(-size // chunk), lock=False)
        self._trainer_conns, self._procs = children.start(ctx, _trainer_main, [(trainer, size)])
        self._conns, procs = children.start(ctx, _reader_main, [(place, i, self.readers, size, chunk, self._bitmap)
                                                                for i, place in enumerate(readers)])
        self._procs += procs
        try:
            infos = children.receive(self._trainer_conns, 180, "the raw NIXL trainer did not start")
            infos += children.receive(self._conns, 180, "a raw NIXL reader did not start")
            for conn in self._conns:
                conn.send(infos)
        except BaseException:
            self.close()  # none left running behind a failed start
            raise

    def run(self, method: str, readers: int | None = None, *, in_flight: int = IN_FLIGHT,
            own: int = OWN, timeout_s: float = TIMEOUT_S) -> RawRun:
        """One run of ``method`` by the first ``readers`` readers (all by default),
        each with ``in_flight`` READs out (a relay among those readers: ``own``
        of them from the trainer); a reader not done after ``timeout_s`` fails it."""
        if method not in METHODS:
            raise ValueError(f"unknown raw method {method!r}; one of {', '.join(METHODS)}")
        n = self.readers if readers is None else readers
        if not 1 <= n <= self.readers:
            raise ValueError(f"a run by {n} readers: this cluster has 1 to {self.readers}")
        conns = self._conns[:n]
        self._bitmap[:] = bytes(len(self._bitmap))
        start_at = time.monotonic() + 0.1
        for conn in conns:
            conn.send((method, start_at, in_flight, own, n, timeout_s))
        got = children.receive(conns, timeout_s + 30, f"a raw NIXL reader did not finish {method}")
        return RawRun(method=method, readers=len(conns), seconds=max(g[1] for g in got) - min(g[0] for g in got),
                      ok=all(g[2] for g in got), trainer_bytes=sum(g[3] for g in got),
                      per_reader_s=[g[1] - g[0] for g in got])

    def close(self) -> None:
        for conn in [*self._conns, *self._trainer_conns]:
            with contextlib.suppress(OSError):  # a child that died already
                conn.send(("stop",))
        for proc in self._procs:
            proc.join(timeout=15)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
