"""Delta versions on the client: a version's delta published beside it, and
pulled by a reader that holds the earlier version.

    Hub.publish(v, delta_from=u) ── publish_with_delta()
        the parts of v against the same parts of u (``previous=``, or this process's replica of u)
        ─▶ codec.encode, on the parts' device
        ─▶ the delta published as model "<model>@delta/<u>/<agent>", version v (index, positions, values)
        ─▶ v published naming it (``deltas``): a reader finds it through v's replicas

    Hub.pull(v, into=<holds u>, have=u) ── DeltaPulls.pull()
        v's replicas that name deltas from u cover the destination?
        ├─ no: None (the caller pulls v whole)
        └─ yes: pull each delta model they name (``serve=`` as asked: a relay serves the delta too)
                ─▶ before_write ─▶ codec.patch into the destination
                ─▶ checked against v's chunk checksums wherever a holder of v lies inside the destination
                ─▶ a mismatch: "mismatch" (the caller pulls v whole into the same destination: never wrong bytes)

A delta model is an ordinary model to the server: it is leased, drained, relayed
and chosen by nearness like any other; its chunks carry checksums like any
other. Only the names tie it to v: the server keeps ``deltas`` per replica and
never opens them.

Memory. The publisher keeps u's bytes to compare against (a copy, unless its
replica of u lives in other buffers) and the delta (about (2 + itemsize) bytes
per changed element). A reader patches its destination in place: it must not
serve u from it at that moment (``before_write=`` unpublishes it first; a pull
into memory that this process still serves is refused before any write).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tensorhub.chunks import MIN_CHUNK_SIZE
from tensorhub.delta.codec import Delta, DeltaPart, encode, flat_span, patch
from tensorhub.errors import InvalidRequest, TensorHubError, VersionNotFound
from tensorhub.integrity import mismatched_chunks
from tensorhub.manifest import Manifest
from tensorhub.regions import Region, cut_out, intersect
from tensorhub.shard import Part

if TYPE_CHECKING:
    from tensorhub.client.holdings import Holdings
    from tensorhub.client.publication import Publication
    from tensorhub.client.rpc import Resolved

log = logging.getLogger(__name__)

_TAG = "@delta/"
# A delta larger than this share of the version's bytes is not published:
# readers would read as much and patch besides (versions that change whole).
MAX_DELTA_SHARE = 0.5


def delta_model(model: str, from_version: int, key: str) -> str:
    """The model name under which ``key`` publishes its delta from ``from_version`` (version: the new one)."""
    return f"{model}{_TAG}{from_version}/{key}"


def delta_from(name: str, model: str) -> int | None:
    """The earlier version of a delta model of ``model``'s, or None if ``name`` is not one."""
    prefix = model + _TAG
    if not name.startswith(prefix):
        return None
    version, _, key = name[len(prefix):].partition("/")
    return int(version) if version.isdigit() and key else None


def _delta_parts(manifest: Manifest, parts: Sequence[Part]) -> list[DeltaPart]:
    index = manifest.index()
    return [DeltaPart(index[p.name], tuple(p.full_shape), p.region, p.tensor) for p in parts]


def _spans(parts: Sequence[Part]) -> list[tuple[int, int]]:
    return [(p.tensor.data_ptr(), p.tensor.data_ptr() + p.nbytes) for p in parts if p.nbytes]


def _overlaps(a: Sequence[Part], b: Sequence[Part]) -> bool:
    """Whether some part of ``a`` shares memory with some part of ``b``: one sweep
    over the spans sorted by start (models have 10^5 tensors: no pairwise test)."""
    spans = sorted([(x0, x1, 0) for x0, x1 in _spans(a)] + [(y0, y1, 1) for y0, y1 in _spans(b)])
    reach = [-1, -1]  # the furthest end of each side's spans so far
    for start, end, side in spans:
        if start < reach[1 - side]:
            return True
        reach[side] = max(reach[side], end)
    return False


