"""Method ``p2p``: plain point-to-point over NIXL, no reference server. Every
rollout, whether it updates or joins, READs the whole version out of the
trainer's registered buffer (the trainer's agent metadata is handed out once).

Without a server someone must keep the trainer from overwriting bytes being
read: here shared counters (``Gate``): the trainer closes the gate, waits until
no READ is in flight, writes the new version and reopens it; a rollout waits
for an open gate, marks itself reading, READs, unmarks. That is what direct
trainer-to-rollout paths do (the trainer waits for every reader).

LoRA mode (``lora_rank > 0``): the trainer registers the frozen base and the
adapter (its matrices as one flat buffer); a rollout READs the base once (never
overwritten: outside the gate) and the adapter at every update (in the gate).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from tensorhub.bench.rl import lora, proc

CLOSED = -1


class Gate:
    """The trainer's version and who is reading it, in shared memory. Waits poll
    (a few ms) rather than use a Condition: a rollout killed while waiting on a
    Condition would leave its notify count unmatched and hang the trainer."""

    POLL_S = 0.002

    def __init__(self, ctx: Any, slots: int) -> None:
        self.lock = ctx.Lock()
        self.version = ctx.Value("i", 0, lock=False)
        self.reading = ctx.Array("i", slots, lock=False)

    @contextlib.contextmanager
    def _locked(self):
        # Held for a few instructions only; the timeout turns a holder killed there into an error.
        if not self.lock.acquire(timeout=proc.WAIT_TIMEOUT_S):
            raise TimeoutError(f"the p2p gate stayed locked for {proc.WAIT_TIMEOUT_S} s")
        try:
            yield
        finally:
            self.lock.release()

    def close_and_drain(self, timeout: float) -> None:
        with self._locked():
            self.version.value = CLOSED
        deadline = time.monotonic() + timeout
        while any(self.reading):
            if time.monotonic() > deadline:
                raise TimeoutError(f"readers {[i for i, r in enumerate(self.reading) if r]} still read after {timeout} s")
            time.sleep(self.POLL_S)

    def open(self, version: int) -> None:
        with self._locked():
            self.version.value = version

    def enter(self, slot: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            with self._locked():
                if self.version.value != CLOSED:
                    self.reading[slot] = 1
                    return self.version.value
            if time.monotonic() > deadline:
                raise TimeoutError(f"the trainer's buffer stayed closed for {timeout} s")
            time.sleep(self.POLL_S)

    def leave(self, slot: int) -> None:
        with self._locked():
            self.reading[slot] = 0

    def latest(self) -> int:
        return self.version.value


def trainer(events: Any, who: str, place: Any, cfg: Any, gate: Gate, go: Any, stop: Any) -> None:
    proc.enter(place)
    from tensorhub.transport.nixl import new_agent

    with proc.reporting(events, who) as report:
        base = proc.weights(cfg.size)
        proc.write_version(base, 0)
        # what each step overwrites: the weights, or in LoRA mode the adapter beside the frozen base
        buf = lora.flat(cfg) if cfg.lora_rank else base
        proc.write_version(buf, 0)
        agent = new_agent(f"p2p-{who}")
        for b in {id(base): base, id(buf): buf}.values():
            agent.register_memory(b)
        report("ready", version=0, metadata=agent.get_agent_metadata(), addr=base.data_ptr(),
               adapter_addr=buf.data_ptr() if cfg.lora_rank else None)
        for version, t1 in proc.trainer_steps(report, cfg, go):
            gate.close_and_drain(proc.WAIT_TIMEOUT_S)
            proc.write_version(buf, version, cfg.changed)
            gate.open(version)
            t2 = time.monotonic()
            report("stall", t1, t2, version=version, what="drain readers")
            report("publish", t2, t2, version=version)
        report("done")
        stop.wait(proc.WAIT_TIMEOUT_S)  # READs may still come until every rollout is done


def _read_all(agent: Any, buf: Any, remote: str, addr: int, chunk: int) -> None:
    """One READ of the whole buffer, cut in ``chunk``-byte descriptors; polled with a deadline."""
    spans = [(off, min(chunk, buf.numel() - off)) for off in range(0, buf.numel(), chunk)]
    local = agent.get_xfer_descs([(buf.data_ptr() + o, n, 0) for o, n in spans], "DRAM")
    far = agent.get_xfer_descs([(addr + o, n, 0) for o, n in spans], "DRAM")
    handle = agent.initialize_xfer("READ", local, far, remote)
    try:
        state = agent.transfer(handle)
        deadline = time.monotonic() + proc.WAIT_TIMEOUT_S
        while state != "DONE":
            if state == "ERR" or time.monotonic() > deadline:
                raise RuntimeError(f"NIXL READ from the trainer failed: {state}")
            time.sleep(0.001)
            state = agent.check_xfer_state(handle)
    finally:
        agent.release_xfer_handle(handle)


def rollout(events: Any, who: str, place: Any, cfg: Any, gen_s: list[float], slot: int, gate: Gate,
            metadata: bytes, addr: int, adapter_addr: int | None, join_at: float | None, go: Any, stop: Any,
            preempt: Any) -> None:
    """``addr``: the trainer's weights (in LoRA mode its base); ``adapter_addr``: its adapter (LoRA mode)."""
    proc.enter(place)
    from tensorhub.transport.nixl import new_agent

    with proc.reporting(events, who) as report:
        base = proc.weights(cfg.size)
        buf = lora.flat(cfg) if cfg.lora_rank else base  # what each update reads
        agent = new_agent(f"p2p-{who}-{time.monotonic_ns()}")
        for b in {id(base): base, id(buf): buf}.values():
            agent.register_memory(b)
        remote = agent.add_remote_agent(metadata)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        need_base = bool(cfg.lora_rank)  # LoRA mode: the base once, at the first update

        def update(what: str) -> int:
            nonlocal need_base
            t0 = time.monotonic()
            report("begin", what=what)
            nbytes = 0
            if need_base:
                _read_all(agent, base, remote, addr, cfg.chunk_size)
                report.check(base, 0)
                need_base, nbytes = False, base.numel()
            version = gate.enter(slot, proc.WAIT_TIMEOUT_S)
            try:
                _read_all(agent, buf, remote, adapter_addr if cfg.lora_rank else addr, cfg.chunk_size)
            finally:
                gate.leave(slot)
            t1 = time.monotonic()
            report.check(buf, version)
            nbytes += buf.numel()
            report("stall", t0, t1, version=version, what=what, bytes=nbytes, sources={"trainer": nbytes})
            report("hold", t1, t1, version=version)
            return version

        proc.rollout_steps(report, update, gate.latest, join_at=join_at, gen_s=gen_s, go=go, stop=stop,
                           preempt=preempt)
