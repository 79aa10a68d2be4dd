"""A process's NIXL agent (UCX backend): register memory in place, learn remote
agents from their metadata, and post READs of byte ranges from them, to be
polled and released by the caller (the puller, which keeps a deadline on each).
Where UCX would emulate READ (TCP only), a "READ" is a pull by push instead:
the holder WRITEs the ranges (tensorhub.transport.push; the mode:
tensorhub.transport.transfermode), where the holder serves push requests (its
published metadata says so); a READ otherwise. Callers see the same
post/poll/release.

NIXL facts this relies on (measured, see the project notes):
* a peer that dies mid-READ makes ``transfer``/``check_xfer_state`` raise;
* a cut link does not raise for minutes, so every wait on a READ needs a deadline;
* with UCX over shared memory (CMA) ``transfer`` copies synchronously and
  releases the GIL; over TCP it returns "PROC" at once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from tensorhub.errors import TransportUnavailable
from tensorhub.transport.memory import MemoryKind, MemoryRegion, regions_of, storages_of
from tensorhub.transport.pending import PendingRead, TransferFailed
from tensorhub.transport.push import PushService, PushTicket
from tensorhub.transport.transfermode import PUSH_ENGINE_CONFIG, advertise, advertised, resolve_transfer

log = logging.getLogger(__name__)


# Applied when the first agent is created, never at import (``import tensorhub``
# must not change a process's UCX settings), and only where the user has not
# set them. NIXL prints INFO lines to stdout otherwise. Over TCP a cut link
# raises nothing for ~200 s (retransmit backoff); the keepalives bring UCX's
# own detection to a few seconds.
_ENV_DEFAULTS = (("NIXL_LOG_LEVEL", "WARN"), ("UCX_TCP_KEEPIDLE", "1s"), ("UCX_TCP_KEEPINTVL", "1s"),
                 ("UCX_TCP_KEEPCNT", "3"), ("UCX_TCP_USER_TIMEOUT", "5s"))


# NIXL's Python API starts every agent's progress thread with no delay: it
# busy-polls a whole core per agent, idle or not (measured: 1.0 CPU-s/s, and
# 0.03 with any delay > 0, where the thread waits for events). On a trainer
# node that is a core per rank; on a small machine it starves the transfers.
PROGRESS_DELAY_US = 100
# The prefix of a chunk-news notification (tensorhub.client.peernews): a relay
# telling its filling peers what it landed. Apart from the push messages
# (pushwire's THQ1, THD1, ...), each kind read by its own consumer.
NEWS_TAG = b"THN1"
_NEWS_KEPT = 4096  # news not yet read kept, at most (a process whose pulls ended still hears for a while)
_KEYS_KEPT = 4096  # replica keys remembered (NixlAgent._remotes): two versions of 2,048 holders
_agent_lock = threading.Lock()


_TIME_UNITS = (("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9), ("s", 1.0), ("m", 60.0))


def _ucx_seconds(value: str | None) -> float | None:
    """A UCX time setting ("5s", "500ms", "inf") in seconds; None if unset or unreadable ("auto")."""
    if value is None:
        return None
    value = value.strip().lower()
    if value in ("inf", "infinity"):
        return float("inf")
    for unit, scale in _TIME_UNITS:
        if value.endswith(unit):
            try:
                return float(value[: -len(unit)]) * scale
            except ValueError:
                return None
    try:
        return float(value)  # UCX reads a bare number as seconds
    except ValueError:
        return None


def failure_detection_s(env: dict[str, str] | None = None) -> float | None:
    """The longest UCX takes, over TCP, to fail a READ from a peer that vanished
    (its host gone or cut off), by this process's settings (``env``: os.environ
    with the defaults above). A READ waiting for the bytes (nothing of ours left
    unacknowledged) fails once the keepalive probes go unanswered: KEEPIDLE +
    KEEPINTVL x KEEPCNT; one whose request is not yet acknowledged, after
    TCP_USER_TIMEOUT. Returns the larger: inf if either is off ("inf"), so such
    a READ may stay out until the link comes back; None if a setting cannot be
    read ("auto": the system's own)."""
    env = {**dict(_ENV_DEFAULTS), **(os.environ if env is None else env)}
    user = _ucx_seconds(env.get("UCX_TCP_USER_TIMEOUT"))
    idle, interval = _ucx_seconds(env.get("UCX_TCP_KEEPIDLE")), _ucx_seconds(env.get("UCX_TCP_KEEPINTVL"))
    count = _ucx_seconds(env.get("UCX_TCP_KEEPCNT"))  # a count, read the same way ("3", "inf")
    if user is None or idle is None or interval is None or count is None:
        return None
    keepalive = float("inf") if float("inf") in (idle, interval, count) else idle + interval * count
    return max(user, keepalive)


def nixl_api():  # type: ignore[no-untyped-def]
    """NIXL's API module, imported on first use, after the environment defaults."""
    for key, value in _ENV_DEFAULTS:
        os.environ.setdefault(key, value)
    from nixl import _api

    return _api


def new_agent(name: str, engine_config: str = ""):  # type: ignore[no-untyped-def]
    """A raw ``nixl_agent`` (UCX) whose progress thread waits instead of spinning.

    The Python API hard-codes the delay; its config object is swapped for one
    that keeps ours, for the duration of this constructor only. ``engine_config``
    ("KEY=VAL,...", UCX settings without the UCX_ prefix) goes to the UCX
    backend's own parameters: NIXL 1.5's config object has no backend
    parameters, so the backend is created after the agent, with them.
    """
    api = nixl_api()
    bindings = api.nixlBind
    base = bindings.nixlAgentConfig

    class _Config(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: object) -> None:
            super().__setattr__(key, PROGRESS_DELAY_US if key == "pthrDelay" else value)

    with _agent_lock:
        bindings.nixlAgentConfig = _Config
        try:
            # Thread-safe: a process posts READs from a pull's thread while others
            # register and deregister memory (publish, unpublish, retention copies).
            # NIXL's default without a listener thread is no locking at all; the
            # fault campaign saw heap corruption ("corrupted double-linked list").
            config = api.nixl_agent_config(backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
            agent = api.nixl_agent(name, config)
            agent.create_backend("UCX", {"engine_config": engine_config} if engine_config else {})
            return agent
        except Exception as e:  # nixlBackendError: e.g. the device is down (a cut link), seen by tensorhub chaos
            raise TransportUnavailable(name, f"{type(e).__name__}: {e}") from e
        finally:
            bindings.nixlAgentConfig = base


@dataclass(slots=True)
class Registration:
    """Memory registered with this agent, and what a remote reader needs to read it."""

    kind: MemoryKind
    regions: list[MemoryRegion]  # one per tensor, in order
    metadata: bytes  # NIXL partial agent metadata for these regions
    _handle: object = None


class NixlAgent:
    """One NIXL agent per process. Thread-safe: reads may run from a pool.
    ``transfer``: "read", "push" or "auto" (tensorhub.transport.transfermode;
    empty: $TENSORHUB_TRANSFER, else auto)."""

    def __init__(self, name: str, transfer: str = "") -> None:
        self.name = name
        self.transfer = resolve_transfer(transfer)
        # Push: any emulated operation fails at once instead of running (a READ
        # emulated over TCP is what can abort a serving process).
        self._agent = new_agent(name, PUSH_ENGINE_CONFIG if self.transfer == "push" else "")
        # Read by a pull's drain: a READ given up on cannot be cancelled, only
        # waited for; UCX fails it at most this long after its peer vanished.
        self.failure_detection_s = failure_detection_s()
        if self.failure_detection_s == float("inf"):
            log.warning("UCX's TCP failure detection is off (UCX_TCP_USER_TIMEOUT or a UCX_TCP_KEEP* setting is "
                        "inf): a READ from a holder that vanished stays out until its link returns, and one a "
                        "pull gave up on can land bytes after the pull ended, in tensors already handed back. "
                        "Leave them unset (TensorHub then detects a vanished holder in about 5 s)")
        self._lock = threading.Lock()  # guards the remote-agent table and the counts below
        self._remotes: dict[str, str] = {}  # metadata key -> remote agent name (the latest _KEYS_KEPT keys)
        # Remote agents loaded, by a digest of the metadata they were loaded from:
        # the next version's replica of a holder that publishes from the same
        # memory brings the same metadata, and is not loaded again (the steady
        # state costs no metadata parsing, and nothing here grows with versions).
        self._loaded: dict[bytes, str] = {}
        # What NIXL holds of each remote agent: the metadata loaded into it since
        # it was last loaded from nothing, by digest, with the memory regions
        # each describes (None: not told). NIXL adds each load to what it holds
        # of an agent and never drops a descriptor, not even of memory the
        # holder has since unregistered and freed; and it finds the descriptor
        # covering a READ's range by a binary search that looks at one neighbour
        # only. So a stale descriptor starting inside the memory of a holder's
        # newer replica hides the newer one, and READs past its start fail
        # (createXferReq: NIXL_ERR_NOT_FOUND; found in a CI run when a trainer's
        # next version reused its earlier versions' addresses, cut otherwise).
        # Metadata whose regions meet an earlier load's is loaded from nothing.
        self._held: dict[str, dict[bytes, np.ndarray | None]] = {}
        # READs posted and not yet released, per remote agent. A remote is removed
        # from NIXL only when none is out: removing it under a READ still in
        # flight, then polling or releasing that READ, crashed a reader (SIGSEGV
        # in the fault campaign, after a link cut made sources fail mid-read).
        self._flights: dict[str, int] = {}
        self._forgotten: set[str] = set()  # removed at the release of their last READ
        self._unloadable: set[str] = set()  # agents NIXL refuses to load again (see connect)
        # Push holders: the digest of the metadata each requesting reader's agent
        # was last loaded from. Apart from _loaded, so that a relay pair (each
        # reads the other's partial metadata and pushes to its whole one) does
        # not reload one for the other at every request.
        self._admitted: dict[str, bytes] = {}
        # Remote agents whose published metadata says they serve push requests:
        # a push reader asks these to WRITE, and READs from the others.
        self._pushers: set[str] = set()
        # Notifications, by kind (``notifications``, ``news``)
        self._inbox_lock = threading.Lock()
        self._news: list[tuple[str, bytes]] = []
        self._other: dict[str, list[bytes]] = {}
        self._listen_metadata: bytes | None = None
        # Last: its thread calls back into this agent at once.
        self._push = PushService(self) if self.transfer == "push" else None

    # ---------------------------------------------------------------- memory

    def register(self, tensors: list[torch.Tensor]) -> Registration:
        """Register the tensors' memory in place (no copy) and describe it for readers."""
        kind, regions = regions_of(tensors)
        storages = storages_of(tensors)
        handle = None
        if storages:
            reg = [(addr, size, dev, "") for addr, size, dev in storages]
            handle = self._agent.register_memory(reg, kind.value)
            descs = self._agent.get_reg_descs(reg, kind.value)
            metadata = self._agent.get_partial_agent_metadata(descs, True, ["UCX"])
        else:
            metadata = self._agent.get_agent_metadata()
        if self._push is not None:
            self._push.metadata_changed()
        return Registration(kind, regions, advertise(metadata, self._push is not None), handle)

    def deregister(self, registration: Registration) -> None:
        if registration._handle is not None:
            self._agent.deregister_memory(registration._handle)
            registration._handle = None
            if self._push is not None:
                self._push.metadata_changed()

    def local_metadata(self) -> bytes:
        """This agent's whole metadata (every registration): what a holder needs to WRITE to us."""
        return self._agent.get_agent_metadata()

    def listen_metadata(self) -> bytes:
        """This agent's connection alone, no memory (as published: ``advertise``):
        what a peer needs to notify it (``peernews`` subscriptions of a pull
        that does not serve). Loading it adds no memory descriptor to what the
        peer's NIXL holds of this agent (see ``_held``)."""
        if self._listen_metadata is None:
            empty = nixl_api().nixlBind.nixlRegDList(self._agent.nixl_mems[MemoryKind.DRAM.value],
                                                     np.zeros((0, 3), np.int64))
            self._listen_metadata = advertise(self._agent.get_partial_agent_metadata(empty, True, ["UCX"]),
                                              self._push is not None)
        return self._listen_metadata

    # ---------------------------------------------------------------- remotes

    def connect(self, key: str, metadata: bytes, regions: np.ndarray | None = None) -> str:
        """Load a remote agent's metadata once per ``key`` (a replica id), as
        its holder published it (``Registration.metadata``, which says whether
        it serves push requests); returns the remote agent's name. ``regions``:
        the replica's memory regions (N x 3: addr, nbytes, device), to tell
        whether what NIXL holds of that agent already may describe memory they
        reuse (then the agent is loaded again from nothing: see ``_held``);
        None: assume so. TransferFailed if it cannot be reached, or must be
        loaded again while READs to it are out."""
        metadata, serves_push = advertised(metadata)
        with self._lock:
            agent = key.rpartition(".")[0]
            if serves_push and self._push is not None and self._usable_as_loaded(agent):
                # Pushed from, never READ: our NIXL never looks up its memory (it
                # WRITEs from its own), so the agent loaded already serves as it is.
                # Loading it again from nothing for memory it reused (see _held)
                # waited for our WRITEs to it and lost it as a source meanwhile: a
                # relay pair, each pushing to the other, lost each other at every
                # wave (bench cluster --zones 2 --delta: 19.7 s against READ's 12.1 s).
                self._remotes[key] = agent
                self._trim()
                self._pushers.add(agent)
                return agent
            name = self._connect(key, metadata, regions)
            if serves_push:
                self._pushers.add(name)
            else:
                self._pushers.discard(name)
            return name

    def _connect(self, key: str, metadata: bytes, regions: np.ndarray | None) -> str:  # under the lock
        name = self._remotes.get(key)
        digest = hashlib.blake2b(metadata, digest_size=16).digest()
        if name is None and (known := self._loaded.get(digest)) is not None and known not in self._forgotten:
            name = self._remotes[key] = known
            self._trim()
        if name is None:
            # A replica id is "<agent id>.<n>" and the agent id names its NIXL agent.
            # Loading more metadata of an agent whose removal waits for READs
            # still out fails half-way (NIXL_ERR_INVALID_PARAM in the fault
            # campaign, the reader crashing later): not until those end.
            agent = key.rpartition(".")[0]
            if agent in self._forgotten:
                raise TransferFailed(key, "its process's connection is closing: READs to it are still out")
            if agent in self._unloadable:
                raise TransferFailed(key, "NIXL can no longer load its process's metadata in this process "
                                          "(a load failed half-way earlier; other holders serve instead)")
            held = self._held.get(agent)
            if held and _meet(held.values(), regions):
                # Its memory changed under what NIXL holds of it: loaded from nothing.
                # Not under READs still out (removing an agent under them crashed
                # readers: see _flights); the next pull finds them ended.
                if self._flights.get(agent):
                    raise TransferFailed(key, "its process's memory was reused since its metadata was loaded, "
                                              "and READs to it are still out: it is loaded again once they end")
                self._drop_agent(agent)
            try:
                raw = self._agent.add_remote_agent(metadata)
            except Exception as e:  # its endpoint is gone (process died, link cut)
                if "INVALID_PARAM" in str(e) or "REMOTE_DISCONNECT" in str(e):
                    # NIXL 1.5: a load whose memory sections fail (REMOTE_DISCONNECT,
                    # a link cut as it loaded) drops the agent's connection info but
                    # not the UCX backend's endpoint; every later load of that agent
                    # then fails with INVALID_PARAM (157 of 157 retries in three
                    # fault campaigns), and remove_remote_agent finds nothing to clear.
                    # The fault campaign's readers that kept calling into NIXL for
                    # it crashed later (SIGSEGV): the first failed load is the last
                    # call. (UCX's "Endpoint timeout" aborts that followed some such
                    # retries come from UCX's emulated GET over TCP in the process
                    # serving bytes, not from the retry: chaos/ucx_cut.py.)
                    self._unloadable.add(agent)
                raise TransferFailed(key, f"cannot connect: {type(e).__name__}: {e}") from e
            name = raw.decode() if isinstance(raw, bytes) else raw
            self._remotes[key] = name
            self._loaded[digest] = name  # earlier loads of it stay: their regions do not meet these
            self._held.setdefault(name, {})[digest] = None if regions is None else _spans(regions)
            self._forgotten.discard(name)  # in use again: not to be removed
            self._trim()
        return name

    def _trim(self) -> None:  # under the lock
        """Forget the oldest keys (replicas of old versions) past _KEYS_KEPT; their
        agents stay loaded and a key that comes back finds its agent by digest."""
        while len(self._remotes) > _KEYS_KEPT:
            del self._remotes[next(iter(self._remotes))]

    def forget(self, key: str) -> None:
        """Drop the remote agent behind ``key``, whose replica failed: every key
        of that agent (its connection is suspect; a later ``connect`` loads it
        afresh). NIXL lets go of it, closing the connection so that no late bytes
        of a READ given up on arrive, once no READ to it is out."""
        with self._lock:
            name = self._remotes.pop(key, None)
            if name is None:  # a key trimmed since: its agent, if loaded (a replica id is "<agent id>.<n>")
                agent = key.rpartition(".")[0]
                name = agent if agent in self._loaded.values() else None
            if name is not None:
                self._drop_agent(name)

    def forget_agent(self, name: str) -> None:
        """Drop remote agent ``name`` (a reader whose WRITE failed): as ``forget``."""
        with self._lock:
            self._drop_agent(name)

    def _drop_agent(self, name: str) -> None:  # under the lock
        for key in [k for k, n in self._remotes.items() if n == name]:
            del self._remotes[key]
        if self._flights.get(name):
            self._forgotten.add(name)
        else:
            self._remove(name)

    def reach(self, key: str, metadata: bytes, regions: np.ndarray | None = None) -> str:
        """The remote agent of replica ``key``, to notify (``client.peernews``):
        an agent loaded here already, in any form (a replica's metadata, or a
        push reader's whole one), is used as it is: a notification needs only
        its connection, and loading another form of its metadata could load it
        again from nothing (see ``_held``), between the push service's loads,
        at every news. Else ``connect``."""
        agent = key.rpartition(".")[0]
        with self._lock:
            if self._usable_as_loaded(agent):
                return agent
        return self.connect(key, metadata, regions)

    def _usable_as_loaded(self, agent: str) -> bool:  # under the lock
        """Loaded here in some form, and neither closing nor past loading."""
        return agent in self._held and agent not in self._forgotten and agent not in self._unloadable

    def _remove(self, name: str) -> None:  # under the lock
        self._forgotten.discard(name)
        self._loaded = {d: n for d, n in self._loaded.items() if n != name}
        self._held.pop(name, None)
        self._admitted.pop(name, None)
        self._pushers.discard(name)
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:  # noqa: BLE001  already gone on NIXL's side
            log.debug("remove_remote_agent(%s): %s", name, e)

    # ---------------------------------------------------------------- reads

    def post(self, remote: str, local: np.ndarray, local_kind: MemoryKind, remote_descs: np.ndarray,
             remote_kind: MemoryKind) -> PendingRead:
        """Start a READ of ``remote_descs`` of agent ``remote`` into ``local`` (both
        N x 3: addr, nbytes, device). Over shared memory it has usually finished
        on return; over TCP or RDMA it is in flight: ``poll`` it, then ``release``
        it. Raises TransferFailed (with nothing left to release) on a NIXL error.
        In push mode a holder that serves push requests WRITEs instead: same
        calls, same deadlines."""
        if self._push is None:
            return self._post("READ", remote, local, local_kind, remote_descs, remote_kind)
        if remote in self._pushers:
            return self._request_push(remote, local, local_kind, remote_descs, remote_kind)
        try:
            return self._post("READ", remote, local, local_kind, remote_descs, remote_kind)
        except TransferFailed as e:  # over TCP: UCX refuses the emulated READ at once (PUSH_ENGINE_CONFIG)
            raise TransferFailed(remote, f"{e}; the holder does not serve push requests (its transfer mode is "
                                         "read) and this process (transfer=push) refuses emulated READs: run "
                                         "both on auto, or the same $TENSORHUB_TRANSFER") from e

    def write(self, reader: str, metadata: bytes, local: np.ndarray, local_kind: MemoryKind,
              remote_descs: np.ndarray, remote_kind: MemoryKind, notif: bytes) -> PendingRead:
        """A holder's WRITE of ``local`` (its memory) into ``remote_descs`` of agent
        ``reader``, whose ``metadata`` came with its request; NIXL notifies the
        reader with ``notif`` once the bytes have landed. Poll and release it."""
        self._admit_reader(reader, metadata)
        return self._post("WRITE", reader, local, local_kind, remote_descs, remote_kind, notif)

    def _admit_reader(self, reader: str, metadata: bytes) -> None:
        """Load a requesting reader's metadata, once per digest (as ``connect``).
        Its whole metadata: where it changed (the reader registered or let go
        of memory), what NIXL holds of it may describe memory it freed and
        reused (see ``_held``), so it is loaded from nothing, unless WRITEs
        (or READs) to it are still out."""
        digest = hashlib.blake2b(metadata, digest_size=16).digest()
        with self._lock:
            if self._admitted.get(reader) == digest and reader not in self._forgotten:
                return
            if reader in self._forgotten:
                raise TransferFailed(reader, "its connection is closing: WRITEs to it are still out")
            if reader in self._unloadable:
                raise TransferFailed(reader, "NIXL can no longer load its metadata in this process")
            if reader in self._admitted and not self._flights.get(reader):
                self._drop_agent(reader)
            try:
                raw = self._agent.add_remote_agent(metadata)
            except Exception as e:  # see connect: a half-failed load is not retried
                if "INVALID_PARAM" in str(e) or "REMOTE_DISCONNECT" in str(e):
                    self._unloadable.add(reader)
                raise TransferFailed(reader, f"cannot load its metadata: {type(e).__name__}: {e}") from e
            name = raw.decode() if isinstance(raw, bytes) else raw
            if name != reader:  # a request naming one agent and carrying another's metadata
                raise TransferFailed(reader, f"its request carries the metadata of agent {name!r}")
            self._admitted[reader] = digest
            # Its regions are not known here: a replica of it that this process
            # reads next (a relay pair) loads it from nothing (see connect).
            self._held.setdefault(name, {})[digest] = None

    def _request_push(self, remote: str, local: np.ndarray, local_kind: MemoryKind, remote_descs: np.ndarray,
                      remote_kind: MemoryKind) -> PendingRead:
        assert self._push is not None
        with self._lock:
            self._flights[remote] = self._flights.get(remote, 0) + 1
        try:
            ticket = self._push.request(remote, local, local_kind, remote_descs, remote_kind)
        except Exception as e:  # the holder's agent is unknown here, or the send failed
            self.release(PendingRead(remote, None))
            raise TransferFailed(remote, f"request not sent: {type(e).__name__}: {e}", op="push") from e
        return PendingRead(remote, ticket)

    def writes_out(self) -> int:
        """The WRITEs this holder has out for readers' push requests."""
        return self._push.writes_out() if self._push is not None else 0

    def notify(self, remote: str, message: bytes) -> None:
        """A NIXL notification to agent ``remote`` (loaded here)."""
        self._agent.send_notif(remote, message)

    def notifications(self) -> dict[str, list[bytes]]:
        """The notifications received since the last call, by sending agent
        (the push service's; chunk news set aside for ``news``)."""
        with self._inbox_lock:
            self._drain_notifications()
            out, self._other = self._other, {}
        return out

    def news(self) -> list[tuple[str, bytes]]:
        """The chunk news (``NEWS_TAG``) received since the last call, as
        (sending agent, message): ``client.peernews``."""
        with self._inbox_lock:
            self._drain_notifications()
            out, self._news = self._news, []
            if self._push is None:
                self._other = {}  # nobody else reads them: not kept
        return out

    def _drain_notifications(self) -> None:
        """NIXL's new notifications into the two inboxes: news and the rest.
        One agent has one queue, read by two consumers (the push thread, the
        pulls), so each takes its own kind from here."""
        for key, messages in self._agent.get_new_notifs().items():
            sender = key.decode() if isinstance(key, bytes) else key
            for message in messages:
                if message.startswith(NEWS_TAG):
                    self._news.append((sender, message))
                    if len(self._news) > _NEWS_KEPT:  # no pull of this process listens: news of ended pulls
                        del self._news[:-_NEWS_KEPT]
                else:
                    self._other.setdefault(sender, []).append(message)

    def _post(self, op: str, remote: str, local: np.ndarray, local_kind: MemoryKind, remote_descs: np.ndarray,
              remote_kind: MemoryKind, notif: bytes = b"") -> PendingRead:
        agent = self._agent
        handle = None
        with self._lock:
            self._flights[remote] = self._flights.get(remote, 0) + 1
        try:
            local_list = agent.get_xfer_descs(local, local_kind.value)
            remote_list = agent.get_xfer_descs(remote_descs, remote_kind.value)
            handle = agent.initialize_xfer(op, local_list, remote_list, remote, notif)
            state = agent.transfer(handle)
            if state == "ERR":
                raise TransferFailed(remote, "NIXL reported ERR")
        except Exception as e:  # nixlRemoteDisconnectError and friends
            self.release(PendingRead(remote, handle))
            if isinstance(e, TransferFailed):
                raise
            raise TransferFailed(remote, f"{type(e).__name__}: {e}") from e
        return PendingRead(remote, handle, done=state == "DONE")

    def poll(self, pending: PendingRead) -> bool:
        """Whether the READ finished; TransferFailed if it failed (release it
        still), and again at every later poll: NIXL need not say it twice (its
        failed requests are gone, and a handle with none left can read as done)."""
        if pending.failed is not None:
            raise pending.failed
        if pending.done:
            return True
        if isinstance(pending.handle, PushTicket):
            return self._poll_push(pending)
        try:
            state = self._agent.check_xfer_state(pending.handle)
        except Exception as e:
            pending.failed = TransferFailed(pending.remote, f"{type(e).__name__}: {e}")
            raise pending.failed from e
        if state == "ERR":
            pending.failed = TransferFailed(pending.remote, "NIXL reported ERR")
            raise pending.failed
        pending.done = state == "DONE"
        return pending.done

    def _poll_push(self, pending: PendingRead) -> bool:
        assert self._push is not None and isinstance(pending.handle, PushTicket)
        done, error, stalled = self._push.state(pending.handle)
        if error:
            pending.failed = TransferFailed(pending.remote, f"the holder reports: {error}", op="push")
            raise pending.failed
        if stalled:  # not marked failed: a holder that was only slow may still write (drained as a READ is)
            raise TransferFailed(pending.remote, "no word from the holder: its process is gone, or busy beyond "
                                 "reason", stalled=True, op="push")
        pending.done = done
        return done

    def release(self, pending: PendingRead) -> None:
        """Let go of a READ's handle (once per ``post``, whatever its outcome)."""
        if isinstance(pending.handle, PushTicket):
            assert self._push is not None
            self._push.forget(pending.handle)
        elif pending.handle is not None:
            try:
                self._agent.release_xfer_handle(pending.handle)
            except Exception as e:  # noqa: BLE001  a failed transfer may refuse release
                log.debug("release_xfer_handle: %s", e)
        with self._lock:
            left = self._flights.pop(pending.remote, 1) - 1
            if left > 0:
                self._flights[pending.remote] = left
            elif pending.remote in self._forgotten:
                self._remove(pending.remote)

    def close(self) -> None:
        if self._push is not None:
            self._push.close()
        with self._lock:
            for name in set(self._remotes.values()) | set(self._loaded.values()) | self._forgotten | set(self._admitted):
                self._remove(name)
            self._remotes.clear()
            self._loaded.clear()
            self._held.clear()


def _spans(regions: np.ndarray) -> np.ndarray:
    """A replica's memory regions (N x 3: addr, nbytes, device) as [start, end) pairs, empty ones left out."""
    r = np.asarray(regions, dtype=np.uint64).reshape(-1, 3)
    r = r[r[:, 1] > 0]
    return np.stack([r[:, 0], r[:, 0] + r[:, 1]], axis=1)


def _meet(loaded: Iterable[np.ndarray | None], regions: np.ndarray | None) -> bool:
    """Whether ``regions`` (a replica's, N x 3) meet any of the spans ``loaded``
    (``_spans``; None: not known, so they may). By address alone: regions on two
    devices that share addresses count as meeting (a load too many, never one too few)."""
    spans = list(loaded)
    if regions is None or any(s is None for s in spans):
        return True
    new = _spans(regions)
    old = np.concatenate([s for s in spans if len(s)]) if any(len(s) for s in spans) else np.zeros((0, 2), np.uint64)
    if not len(new) or not len(old):
        return False
    order = np.argsort(old[:, 0], kind="stable")
    starts, reach = old[order, 0], np.maximum.accumulate(old[order, 1])  # the furthest end of those started so far
    before = np.searchsorted(starts, new[:, 1], side="left")  # old spans starting before each new one ends
    return bool(((before > 0) & (reach[np.maximum(before - 1, 0)] > new[:, 0])).any())
