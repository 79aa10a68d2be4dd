"""Which operation moves the bytes (read or push), and the push messages'
encoding, which a holder decodes from any peer."""

from __future__ import annotations

import numpy as np
import pytest

from tensorhub.transport import pushwire
from tensorhub.transport.memory import MemoryKind
from tensorhub.transport.transfermode import resolve_transfer, tcp_only


@pytest.mark.parametrize(("tls", "expected"), [
    ("tcp", True), ("tcp,self", True), ("TCP", True),
    ("", False),  # unset: UCX picks shared memory within a host and RDMA where present
    ("^sm", False), ("tcp,sm", False), ("tcp,cma", False), ("rc,tcp", False), ("all", False), ("shm", False),
])
def test_auto_pushes_only_where_ucx_is_limited_to_tcp(tls, expected):
    env = {"UCX_TLS": tls} if tls else {}
    assert tcp_only(env) is expected
    assert resolve_transfer("auto", env) == ("push" if expected else "read")


def test_the_setting_beats_the_environment_and_unknown_modes_are_errors():
    assert resolve_transfer("", {"TENSORHUB_TRANSFER": "push"}) == "push"
    assert resolve_transfer("read", {"TENSORHUB_TRANSFER": "push", "UCX_TLS": "tcp"}) == "read"
    assert resolve_transfer("", {"UCX_TLS": "tcp"}) == "push"
    with pytest.raises(ValueError, match="'pull' is not one of read, push, auto"):
        resolve_transfer("pull", {})


def test_a_request_survives_encoding_and_malformed_ones_are_refused():
    dest = np.array([[1 << 40, 4096, 0], [(1 << 40) + 8192, 100, 0]], dtype=np.int64)
    source = np.array([[7 << 32, 4096, 3], [(7 << 32) + 64, 100, 3]], dtype=np.int64)
    req = pushwire.PushRequest(b"t" * 16, MemoryKind.DRAM, MemoryKind.VRAM, dest, source, b"metadata")
    message = pushwire.encode_request(req)
    got = pushwire.decode_request(message)
    assert (got.tag, got.dest_kind, got.source_kind, got.metadata) == (req.tag, req.dest_kind, req.source_kind,
                                                                       b"metadata")
    assert np.array_equal(got.dest, dest) and np.array_equal(got.source, source)
    for bad in (message[:-9], message + b"x", message[:20], b"THQ1", pushwire.encode_done(b"t" * 16),
                message[:len(pushwire.REQUEST)] + b"\xff" * (len(message) - len(pushwire.REQUEST))):
        with pytest.raises(pushwire.BadMessage):
            pushwire.decode_request(bad)
    with pytest.raises(ValueError, match="2 destination descriptors for 1 source"):
        pushwire.encode_request(pushwire.PushRequest(b"t" * 16, MemoryKind.DRAM, MemoryKind.DRAM, dest, source[:1],
                                                     b""))


def test_answers_name_their_requests():
    a, b = b"a" * 16, b"b" * 16
    assert pushwire.decode_answer(pushwire.encode_done(a)) == (pushwire.DONE, [a], "")
    assert pushwire.decode_answer(pushwire.encode_alive([a, b])) == (pushwire.ALIVE, [a, b], "")
    assert pushwire.decode_answer(pushwire.encode_error(b, "not registered")) == (pushwire.ERROR, [b],
                                                                                  "not registered")
    for bad in (b"THD1short", pushwire.ALIVE + b"x" * 17, b"other"):
        with pytest.raises(pushwire.BadMessage):
            pushwire.decode_answer(bad)
