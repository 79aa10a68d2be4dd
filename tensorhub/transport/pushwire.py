"""The messages of a pull by push, carried as NIXL notifications (genNotif):
a reader's request, and the holder's answers. Pure encoding: no NIXL here.

request  (reader -> holder): tag, memory kinds, the reader's destination and
          the holder's source descriptors (N x 3: addr, nbytes, device), and the
          reader's agent metadata (so the holder can WRITE into its memory).
done     (holder -> reader): the WRITE's own notification, sent by NIXL after
          the bytes have landed.
alive    (holder -> reader): tags still being served; a reader that hears
          nothing for a while takes its holder for dead (a dead holder's
          WRITE fails nowhere the reader can see: see tensorhub.transport.push).
error    (holder -> reader): a request the holder could not serve, and why.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from tensorhub.transport.memory import MemoryKind

TAG_BYTES = 16
REQUEST, DONE, ALIVE, ERROR = b"THQ1", b"THD1", b"THA1", b"THE1"
_KINDS = (MemoryKind.DRAM, MemoryKind.VRAM)
_HEAD = struct.Struct("<16sBBII")  # tag, dest kind, source kind, descriptors, metadata bytes
_MAX_DESCS = 1 << 20  # a request is one planned transfer: far fewer in practice


class BadMessage(ValueError):
    """A notification that is not a well-formed push message."""


@dataclass(frozen=True, slots=True)
class PushRequest:
    tag: bytes
    dest_kind: MemoryKind  # the reader's memory
    source_kind: MemoryKind  # the holder's memory
    dest: np.ndarray  # N x 3 int64, in the reader
    source: np.ndarray  # N x 3 int64, in the holder
    metadata: bytes  # the reader's NIXL agent metadata


def encode_request(req: PushRequest) -> bytes:
    dest = np.ascontiguousarray(req.dest, dtype=np.int64).reshape(-1, 3)
    source = np.ascontiguousarray(req.source, dtype=np.int64).reshape(-1, 3)
    if len(dest) != len(source):
        raise ValueError(f"{len(dest)} destination descriptors for {len(source)} source descriptors")
    head = _HEAD.pack(req.tag, _KINDS.index(req.dest_kind), _KINDS.index(req.source_kind), len(dest),
                      len(req.metadata))
    return b"".join((REQUEST, head, dest.tobytes(), source.tobytes(), req.metadata))


def decode_request(message: bytes) -> PushRequest:
    """The request in ``message``; BadMessage if it is malformed (peers are not trusted to be well-formed)."""
    if not message.startswith(REQUEST) or len(message) < len(REQUEST) + _HEAD.size:
        raise BadMessage("not a push request")
    tag, dest_kind, source_kind, count, md_len = _HEAD.unpack_from(message, len(REQUEST))
    if dest_kind >= len(_KINDS) or source_kind >= len(_KINDS) or count > _MAX_DESCS:
        raise BadMessage("push request with an unknown memory kind or too many descriptors")
    start = len(REQUEST) + _HEAD.size
    table = count * 3 * 8
    if len(message) != start + 2 * table + md_len:
        raise BadMessage(f"push request of {len(message)} bytes, expected {start + 2 * table + md_len}")
    dest = np.frombuffer(message, dtype=np.int64, count=count * 3, offset=start).reshape(-1, 3)
    source = np.frombuffer(message, dtype=np.int64, count=count * 3, offset=start + table).reshape(-1, 3)
    return PushRequest(tag, _KINDS[dest_kind], _KINDS[source_kind], dest, source, message[start + 2 * table:])


def encode_done(tag: bytes) -> bytes:
    return DONE + tag


def encode_alive(tags: list[bytes]) -> bytes:
    return ALIVE + b"".join(tags)


def encode_error(tag: bytes, detail: str) -> bytes:
    return ERROR + tag + detail.encode("utf-8", "replace")[:1024]


def decode_answer(message: bytes) -> tuple[bytes, list[bytes], str]:
    """(kind, tags, error detail) of a holder's answer; BadMessage if it is none."""
    kind, body = message[:4], message[4:]
    if kind in (DONE, ERROR) and len(body) >= TAG_BYTES:
        return kind, [body[:TAG_BYTES]], body[TAG_BYTES:].decode("utf-8", "replace") if kind == ERROR else ""
    if kind == ALIVE and len(body) % TAG_BYTES == 0:
        return kind, [body[i:i + TAG_BYTES] for i in range(0, len(body), TAG_BYTES)], ""
    raise BadMessage("not a push answer")
