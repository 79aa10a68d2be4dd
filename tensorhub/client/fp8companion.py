"""The FP8 companion on the client: ``Hub.publish(..., fp8=True)`` publishes,
beside version v of ``<model>``, version v of ``<model>@fp8`` (tensorhub.fp8:
block-FP8 weights and their scales, quantized on the tensors' device), and v
names it as a companion, so that it is withdrawn with v. A reader that wants
FP8 pulls ``pull(model, v, fp8=True)``; one that wants bf16 pulls ``model``
and never sees the companion: it is another model to the server.

Why a companion model and not a second dtype of one model: the server, leases,
relays, retention and nearness already work per model, as for deltas
(``<model>@delta/...``); a reader's destination is checked against one
manifest; and nothing on the server changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tensorhub.errors import InvalidRequest, TensorHubError
from tensorhub.fp8 import check_fp8_destination, companion_tensors, fp8_model
from tensorhub.manifest import Manifest
from tensorhub.regions import Region
from tensorhub.shard import Entry, Part

if TYPE_CHECKING:
    from tensorhub.client.holdings import Holdings
    from tensorhub.client.publication import Publication

log = logging.getLogger(__name__)


def publish_with_fp8(holdings: Holdings, *, model: str, version: int, manifest: Manifest, parts: list[Part],
                     tensors: Mapping[str, Entry], chunk_size: int) -> Publication:
    """Quantize ``tensors`` (whole tensors of the whole model), publish the
    companion, then ``parts`` as ``version`` naming it. The quantization's
    seconds are ``publication.fp8_quantize_s``; the companion's bytes are kept
    alive by its publication (not this process's bf16 ones: it is a copy)."""
    if set(tensors) != set(manifest.names):
        raise InvalidRequest(f"publish {model!r} version {version} with fp8=True: the companion is made from the "
                             "whole model in this process; a rank holding part of it gathers first. Nothing was published.")
    start = time.perf_counter()
    try:
        companion = companion_tensors(tensors)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"publish {model!r} version {version} with fp8=True: {e}. Nothing was published.") from None
    _sync(companion.values())
    quantize_s = time.perf_counter() - start
    cparts = [Part(n, tuple(t.shape), Region(), t) for n, t in companion.items()]
    held = holdings.publish(fp8_model(model), version, Manifest.of(companion), cparts, chunk_size)
    try:
        pub = holdings.publish(model, version, manifest, parts, chunk_size, companions=(held,))
    except BaseException:
        try:
            holdings.unpublish(held, holdings.lease_ttl_s + 1, force=True)
        except TensorHubError as e:
            log.warning("withdrawing the FP8 companion of %r v%d: %s", model, version, e)
        raise
    pub.fp8_quantize_s = quantize_s
    return pub


def check_fp8_pull(model: str, into: object) -> None:
    """A reader's destination for ``model``'s companion, refused before any byte moves."""
    if isinstance(into, Mapping):
        try:
            check_fp8_destination(into)
        except ValueError as e:
            raise InvalidRequest(f"pull {fp8_model(model)!r}: {e}. Nothing was read.") from None


def _sync(tensors) -> None:  # type: ignore[no-untyped-def]
    """Wait for the quantization kernels, so that the time is theirs and the checksums read finished bytes."""
    import torch

    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()
