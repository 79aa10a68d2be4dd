"""Pull by push: the reader asks, the holder WRITEs (see tensorhub.transport.transfermode
for why). Both roles run in every process in push mode: one background thread
per agent serves the requests of readers and hands holders' answers to the
waits of this process's pulls.

The request channel is NIXL's own notifications (genNotif / getNotifs), on the
connection the reader already opened to read the holder's metadata: no second
listener, port or RPC, nothing new to secure or to fail separately, and it
travels wherever the data does (measured: a 64 MiB WRITE + notification over
TCP, data byte-exact). A request carries the reader's agent metadata (a few
hundred bytes a region), which the holder loads once per digest.

A dead holder fails nothing the reader can see: over TCP the reader's own sends
to it still complete (measured: 80 notifications and 60 small WRITEs "DONE" in
the 5 s after the holder's SIGKILL). So a holder sends ``alive`` for the
requests it is serving every ``ALIVE_INTERVAL_S``, and a reader that hears
nothing from a holder for ``SILENCE_S`` gives that request up as stalled: it
may still land later (a holder that was only slow), so the puller drains it
like a READ it gave up on. Any answer from a holder counts as word for all of
its requests: its messages queue behind the bytes of the WRITEs it posted
before them on the same connection, so over a slow link (two zones, 200 Mbit/s)
a request's own ``alive`` came after more than ``SILENCE_S`` while the holder's
earlier WRITEs were still landing one by one (``tensorhub bench cluster
--zones 2 --delta`` lost every holder so).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from tensorhub.transport import pushwire
from tensorhub.transport.memory import MemoryKind
from tensorhub.transport.pending import PendingRead

log = logging.getLogger(__name__)

ALIVE_INTERVAL_S = 0.2  # a holder's "still serving" to each reader it is writing to
SILENCE_S = 3.0  # a reader hearing nothing this long from a holder: the request stalled
_BUSY_POLL_S = 0.0005  # notification polling while requests are out or being served
_IDLE_POLL_S = 0.002  # ... and while none are: ~500 cheap calls a second
_BUSY_FOR_S = 0.05  # how long after the last activity the thread keeps polling fast
_AFTER_ERROR_S = 0.1


@runtime_checkable
class PushAgent(Protocol):
    """What the push service needs of its process's NIXL agent (``nixl.NixlAgent``)."""

    name: str

    def local_metadata(self) -> bytes: ...

    def notify(self, remote: str, message: bytes) -> None: ...

    def notifications(self) -> dict[str, list[bytes]]: ...

    def write(self, reader: str, metadata: bytes, local: np.ndarray, local_kind: MemoryKind,
              remote_descs: np.ndarray, remote_kind: MemoryKind, notif: bytes) -> PendingRead: ...

    def poll(self, pending: PendingRead) -> bool: ...

    def release(self, pending: PendingRead) -> None: ...

    def forget_agent(self, name: str) -> None: ...


@dataclass(frozen=True, slots=True)
class PushTicket:
    """A request this process sent: the handle of a pending push."""

    tag: bytes


@dataclass(slots=True)
class _Wait:
    """What this reader has heard about one of its requests."""

    remote: str
    heard_at: float
    done: bool = False
    error: str = ""
    stall_reported: bool = False


@dataclass(slots=True)
class _Write:
    """A WRITE this holder posted for a reader's request."""

    reader: str
    tag: bytes
    pending: PendingRead


@dataclass(slots=True)
class _Metadata:
    """This process's agent metadata, recomputed after (de)registrations."""

    payload: bytes = b""
    stale: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)