def previous_parts(holdings: Holdings, model: str, from_version: int, parts: Sequence[Part],
                   previous: Sequence[Part] | None) -> list[Part]:
    """The parts of ``from_version`` to compare ``parts`` against: ``previous``,
    or this process's own replica of it, holding the same regions in other memory."""
    what = f"publish {model!r} delta_from={from_version}"
    if previous is None:
        pubs = [p for p in holdings.find(model, from_version) if p.complete]
        if not pubs:
            raise InvalidRequest(f"{what}: this process holds no replica of version {from_version}; pass previous= "
                                 "the earlier version's tensors")
        previous = pubs[0].parts
        if _overlaps(previous, parts):
            raise InvalidRequest(f"{what}: its replica of version {from_version} shares memory with the new tensors "
                                 "(updated in place), so its old bytes are gone; pass previous= a copy of them")
    by_key = {(p.name, p.region): p for p in previous}
    missing = [f"{p.name} {p.region.describe()}" for p in parts if (p.name, p.region) not in by_key]
    if missing:
        raise InvalidRequest(f"{what}: the earlier version has no {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''}; nothing was published")
    return [by_key[(p.name, p.region)] for p in parts]


def delta_chunk_size(delta: Delta, chunk_size: int) -> int:
    """A delta is a few percent of its version: cut in the version's chunks it
    would be one or two, and readers that start together would each take it
    whole from the publisher instead of relaying it (chunks are what a relay
    passes on). About 16 chunks, of ``MIN_CHUNK_SIZE`` at least."""
    return min(chunk_size, max(MIN_CHUNK_SIZE, 1 << max(0, delta.nbytes // 16 - 1).bit_length()))


def encode_against(manifest: Manifest, parts: Sequence[Part], previous: Sequence[Part], *, from_version: int,
                   to_version: int) -> Delta:
    """The delta of ``parts`` against ``previous`` (the same regions of the earlier version)."""
    return encode(_delta_parts(manifest, parts), _delta_parts(manifest, previous), from_version=from_version,
                  to_version=to_version)


def publish_with_delta(holdings: Holdings, *, model: str, version: int, manifest: Manifest, parts: list[Part],
                       chunk_size: int, from_version: int, delta: Delta) -> Publication:
    """Publish ``delta`` as a model of its own, then ``parts`` as ``version``
    naming it; the delta is unpublished with the version."""
    problem = delta.check(from_version, version)
    if problem:
        raise InvalidRequest(f"publish {model!r} version {version}: the delta given: {problem}; nothing was published")
    nbytes = sum(p.nbytes for p in parts)
    if delta.nbytes > MAX_DELTA_SHARE * nbytes:
        # Most of it changed: reading the delta and patching would cost more than reading v.
        log.info("%r v%d: its delta from v%d is %.0f%% of its bytes: published without it", model, version,
                 from_version, 100 * delta.nbytes / max(1, nbytes))
        return holdings.publish(model, version, manifest, parts, chunk_size)
    name = delta_model(model, from_version, holdings.agent_id)
    tensors = delta.tensors()
    dparts = [Part(n, tuple(t.shape), Region(), t) for n, t in tensors.items()]
    companion = holdings.publish(name, version, Manifest.of(tensors), dparts, delta_chunk_size(delta, chunk_size))
    try:
        return holdings.publish(model, version, manifest, parts, chunk_size, deltas=(name,), companions=(companion,))
    except BaseException:
        try:
            holdings.unpublish(companion, holdings.lease_ttl_s + 1, force=True)
        except TensorHubError as e:
            log.warning("withdrawing the delta %s: %s", name, e)
        raise


# ------------------------------------------------------------------ pulling

@dataclass(kw_only=True, slots=True)
class DeltaOutcome:
    """What a delta pull did. ``status``: "patched" (the destination holds the
    version), or "mismatch" (some chunk failed its check: pull it whole)."""

    status: str
    delta_bytes: int = 0  # bytes of the delta models read
    seconds: float = 0.0
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    verified_bytes: int = 0
    unverified_bytes: int = 0
    mismatched: int = 0  # chunks of v's holders that did not match
    written: int = 0  # elements patched
    deltas: tuple[str, ...] = ()
    publications: tuple[Publication, ...] = ()  # the delta models served, when the pull serves


def _boxes(held: Sequence[tuple[int, Region]], manifest: Manifest) -> dict[int, list]:
    out: dict[int, list] = {}
    for ti, region in held:
        out.setdefault(ti, []).extend(region.boxes(tuple(manifest.tensors[ti].shape)))
    return out


def _wanted(resolved: Resolved, parts: Sequence[Part]) -> dict[int, list]:
    index = resolved.manifest.index()
    return _boxes([(index[p.name], p.region) for p in parts], resolved.manifest)


def covering_deltas(resolved: Resolved, parts: Sequence[Part], from_version: int) -> list[str] | None:
    """Delta models from ``from_version`` whose holders of v cover every
    element of ``parts`` (fewest first, in the server's order of preference), or None."""
    manifest = resolved.manifest
    left = _wanted(resolved, parts)
    names: list[str] = []
    for replica in resolved.replicas:
        mine = [n for n in replica.deltas if delta_from(n, resolved.model) == from_version]
        if not mine or not replica.source.complete:
            continue
        held = _boxes(replica.held, manifest)
        useful = False
        for ti in list(left):
            if ti in held:
                rest = cut_out(left[ti], held[ti])
                useful |= rest != left[ti]
                left[ti] = rest
                if not rest:
                    del left[ti]
        if useful:
            names += [n for n in mine if n not in names]
        if not left:
            return names
    return None


def check_against(resolved: Resolved, parts: Sequence[Part]) -> tuple[int, int, int]:
    """(verified bytes, unverified bytes, mismatched chunks) of ``parts`` against
    the chunk checksums of v's holders that lie wholly inside them (each
    destination byte checked at most once)."""
    manifest, index = resolved.manifest, resolved.manifest.index()
    by_tensor: dict[int, list[Part]] = {}
    for p in parts:
        by_tensor.setdefault(index[p.name], []).append(p)
    total = sum(p.nbytes for p in parts)
    checked: dict[int, list] = {}
    verified = mismatched = 0
    for replica in sorted(resolved.replicas, key=lambda r: not r.source.origin):
        if replica.chunk_crc32 is None or not replica.source.complete:
            continue
        views = _views_of(replica.held, by_tensor, manifest, checked)
        if views is None:
            continue
        mismatched += len(mismatched_chunks(views, replica.chunk_size, replica.chunk_crc32))
        verified += sum(v.numel() * v.element_size() for v in views)
        for ti, region in replica.held:
            checked.setdefault(ti, []).extend(region.boxes(tuple(manifest.tensors[ti].shape)))
    return verified, total - verified, mismatched


def _views_of(held: Sequence[tuple[int, Region]], by_tensor: dict[int, list[Part]], manifest: Manifest,
              checked: dict[int, list]) -> list[torch.Tensor] | None:
    """The destination's bytes of each held region, in the holder's order, or
    None if some region is not inside one destination part (or was checked already)."""
    views = []
    for ti, region in held:
        shape = tuple(manifest.tensors[ti].shape)
        boxes = region.boxes(shape)
        if any(intersect(a, b) is not None for a in boxes for b in checked.get(ti, ())):
            return None
        view = None
        for part in by_tensor.get(ti, ()):
            view = _inside(part, region, shape)
            if view is not None:
                break
        if view is None:
            return None
        views.append(view)
    return views


def _inside(part: Part, region: Region, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The bytes of ``region`` in ``part``'s memory (a copy where they are strided), or None if not inside it."""
    outer, inner = flat_span(part.region, shape), flat_span(region, shape)
    if outer is not None and inner is not None and part.region.box is None and region.box is None:
        if outer[0] <= inner[0] and inner[1] <= outer[1]:
            return part.tensor.reshape(-1)[inner[0] - outer[0]:inner[1] - outer[0]]
        return None
    if part.region.flat is not None or region.flat is not None:
        return None  # a flat range against a box: not worth the index arithmetic here
    pbox, rbox = part.region.bounds(shape), region.bounds(shape)
    if any(not (pa <= ra and rb <= pb) for (pa, pb), (ra, rb) in zip(pbox, rbox)):
        return None
    local = part.tensor.reshape([b - a for a, b in pbox])
    view = local[tuple(slice(ra - pa, rb - pa) for (pa, _), (ra, rb) in zip(pbox, rbox))]
    return view if view.is_contiguous() else view.contiguous()


PullFn = Callable[..., Any]  # Hub.pull


class DeltaPulls:
    """A reader's delta pulls, for a Hub: ``pull_fn`` pulls the delta models."""

    def __init__(self, holdings: Holdings, pull_fn: PullFn) -> None:
        self._holdings, self._pull = holdings, pull_fn

    def pull(self, resolved: Resolved, parts: list[Part], from_version: int, names: Sequence[str], *, serve: bool,
             before_write: Callable[[], None], deadline: float) -> DeltaOutcome | None:
        """Patch ``parts`` (holding ``from_version``) to ``resolved.version`` from
        the delta models ``names`` (``covering_deltas``); None when one could not
        be pulled (nothing was written)."""
        start = time.perf_counter()
        outcome = DeltaOutcome(status="patched", deltas=tuple(names))
        deltas: list[Delta] = []
        served: list[Publication] = []
        try:
            for name in names:
                got = self._pull(name, resolved.version, serve=serve, timeout=max(1.0, deadline - time.monotonic()))
                if got.publication is not None:
                    served.append(got.publication)
                delta = Delta.of(got.tensors)
                problem = delta.check(from_version, resolved.version)
                if problem:
                    raise TensorHubError(f"delta {name!r} v{resolved.version}: {problem}")
                deltas.append(delta)
                outcome.delta_bytes += got.read_bytes or got.nbytes
                for source, n in got.bytes_by_source.items():
                    outcome.bytes_by_source[source] = outcome.bytes_by_source.get(source, 0) + n
        except (VersionNotFound, TensorHubError) as e:
            log.warning("%r v%d: a delta could not be pulled (%s): pulling it whole", resolved.model,
                        resolved.version, e)
            self._withdraw(served)
            return None
        except BaseException:
            self._withdraw(served)
            raise
        try:
            before_write()
            serving = [p for p in self._holdings.publications() if p.announced and _overlaps(p.parts, parts)]
            if serving:
                raise InvalidRequest(
                    f"{resolved.model!r} v{resolved.version}: the destination is memory this process still serves "
                    f"({serving[0].model!r} v{serving[0].version}); unpublish it first (before_write=pub.unpublish)"
                    ": nothing was written")
            dparts = _delta_parts(resolved.manifest, parts)
            for delta in deltas:
                outcome.written += patch(delta, dparts)
            outcome.verified_bytes, outcome.unverified_bytes, outcome.mismatched = check_against(resolved, parts)
        except BaseException:
            self._withdraw(served)
            raise
        if outcome.mismatched:
            log.warning("%r v%d: %d chunk(s) patched from deltas failed their check: pulling it whole",
                        resolved.model, resolved.version, outcome.mismatched)
            self._withdraw(served)
            outcome.status = "mismatch"
        else:
            outcome.publications = tuple(served)
        outcome.seconds = time.perf_counter() - start
        return outcome

    def _withdraw(self, pubs: Sequence[Publication]) -> None:
        for pub in pubs:
            try:
                self._holdings.unpublish(pub, self._holdings.lease_ttl_s + 1, force=True)
            except TensorHubError as e:
                log.warning("withdrawing the relayed delta %s: %s", pub.model, e)

