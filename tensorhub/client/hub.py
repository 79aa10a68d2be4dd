"""``Hub``: a process's handle on TensorHub. Publishes tensors it holds, pulls
versions others hold, and keeps the reference server's picture of this process
true (heartbeats; re-registration after a server restart)."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch

from tensorhub.client.config import HubConfig
from tensorhub.client.publication import Publication
from tensorhub.client.puller import ProgressFn, PullJob
from tensorhub.client.rpc import AgentUnknown, ReferenceClient, Resolved
from tensorhub.errors import InvalidRequest, ServerUnavailable, TensorHubError, UnpublishTimeout, VersionNotFound
from tensorhub.manifest import DTYPES, Manifest
from tensorhub.topology import Labels
from tensorhub.transport import NixlAgent, Registration

log = logging.getLogger(__name__)

_DEST_CACHE_SIZE = 2  # registrations of recent ``into`` destinations kept for reuse


@dataclass(kw_only=True, slots=True)
class PullResult:
    """What a pull returned. ``tensors`` are the destination tensors (``into``'s
    own when given). ``publication`` is set when the pull serves what it got."""

    model: str
    version: int
    tensors: dict[str, torch.Tensor]
    nbytes: int
    seconds: float
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    lost_sources: list[str] = field(default_factory=list)
    publication: Publication | None = None

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _address(url: str) -> str:
    for scheme in ("tensorhub://", "grpc://"):
        if url.startswith(scheme):
            url = url[len(scheme):]
    if not re.match(r"^[^\s/:]+:\d+$|^\[[0-9a-fA-F:]+\]:\d+$", url):
        raise ValueError(f"hub address {url!r} is not host:port (e.g. 127.0.0.1:50051)")
    return url


def _check_version(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise InvalidRequest(f"version must be an integer >= 0 or 'latest', not {version!r}")
    return int(version)


def _check_model(model: Any) -> str:
    if not isinstance(model, str) or not model:
        raise InvalidRequest(f"model must be a non-empty string, not {model!r}")
    return model


class Hub:
    """Thread-safe client of one reference server, with one NIXL agent.

    >>> with Hub.connect("127.0.0.1:50051", name="trainer") as hub:
    ...     pub = hub.publish("policy", 7, model.state_dict())
    ...     ...
    ...     pub.unpublish()
    """

    def __init__(self, address: str, config: HubConfig) -> None:
        self.address = _address(address)
        self.config = config
        name = config.name or f"{socket.gethostname()}:{os.getpid()}"
        self.name = name
        self.agent_id = f"{re.sub(r'[^A-Za-z0-9._:@/+-]', '_', name)[:80]}-{uuid.uuid4().hex[:12]}"
        self._rpc = ReferenceClient(self.address, timeout_s=config.rpc_timeout_s)
        self._lock = threading.RLock()
        self._publications: dict[str, Publication] = {}
        self._replica_seq = itertools.count()
        self._instance_id = ""
        self._retain_spares: dict[str, list[dict[str, torch.Tensor]]] = {}
        self._releasing: set[str] = set()
        # Slow housekeeping off the heartbeat thread (releasing retained copies drains readers).
        self._chores = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensorhub-chores")
        self._dest_cache: OrderedDict[tuple, tuple[list[torch.Tensor], Registration]] = OrderedDict()
        self._lease_ttl_s = 10.0
        self._closed = False
        self._nixl = NixlAgent(self.agent_id)
        self._pool = cf.ThreadPoolExecutor(max_workers=max(1, config.read_workers), thread_name_prefix="tensorhub-read")
        try:
            self._register(wait_s=config.connect_timeout_s)
        except BaseException:
            self._shutdown_local()
            raise
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="tensorhub-heartbeat", daemon=True)
        self._heartbeat.start()

    @classmethod
    def connect(cls, url: str, *, name: str | None = None, labels: Labels | dict[str, str] | None = None,
                config: HubConfig | None = None, **overrides: Any) -> Hub:
        """Connect to the reference server at ``url`` (``host:port``) and register
        this process. Raises ServerUnavailable if it cannot be reached within
        ``config.connect_timeout_s``."""
        config = config or HubConfig()
        if name is not None:
            overrides["name"] = name
        if labels is not None:
            overrides["labels"] = Labels.parse(labels)
        if overrides:
            config = replace(config, **HubConfig.coerce(overrides))
        return cls(url, config)

    # ---------------------------------------------------------------- publish

    def publish(self, model: str, version: int, tensors: Mapping[str, torch.Tensor], *,
                chunk_size: int | None = None) -> Publication:
        """Make ``tensors`` pullable as ``version`` of ``model``, in place (their
        memory is registered with NIXL, not copied). Do not modify them until
        the returned publication is unpublished."""
        model, version = _check_model(model), _check_version(version)
        if not all(isinstance(k, str) and k for k in tensors):
            raise InvalidRequest("tensor names must be non-empty strings")
        manifest = Manifest.of(tensors)
        return self._publish(model, version, manifest, dict(tensors), chunk_size or self.config.chunk_size,
                             origin=True, complete=True)

    def _publish(self, model: str, version: int, manifest: Manifest, tensors: dict[str, torch.Tensor],
                 chunk_size: int, *, origin: bool, complete: bool, retained: bool = False) -> Publication:
        registration = self._nixl.register(list(tensors.values()))
        pub = Publication(self, model=model, version=version, replica_id=f"{self.agent_id}.{next(self._replica_seq)}",
                          manifest=manifest, chunk_size=chunk_size, tensors=tensors, registration=registration,
                          origin=origin, complete=complete, retained=retained)
        try:
            self._with_agent(lambda: self._send_publication(pub))
        except BaseException:
            self._nixl.deregister(registration)
            raise
        with self._lock:
            self._publications[pub.replica_id] = pub
        return pub

    def _send_publication(self, pub: Publication) -> None:
        with pub.lock:
            bitmap, complete = bytes(pub.bitmap), pub.complete
        self._rpc.publish(
            agent_id=self.agent_id, replica_id=pub.replica_id, model=pub.model, version=pub.version,
            manifest=pub.manifest, chunk_size=pub.chunk_size, kind=pub.registration.kind,
            regions=pub.registration.regions, metadata=pub.registration.metadata,
            complete=complete, bitmap=bitmap, origin=pub.origin, retained=pub.retained,
        )

    def unpublish(self, model: str, version: int, timeout: float = 60.0) -> None:
        """Unpublish this process's replica of (model, version); see Publication.unpublish."""
        with self._lock:
            pubs = [p for p in self._publications.values()
                    if (p.model, p.version) == (model, version) and not p.retained]
        if not pubs:
            raise VersionNotFound(model, version, f"this process publishes no replica of {model!r} version {version}")
        for pub in pubs:
            pub.unpublish(timeout)

    def _unpublish(self, pub: Publication, timeout: float, *, force: bool = False) -> None:
        with self._lock:
            if pub.closed:
                return
            # From here on heartbeats must never publish it again: the server may
            # drop it any moment, and the caller is about to reuse the memory.
            pub.withdrawing = True
        try:
            drained, outstanding, retain = self._rpc.unpublish(self.agent_id, pub.replica_id, timeout, force=force)
            if retain:
                # The last reliable copy of a retained version: keep the bytes in
                # host memory of this process before letting go of these tensors.
                self._retain_copy(pub)
                drained, outstanding, retain = self._rpc.unpublish(self.agent_id, pub.replica_id, timeout)
                if retain:
                    raise TensorHubError(f"{pub.model!r} v{pub.version}: retention copy was not accepted")
        except (ServerUnavailable, AgentUnknown) as e:
            # The server cannot say who still reads. Readers stop at their
            # lease's expiry, so waiting one lease TTL is safe.
            wait = min(self._lease_ttl_s, timeout)
            log.warning("unpublish %r v%d: %s; waiting %.1fs for read leases to expire", pub.model, pub.version, e, wait)
            time.sleep(wait)
            drained, outstanding = wait >= self._lease_ttl_s, -1
        if not drained:
            raise UnpublishTimeout(
                f"{pub.model!r} version {pub.version}: {outstanding} reader(s) still held read leases after "
                f"{timeout:.1f}s; the replica is withdrawn, but its memory must not be reused yet: call unpublish again"
            )
        with self._lock:
            self._publications.pop(pub.replica_id, None)
            pub.closed = True
        self._nixl.deregister(pub.registration)

    # ---------------------------------------------------------------- pull

    def pull(self, model: str, version: int | Literal["latest"] = "latest",
             into: Mapping[str, torch.Tensor] | None = None, *, serve: bool = False,
             group: str = "", group_round: int = 0, progress: ProgressFn | None = None,
             timeout: float | None = None) -> PullResult:
        """Pull a complete version of ``model`` from whoever holds it.

        ``into``: destination tensors (names, shapes, dtypes must match the
        manifest; checked before any byte moves); bytes land in them in place.
        Without it, new tensors are allocated. ``serve=True`` publishes the
        destination as a replica as chunks land (pipeline replication): the
        caller must then unpublish ``result.publication`` before modifying it.
        ``group``/``group_round``: all members of a group asking in the same
        round receive the same version (the first request fixes it).
        """
        model = _check_model(model)
        wanted = None if version == "latest" else _check_version(version)
        start = time.perf_counter()
        resolved = self._with_agent(
            lambda: self._rpc.resolve(self.agent_id, model, wanted, group=group, group_round=group_round, lease=True))
        try:
            dests, publication, registration = self._prepare_destination(resolved, into, serve)
        except BaseException:
            # The resolve leased the sources; unreleased, that lease would hold
            # their unpublish for a whole TTL although no byte will be read.
            self._rpc.release_lease_async(self.agent_id, resolved.lease_id)
            raise
        job = PullJob(
            rpc=self._rpc, nixl=self._nixl, agent_id=self.agent_id, labels=self.config.labels, resolved=resolved,
            dest_regions=np.array([(r.addr, r.size, r.device_id) for r in registration.regions],
                                  dtype=np.uint64).reshape(-1, 3),
            dest_kind=registration.kind, pool=self._pool, workers=max(1, self.config.read_workers),
            chunk_timeout_s=self.config.chunk_timeout_s,
            deadline=time.monotonic() + (timeout or self.config.pull_timeout_s), progress=progress,
            landed=(lambda chunks: self._report_landed(publication, chunks)) if publication else None,
        )
        try:
            stats = job.run()
            if publication is not None:
                self._report_landed(publication, [], complete=True)
        except BaseException:
            if publication is not None:
                try:
                    publication.unpublish(timeout=self._lease_ttl_s + 1)
                except TensorHubError as e:
                    log.warning("could not withdraw the partial replica: %s", e)
            elif into is None:
                self._nixl.deregister(registration)
            raise
        if publication is None and into is None:
            self._nixl.deregister(registration)
        return PullResult(model=model, version=resolved.version, tensors=dests, nbytes=stats.nbytes,
                          seconds=time.perf_counter() - start, bytes_by_source=stats.bytes_by_source,
                          lost_sources=stats.lost_sources, publication=publication)

    def _cached_destination(self, dests: dict[str, torch.Tensor]) -> Registration:
        """Registrations of recent ``into`` tensors, kept so that pulling into the
        same buffers again skips re-registration. The entry holds the tensors,
        so their memory cannot be freed and reused while registered."""
        key = tuple((t.data_ptr(), t.numel() * t.element_size()) for t in dests.values())
        with self._lock:
            hit = self._dest_cache.pop(key, None)
            if hit is None:
                hit = (list(dests.values()), self._nixl.register(list(dests.values())))
            self._dest_cache[key] = hit
            while len(self._dest_cache) > _DEST_CACHE_SIZE:
                _, (_, old) = self._dest_cache.popitem(last=False)
                self._nixl.deregister(old)
            return hit[1]

    def _uncache_destination(self, dests: dict[str, torch.Tensor]) -> None:
        key = tuple((t.data_ptr(), t.numel() * t.element_size()) for t in dests.values())
        with self._lock:
            hit = self._dest_cache.pop(key, None)
        if hit is not None:
            self._nixl.deregister(hit[1])

    def _prepare_destination(self, resolved: Resolved, into: Mapping[str, torch.Tensor] | None,
                             serve: bool) -> tuple[dict[str, torch.Tensor], Publication | None, Registration]:
        """Check or allocate the destination and register it (as a filling
        replica when serving). Raises ManifestMismatch before any byte moves."""
        manifest = resolved.manifest
        if into is not None:
            manifest.check_destination(into, model=resolved.model, version=resolved.version)
            dests = {t.name: into[t.name] for t in manifest.tensors}
        else:
            dests = {t.name: torch.empty(t.shape, dtype=DTYPES[t.dtype]) for t in manifest.tensors}
        if serve:
            self._uncache_destination(dests)
            publication = self._publish(resolved.model, resolved.version, manifest, dests, resolved.chunk_size,
                                        origin=False, complete=False)
            return dests, publication, publication.registration
        if into is not None:
            return dests, None, self._cached_destination(dests)
        return dests, None, self._nixl.register(list(dests.values()))

    def _retain_copy(self, pub: Publication) -> Publication:
        """Copy a publication into host memory (a reused buffer where one is
        free) and publish the copy as a retained replica."""
        with self._lock:
            spares = self._retain_spares.get(pub.manifest.fingerprint, [])
            buffers = spares.pop() if spares else None
        if buffers is None:
            buffers = {name: torch.empty(t.shape, dtype=t.dtype, device="cpu") for name, t in pub.tensors.items()}
        for name, src in pub.tensors.items():
            buffers[name].copy_(src)
        log.info("retaining %r v%d in host memory (%d bytes)", pub.model, pub.version, pub.nbytes)
        return self._publish(pub.model, pub.version, pub.manifest, buffers, pub.chunk_size, origin=True,
                             complete=True, retained=True)

    def _release_retained(self, pub: Publication) -> None:
        """The server no longer needs this retained copy: drop it, keep its buffer."""
        try:
            self._unpublish(pub, 60.0, force=True)
        except TensorHubError as e:
            log.warning("releasing retained %r v%d: %s", pub.model, pub.version, e)
            return
        finally:
            with self._lock:
                self._releasing.discard(pub.replica_id)
        with self._lock:
            spares = self._retain_spares.setdefault(pub.manifest.fingerprint, [])
            if not spares:  # one spare buffer per layout is enough to avoid re-allocating
                spares.append(pub.tensors)

    def _report_landed(self, pub: Publication, chunks: list[int], complete: bool = False) -> None:
        pub.mark_landed(chunks)
        if complete:
            with pub.lock:
                pub.complete = True
        self._with_agent(lambda: self._rpc.report_chunks(self.agent_id, pub.replica_id, chunks, complete))

    # ---------------------------------------------------------------- queries

    def versions(self, model: str) -> list[int]:
        """Versions of ``model`` that are pullable now (a complete replica exists), ascending."""
        return [v.version for v in self._rpc.list_versions(_check_model(model)) if v.complete_replicas > 0]

    def latest(self, model: str) -> int:
        """The highest pullable version of ``model``; VersionNotFound if none."""
        versions = self.versions(model)
        if not versions:
            raise VersionNotFound(model, "latest")
        return versions[-1]

    def publications(self) -> list[Publication]:
        with self._lock:
            return list(self._publications.values())

    # ---------------------------------------------------------------- liveness

    def _register(self, wait_s: float = 0.0) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                instance, lease_ttl = self._rpc.register_agent(
                    self.agent_id, self.name, self.config.labels, self.config.reliability)
                break
            except ServerUnavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
        with self._lock:
            changed = self._instance_id != instance
            self._instance_id, self._lease_ttl_s = instance, lease_ttl
            pubs = [p for p in self._publications.values() if not p.withdrawing]
        if changed and pubs:
            log.info("reference server %s: re-registering %d replica(s)", instance[:8], len(pubs))
        for pub in pubs:
            self._send_publication(pub)

    def _with_agent(self, fn):  # type: ignore[no-untyped-def]
        """Run an RPC; if the server forgot this agent, register again and retry once."""
        try:
            return fn()
        except AgentUnknown:
            self._register()
            return fn()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            try:
                self._heartbeat_once()
            except ServerUnavailable as e:
                log.debug("heartbeat: %s", e)
            except Exception:
                log.exception("heartbeat failed")

    def _heartbeat_once(self) -> None:
        with self._lock:
            held = [p.replica_id for p in self._publications.values() if not p.withdrawing]
        instance, known, unknown, release = self._rpc.heartbeat(self.agent_id, held,
                                                                timeout=max(self.config.heartbeat_interval_s, 1.0))
        if not known or instance != self._instance_id:
            self._register()
            return
        for rid in release:
            with self._lock:
                pub = self._publications.get(rid)
                if pub is None or not pub.retained or pub.withdrawing or rid in self._releasing:
                    continue
                self._releasing.add(rid)
            self._chores.submit(self._release_retained, pub)
        for rid in unknown:
            with self._lock:
                pub = self._publications.get(rid)
            if pub is not None and not pub.withdrawing:
                log.info("server dropped replica %s; publishing it again", rid)
                self._send_publication(pub)

    # ---------------------------------------------------------------- lifecycle

    def close(self, timeout: float = 30.0) -> None:
        """Unpublish everything this process holds (waiting for readers), stop
        heartbeats and release NIXL. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._heartbeat.join(timeout=5)
        self._chores.shutdown(wait=True)
        for pub in self.publications():
            try:
                self._unpublish(pub, timeout, force=True)  # nothing can be retained past this process
            except TensorHubError as e:
                log.warning("close: %s", e)
        self._shutdown_local()

    def _shutdown_local(self) -> None:
        self._chores.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        for _, registration in self._dest_cache.values():
            self._nixl.deregister(registration)
        self._dest_cache.clear()
        self._nixl.close()
        self._rpc.close()

    def __enter__(self) -> Hub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Hub({self.address!r}, name={self.name!r})"
