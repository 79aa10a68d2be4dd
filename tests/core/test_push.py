"""Pull by push between two real NIXL agents over UCX's TCP transport: bytes
land exact, a request for memory the holder does not have is refused at once,
and a holder that stops answering is given up as stalled (not failed: a slow
holder may still write)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tensorhub.testing import finish_transfer
from tensorhub.transport import push, pushwire
from tensorhub.transport.memory import MemoryKind
from tensorhub.transport.nixl import NixlAgent, TransferFailed

NBYTES = 4 << 20


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by UCX when each agent starts
    monkeypatch.setattr(push, "SILENCE_S", 0.5)
    holder, reader = NixlAgent("push-holder", "auto"), NixlAgent("push-reader", "auto")
    try:
        yield holder, reader
    finally:
        reader.close()
        holder.close()


def test_the_nixl_agent_is_what_the_push_service_drives(pair):
    """push.py types its agent as a protocol (it does not import nixl): the agent must fit it."""
    assert all(isinstance(agent, push.PushAgent) for agent in pair)


def test_holder_writes_what_the_reader_asks_and_refuses_what_it_does_not_hold(pair):
    holder, reader = pair
    assert holder.transfer == reader.transfer == "push"  # auto, with UCX_TLS=tcp
    source = torch.arange(NBYTES // 8, dtype=torch.int64).view(torch.uint8)
    dest = torch.zeros(NBYTES, dtype=torch.uint8)
    remote = reader.connect("push-holder.1", holder.register([source]).metadata)
    reader.register([dest])
    half = NBYTES // 2  # two requests, the second half first: each lands where asked
    for at in (half, 0):
        finish_transfer(reader, reader.post(remote, np.array([[dest.data_ptr() + at, half, 0]]), MemoryKind.DRAM,
                                  np.array([[source.data_ptr() + at, half, 0]]), MemoryKind.DRAM))
    assert torch.equal(dest, source)
    assert holder.writes_out() == 0

    started = time.monotonic()
    pending = reader.post(remote, np.array([[dest.data_ptr(), 4096, 0]]), MemoryKind.DRAM,
                          np.array([[source.data_ptr() + NBYTES, 4096, 0]]), MemoryKind.DRAM)  # past its end
    with pytest.raises(TransferFailed, match="holder could not WRITE") as failed:
        finish_transfer(reader, pending)
    assert not failed.value.stalled and time.monotonic() - started < push.SILENCE_S


def test_a_holder_that_stops_answering_is_given_up_as_stalled(pair):
    holder, reader = pair
    source, dest = torch.ones(NBYTES, dtype=torch.uint8), torch.zeros(NBYTES, dtype=torch.uint8)
    remote = reader.connect("push-holder.1", holder.register([source]).metadata)
    reader.register([dest])
    holder._push.close()  # its serving thread gone: requests go unanswered
    pending = reader.post(remote, np.array([[dest.data_ptr(), NBYTES, 0]]), MemoryKind.DRAM,
                          np.array([[source.data_ptr(), NBYTES, 0]]), MemoryKind.DRAM)
    started = time.monotonic()
    with pytest.raises(TransferFailed, match="no word from the holder") as failed:
        finish_transfer(reader, pending)
    assert failed.value.stalled
    assert push.SILENCE_S - 0.1 < time.monotonic() - started < push.SILENCE_S + 2.0
    assert not dest.any()


def test_where_push_is_used_an_emulated_read_is_an_error_not_a_fallback(pair):
    holder, reader = pair
    assert reader._agent.get_backend_params("UCX")["engine_config"] == "PROTO_EMULATION_ENABLE=n"
    source, dest = torch.ones(NBYTES, dtype=torch.uint8), torch.zeros(NBYTES, dtype=torch.uint8)
    remote = reader.connect("push-holder.1", holder.register([source]).metadata)
    reader.register([dest])
    started = time.monotonic()
    with pytest.raises(TransferFailed):  # a READ over TCP would be emulated: UCX refuses it at once
        finish_transfer(reader, reader._post("READ", remote, np.array([[dest.data_ptr(), NBYTES, 0]]),
                                             MemoryKind.DRAM, np.array([[source.data_ptr(), NBYTES, 0]]),
                                             MemoryKind.DRAM))
    assert time.monotonic() - started < 2.0 and not dest.any()


def test_any_word_from_a_holder_keeps_every_request_to_it_from_stalling(pair):
    """A holder's answers queue behind the bytes of its earlier WRITEs: over a
    slow link a request's own ``alive`` can come late while the holder is busy
    landing the others, so an answer about any request counts for all."""
    holder, reader = pair
    source, dest = torch.ones(NBYTES, dtype=torch.uint8), torch.zeros(NBYTES, dtype=torch.uint8)
    remote = reader.connect("push-holder.1", holder.register([source]).metadata)
    reader.register([dest])
    holder._push.close()  # nothing answers this request ...
    pending = reader.post(remote, np.array([[dest.data_ptr(), NBYTES, 0]]), MemoryKind.DRAM,
                          np.array([[source.data_ptr(), NBYTES, 0]]), MemoryKind.DRAM)
    holder._admit_reader(reader.name, reader.local_metadata())  # ... but the holder speaks of another
    until = time.monotonic() + 3 * push.SILENCE_S
    while time.monotonic() < until:
        holder.notify(reader.name, pushwire.encode_alive([b"another request!"]))
        assert not reader.poll(pending)  # no stall while the holder is heard from
        time.sleep(push.SILENCE_S / 5)
    with pytest.raises(TransferFailed, match="no word from the holder"):  # silent from now on
        finish_transfer(reader, pending)


def test_a_push_holder_connects_to_its_reader_as_a_relay_while_writing_to_it(pair):
    """A relay pair pushes both ways: the holder loaded the reader's whole
    metadata for a WRITE still out, and now pulls from the reader's replica. It
    pushes from it (never READs), so the loaded agent serves as it is: not
    loaded again from nothing, which would wait for the WRITE and lose the
    reader as a source meanwhile."""
    holder, reader = pair
    source, dest = torch.ones(NBYTES, dtype=torch.uint8), torch.zeros(NBYTES, dtype=torch.uint8)
    holder.register([source])
    relayed = reader.register([dest])
    holder._push.close()  # the WRITE below is the test's own: nothing else serves or releases
    writing = holder.write(reader.name, reader.local_metadata(), np.array([[source.data_ptr(), NBYTES, 0]]),
                           MemoryKind.DRAM, np.array([[dest.data_ptr(), NBYTES, 0]]), MemoryKind.DRAM, notif=b"x")
    try:
        regions = np.array([[dest.data_ptr(), NBYTES, 0]])
        assert holder.connect(f"{reader.name}.1", relayed.metadata, regions) == reader.name
    finally:
        finish_transfer(holder, writing)
    assert torch.equal(dest, source)
