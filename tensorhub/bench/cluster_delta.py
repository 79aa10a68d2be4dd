"""The delta rows of ``tensorhub bench cluster --delta``: consecutive versions
of a small transformer from real AdamW steps (``bench.sparsity``), moved
both ways on the same emulated hosts, in the same run:

* ``tensorhub-whole``: every reader holds version u and pulls v whole (serving);
* ``tensorhub-delta``: every reader holds u and pulls v with ``have=u``: only
  the trainer's delta moves, and readers that patched serve it on (the zone's
  seed carries it across the zone link once).

Each row has ``zone_link_bytes`` (what crossed the link joining the zones),
``changed_fraction`` (measured: elements whose bits differ from u to v) and
``bytes`` (the version's). The two models are published under their own keys,
so that neither row's readers can take the other's bytes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tensorhub.bench.report import Row

FULL, DELTA = "bench/cluster-whole", "bench/cluster-delta"


def versions_file(size: int, lr: float, directory: str) -> tuple[str, float, int]:
    """Train the TinyLM of about ``size`` bytes two AdamW steps; save v1 and v2.
    Returns (path, changed fraction v1 -> v2, bytes per version)."""
    from tensorhub.bench.sparsity import changed_fraction, save_versions, state_bytes, trained_versions

    versions = trained_versions(target_bytes=size, lr=lr, steps=2)[1:]
    path = str(Path(directory) / "versions.pt")
    save_versions(path, versions)
    return path, changed_fraction(versions[0], versions[1]), state_bytes(versions[1])


def delta_rows(*, trainer: Any, readers: list[Any], size: int, lr: float, chunk_size: int,
               zone_link_bytes: Callable[[], int], trainer_tx: Callable[[], int],
               progress: Callable[[str], None]) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="tensorhub-delta-") as tmp:
        progress(f"delta: training a TinyLM of {size / 2**20:.0f} MiB two AdamW steps (lr {lr:g})")
        path, changed, nbytes = versions_file(size, lr, tmp)
        progress("delta: every reader pulls version 1 of both models")
        for model in (FULL, DELTA):
            trainer.call("publish_saved", model=model, version=1, path=path, index=0, chunk_size=chunk_size)
        for reader in readers:
            for model in (FULL, DELTA):
                got = reader.call("pull", model=model, version=1, keep=model, expect_saved=(path, 0), timeout=300)
                if got["mismatched"]:
                    raise RuntimeError(f"delta bench: a reader received wrong bytes of {model} v1")
        trainer.call("publish_saved", model=FULL, version=2, path=path, index=1, chunk_size=chunk_size)
        published = trainer.call("publish_saved", model=DELTA, version=2, path=path, index=1, delta_from=1,
                                 chunk_size=chunk_size)
        rows = []
        for method, model, have in (("tensorhub-whole", FULL, None), ("tensorhub-delta", DELTA, 1)):
            progress(f"{method}: {len(readers)} reader(s) holding v1 pull v2")
            zone0, tx0 = zone_link_bytes(), trainer_tx()
            for reader in readers:
                reader.send("pull", model=model, version=2, keep=model, have=have, serve=True,
                            expect_saved=(path, 1), timeout=300)
            got = [reader.result(timeout=300) for reader in readers]
            crossed, egress = zone_link_bytes() - zone0, trainer_tx() - tx0
            if any(g["mismatched"] for g in got):
                raise RuntimeError(f"{method}: a reader received wrong bytes")
            if have is not None and any(g["delta_from"] != have for g in got):
                raise RuntimeError(f"{method}: a reader pulled v2 whole ({[g['delta_from'] for g in got]})")
            seconds = max(g["end"] for g in got) - min(g["start"] for g in got)
            rows.append(Row.of(method, len(readers), nbytes, [seconds], zone_link_bytes=crossed,
                               cross_zone_bytes=crossed, trainer_egress_bytes=egress,
                               trainer_copies=round(egress / nbytes, 3), changed_fraction=round(changed, 5),
                               read_bytes=[g["read_bytes"] for g in got],
                               delta_bytes=published["delta_bytes"] if have is not None else 0))
            for reader in readers:
                reader.call("unpublish", model=model, version=2)
        for model in (FULL, DELTA):
            for version in (1, 2):
                trainer.call("unpublish", model=model, version=version)
    return rows
