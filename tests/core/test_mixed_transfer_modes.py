"""Processes in different transfer modes, the holder in its own OS process: a
push reader asks only holders whose published metadata says they serve push
requests, and READs from the others; where that READ would be emulated (UCX
limited to TCP) it fails at once with why, not after SILENCE_S of silence."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection

import numpy as np
import pytest
import torch

from tensorhub.testing import finish_transfer
from tensorhub.transport import push
from tensorhub.transport.memory import MemoryKind
from tensorhub.transport.nixl import NixlAgent, TransferFailed
from tensorhub.transport.transfermode import advertised

NBYTES = 1 << 20
_WAIT_S = 30.0


def _pattern() -> torch.Tensor:
    return torch.arange(NBYTES // 8, dtype=torch.int64).view(torch.uint8)


def _holder(conn: Connection, mode: str, tls: str) -> None:
    if tls:
        os.environ["UCX_TLS"] = tls
    agent = NixlAgent(f"mixed-holder-{os.getpid()}", mode)
    source = _pattern()
    conn.send((agent.register([source]).metadata, source.data_ptr()))
    conn.poll(_WAIT_S)  # serves (the push thread, or UCX's) until the test is done
    agent.close()


@pytest.fixture
def holder_in(monkeypatch):
    """Starts a holder process in a mode; yields (metadata, address) of its bytes."""
    started = []

    def start(mode: str, tls: str = "") -> tuple[bytes, int]:
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=_holder, args=(theirs, mode, tls), daemon=True)
        process.start()
        started.append((process, ours))
        assert ours.poll(_WAIT_S), "the holder process did not start"
        return ours.recv()

    yield start
    for process, conn in started:
        conn.send("done")
        process.join(_WAIT_S)
        assert process.exitcode == 0, f"the holder process exited {process.exitcode}"


def _pull(reader: NixlAgent, metadata: bytes, address: int) -> torch.Tensor:
    dest = torch.zeros(NBYTES, dtype=torch.uint8)
    reader.register([dest])
    remote = reader.connect("holder.1", metadata)
    finish_transfer(reader, reader.post(remote, np.array([[dest.data_ptr(), NBYTES, 0]]), MemoryKind.DRAM,
                                        np.array([[address, NBYTES, 0]]), MemoryKind.DRAM))
    return dest


def test_a_push_reader_reads_from_a_holder_that_does_not_serve_push(holder_in):
    """Shared memory between them (UCX_TLS unset): the READ is native, and the
    reader does not wait SILENCE_S for an answer that never comes."""
    metadata, address = holder_in("read")
    assert advertised(metadata)[1] is False  # its published metadata: no push served
    reader = NixlAgent("mixed-reader", "push")
    try:
        started = time.monotonic()
        assert torch.equal(_pull(reader, metadata, address), _pattern())
        assert time.monotonic() - started < push.SILENCE_S
    finally:
        reader.close()


def test_a_push_reader_facing_a_read_holder_over_tcp_fails_at_once_and_says_why(holder_in, monkeypatch):
    metadata, address = holder_in("read", "tcp")
    monkeypatch.setenv("UCX_TLS", "tcp")
    reader = NixlAgent("mixed-reader", "auto")
    try:
        assert reader.transfer == "push"
        started = time.monotonic()
        with pytest.raises(TransferFailed, match="does not serve push requests") as failed:
            _pull(reader, metadata, address)
        assert not failed.value.stalled and time.monotonic() - started < push.SILENCE_S
    finally:
        reader.close()


def test_a_push_reader_and_a_push_holder_in_two_processes(holder_in, monkeypatch):
    metadata, address = holder_in("push", "tcp")
    assert advertised(metadata)[1] is True
    monkeypatch.setenv("UCX_TLS", "tcp")
    reader = NixlAgent("mixed-reader", "auto")
    try:
        assert torch.equal(_pull(reader, metadata, address), _pattern())
    finally:
        reader.close()