class PushService:
    """The push requests and answers of one NIXL agent, served by one thread."""

    def __init__(self, nixl: PushAgent) -> None:
        self._nixl = nixl
        self._lock = threading.Lock()  # guards _waits
        self._waits: dict[bytes, _Wait] = {}
        self._heard: dict[str, float] = {}  # holder -> when it last answered anything (guarded by _lock)
        self._writes: list[_Write] = []  # the thread's own: no lock
        self._metadata = _Metadata()
        self._tags = itertools.count()
        self._salt = os.urandom(8)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tensorhub-push-{nixl.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ reader side

    def metadata_changed(self) -> None:
        """Memory was (de)registered: the next request carries fresh metadata."""
        self._metadata.stale = True

    def _own_metadata(self) -> bytes:
        with self._metadata.lock:
            if self._metadata.stale:
                self._metadata.stale = False  # before reading: a registration meanwhile marks it again
                self._metadata.payload = self._nixl.local_metadata()
            return self._metadata.payload

    def request(self, remote: str, local: np.ndarray, local_kind: MemoryKind, remote_descs: np.ndarray,
                remote_kind: MemoryKind) -> PushTicket:
        """Ask holder ``remote`` to WRITE ``remote_descs`` (its memory) into ``local``
        (ours). Raises what sending raises; nothing is left to forget then."""
        tag = next(self._tags).to_bytes(8, "little") + self._salt
        message = pushwire.encode_request(pushwire.PushRequest(tag, local_kind, remote_kind, local, remote_descs,
                                                               self._own_metadata()))
        with self._lock:
            self._waits[tag] = _Wait(remote, time.monotonic())
        try:
            self._nixl.notify(remote, message)
        except BaseException:
            self.forget(PushTicket(tag))
            raise
        return PushTicket(tag)

    def state(self, ticket: PushTicket) -> tuple[bool, str, bool]:
        """(done, error, newly stalled) of a request: stalled is said once, when
        its holder has been silent for SILENCE_S; later calls say not done."""
        with self._lock:
            wait = self._waits.get(ticket.tag)
            if wait is None:
                return False, "request forgotten", False
            if wait.done or wait.error:
                return wait.done, wait.error, False
            heard = max(wait.heard_at, self._heard.get(wait.remote, 0.0))
            if not wait.stall_reported and time.monotonic() - heard > SILENCE_S:
                wait.stall_reported = True
                return False, "", True
            return False, "", False

    def forget(self, ticket: PushTicket) -> None:
        with self._lock:
            wait = self._waits.pop(ticket.tag, None)
            if wait is not None and not any(w.remote == wait.remote for w in self._waits.values()):
                self._heard.pop(wait.remote, None)  # none out to it: nothing to keep

    def _answered(self, holder: str, message: bytes) -> None:
        try:
            kind, tags, detail = pushwire.decode_answer(message)
        except pushwire.BadMessage:
            log.debug("ignored a notification that is no push answer (%d bytes)", len(message))
            return
        now = time.monotonic()
        with self._lock:
            if any(w.remote == holder for w in self._waits.values()):
                self._heard[holder] = now
            for tag in tags:
                wait = self._waits.get(tag)
                if wait is None:
                    continue  # forgotten: a request given up on and released
                wait.heard_at = now
                if kind == pushwire.DONE:
                    wait.done = True
                elif kind == pushwire.ERROR:
                    wait.error = detail or "the holder refused the request"

    # ------------------------------------------------------------ holder side

    def _serve(self, reader: str, message: bytes) -> None:
        try:
            req = pushwire.decode_request(message)
        except pushwire.BadMessage as e:
            log.warning("push request from %s ignored: %s", reader, e)
            return
        try:
            pending = self._nixl.write(reader, req.metadata, req.source, req.source_kind, req.dest, req.dest_kind,
                                       notif=pushwire.encode_done(req.tag))
        except Exception as e:  # noqa: BLE001  TransferFailed, or memory this holder does not have registered
            log.info("push request from %s refused: %s", reader, e)
            self._tell(reader, pushwire.encode_error(req.tag, f"holder could not WRITE: {e}"))
            return
        self._writes.append(_Write(reader, req.tag, pending))
        self._tell(reader, pushwire.encode_alive([req.tag]))  # accepted: the reader's silence clock restarts

    def _progress_writes(self) -> None:
        left = []
        for write in self._writes:
            try:
                if not self._nixl.poll(write.pending):
                    left.append(write)
                    continue
            except Exception as e:  # noqa: BLE001  TransferFailed: the reader died, or its link is cut
                log.info("push WRITE to %s failed: %s", write.reader, e)
                self._tell(write.reader, pushwire.encode_error(write.tag, f"holder's WRITE failed: {e}"))
                self._nixl.forget_agent(write.reader)  # its connection is suspect; removed once no WRITE is out
            self._nixl.release(write.pending)  # done (NIXL sends its notification) or failed
        self._writes = left

    def writes_out(self) -> int:
        return len(self._writes)

    def _send_alive(self) -> None:
        by_reader: dict[str, list[bytes]] = {}
        for write in self._writes:
            by_reader.setdefault(write.reader, []).append(write.tag)
        for reader, tags in by_reader.items():
            self._tell(reader, pushwire.encode_alive(tags))

    def _tell(self, reader: str, message: bytes) -> None:
        try:
            self._nixl.notify(reader, message)
        except Exception as e:  # noqa: BLE001  the reader is gone: its WRITE fails on its own
            log.debug("notification to %s: %s", reader, e)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        busy_until = 0.0
        alive_at = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                notifs = self._nixl.notifications()
                for source, messages in notifs.items():
                    for message in messages:
                        if message.startswith(pushwire.REQUEST):
                            self._serve(source, message)
                        else:
                            self._answered(source, message)
                if self._writes:
                    self._progress_writes()
                    if now - alive_at >= ALIVE_INTERVAL_S:
                        alive_at = now
                        self._send_alive()
            except Exception:  # keep serving: a thread that ended would leave every reader of this holder silent
                log.exception("push: serving round failed")
                self._stop.wait(_AFTER_ERROR_S)  # a lasting fault logs 10 times a second, not 2,000
                continue
            with self._lock:
                waiting = bool(self._waits)
            if notifs or self._writes or waiting:
                busy_until = now + _BUSY_FOR_S
            self._stop.wait(_BUSY_POLL_S if now < busy_until else _IDLE_POLL_S)
        for write in self._writes:  # closing: let go of what is still out
            self._nixl.release(write.pending)
        self._writes = []

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
